"""The in-process transport: every client's computation runs in this process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedsaddle.common import blas
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import DataProblem, make_problem
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.server.config import RunConfig
from fedsaddle.server.pool import Category, ClientPool, RunInfo


class LocalPool(ClientPool):
    """Runs all clients in one vectorized worker. Same answers as GrpcPool, bit for bit.

    `data` gives each client's own data file (client index -> path) for problems
    on real data; synthetic problems need none. A run sets this process's BLAS to
    the thread count client processes use (one, unless OPENBLAS_NUM_THREADS says
    otherwise), on which its sums' bits depend.
    """

    def __init__(self, data: Mapping[int, str | Path] | None = None, cache: ShardCache | None = None) -> None:
        super().__init__()
        self.cache = cache or ShardCache(size=1, data=data)
        self._worker: Worker | None = None

    def describe(self) -> dict[str, str]:
        """What summary.json records of this transport: in-process, and the BLAS its sums ran on."""
        return {"kind": "in-process", "blas": blas.describe()}

    def _announce(self, run: RunInfo) -> Sequence[int] | None:
        blas.apply()  # the thread count client processes use: BLAS's sums depend on it (common/blas.py)
        shards = self.cache.get(run.problem, run.seed, range(run.num_clients))
        self._worker = Worker(shards, run.seed, run.gradient_noise)
        counts = getattr(shards, "sample_counts", None)
        return counts() if counts is not None else None

    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        assert self._worker is not None
        return [self._worker.execute(task, round_id, participants)]


def reference_solution(config: RunConfig, cache: ShardCache) -> Array | None:
    """z* of the federation's f from all clients' data, when the problem can compute it.

    Only possible where every client's data is at hand (an in-process run): a
    gRPC coordinator never has it.
    """
    problem = make_problem(config.problem)
    if not isinstance(problem, DataProblem):
        return None
    shards = cache.get(config.problem, config.seed, range(config.problem.num_clients))
    datas = shards.datas  # type: ignore[attr-defined]
    weights = np.array([d.samples for d in datas], dtype=float) if config.weighting == "samples" else None
    return problem.reference_solution(datas, weights)
