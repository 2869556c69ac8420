"""Secure aggregation's pure modules, side against side in memory: codec, Shamir, primitives, both protocol halves."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from fedsaddle.common import wire
from fedsaddle.common.secagg import crypto, fixedpoint, graph, messages, shamir
from fedsaddle.common.secagg.fixedpoint import FixedPointOverflow
from fedsaddle.common.secagg.messages import SEALED_SHARE_BYTES
from fedsaddle.common.secagg.party import MaskedRow, Party, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.secagg.settings import (
    SecAggError,
    SecAggSettings,
    check_bound,
    check_threshold,
    default_bound,
    default_threshold,
    round_threshold,
)
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.secure import KeyDirectory, MaskedRound

RUN = "run-secagg"

# -- fixed point ------------------------------------------------------------------------------


def test_fixed_point_round_trip_is_within_half_a_step() -> None:
    values = np.random.default_rng(0).uniform(-1000, 1000, 10_000)
    decoded = fixedpoint.decode(fixedpoint.encode(values, 40, 1e4, 1), 40)
    assert np.max(np.abs(decoded - values)) <= 2.0**-41
    assert fixedpoint.decode(fixedpoint.encode(np.array([1.5, -2.25, 0.0]), 40, 4, 1), 40).tolist() == [1.5, -2.25, 0]


def test_fixed_point_sums_are_exact_in_any_order() -> None:
    rows = np.random.default_rng(1).normal(size=(7, 50)) * 100
    encoded = [fixedpoint.encode(row, 40, 1e3, 3) for row in rows]
    forward = sum(encoded[1:], encoded[0].copy())
    backward = sum(encoded[-2::-1], encoded[-1].copy())
    assert np.array_equal(forward, backward)
    # The decoded sum is the sum of the rounded values, computed here in exact integers.
    exact = [sum(int(np.rint(v * 2**40)) for v in column) for column in rows.T]
    assert fixedpoint.decode(forward, 40).tolist() == [float(x) * 2.0**-40 for x in exact]


def test_encoding_is_the_rounded_scaled_value_exactly_across_blocks() -> None:
    """Every entry of a row longer than several encoding blocks is round(v * 2^s) mod 2^64, computed here
    in exact rationals, for ordinary, tiny (subnormal), half-way and bound-sized values."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    special = [5e-324, -5e-324, 2.0**-41, -(2.0**-41), 3 * 2.0**-42, 1e-300, 8.0, -8.0, 0.0, -0.0]
    values = np.concatenate([rng.normal(size=3 * 32_768 + 11), special])
    total = np.arange(len(values), dtype=np.uint64)  # added onto, mod 2^64
    fixedpoint.add_encoded(total, values, 40, 8.0, 1)

    def rounded(v: float) -> int:  # round half to even, as np.rint
        exact = Fraction(v) * 2**40
        low = exact.numerator // exact.denominator
        rest = exact - low
        return low + (rest > Fraction(1, 2) or (rest == Fraction(1, 2) and low % 2 == 1))

    expected = [(k + rounded(float(v))) % 2**64 for k, v in enumerate(values)]
    assert [int(x) for x in total] == expected


def test_negative_sums_decode_as_negative() -> None:
    encoded = fixedpoint.encode(np.array([-3.0, 1.0]), 40, 4, 1)
    total = np.array([encoded[0] + encoded[1]], dtype=np.uint64)
    assert fixedpoint.decode(total, 40).tolist() == [-2.0]


@pytest.mark.parametrize("bad", [5.0000001, -7.0, np.inf, np.nan])
def test_a_value_outside_the_bound_is_refused_naming_round_entry_and_bound(bad: float) -> None:
    values = np.array([0.0, 1.0, bad, 2.0])
    with pytest.raises(FixedPointOverflow) as caught:
        fixedpoint.encode(values, 40, 5.0, round_id=17)
    message = str(caught.value)
    assert "round 17" in message and "entry 2" in message and "+-5" in message
    assert caught.value.entry == 2 and caught.value.round_id == 17


def test_the_default_bound_keeps_the_sum_inside_the_ring() -> None:
    for parties in (2, 3, 10, 1000, 2**20):
        bound = default_bound(parties)
        assert parties * bound * 2.0**40 <= 2.0**62
        check_bound(parties, bound, 40)
        # At the bound, every client sending +bound (rounded) still decodes to the true sum.
        one = fixedpoint.encode(np.array([bound, -bound]), 40, bound, 1)
        total = np.zeros(2, dtype=np.uint64)
        for _ in range(min(parties, 64)):
            total += one
        assert fixedpoint.decode(total, 40).tolist() == [min(parties, 64) * bound, -min(parties, 64) * bound]
    with pytest.raises(ValueError, match="overflow the 64-bit ring"):
        check_bound(10, 2.0**20, 40)


