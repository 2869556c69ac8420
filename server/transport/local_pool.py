"""The in-process transport: every client's computation runs in this process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedsaddle.common import blas
from fedsaddle.common.attacks import label_flipped
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import DataProblem, make_problem
from fedsaddle.common.secagg.party import Party, UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer, mask_answer
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.server.config import RunConfig
from fedsaddle.server.pool import Category, ClientPool, RunInfo
from fedsaddle.server.secure import MaskedRound


class LocalPool(ClientPool):
    """Runs all clients in one vectorized worker. Same answers as GrpcPool, bit for bit.

    `data` gives each client's own data file (client index -> path) for problems
    on real data; synthetic problems need none. A run sets this process's BLAS to
    the thread count client processes use (one, unless OPENBLAS_NUM_THREADS says
    otherwise), on which its sums' bits depend.

    With secure aggregation, each client is a `Party` of its own here too, and
    masks its row as a client process would: the pool above only ever sees masked
    rows and the unmasked sum, as over gRPC.
    """

    def __init__(self, data: Mapping[int, str | Path] | None = None, cache: ShardCache | None = None) -> None:
        super().__init__()
        self.cache = cache or ShardCache(size=1, data=data)
        self._worker: Worker | None = None
        self._parties: dict[int, Party] = {}  # secure aggregation: each client's own side
        self._sample_counts: dict[int, float] | None = None  # each client's weight, known to itself only

    def describe(self) -> dict[str, str]:
        """What summary.json records of this transport: in-process, and the BLAS its sums ran on."""
        return {"kind": "in-process", "blas": blas.describe()}

    def _announce(self, run: RunInfo) -> Sequence[int] | None:
        blas.apply()  # the thread count client processes use: BLAS's sums depend on it (common/blas.py)
        flipped = label_flipped(run.attack)
        shards = self.cache.get(run.problem, run.seed, range(run.num_clients), run.weighting, flipped)
        self._worker = Worker(shards, run.seed, run.gradient_noise, element=run.element)
        counts = getattr(shards, "sample_counts", None)
        self._parties, self._sample_counts = {}, None
        if run.secure is not None and run.weighting == "samples" and counts is not None:
            self._sample_counts = dict(enumerate(float(c) for c in counts()))
        return counts() if counts is not None else None

    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        assert self._worker is not None
        return [self._worker.execute(task, round_id, participants)]

    # -- secure aggregation: the clients' side, in this process ----------------------------

    def _public_keys(self) -> dict[int, bytes]:
        run = self._require_run()
        assert run.secure is not None
        self._parties = {i: Party(i, run.run_id, run.secure) for i in range(run.num_clients)}
        return {i: party.public_key for i, party in self._parties.items()}

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        for party in self._parties.values():
            party.agree(epoch, keys)

    def _exchange_masked(
        self,
        task: Task,
        round_id: int,
        category: Category,
        participants: tuple[int, ...] | None,
        rows: MaskedRound,
    ) -> list[MaskedAnswer]:
        """The rows are all here at once: returned (the round adds them in client order; any order gives the
        same bits)."""
        assert self._worker is not None
        answer = self._worker.execute(task, round_id, participants)
        clients = participants if participants is not None else tuple(range(self._require_run().num_clients))
        run = self._require_run()
        return [mask_answer(self._parties, answer, task, round_id, 0, clients, self._sample_counts, run.dp)]

    def _unmask(self, requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskReply]:
        return {j: self._parties[j].unmask(request) for j, request in requests.items()}


def reference_solution(config: RunConfig, cache: ShardCache) -> Array | None:
    """z* of the federation's f from all clients' data, when the problem can compute it.

    Only possible where every client's data is at hand (an in-process run): a
    gRPC coordinator never has it.
    """
    problem = make_problem(config.problem)
    if not isinstance(problem, DataProblem):
        return None
    shards = cache.get(config.problem, config.seed, range(config.problem.num_clients), config.weighting)
    datas = shards.datas  # type: ignore[attr-defined]
    weights = np.array([d.samples for d in datas], dtype=float) if config.weighting == "samples" else None
    return problem.reference_solution(datas, weights)
