"""Secure aggregation's round sum as the protocol reads the masked answers, in memory (tests/federation.py).

Masked answers in chunks are added to the round's sum chunk by chunk, one at a time; the others are read
whole (an answer of one message, or one whose chunks came while another was being added) and added when
accepted. However their arrivals interleave, the run is bit-identical to the in-process one.
"""

from __future__ import annotations

from typing import Any

import pytest
from federation import Federation, SecureMemoryPool

from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.pool import Category
from fedsaddle.server.transport.local_pool import LocalPool

CLIENTS, DIM = 6, 30  # a client's masked row: 2 * DIM + 2 entries, 496 bytes
CONFIG = parse_config(
    {
        "problem": {"name": "paper_regression", "num_clients": CLIENTS, "dim": DIM, "s": 1.0},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
        "sync": {"kind": "fixed", "tau": 2},
        "rounds": 4,
        "privacy": {"secure_aggregation": True},
        "output": {"plot": False},
    }
)


class Interleaving(SecureMemoryPool):
    """Each masked round: `streamed` sends its answer's header and first chunk, then `whole` its whole answer,
    then `streamed` the rest of its chunks (the other sessions answered as the round opened)."""

    def __init__(self, federation: Federation, streamed: int, whole: int) -> None:
        super().__init__(federation)
        self.streamed, self.whole = streamed, whole
        self.meanwhile = self._interleave

    def _exchange_masked(self, task: Any, round_id: int, category: Category, participants: Any, rows: Any) -> Any:
        self.federation.honest -= {self.streamed, self.whole}
        return super()._exchange_masked(task, round_id, category, participants, rows)

    def _interleave(self) -> None:
        federation = self.federation
        streamed = federation.answer(self.streamed, federation.take(self.streamed))  # (none: not in the round)
        whole = federation.answer(self.whole, federation.take(self.whole))
        for data in streamed[:2]:
            federation.send(self.streamed, data)
        for data in whole:
            federation.send(self.whole, data)
        self._then(streamed)
        federation.honest |= {self.streamed, self.whole}

    def _then(self, streamed: list[bytes]) -> None:
        """After `streamed`'s header and first chunk, and `whole`'s answer: the rest of `streamed`'s chunks."""
        for data in streamed[2:]:
            self.federation.send(self.streamed, data)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("other", ["one message", "read whole"])
def test_an_answer_accepted_whole_while_another_is_added_chunk_by_chunk_counts_once(other: str, fold: bool) -> None:
    # Three clients in one process answer in chunks (1488 bytes, chunks of 1024); meanwhile another process's
    # answer comes whole: one client's (496 bytes, one message), or three clients' in chunks, read whole while
    # the first is being added (a straggler deadline: no reorder bound, every stream is read).
    alone = run_algorithm(CONFIG.algorithms[0], CONFIG, LocalPool(), run_id="interleaved")
    options: dict[str, Any] = {"round_timeout_s": 30.0}
    if other == "read whole":
        options.update(straggler_deadline_s=10.0, min_clients=CLIENTS)
    federation = Federation(CLIENTS, chunk_bytes=1024, **options)
    streamed = federation.join((0, 1, 2))
    if other == "one message":
        whole = federation.join((3,))
        federation.join((4,))
        federation.join((5,))
    else:
        whole = federation.join((3, 4, 5))
    pool = Interleaving(federation, streamed, whole)
    pool.fold = fold
    federated = run_algorithm(CONFIG.algorithms[0], CONFIG, pool, run_id="interleaved")
    assert federated.status == alone.status == "ok", federated.detail
    assert federated.z_sha256 == alone.z_sha256


def _config(dim: int = DIM, **privacy: Any) -> Any:
    participation = privacy.pop("participation", {})
    return parse_config(
        {
            "problem": {"name": "paper_regression", "num_clients": CLIENTS, "dim": dim, "s": 1.0},
            "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
            "sync": {"kind": "fixed", "tau": 2},
            "rounds": 6,
            "privacy": {"secure_aggregation": True, **privacy},
            "participation": participation,
            "output": {"plot": False},
        }
    )


