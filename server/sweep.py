"""Many runs at once: a batch of runs through the same algorithm code, in one process.

A batch holds B runs of one algorithm that share the problem kind, the clients,
the dimension, the budget and the synchronization schedule, and may differ in
seed, problem parameters (e.g. heterogeneity s) and step sizes. Every array
gains a leading run axis: iterates (B, D), answers (B, n, D), per-run step sizes
(B, 1). All client and coordinator arithmetic is elementwise, per run, or goes
through `base.norm` and `pool.mean_over_clients`, so each run gets the same bits
it gets alone, in-process or over gRPC (tests/test_sweep.py checks this).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsaddle.client.worker import Worker
from fedsaddle.common.config import AlgorithmSpec, FixedSync, RunConfig
from fedsaddle.common.problems import Array, Shards, make_shards, solution, stack_shards
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.server.algorithms import Algorithm, SyncSchedule, build
from fedsaddle.server.algorithms.base import norm
from fedsaddle.server.coordinator import AlgorithmResult, budgeted_steps, initial_point, state_counters
from fedsaddle.server.pool import Category, ClientPool, RunInfo, TrafficCounts


class BatchedLocalPool(ClientPool):
    """The in-process transport for a batch of runs; flags divergence per run instead of raising."""

    def __init__(self, runs: Sequence[RunInfo], data: dict[tuple[str, int], Shards] | None = None) -> None:
        super().__init__()
        self.runs = list(runs)
        data = {} if data is None else data  # shards by (problem JSON, seed): reuse across batches
        for r in runs:
            key = (r.problem.model_dump_json(), r.seed)
            if key not in data:
                data[key] = make_shards(r.problem, r.seed, range(r.num_clients))
        shards = stack_shards([data[(r.problem.model_dump_json(), r.seed)] for r in runs])
        noise = {r.gradient_noise for r in runs}
        if len(noise) != 1:
            raise ValueError("a batch needs one gradient_noise for all runs")
        self._worker = Worker(shards, [r.seed for r in runs], noise.pop())
        self.start_run(runs[0])
        self.diverged_round = np.full(len(runs), -1)
        self.traffic_at_divergence: list[dict[Category, TrafficCounts] | None] = [None] * len(runs)

    def _announce(self, run: RunInfo) -> None:
        pass  # the batch's shards are built in __init__

    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        return [self._worker.execute(task, round_id)]

    def _run_round(self, task: Task, category: Category) -> tuple[Array, Array | None]:
        vectors, objective = super()._run_round(task, category)
        bad = ~np.isfinite(vectors).all(axis=(-2, -1))
        if objective is not None:
            bad |= ~np.isfinite(objective).all(axis=-1)
        for b in np.flatnonzero(bad & (self.diverged_round < 0)):
            # A run alone stops here (Diverged), with this round counted.
            self.diverged_round[b] = self.round_id
            self.traffic_at_divergence[b] = copy.deepcopy(self.traffic)
        return vectors, objective


@dataclass(frozen=True)
class BatchRun:
    """One member of a batch: its config (one algorithm) and that algorithm's spec."""

    config: RunConfig
    spec: AlgorithmSpec


