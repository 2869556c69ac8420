"""What a run's secure aggregation is configured with, and the protocol's refusal."""

from __future__ import annotations

from typing import NamedTuple

SCALE_BITS = 40  # fixed-point resolution 2^-40 (about 9.1e-13)
RING_BITS = 64  # numpy's uint64 wraps mod 2^64 for free


class SecAggError(ValueError):
    """A secure aggregation step refused: the message names the round and the reason. No state changed."""


class SecAggSettings(NamedTuple):
    """A run's secure aggregation, as the coordinator tells it to every client.

    threshold: the least number of a round's clients that must answer for it to be unmasked (t of
    Shamir's t-of-k); a round of k clients needs max(threshold, floor((k+1)/2) + 1), a majority of k + 1
    always (default_threshold);
    scale_bits: values are encoded as round(v * 2^scale_bits);
    bound: every value a client sends must satisfy |v| <= bound, so that the sum of
    `parties` such values cannot leave the signed range of the ring;
    neighbours: k, each client masks with its k neighbours in the round's Harary graph (SecAgg+,
    common/secagg/graph.py) and shares its self-mask seed among them; 0: all pairs.
    """

    threshold: int = 0  # 0: default_threshold of each round's clients
    scale_bits: int = SCALE_BITS
    bound: float = 0.0  # 0: default_bound(parties, scale_bits)
    neighbours: int = 0  # 0: every pair of the round's clients


def default_bound(parties: int, scale_bits: int = SCALE_BITS) -> float:
    """The largest power-of-two bound B with parties * B * 2^scale_bits <= 2^62: half the signed range,
    so that rounding each value to the grid can never carry the sum over 2^63."""
    bound = 2.0 ** (62 - scale_bits)
    while parties * bound > 2.0 ** (62 - scale_bits):
        bound /= 2
    return bound


def check_bound(parties: int, bound: float, scale_bits: int) -> None:
    """ValueError unless `parties` values of magnitude <= bound sum inside the ring's signed range."""
    if not 8 <= scale_bits <= 52:
        raise ValueError(f"scale_bits must be within 8..52, got {scale_bits}")
    if not bound > 0:
        raise ValueError(f"the fixed-point bound must be > 0, got {bound}")
    if parties * bound * 2.0**scale_bits > 2.0**62:
        raise ValueError(
            f"a bound of {bound:g} with scale 2^-{scale_bits} lets {parties} clients' sum overflow the 64-bit ring; "
            f"the largest safe bound is {default_bound(parties, scale_bits):g}"
        )


def round_threshold(settings: SecAggSettings, parties: int) -> int:
    """t for a round of `parties` clients: the configured one, and never less than default_threshold (a
    client computes it from the round's clients itself, so a coordinator cannot lower it)."""
    return max(settings.threshold, default_threshold(parties))


def default_threshold(parties: int) -> int:
    """floor((k+1)/2) + 1: a majority of k + 1, for a round of k clients (k/2 + 1 when k is even, one more
    than a bare majority when k is odd).

    A coordinator that tells two groups of clients different stories about who dropped gets, from one
    group, shares of a client's self-mask seed and, from the other, the pairwise seeds of that client with
    them; the client itself gives its own share and its seeds with the first group. Both groups count the
    target, so each needs only t - 1 others: with 2(t - 1) <= k - 1 (a bare majority of an odd k) every
    mask of one client's row could be stripped, its answer read alone (tests/test_privacy_attacks.py)."""
    return (parties + 1) // 2 + 1


def check_threshold(threshold: int, parties: int) -> None:
    """ValueError unless t is at least default_threshold(k) for a round of k clients and at most k.

    At least default_threshold(k), so that no two groups of clients that share only one client can each
    reach the threshold (a coordinator that told each group a different story could otherwise unmask that
    client's row: default_threshold); at most k, or a round could never be unmasked.
    """
    if parties < 2:
        raise ValueError(
            f"secure aggregation needs at least 2 clients per round (the sum of one is its answer), got {parties}"
        )
    least = default_threshold(parties)
    if not least <= threshold <= parties:
        raise ValueError(
            f"threshold {threshold} is unsafe for {parties} clients per round: it must be within "
            f"{least}..{parties} (a majority of {parties} + 1, and no more than the clients)"
        )