@pytest.mark.parametrize(
    "privacy",
    [
        {"neighbours": 2},  # SecAgg+: each row's shares go to its two neighbours only
        {"dp": {"clip": 10.0, "noise_multiplier": 0.5}},  # the clients' noise in their rows (fresh each run)
        {"participation": {"fraction": 0.5}},  # sampled: a process may answer for some of its clients, or none
    ],
    ids=["neighbours", "dp", "sampled"],
)
def test_masked_answers_interleaved_give_the_in_process_run_with_neighbours_noise_or_sampling(
    privacy: dict[str, Any],
) -> None:
    config = _config(**privacy)
    alone = run_algorithm(config.algorithms[0], config, LocalPool(), run_id="variants")
    federation = Federation(CLIENTS, chunk_bytes=1024, round_timeout_s=30.0)
    streamed = federation.join((2, 0, 1))  # (its Hello lists its clients out of index order)
    whole = federation.join((3,))
    federation.join((5, 4))
    pool = Interleaving(federation, streamed, whole)
    pool.fold = True
    federated = run_algorithm(config.algorithms[0], config, pool, run_id="variants")
    assert federated.status == alone.status == "ok", federated.detail
    if "dp" not in privacy:  # (the noise is drawn afresh: no two runs agree)
        assert federated.z_sha256 == alone.z_sha256


class Straggling(Interleaving):
    """Each masked round: `streamed` sends its header and first chunk, `whole` its answer of one message, the
    straggler deadline passes (closing the round without `streamed`), then the rest of `streamed`'s chunks
    come (read and dropped)."""

    told: list[str]

    def _then(self, streamed: list[bytes]) -> None:
        self.federation.advance(1.5)
        super()._then(streamed)
        self.told = [rejected.details for rejected in self.federation.rejected(self.streamed)]


def _cut_run(fold: bool) -> tuple[str, list[str]]:
    config = _config(40, participation={"straggler_deadline_s": 1.0, "min_clients": 4})  # rows of 656 bytes
    federation = Federation(CLIENTS, chunk_bytes=1024, round_timeout_s=30.0, straggler_deadline_s=1.0, min_clients=4)
    streamed = federation.join((0, 1))  # (1312 bytes: two chunks)
    whole = federation.join((2,))  # (one message)
    for index in (3, 4, 5):
        federation.join((index,))
    pool = Straggling(federation, streamed, whole)
    pool.fold = fold
    federated = run_algorithm(config.algorithms[0], config, pool, run_id="cut")
    assert federated.status == "ok", federated.detail
    return federated.z_sha256, pool.told


def test_an_answer_cut_by_the_straggler_deadline_leaves_the_one_accepted_while_it_was_read() -> None:
    # Each round: clients 0 and 1's answer is half added when client 2's whole answer is accepted; the deadline
    # then closes the round without clients 0 and 1. Their half answer is taken back out of the sum, client 2's
    # row stays: the run equals one whose rows are kept whole and summed once the round closes.
    cut, told = _cut_run(fold=True)
    kept, _ = _cut_run(fold=False)
    assert cut == kept
    assert told and all("closed while this answer was being read" in details for details in told)


class Gapping(Interleaving):
    """Each masked round: `streamed` sends its header, its first chunk and then a chunk that leaves a gap (the
    answer is refused half added), while `whole` answers; then `streamed` sends its whole answer again."""

    told: list[str]

    def _then(self, streamed: list[bytes]) -> None:
        federation = self.federation
        federation.send(self.streamed, pb.ClientMessage(chunk=pb.Chunk(offset=10**6, data=b"\0" * 8)))
        for data in streamed:
            federation.send(self.streamed, data)
        self.told = [rejected.details for rejected in federation.rejected(self.streamed)]


def test_an_answer_refused_half_added_for_a_gap_is_taken_out_and_its_good_one_counts_once() -> None:
    alone = run_algorithm(CONFIG.algorithms[0], CONFIG, LocalPool(), run_id="gap")
    federation = Federation(CLIENTS, chunk_bytes=1024, round_timeout_s=30.0)
    streamed = federation.join((0, 1, 2))
    whole = federation.join((3,))
    federation.join((4,))
    federation.join((5,))
    pool = Gapping(federation, streamed, whole)
    pool.fold = True
    federated = run_algorithm(CONFIG.algorithms[0], CONFIG, pool, run_id="gap")
    assert federated.status == "ok", federated.detail
    assert federated.z_sha256 == alone.z_sha256
    assert pool.told == ["chunk at byte 1000000, expected byte 1024"]  # (in the last round, as in every one)
