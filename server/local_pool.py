"""The in-process transport: every client's computation runs in this process."""

from __future__ import annotations

from fedsaddle.common.tasks import Answer, Task
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.server.pool import Category, ClientPool, RunInfo


class LocalPool(ClientPool):
    """Runs all clients in one vectorized worker. Same answers as GrpcPool, bit for bit."""

    def __init__(self, cache: ShardCache | None = None) -> None:
        super().__init__()
        self._cache = cache or ShardCache(size=1)
        self._worker: Worker | None = None

    def _announce(self, run: RunInfo) -> None:
        shards = self._cache.get(run.problem, run.seed, range(run.num_clients))
        self._worker = Worker(shards, run.seed, run.gradient_noise)

    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        assert self._worker is not None
        return [self._worker.execute(task, round_id)]
