"""The in-process transport: every client's worker lives in this process."""

from __future__ import annotations

from fedsaddle.client.worker import Worker
from fedsaddle.common.problems import make_shards
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.server.pool import Category, ClientPool, RunInfo


class LocalPool(ClientPool):
    """Runs all clients in one vectorized worker. Same answers as GrpcPool, bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self._worker: Worker | None = None
        self._worker_key: tuple[str, int, float] | None = None

    def _announce(self, run: RunInfo) -> None:
        key = (run.problem.model_dump_json(), run.seed, run.gradient_noise)
        if key != self._worker_key:  # rebuilding shards is the costly part; reuse across runs
            shards = make_shards(run.problem, run.seed, range(run.num_clients))
            self._worker = Worker(shards, run.seed, run.gradient_noise)
            self._worker_key = key

    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        assert self._worker is not None
        return [self._worker.execute(task, round_id)]