def test_threshold_must_be_a_majority_and_at_most_the_clients() -> None:
    # a majority of k + 1: one more than a bare majority when k is odd (settings.default_threshold)
    assert [default_threshold(k) for k in (2, 3, 4, 5, 10)] == [2, 3, 3, 4, 6]
    check_threshold(6, 10)
    with pytest.raises(ValueError, match="unsafe for 10 clients"):
        check_threshold(5, 10)
    with pytest.raises(ValueError, match="unsafe for 10 clients"):
        check_threshold(11, 10)
    with pytest.raises(ValueError, match="at least 2 clients"):
        check_threshold(1, 1)


# -- Shamir ------------------------------------------------------------------------------------


def test_shares_are_the_polynomials_values_at_index_plus_one() -> None:
    draws = iter([11, 22])  # the coefficients of x and x^2
    shares = shamir.split(7, 3, [0, 1, 4], randbelow=lambda _: next(draws))
    assert shares == {h: (7 + 11 * (h + 1) + 22 * (h + 1) ** 2) % shamir.PRIME for h in (0, 1, 4)}


def test_any_t_shares_rebuild_the_secret_and_t_minus_1_do_not() -> None:
    secret = random.Random(2).getrandbits(128)
    holders = [0, 2, 3, 5, 8, 9]
    shares = shamir.split(secret, 4, holders)
    for subset in itertools.combinations(holders, 4):
        assert shamir.combine({h: shares[h] for h in subset}) == secret
    assert shamir.combine(shares) == secret  # more than t lie on the same polynomial
    for subset in itertools.combinations(holders, 3):
        assert shamir.combine({h: shares[h] for h in subset}) != secret


def test_t_minus_1_shares_fit_every_secret_equally() -> None:
    # Perfect secrecy in a small case, by the definition: for any two secrets, t - 1 fixed share values
    # are reached by exactly one polynomial each (a bijection between the free coefficients and the shares).
    shares = shamir.split(123, 2, [0, 1])
    for other in (0, 1, 2**100):
        slope = (shares[0] - other) % shamir.PRIME  # the polynomial other + slope * x through (1, shares[0])
        assert (other + slope * 1) % shamir.PRIME == shares[0]


def test_share_bytes_are_checked() -> None:
    assert shamir.from_bytes(shamir.to_bytes(shamir.PRIME - 1)) == shamir.PRIME - 1
    with pytest.raises(ValueError, match="17 bytes"):
        shamir.from_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not an element"):
        shamir.from_bytes(b"\xff" * 17)


# -- primitives --------------------------------------------------------------------------------


def test_pairwise_keys_agree_from_both_sides_and_differ_between_pairs() -> None:
    a, b, c = (crypto.new_private_key() for _ in range(3))
    ab = crypto.pairwise_key(a, 0, crypto.public_bytes(b), 1, RUN)
    assert ab == crypto.pairwise_key(b, 1, crypto.public_bytes(a), 0, RUN)
    assert ab != crypto.pairwise_key(a, 0, crypto.public_bytes(c), 2, RUN)
    assert ab != crypto.pairwise_key(a, 0, crypto.public_bytes(b), 1, "another run")
    with pytest.raises(crypto.KeyRejected, match="not a usable"):
        crypto.pairwise_key(a, 0, bytes(32), 1, RUN)  # the all-zero point


