"""The coordinator's run loop: runs each configured algorithm on a pool within its budget."""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.config import AlgorithmSpec, RunConfig
from fedsaddle.common.problems import Array, solution
from fedsaddle.server.algorithms import Algorithm, SyncSchedule, build
from fedsaddle.server.algorithms.base import norm
from fedsaddle.server.pool import ClientPool, Diverged, RunInfo


@dataclass
class AlgorithmResult:
    """The outcome of one algorithm's run."""

    name: str
    spec: dict[str, Any]
    status: str  # "ok" or "diverged"
    records: list[dict[str, float | int]]
    final_z: Array
    dist_x: float
    dist_z: float
    traffic: dict[str, dict[str, Any]]
    wall_s: float
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def z_sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.final_z, dtype="<f8").tobytes()).hexdigest()

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spec": self.spec,
            "status": self.status,
            "detail": self.detail,
            "dist_x": self.dist_x,
            "dist_z": self.dist_z,
            "rounds": self.traffic["algorithm"]["rounds"],
            "paper_rounds": self.records[-1]["paper_rounds"] if self.records else 0,
            "wall_s": self.wall_s,
            "z_sha256": self.z_sha256,
            "traffic": self.traffic,
            **self.extra,
        }


ProgressHook = Callable[[str, int, int, float], None]

COUNTERS = ("meta_iterations", "syncs", "steps", "theta")


def state_counters(state: Any, run: int | None = None) -> dict[str, Any]:
    """The counters a result reports from an algorithm state (of run `run` in a batch)."""
    if state is None:
        return {}
    out = {}
    for k in COUNTERS:
        if hasattr(state, k):
            value = np.asarray(getattr(state, k))
            out[k] = (value[run] if run is not None and value.ndim else value).squeeze().tolist()
    return out


class RunStopped(Exception):
    """A run ended early by something other than divergence (a lost client, a signal).

    Carries the partial result, so the metrics so far are never lost, and the cause.
    """

    def __init__(self, result: AlgorithmResult, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.result = result
        self.cause = cause


def initial_point(config: RunConfig) -> Array:
    dim = 2 * config.problem.dim
    if config.init == "ones":
        return np.ones(dim)
    if config.init == "zeros":
        return np.zeros(dim)
    return seeding.rng(config.seed, seeding.INIT).standard_normal(dim)


def budgeted_steps(
    algorithm: Algorithm[Any], pool: ClientPool, schedule: SyncSchedule, z0: Array, config: RunConfig
) -> Iterator[tuple[int, Any, Any, int]]:
    """Init, then one step at a time while the next step fits the round budget.

    Yields (steps taken, the state before the step, the state after it, paper
    rounds spent) once after init (steps 0, before None) and after every step.
    The budget counts rounds as `config.round_convention` says.
    """
    paper = config.round_convention == "paper"
    init_cost = algorithm.init_cost()
    if (init_cost.paper if paper else init_cost.exchanges) > config.rounds:
        return
    state = algorithm.init(z0, pool, schedule)
    paper_rounds = init_cost.paper
    yield 0, None, state, paper_rounds
    steps = 0
    while True:
        cost = algorithm.step_cost(state)
        spent = paper_rounds if paper else pool.traffic["algorithm"].rounds
        if spent + (cost.paper if paper else cost.exchanges) > config.rounds:
            return
        with np.errstate(over="ignore", invalid="ignore"):  # divergence is reported, not warned about
            before, state = state, algorithm.step(state, pool, schedule)
        paper_rounds += cost.paper
        steps += 1
        yield steps, before, state, paper_rounds


def run_algorithm(
    spec: AlgorithmSpec,
    config: RunConfig,
    pool: ClientPool,
    run_id: str | None = None,
    progress: ProgressHook | None = None,
) -> AlgorithmResult:
    """Run one algorithm until its next step would exceed the round budget."""
    name = spec.display_name
    run = RunInfo(run_id or f"{name}-{uuid.uuid4().hex[:8]}", config.problem, config.seed, config.gradient_noise)
    pool.start_run(run)
    algorithm = build(spec)
    schedule = SyncSchedule(config.sync, config.seed)
    z_star = solution(config.problem, config.seed)
    d = config.problem.dim
    records: list[dict[str, float | int]] = []

    def record(z: Array, steps: int, paper_rounds: int) -> None:
        entry: dict[str, float | int] = {
            "step": steps,
            "rounds": pool.traffic["algorithm"].rounds,
            "paper_rounds": paper_rounds,
            "time_s": time.perf_counter() - start,
        }
        if z_star is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                entry["dist_x"] = float(norm(z[:d] - z_star[:d])[0])
                entry["dist_z"] = float(norm(z - z_star)[0])
        records.append(entry)

    start = time.perf_counter()
    status, detail = "ok", ""
    stopped_by: BaseException | None = None
    state: Any = None
    z = initial_point(config)
    try:
        for steps, _, state, paper_rounds in budgeted_steps(algorithm, pool, schedule, z, config):
            z = algorithm.iterate(state)
            record(z, steps, paper_rounds)
            if steps == 0:
                continue
            if not np.isfinite(z).all():
                raise Diverged(pool.round_id, ())
            if progress is not None:
                spent = paper_rounds if config.round_convention == "paper" else pool.traffic["algorithm"].rounds
                progress(name, spent, config.rounds, records[-1].get("dist_z", float("nan")))
    except Diverged as exc:
        status, detail = "diverged", str(exc)
    except (Exception, KeyboardInterrupt) as exc:  # re-raised below, with the partial result
        status, detail, stopped_by = "stopped", str(exc) or type(exc).__name__, exc
    wall = time.perf_counter() - start
    last = records[-1] if records and status != "diverged" else {}
    extra = state_counters(state)
    result = AlgorithmResult(
        name=name,
        spec=spec.model_dump(mode="json"),
        status=status,
        records=records,
        final_z=z,
        dist_x=float(last.get("dist_x", float("nan"))),
        dist_z=float(last.get("dist_z", float("nan"))),
        traffic={category: counts.as_dict() for category, counts in pool.traffic.items()},
        wall_s=wall,
        detail=detail,
        extra=extra,
    )
    if stopped_by is not None:
        raise RunStopped(result, stopped_by) from stopped_by
    return result


def run_all(config: RunConfig, pool: ClientPool, progress: ProgressHook | None = None) -> list[AlgorithmResult]:
    """Run every algorithm of the config, one after another, on the same pool."""
    return [run_algorithm(spec, config, pool, progress=progress) for spec in config.algorithms]


class Progress:
    """Progress on a terminal (one updating line) or in logs (a line every 10%)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_decile: dict[str, int] = {}
        self._started: dict[str, float] = {}

    def __call__(self, name: str, spent: int, budget: int, dist_z: float) -> None:
        started = self._started.setdefault(name, time.perf_counter())
        line = f"{name:<22} round {spent:>6}/{budget}  ||z-z*|| {dist_z:9.3e}  {time.perf_counter() - started:7.1f} s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if spent == budget else ""))
            self.stream.flush()
            return
        decile = 10 * spent // budget
        if decile > self._last_decile.get(name, -1):
            self._last_decile[name] = decile
            self.stream.write(line + "\n")
            self.stream.flush()

    def finish(self, name: str) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