def _stacked(values: Sequence[Any]) -> Any:
    """Per-run hyperparameters as a (B, 1) column; None stays None."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError("a batch mixes set and unset step sizes")
    return np.array(values, dtype=float)[:, None]


def build_batch(specs: Sequence[AlgorithmSpec]) -> Algorithm[Any]:
    """One algorithm object whose numeric hyperparameters are (B, 1) columns."""
    numeric = ("gamma", "gamma_local", "gamma_global", "theta", "theta_scale")
    fields = [f for f in numeric if f in type(specs[0]).model_fields]
    shapes = {s.model_copy(update={"label": None, **dict.fromkeys(fields, 1.0)}) for s in specs}
    if len(shapes) != 1 or len({type(s) for s in specs}) != 1:
        raise ValueError("a batch needs one algorithm with the same options, differing only in step sizes")
    columns = {f: _stacked([getattr(s, f) for s in specs]) for f in fields}
    return build(specs[0], overrides={f: c for f, c in columns.items() if c is not None})


def run_batch(members: Sequence[BatchRun], data: dict[tuple[str, int], Shards] | None = None) -> list[AlgorithmResult]:
    """Run every member of the batch; each result is what `run_algorithm` would give it alone.

    `data` caches the clients' shards by (problem, seed) across calls.
    """
    configs = [m.config for m in members]
    first = configs[0]
    shared = {(c.rounds, c.round_convention, c.sync) for c in configs}
    if len(shared) != 1 or (not isinstance(first.sync, FixedSync) and len({c.seed for c in configs}) != 1):
        raise ValueError("a batch needs one budget, convention and synchronization schedule")
    runs = [RunInfo(f"batch-{b}", c.problem, c.seed, c.gradient_noise) for b, c in enumerate(configs)]
    pool = BatchedLocalPool(runs, data)
    algorithm = build_batch([m.spec for m in members])
    schedule = SyncSchedule(first.sync, first.seed)
    z_star = np.stack([_solution(c) for c in configs])
    d = first.problem.dim
    B = len(members)
    # Records are kept as columns (one row per step, one column per run) and turned
    # into each run's list of dicts at the end; `recorded` says which runs were
    # still going at each step.
    columns: dict[str, list[Any]] = {k: [] for k in ("step", "rounds", "paper_rounds", "time_s", "dist_x", "dist_z")}
    recorded: list[NDArray[np.bool_]] = []
    last_z = np.full((B, z_star.shape[-1]), np.nan)  # each run's iterate at its last record
    # A run stops where it would stop alone: before a step whose answers were not
    # finite (Diverged inside the step), or after a step that left z non-finite.
    # Its traffic and counters are frozen there.
    stopped = np.zeros(B, dtype=bool)
    frozen: list[tuple[dict[Category, TrafficCounts], dict[str, Any]] | None] = [None] * B
    start = time.perf_counter()

    def record(z: Array, steps: int, paper_rounds: int, before: Any, after: Any) -> None:
        for b in np.flatnonzero((pool.diverged_round >= 0) & ~stopped):
            snapshot = pool.traffic_at_divergence[b]
            assert snapshot is not None
            frozen[b] = (snapshot, state_counters(before, int(b)))
            stopped[b] = True
        with np.errstate(over="ignore", invalid="ignore"):
            columns["dist_x"].append(norm(z[..., :d] - z_star[..., :d])[:, 0])
            columns["dist_z"].append(norm(z - z_star)[:, 0])
        columns["step"].append(steps)
        columns["rounds"].append(pool.traffic["algorithm"].rounds)
        columns["paper_rounds"].append(paper_rounds)
        columns["time_s"].append(time.perf_counter() - start)
        going = ~stopped
        recorded.append(going.copy())
        last_z[going] = z[going]
        for b in np.flatnonzero(going & ~np.isfinite(z).all(axis=-1)):
            frozen[b] = (copy.deepcopy(pool.traffic), state_counters(after, int(b)))
            stopped[b] = True

    z = np.stack([initial_point(c) for c in configs])
    state: Any = None
    for steps, before, state, paper_rounds in budgeted_steps(algorithm, pool, schedule, z, first):
        z = algorithm.iterate(state)
        record(z, steps, paper_rounds, before, state)
        if stopped.all():
            break
    wall = time.perf_counter() - start
    records = _per_run_records(columns, recorded, B)
    results = []
    for b, member in enumerate(members):
        diverged = frozen[b] is not None
        traffic, extra = frozen[b] or (pool.traffic, state_counters(state, b))
        last = records[b][-1] if records[b] and not diverged else {}
        results.append(
            AlgorithmResult(
                name=member.spec.display_name,
                spec=member.spec.model_dump(mode="json"),
                status="diverged" if diverged else "ok",
                records=records[b],
                final_z=last_z[b] if records[b] else z[b],
                dist_x=float(last.get("dist_x", float("nan"))),
                dist_z=float(last.get("dist_z", float("nan"))),
                traffic={category: counts.as_dict() for category, counts in traffic.items()},
                wall_s=wall / B,
                detail="non-finite values" if diverged else "",
                extra=extra,
            )
        )
    return results


def _per_run_records(
    columns: dict[str, list[Any]], recorded: list[NDArray[np.bool_]], runs: int
) -> list[list[dict[str, float | int]]]:
    if not recorded:
        return [[] for _ in range(runs)]
    mask = np.array(recorded)  # (steps, runs)
    shared = [
        (columns["step"][t], columns["rounds"][t], columns["paper_rounds"][t], columns["time_s"][t])
        for t in range(len(recorded))
    ]
    dist_x, dist_z = np.array(columns["dist_x"]).T.tolist(), np.array(columns["dist_z"]).T.tolist()
    records = []
    for b in range(runs):
        steps = np.flatnonzero(mask[:, b]).tolist()
        records.append(
            [
                {"step": s, "rounds": r, "paper_rounds": p, "time_s": t, "dist_x": dist_x[b][i], "dist_z": dist_z[b][i]}
                for i in steps
                for s, r, p, t in (shared[i],)
            ]
        )
    return records


def _solution(config: RunConfig) -> Array:
    z_star = solution(config.problem, config.seed)
    if z_star is None:
        raise ValueError(f"problem {config.problem.name} has no known solution to measure against")
    return z_star