def test_masks_are_deterministic_per_seed_and_uniform_looking() -> None:
    seed = crypto.round_seed(b"k" * 32, "pairwise", RUN, 4, 0)
    mask = crypto.expand(seed, 100_000)
    assert np.array_equal(mask, crypto.expand(seed, 100_000))
    assert not np.array_equal(mask, crypto.expand(crypto.round_seed(b"k" * 32, "pairwise", RUN, 5, 0), 100_000))
    bits = np.unpackbits(mask.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.01


def test_blockwise_masks_equal_whole_keystreams_added() -> None:
    """add_masks works block by block; the result is each seed's whole AES-256-CTR keystream (counter blocks
    from zero; taken here straight from `cryptography`, in one call) added or subtracted mod 2^64."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    def keystream(seed: bytes, length: int) -> np.ndarray:
        stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * length))
        return np.frombuffer(stream, dtype="<u8").astype(np.uint64)

    length = 2 * crypto.MASK_BLOCK + 123  # two whole blocks and a tail
    seeds = [(bytes([k]) * 16 + bytes([k + 7]) * 16, sign) for k, sign in ((1, 1), (2, -1), (3, 1))]
    start = np.arange(length, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    expected = start.copy()
    for seed, sign in seeds:
        expected = expected + keystream(seed, length) if sign > 0 else expected - keystream(seed, length)
    total = start.copy()
    crypto.add_masks(total, seeds)
    assert np.array_equal(total, expected)
    assert np.array_equal(crypto.expand(seeds[0][0], 10), keystream(seeds[0][0], 10))
    # A mask depends on every byte of the seed (the AES-256 key).
    assert not np.array_equal(crypto.expand(bytes(16) + b"a" * 16, 10), crypto.expand(bytes(16) + b"b" * 16, 10))
    assert not np.array_equal(crypto.expand(bytes(31) + b"a", 10), crypto.expand(b"a" + bytes(31), 10))


def test_masks_onto_a_fresh_array_equal_masks_added_to_zeros() -> None:
    """add_masks(fresh=True) overwrites whatever the array held with the masks' sum, whichever sign comes first."""
    length = crypto.MASK_BLOCK + 5
    for seeds in ([(b"a" * 32, 1), (b"b" * 32, -1)], [(b"c" * 32, -1), (b"d" * 32, 1), (b"e" * 32, -1)]):
        expected = np.zeros(length, dtype=np.uint64)
        crypto.add_masks(expected, seeds)
        garbage = np.full(length, 12345, dtype=np.uint64)
        crypto.add_masks(garbage, seeds, fresh=True)
        assert np.array_equal(garbage, expected)
    cleared = np.full(3, 7, dtype=np.uint64)
    crypto.add_masks(cleared, [], fresh=True)
    assert cleared.tolist() == [0, 0, 0]


def test_the_round_adds_each_row_as_it_comes_and_keeps_none_of_them() -> None:
    """MaskedRound.add folds a row into the round's sum at once (the coordinator holds one row's worth, however
    many clients answer): the sum is the rows' sum mod 2^64 in whatever order they came, and is the round's own
    array, sharing no memory with any row (a row may be freed or reused as soon as it is added)."""
    parties = federation(4)
    clients = tuple(range(4))
    rows = [parties[i].mask(3, 0, clients, np.arange(5.0) * (i + 1)) for i in clients]
    expected = np.zeros(5, dtype=np.uint64)
    for row in rows:
        np.add(expected, row.masked, out=expected)
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        masked_round = MaskedRound(RUN, 3, 0, clients, 3, 5)
        assert not masked_round.total.any()  # (no row yet: zero)
        for i in order:
            masked_round.add(rows[i])
        assert masked_round.total.dtype == np.uint64 and np.array_equal(masked_round.total, expected)
        assert not any(np.shares_memory(masked_round.total, row.masked) for row in rows)
        assert not hasattr(masked_round, "rows") and sorted(masked_round.shares) == list(clients)


def test_an_answer_added_chunk_by_chunk_gives_the_bits_of_its_rows_added_whole_or_leaves_no_trace() -> None:
    """MaskedRound.begin_stream/stream_chunk/end_stream: an answer's payload (its rows one after another) cut
    at any byte, entries split between chunks included, adds up to what `add` gives; an answer aborted or
    refused half-way leaves the sum as it was before it."""
    parties = federation(4)
    clients = tuple(range(4))
    rows = [parties[i].mask(4, 0, clients, np.arange(7.0) - i) for i in clients]
    whole = MaskedRound(RUN, 4, 0, clients, 3, 7)
    for row in rows:
        whole.add(row)
    payload = b"".join(row.masked.astype("<u8").tobytes() for row in rows[1:])  # one process's three rows
    for cuts in ((), (5,), (8, 16, 100), (3, 11, 56, 57, 167)):
        streamed = MaskedRound(RUN, 4, 0, clients, 3, 7)
        streamed.add(rows[0])
        assert streamed.begin_stream((1, 2, 3), 7)
        assert not streamed.begin_stream((0,), 7)  # (one answer at a time: another is read whole)
        for start, end in zip((0, *cuts), (*cuts, len(payload)), strict=True):
            streamed.stream_chunk(start, payload[start:end])
        streamed.end_stream([row.shares for row in rows[1:]])
        assert np.array_equal(streamed.total, whole.total), cuts
        assert sorted(streamed.shares) == list(clients)
    before = MaskedRound(RUN, 4, 0, clients, 3, 7)
    before.add(rows[0])
    expected = before.total.copy()
    assert before.begin_stream((1, 2, 3), 7)
    before.stream_chunk(0, payload[:60])
    before.abort_stream()  # (its client lost half-way)
    assert np.array_equal(before.total, expected) and sorted(before.shares) == [0]
    assert before.begin_stream((1, 2, 3), 7)
    before.stream_chunk(0, payload)
    wrong = [rows[1].shares, {0: rows[2].shares[0]}, rows[3].shares]  # client 2's shares miss some neighbours
    with pytest.raises(SecAggError, match="round 4: client 2: sealed shares for clients \\[0\\]"):
        before.end_stream(wrong)
    assert np.array_equal(before.total, expected) and sorted(before.shares) == [0]  # as before the answer
    assert not MaskedRound(RUN, 4, 0, clients, 3, 7).begin_stream((0,), 6)  # (not the round's length: read whole)
    # A whole answer taken while another streams (a one-message answer, or room in the reorder bound) is in the
    # sum whether the streaming answer ends or is taken back out; a row of a streaming client is refused.
    for fresh in (True, False):
        for ends in (True, False):
            both = MaskedRound(RUN, 4, 0, clients, 3, 7)
            if not fresh:
                both.add(rows[3])
            assert both.begin_stream((1, 2), 7)
            both.stream_chunk(0, payload[:61])
            with pytest.raises(SecAggError, match="round 4: client 2 sent a second masked row"):
                both.add(rows[2])
            both.add(rows[0])
            both.stream_chunk(61, payload[61:112])
            kept = [0] if fresh else [0, 3]
            if ends:
                both.end_stream([rows[1].shares, rows[2].shares])
                kept += [1, 2]
            else:
                both.abort_stream()
            assert sorted(both.shares) == sorted(kept), (fresh, ends)
            expected = np.zeros(7, dtype=np.uint64)
            for i in kept:
                np.add(expected, rows[i].masked, out=expected)
            assert np.array_equal(both.total, expected), (fresh, ends)


def test_sealed_shares_open_only_in_their_own_context() -> None:
    key = crypto.envelope(bytes(range(32)))
    sealed = crypto.seal(key, b"share", RUN, 3, 0, 1, 2)
    assert crypto.open_sealed(key, sealed, RUN, 3, 0, 1, 2) == b"share"
    for context in [(RUN, 4, 0, 1, 2), (RUN, 3, 1, 1, 2), (RUN, 3, 0, 2, 1), ("other", 3, 0, 1, 2)]:
        with pytest.raises(ValueError, match="fails authentication"):
            crypto.open_sealed(key, sealed, *context)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too short"):
        crypto.open_sealed(key, sealed[:20], RUN, 3, 0, 1, 2)


# -- the protocol, side against side -----------------------------------------------------------


def federation(n: int, threshold: int | None = None, bound: float = 1e3, neighbours: int = 0) -> list[Party]:
    settings = SecAggSettings(threshold or 0, 40, bound, neighbours)
    parties = [Party(i, RUN, settings) for i in range(n)]
    directory = KeyDirectory()
    for party in parties:
        directory.announce(party.index, party.public_key)
    for party in parties:
        party.agree(directory.epoch, directory.keys)
    return parties


def run_round(
    parties: list[Party], rows: np.ndarray, round_id: int, drop: set[int], participants: tuple[int, ...] | None = None
) -> np.ndarray:
    clients = participants or tuple(range(len(parties)))
    settings = parties[0].settings
    threshold = round_threshold(settings, len(clients))
    masked_round = MaskedRound(RUN, round_id, 0, clients, threshold, rows.shape[1], settings.neighbours)
    for i in clients:
        row = parties[i].mask(round_id, 0, clients, rows[i])
        if i not in drop:
            masked_round.add(row)
    requests = masked_round.close()
    replies = {j: parties[j].unmask(request) for j, request in requests.items()}
    return masked_round.finish(replies)


def encoded_sum(rows: np.ndarray, which: list[int]) -> np.ndarray:
    total = np.zeros(rows.shape[1], dtype=np.uint64)
    for i in which:
        total += fixedpoint.encode(rows[i], 40, 1e3, 0)
    return total


@pytest.mark.parametrize("drop", [set(), {2}, {0, 4}])
def test_the_unmasked_sum_is_the_fixed_point_sum_of_the_answers_bit_for_bit(drop: set[int]) -> None:
    parties = federation(6)
    rows = np.random.default_rng(3).normal(size=(6, 257)) * 10
    total = run_round(parties, rows, 1, drop)
    answered = [i for i in range(6) if i not in drop]
    assert np.array_equal(total, encoded_sum(rows, answered))
    assert np.allclose(fixedpoint.decode(total, 40), rows[answered].sum(axis=0), atol=1e-11)


def test_rounds_follow_each_other_and_sampled_rounds_sum_their_clients() -> None:
    parties = federation(5)
    rng = np.random.default_rng(4)
    for round_id, clients in [(1, (0, 1, 2, 3, 4)), (2, (1, 3, 4)), (3, (0, 2))]:
        rows = rng.normal(size=(5, 9))
        assert np.array_equal(run_round(parties, rows, round_id, set(), clients), encoded_sum(rows, list(clients)))


def test_masks_made_ahead_of_a_round_give_the_same_exact_sum_and_are_dropped_if_the_round_differs() -> None:
    parties = federation(5)
    rng = np.random.default_rng(6)
    for party in parties[:3]:  # some made round 1's masks while they waited, the others make them on the task
        assert party.prepare(1, 0, tuple(range(5)), 9)
    rows = rng.normal(size=(5, 9))
    assert np.array_equal(run_round(parties, rows, 1, set()), encoded_sum(rows, list(range(5))))
    for party in parties:  # made for all five, but round 2 comes for four, round 3 with another length
        party.prepare(2, 0, tuple(range(5)), 9)
    rows = rng.normal(size=(5, 9))
    assert np.array_equal(run_round(parties, rows, 2, set(), (0, 1, 2, 3)), encoded_sum(rows, [0, 1, 2, 3]))
    for party in parties:
        party.prepare(3, 0, tuple(range(5)), 4)
    rows = rng.normal(size=(5, 9))
    assert np.array_equal(run_round(parties, rows, 3, {1}), encoded_sum(rows, [0, 2, 3, 4]))
    assert not parties[0].prepare(3, 0, tuple(range(5)), 9)  # it answered round 3: nothing is made for it again
    assert not parties[0].prepare(4, 0, (0,), 9)  # a round of one client is never masked


def test_a_masked_row_reveals_nothing_like_the_answer() -> None:
    parties = federation(3)
    row = np.zeros(10_000)
    masked = parties[0].mask(1, 0, (0, 1, 2), row).masked
    bits = np.unpackbits(masked.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.01  # an all-zero answer looks like noise
    assert not np.array_equal(masked, fixedpoint.encode(row, 40, 1e3, 1))


def test_too_many_dropouts_are_refused_before_anything_is_revealed() -> None:
    parties = federation(5)  # t = 3
    rows = np.ones((5, 4))
    masked_round = MaskedRound(RUN, 1, 0, tuple(range(5)), 3, 4)
    for i in range(5):
        row = parties[i].mask(1, 0, tuple(range(5)), rows[i])
        if i < 2:
            masked_round.add(row)
    with pytest.raises(SecAggError, match=r"round 1: only 2 clients answered; .* needs 3"):
        masked_round.close()


# -- SecAgg+: sparse neighbour graphs -----------------------------------------------------------


def test_the_harary_graph_is_circulant_symmetric_and_k_connected() -> None:
    clients = (0, 2, 3, 5, 8, 9, 11, 12, 14, 20)  # a sampled round: positions, not indices, are what count
    assert graph.neighbours_of(0, clients, 4) == (2, 3, 14, 20)
    assert graph.neighbours_of(9, clients, 4) == (5, 8, 11, 12)
    assert graph.neighbours_of(9, clients, 0) == tuple(j for j in clients if j != 9)
    assert graph.neighbours_of(9, clients, 10) == tuple(j for j in clients if j != 9)  # k >= m - 1: all pairs
    for i in clients:  # symmetric: i masks with j exactly when j masks with i
        for j in graph.neighbours_of(i, clients, 4):
            assert i in graph.neighbours_of(j, clients, 4)
    # 4-connected: any 3 removed leave it connected; the right 4 split it
    for removed in itertools.combinations(clients, 3):
        assert graph.connected([c for c in clients if c not in removed], clients, 4)
    assert not graph.connected([c for c in clients if c not in (2, 3, 11, 12)], clients, 4)


def test_the_default_is_all_pairs_for_small_federations_and_logarithmic_above() -> None:
    assert [graph.default_neighbours(n) for n in (2, 10, 13, 14, 30, 100, 1000)] == [0, 0, 0, 12, 16, 20, 30]
    for k in (1, 3, -2):
        with pytest.raises(ValueError, match=r"neighbours must be 0 .* or an even number >= 2"):
            graph.check_neighbours(k)


@pytest.mark.parametrize("drop", [set(), {4}, {0, 7}, {3, 9, 14}])  # no neighbourhood loses more than k/2 - 1
def test_secagg_plus_unmasks_the_exact_sum_with_and_without_dropouts(drop: set[int]) -> None:
    n = 16
    parties = federation(n, neighbours=4)
    rows = np.random.default_rng(5).normal(size=(n, 33)) * 10
    total = run_round(parties, rows, 1, drop)
    assert np.array_equal(total, encoded_sum(rows, [i for i in range(n) if i not in drop]))


def test_secagg_plus_masks_shares_and_unmasks_with_neighbours_only() -> None:
    n = 12
    parties = federation(n, neighbours=4)
    clients = tuple(range(n))
    masked_round = MaskedRound(RUN, 1, 0, clients, round_threshold(parties[0].settings, n), 5, 4)
    rows = {i: parties[i].mask(1, 0, clients, np.full(5, float(i))) for i in clients}
    assert sorted(rows[0].shares) == [1, 2, 10, 11]  # sealed to its 4 neighbours, not to the 11 others
    assert len(parties[0]._pairwise) == 4  # keys derived with the neighbours only
    for i in clients:
        if i != 5:
            masked_round.add(rows[i])
    requests = masked_round.close()
    assert [sender for sender, _ in requests[4].shares] == [2, 3, 6]  # 5 dropped
    replies = {j: parties[j].unmask(request) for j, request in requests.items()}
    assert sorted(replies[4].seeds) == [5] and sorted(replies[4].b_shares) == [2, 3, 4, 6]
    assert replies[0].seeds == {}  # 5 is not a neighbour of 0: 0 reveals nothing about it
    assert np.array_equal(
        masked_round.finish(replies),
        encoded_sum(np.array([np.full(5, float(i)) for i in clients]), [i for i in clients if i != 5]),
    )


def test_secagg_plus_refuses_to_unmask_survivors_that_fall_apart() -> None:
    n = 10
    parties = federation(n, threshold=6, neighbours=2)  # a ring: two dropouts split it in two
    clients = tuple(range(n))
    masked_round = MaskedRound(RUN, 3, 0, clients, 6, 2, 2)
    rows = {i: parties[i].mask(3, 0, clients, np.ones(2)) for i in clients}
    for i in clients:
        if i not in (2, 6):
            masked_round.add(rows[i])
    with pytest.raises(SecAggError, match="round 3: the 8 clients that answered are not connected"):
        masked_round.close()
    # A coordinator that asks anyway is refused by the clients themselves, which compute the graph too.
    request = UnmaskRequest(3, 0, (0, 1, 3, 4, 5, 7, 8, 9), (2, 6), ())
    with pytest.raises(SecAggError, match="round 3: the clients that answered fall apart"):
        parties[0].unmask(request)


def test_secagg_plus_refuses_a_neighbourhood_without_a_majority() -> None:
    n = 12
    parties = federation(n, threshold=7, neighbours=4)
    clients = tuple(range(n))
    for i in clients:
        parties[i].mask(2, 0, clients, np.ones(3))
    # 0 keeps 3 of its neighbourhood of 5: a bare majority, but not the 4 (a majority of 6) that keep two
    # groups told different stories from sharing only client 0 (graph.neighbourhood_threshold)
    answered = tuple(i for i in clients if i not in (1, 11))
    with pytest.raises(SecAggError, match="round 2: only 3 of this client's neighbourhood answered, fewer than the 4"):
        parties[0].unmask(UnmaskRequest(2, 0, answered, (1, 11), ()))


# -- what an honest client refuses -------------------------------------------------------------


def prepared_round(n: int = 5) -> tuple[list[Party], dict[int, UnmaskRequest], MaskedRound]:
    parties = federation(n)
    masked_round = MaskedRound(RUN, 7, 0, tuple(range(n)), round_threshold(parties[0].settings, n), 3)
    for i in range(n):
        row = parties[i].mask(7, 0, tuple(range(n)), np.full(3, float(i)))
        if i != n - 1:
            masked_round.add(row)
    return parties, masked_round.close(), masked_round


def refused(party: Party, request: UnmaskRequest, match: str) -> None:
    with pytest.raises(SecAggError, match=match):
        party.unmask(request)


def test_honest_clients_refuse_what_would_unmask_a_client_that_answered() -> None:
    parties, requests, masked_round = prepared_round()
    honest = requests[0]
    # The classic attack: client 1 answered, the coordinator calls it dropped to get the seeds of its masks.
    # Client 1 itself refuses; client 0 sees 1's share forwarded (so 1 answered) and refuses too.
    refused(
        parties[1],
        requests[1]._replace(answered=(0, 2, 3), dropped=(1, 4)),
        "round 7: .*this client \\(1\\) as dropped",
    )
    refused(
        parties[0],
        honest._replace(answered=(0, 2, 3, 4), dropped=(1,)),
        "round 7: a share from client 1, which is not among",
    )
    refused(parties[0], honest._replace(dropped=(1, 4)), "round 7: clients \\[1\\] are listed both as answered")
    refused(parties[0], honest._replace(answered=(0, 1, 3), dropped=(4,)), "not the clients the round was sent to")
    # Fewer than t survivors claimed: unmasking then could reveal the survivors' answers.
    few = honest._replace(answered=(0, 1), dropped=(2, 3, 4), shares=honest.shares[:1])
    refused(parties[0], few, "round 7: only 2 clients answered, fewer than the threshold 4")
    refused(parties[4], requests[3], "round 7: the coordinator lists this client \\(4\\) as dropped")
    # Nothing above changed any state: the honest requests still unmask the sum.
    replies = {j: parties[j].unmask(request) for j, request in requests.items()}
    total = masked_round.finish(replies)
    assert fixedpoint.decode(total, 40).tolist() == [6.0, 6.0, 6.0]  # 0 + 1 + 2 + 3
    refused(parties[0], honest, "round 7: the unmasking was already given")
    # For every client the coordinator holds b-shares or pairwise seeds, never both.
    for i in range(5):
        got_b = any(i in reply.b_shares for reply in replies.values())
        got_seeds = any(i in reply.seeds for reply in replies.values())
        assert got_b != got_seeds


def test_a_client_cannot_be_asked_twice_with_two_stories() -> None:
    parties, requests, _ = prepared_round(6)  # 0 to 4 answered, 5 dropped; t = 4
    honest = requests[0]
    # Client 3 is called dropped in a first request (its share withheld); a second, telling the truth, is refused.
    lie = honest._replace(answered=(0, 1, 2, 4), dropped=(3, 5), shares=tuple(s for s in honest.shares if s[0] != 3))
    assert sorted(parties[0].unmask(lie).seeds) == [3, 5]
    refused(parties[0], honest, "round 7: the unmasking was already given")


def test_a_round_the_client_did_not_answer_is_refused() -> None:
    parties, requests, _ = prepared_round()
    refused(parties[0], requests[0]._replace(round_id=6), "round 6: this client did not answer it")
    refused(parties[0], requests[0]._replace(attempt=1), "round 7: this client did not answer it \\(attempt 1\\)")


def test_malformed_duplicated_and_forged_shares_are_refused() -> None:
    parties, requests, _ = prepared_round()
    honest = requests[0]
    sender, sealed = honest.shares[0]
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    refused(
        parties[0],
        honest._replace(shares=((sender, tampered), *honest.shares[1:])),
        f"share from client {sender} .*fails authentication",
    )
    refused(parties[0], honest._replace(shares=((sender, sealed[:10]), *honest.shares[1:])), "too short")
    refused(parties[0], honest._replace(shares=(honest.shares[0], *honest.shares)), f"two shares from client {sender}")
    refused(parties[0], honest._replace(shares=honest.shares[1:]), f"no share from clients \\[{sender}\\]")
    # A share sealed for another client (moved by the coordinator) fails authentication.
    moved = requests[2].shares[0]
    refused(
        parties[0], honest._replace(shares=((1, requests[2].shares[1][1]), *honest.shares[1:])), "fails authentication"
    )
    assert moved[0] == 0
    assert parties[0].unmask(honest).client == 0  # still answered after every refusal


def test_the_aggregator_refuses_wrong_rows_and_keeps_the_round_as_it_was() -> None:
    parties = federation(3)
    masked_round = MaskedRound(RUN, 2, 0, (0, 1, 2), 2, 4)
    good = parties[0].mask(2, 0, (0, 1, 2), np.ones(4))
    with pytest.raises(SecAggError, match="round 2: client 0: masked row of shape \\(3,\\), expected \\(4,\\)"):
        masked_round.add(good._replace(masked=good.masked[:3]))
    with pytest.raises(SecAggError, match="round 2: client 0: masked row of int64 entries, expected uint64"):
        masked_round.add(good._replace(masked=good.masked.view(np.int64)))
    with pytest.raises(SecAggError, match="sealed shares for clients \\[1\\]"):
        masked_round.add(good._replace(shares={1: good.shares[1]}))
    with pytest.raises(SecAggError, match="not 45 bytes"):
        masked_round.add(good._replace(shares={1: good.shares[1], 2: good.shares[2][:-1]}))
    with pytest.raises(SecAggError, match="client 5 is not one of the round's clients"):
        masked_round.add(good._replace(client=5))
    assert masked_round.shares == {} and not masked_round.total.any()
    masked_round.add(good)
    with pytest.raises(SecAggError, match="sent a second masked row"):
        masked_round.add(good)


def test_a_client_refuses_values_outside_the_bound_naming_round_and_entry() -> None:
    parties = federation(3, bound=2.0)
    with pytest.raises(FixedPointOverflow, match="round 9: entry 1 is 3, outside the fixed-point bound \\+-2"):
        parties[0].mask(9, 0, (0, 1, 2), np.array([1.0, 3.0]))
    assert parties[0].mask(9, 0, (0, 1, 2), np.array([1.0, 2.0])).masked.shape == (2,)  # nothing was recorded


def test_replayed_or_forged_key_directories_are_refused() -> None:
    parties = federation(3)
    directory = {p.index: p.public_key for p in parties}
    with pytest.raises(SecAggError, match="epoch 0 refused: this client already agreed to epoch 0"):
        parties[0].agree(0, directory)
    with pytest.raises(SecAggError, match="does not carry this client's \\(client 0\\) own public key"):
        parties[0].agree(1, {**directory, 0: parties[1].public_key})
    with pytest.raises(SecAggError, match="gives two clients the same key"):
        parties[0].agree(1, {**directory, 2: parties[1].public_key})
    with pytest.raises(SecAggError, match="client 2's public key is not a usable"):
        parties[0].agree(1, {**directory, 2: bytes(32)})
    assert parties[0].epoch == 0
    # A client that rejoined with a new key: the next epoch's directory is taken, and rounds go on.
    parties[2] = Party(2, RUN, parties[0].settings)
    book = KeyDirectory()
    for party in parties:
        book.announce(party.index, directory[party.index])
    book.announce(2, parties[2].public_key)
    assert book.epoch == 1
    for party in parties:
        party.agree(book.epoch, book.keys)
    rows = np.arange(6.0).reshape(3, 2)
    assert fixedpoint.decode(run_round(parties, rows, 1, set()), 40).tolist() == [6.0, 9.0]


def test_a_round_needs_a_majority_whatever_the_coordinator_says() -> None:
    parties = federation(6, threshold=5)
    # a majority of k + 1 at least, whatever the RunSpec says: 6 for 9 and 10 clients
    assert [round_threshold(parties[0].settings, k) for k in (2, 6, 9, 10)] == [5, 5, 6, 6]
    with pytest.raises(SecAggError, match="round 3: 4 clients take part, fewer than 2 or than the threshold 5"):
        parties[0].mask(3, 0, (0, 1, 2, 3), np.ones(2))
    with pytest.raises(SecAggError, match="round 3: 1 clients take part"):
        federation(3)[0].mask(3, 0, (0,), np.ones(2))


def test_a_client_does_not_mask_a_round_twice() -> None:
    parties = federation(3)
    parties[0].mask(1, 0, (0, 1, 2), np.ones(2))
    with pytest.raises(SecAggError, match="round 1: this client already answered it"):
        parties[0].mask(1, 0, (0, 1, 2), np.ones(2))
    parties[0].mask(1, 1, (0, 1, 2), np.ones(2))  # a new attempt (the round sent again) is a new masking


@pytest.mark.parametrize(
    ("round_id", "answered", "dropped"), [(0, (0, 1, 2), ()), (7, (1, 2, 300), (0, 5)), (1 << 40, (0,), (128,))]
)
def test_unmask_requests_written_by_hand_are_the_bytes_protobuf_writes(
    round_id: int, answered: tuple[int, ...], dropped: tuple[int, ...]
) -> None:
    shares = {j: tuple((i, bytes([i % 256]) * 45) for i in answered if i != j) for j in answered}
    requests = {j: UnmaskRequest(round_id, 0, answered, dropped, shares[j]) for j in answered}
    for client, data in messages.unmask_requests("run-é", requests).items():
        expected = pb.UnmaskRequest(
            run_id="run-é",
            round_id=round_id,
            client=client,
            answered=answered,
            dropped=dropped,
            shares=[pb.ClientValue(client=i, value=sealed) for i, sealed in shares[client]],
        )
        assert data == pb.Instruction(unmask=expected).SerializeToString()
        assert pb.Instruction.FromString(data).unmask == expected


def test_masks_of_every_short_length_and_block_boundary_are_the_ctr_keystream() -> None:
    """The keystream is computed through AES-GCM from its third counter block on (crypto.Keystream): every
    length around the 32 bytes taken from CTR mode, and around a block of add_masks, gives AES-256-CTR's
    keystream from counter block zero, fresh or added, and so does a stream read in pieces of any size."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    seed = bytes(range(32))
    whole = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * (crypto.MASK_BLOCK + 9)))
    reference = np.frombuffer(whole, dtype="<u8").astype(np.uint64)
    for length in (
        *range(1, 10),
        *(crypto.Keystream.GCM_FROM // 8 + k for k in (-1, 0, 1)),  # CTR alone below, GCM from there
        crypto.MASK_BLOCK - 1,
        crypto.MASK_BLOCK,
        crypto.MASK_BLOCK + 1,
        crypto.MASK_BLOCK + 9,
    ):
        assert np.array_equal(crypto.expand(seed, length), reference[:length]), length
        total = np.arange(length, dtype=np.uint64)
        crypto.add_masks(total, [(seed, -1)])
        assert np.array_equal(total, np.arange(length, dtype=np.uint64) - reference[:length]), length
    stream, out, at = crypto.Keystream(seed, 8000), bytearray(8000), 0
    for piece in (1, 7, 8, 16, 3, 100, 865, 7000):  # across the 32 bytes from CTR mode and GCM's 16-byte blocks
        stream.update_into(memoryview(bytes(piece)), memoryview(out)[at : at + piece])
        at += piece
    assert bytes(out) == whole[:8000]


@pytest.mark.parametrize("entries", [100, wire.BY_HAND_ABOVE // 8 - 1, wire.BY_HAND_ABOVE // 8, 40_000])
def test_a_masked_answer_inline_is_protobufs_bytes_whether_written_by_hand_or_not(entries: int) -> None:
    # From 64 KiB up the rows are joined by hand (protobuf would copy them twice); the bytes are protobuf's own.
    rng = np.random.default_rng(entries)
    rows = tuple(
        MaskedRow(
            client,
            rng.integers(0, 2**63, entries, dtype=np.uint64),
            {j: bytes([j]) * SEALED_SHARE_BYTES for j in (0, 2, 5) if j != client},
        )
        for client in (5, 2)
    )
    (made,) = messages.masked_answer("run", 4, MaskedAnswer(rows), 1 << 22)
    expected = pb.Answer(run_id="run", round_id=4, masked=True, client_indices=[2, 5], payload_length=2 * entries)
    for row in sorted(rows, key=lambda r: r.client):
        holders = sorted(row.shares)
        expected.shares.add(holders=holders, sealed=[row.shares[j] for j in holders])
    expected.payload = np.concatenate([rows[1].masked, rows[0].masked]).astype("<u8").tobytes()
    assert made == pb.ClientMessage(answer=expected).SerializeToString()
    read = pb.ClientMessage.FromString(made).answer
    inline = wire.read_inline_answer(made)
    payload = read.payload if inline is None else inline[1]
    assert (inline is None) == (len(made) < wire.BY_HAND_ABOVE)
    answer = messages.read_masked_answer(read if inline is None else inline[0].answer, payload, entries)
    assert answer.indices == (2, 5) and answer.vectors.view(np.uint64).tobytes() == expected.payload
