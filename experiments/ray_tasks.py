"""A compare's tasks on a Ray cluster: fedsaddle cuts the grid into tasks, Ray places them.

Each task (experiments/compare.py's `Task`) becomes one Ray task that asks for
one CPU; Ray's scheduler decides the node. Nothing here schedules, retries or
balances. A task's runs have the same bits on any node (they depend on their
config and seed only, and every worker runs BLAS on one thread), so runs.csv is
byte for byte the one a local run writes.

Every node of the cluster needs the same fedsaddle and Ray installed as the
command that submits (`pip install 'fedsaddle[ray,data]'`); the driver ships no
code.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from fedsaddle.common import blas

from .compare import CompareError, Progress, Task, TaskResult, run_task

# --ray local: a one-node Ray started for this command (ray.init() with no address). Ray's own servers
# listen on every interface of the machine, whatever node address it is given.
LOCAL = "local"


def _on_node(task: Task) -> TaskResult:
    import ray

    return run_task(task, node=ray.get_runtime_context().get_node_id())


def _reachable(address: str, timeout: float = 10.0) -> None:
    """Fail at once, naming the address, when nothing listens at a HOST:PORT: Ray's driver would retry
    for many minutes before it gave up. (Other forms, `auto` or `ray://...`, are left to Ray.)"""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise CompareError(f"--ray {address}: no Ray head answers there ({exc})") from None


def run_on_ray(tasks: Sequence[Task], address: str, progress: Progress | None = None) -> list[TaskResult]:
    """The tasks on the Ray cluster at `address` (HOST:PORT of its head, or `local`), in the order given."""
    if address != LOCAL:
        _reachable(address)
    try:
        import ray
    except ImportError:
        raise CompareError("--ray needs Ray: pip install 'fedsaddle[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        # The workers' BLAS on the thread count every fedsaddle process uses, set before numpy loads there.
        env: dict[str, Any] = {"env_vars": {name: str(blas.threads()) for name in blas.VARIABLES}}
        try:
            if address == LOCAL:
                ray.init(runtime_env=env, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, runtime_env=env, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise CompareError(f"--ray {address}: no Ray cluster to join ({exc})") from None
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(_on_node)
        pending = {remote.remote(task): i for i, task in enumerate(tasks)}
        results: list[TaskResult | None] = [None] * len(tasks)
        done = 0
        waiting = list(pending)
        while waiting:
            finished, waiting = ray.wait(waiting, num_returns=1)
            for ref in finished:
                result: TaskResult = ray.get(ref)
                results[pending[ref]] = result
                done += len(result.runs)
            if progress is not None:
                progress(done)
        return [r for r in results if r is not None]
    finally:
        if started_here:
            ray.shutdown()
