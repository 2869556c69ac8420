"""Secure aggregation's round sum as the protocol reads the masked answers, in memory (tests/federation.py).

Masked answers in chunks are added to the round's sum chunk by chunk, one at a time; the others are read
whole (an answer of one message, or one whose chunks came while another was being added) and added when
accepted. However their arrivals interleave, the run is bit-identical to the in-process one.
"""

from __future__ import annotations

from typing import Any

import pytest
from federation import Federation, SecureMemoryPool

from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.local_pool import LocalPool
from fedsaddle.server.pool import Category

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
        header, first, *rest = federation.answer(self.streamed, federation.take(self.streamed))
        whole = federation.answer(self.whole, federation.take(self.whole))
        federation.send(self.streamed, header)
        federation.send(self.streamed, first)
        for data in whole:
            federation.send(self.whole, data)
        for data in rest:
            federation.send(self.streamed, data)
        federation.honest |= {self.streamed, self.whole}


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
