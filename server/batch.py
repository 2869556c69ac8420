"""Many runs at once: every run is its own single-run generator; their exchanges share worker calls.

Each member of a batch is an ordinary `Run` (server/driver.py) of the same
algorithm code as a run alone, and each of its rounds is settled by the same
rules as a run alone's (`settle`, server/settlement.py). The driver here advances all of them together:
whenever every unfinished run waits on an exchange, it groups the pending tasks
by shape (kind, local steps, round id, ...), stacks each group's vectors along a
leading run axis, and executes the group in one vectorized worker call; per-run
numbers (step sizes, theta) travel as a column. So do a COMPUTE task's parameters
that its computation declares per run (common/computations.py's `per_run`); runs
of a computation that declares none share a call when their parameters are
equal. Client arithmetic is elementwise
per run, so each run gets the bits it gets alone, in-process or over gRPC
(tests/test_batch.py checks this). Metrics at step boundaries are computed for
all runs at a boundary at once.

Runs of a batch share the problem kind, the clients, the dimension and the
gradient noise (one stacked worker); they may differ in anything else: seed,
problem parameters, algorithm, step sizes, budget, synchronization.

`run_batches` spreads several batches over worker processes (one per core by
default): a run's result does not depend on the process that computes it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from fedsaddle.common.attacks import corrupt_round, label_flipped
from fedsaddle.common.computations import find_computation, per_run_names
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import make_problem, solution, stack_shards
from fedsaddle.common.tasks import Answer, ComputeTask, GradientTask, LocalStepsTask, Task
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.server.aggregation import round_rule
from fedsaddle.server.algorithms.base import aggregate
from fedsaddle.server.config import AlgorithmSpec, RunConfig
from fedsaddle.server.driver import AlgorithmResult, Run, StepDone, distances, make_run, robustness
from fedsaddle.server.pool import fresh_traffic, sample_clients
from fedsaddle.server.settlement import RoundTally, settle, settle_everyone


@dataclass(frozen=True)
class BatchRun:
    """One member of a batch: its config, the algorithm entry to run, and z* to measure against
    (a synthetic problem's own when not given)."""

    config: RunConfig
    spec: AlgorithmSpec
    reference: Array | None = None


class _Member:
    """A run of the batch and its own counts."""

    __slots__ = (
        "attack",
        "config",
        "event",
        "faulty",
        "faulty_rounds",
        "plain",
        "rounds",
        "rule",
        "run",
        "tally",
        "tally_rounds",
        "traffic",
        "weights",
        "weights_key",
        "z_star",
    )

    def __init__(self, member: BatchRun) -> None:
        self.config = member.config
        self.run: Run = make_run(member.spec, member.config)
        z_star = (
            member.reference if member.reference is not None else solution(member.config.problem, member.config.seed)
        )
        if z_star is None:
            raise ValueError(f"problem {member.config.problem.name} has no known solution to measure against")
        self.z_star: Array = z_star
        self.rounds = 0
        self.traffic: Counter[RoundTally] = Counter()
        self.event: Task | StepDone | None = None
        self.weights: Array | None = None  # the clients' sample counts, when the run weights by samples
        # As ClientPool's: the run's robust rule and simulated attack, and the clients the rule left out.
        self.rule = member.config.aggregation.build()
        self.attack = member.config.attack.attack() if member.config.attack is not None else None
        self.faulty: Counter[int] = Counter()
        self.faulty_rounds = 0
        # Every client takes part in every round, with no rule and no attack: the rounds `settle_everyone`
        # settles for a whole group at once.
        self.plain = self.rule is None and self.attack is None and member.config.participation.fraction >= 1
        # The latest rounds' tally and how many rounds in a row had it (added to `traffic` when it changes).
        self.tally: RoundTally | None = None
        self.tally_rounds = 0
        self.weights_key: bytes | None = None  # `weights` as the key of a group of exchanges

    def count(self, tally: RoundTally) -> None:
        """One more round of this cost."""
        if tally != self.tally:
            if self.tally is not None:
                self.traffic[self.tally] += self.tally_rounds
            self.tally, self.tally_rounds = tally, 0
        self.tally_rounds += 1

    def counted(self) -> Counter[RoundTally]:
        """Every round's tally, counted."""
        if self.tally is not None:
            self.traffic[self.tally] += self.tally_rounds
            self.tally, self.tally_rounds = None, 0
        return self.traffic


def _per_run_params(name: str) -> frozenset[str]:
    """The parameters the computation `name` takes one per run (common/computations.py's `per_run`)."""
    computation = find_computation(name)
    return frozenset() if computation is None else per_run_names(computation)


def _compared_params(
    per_run: Callable[[str], frozenset[str]], name: str, params: tuple[tuple[str, float], ...]
) -> tuple[object, ...]:
    """A COMPUTE task's name and parameters as its batch signature compares them: the values of those its
    computation takes one per run left out (None), so that runs that differ only in them share a call."""
    varying = per_run(name)
    return name, tuple([(key, None if key in varying else value) for key, value in params])


Compared = Callable[[str, tuple[tuple[str, float], ...]], tuple[object, ...]]  # `_compared_params`, cached per batch


def _signature(task: Task, round_id: int, compared: Compared) -> tuple[object, ...]:
    """Tasks with equal signatures can run as one batched worker call."""
    if isinstance(task, GradientTask):
        return ("gradient", round_id, task.batch, task.exact, task.want_objective)
    if isinstance(task, LocalStepsTask):
        return ("local", round_id, task.steps, task.step_offset, task.decay, task.control is None)
    if isinstance(task, ComputeTask):
        # One call for runs of the same computation, array names and parameters: equal parameters, but for those
        # the computation takes one per run, which need only the same names.
        # (A list comprehension: this runs once per run and round of a sweep, and a generator's cost doubled it.)
        return ("compute", round_id, compared(task.name, task.params), tuple([name for name, _ in task.arrays]))
    raise ValueError("batches of runs do not evaluate on held-out data; run them one at a time")


def _per_run(values: list[float]) -> float | Array:
    """One number for the group when all runs agree (as a run alone sees it), else a (R, 1) column."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return np.array(values, dtype=float)[:, None]


def _rows(vectors: Sequence[Array]) -> Array:
    """The runs' vectors, of one shape, stacked along a new first axis: np.stack's array, made by np.array, which
    costs a third of np.stack's for a few hundred short vectors (np.stack makes a view of each first)."""
    return np.array(vectors)


def _stacked_task(tasks: list[Task], per_run: Callable[[str], frozenset[str]]) -> Task:
    first = tasks[0]
    if isinstance(first, GradientTask):
        z = _rows([t.z for t in tasks])  # type: ignore[union-attr]
        return GradientTask(z, batch=first.batch, exact=first.exact, want_objective=first.want_objective)
    if isinstance(first, ComputeTask):
        computes = [t for t in tasks if isinstance(t, ComputeTask)]
        varying = per_run(first.name)
        # (The names of the arrays and parameters agree, in order: the signature's.)
        arrays = tuple((name, _rows([t.arrays[k][1] for t in computes])) for k, (name, _) in enumerate(first.arrays))
        shared: list[tuple[str, float]] = []
        columns: list[tuple[str, Array]] = []
        for k, (name, value) in enumerate(first.params):
            if name in varying:
                column = np.array([float(t.params[k][1]) for t in computes])[:, None]
                if (column.view(np.int64) != column.view(np.int64)[0]).any():
                    columns.append((name, column))
                    continue
            # Equal in every run (by the signature, or bit for bit when declared per run): as a run alone sees it.
            shared.append((name, value))
        return ComputeTask(first.name, _rows([t.z for t in computes]), arrays, tuple(shared), tuple(columns))
    local = [t for t in tasks if isinstance(t, LocalStepsTask)]
    first = local[0]
    return LocalStepsTask(
        z_start=_rows([t.z_start for t in local]),
        steps=first.steps,
        gamma_local=_per_run([float(t.gamma_local) for t in local]),
        step_offset=first.step_offset,
        decay=first.decay,
        control=None if first.control is None else _rows([t.control for t in local if t.control is not None]),
        theta=_per_run([float(t.theta) for t in local]),
    )


class _Workers:
    """The stacked worker over all runs, and sub-workers for groups of some runs (cached)."""

    def __init__(self, members: Sequence[_Member], cache: ShardCache) -> None:
        configs = [m.config for m in members]
        noise = {c.gradient_noise for c in configs}
        if len(noise) != 1:
            raise ValueError("a batch needs one gradient_noise for all runs")
        shards = [
            cache.get(c.problem, c.seed, range(c.problem.num_clients), c.weighting, label_flipped(m.attack))
            for m, c in zip(members, configs, strict=True)
        ]
        for member, shard in zip(members, shards, strict=True):
            if member.config.weighting == "samples":
                # The same rule as ClientPool.start_run: aggregation weighted by the clients' sample counts.
                member.weights = np.asarray(shard.sample_counts(), dtype=np.float64)  # type: ignore[attr-defined]
                member.weights_key = member.weights.tobytes()
        self.all = Worker(stack_shards(shards), [c.seed for c in configs], noise.pop())
        self._some: dict[tuple[int, ...], Worker] = {}

    def over(self, rows: tuple[int, ...], total: int) -> Worker:
        if len(rows) == total:
            return self.all
        worker = self._some.get(rows)
        if worker is None:
            if len(self._some) > 16:
                self._some.clear()
            worker = self._some[rows] = self.all.select(rows)
        return worker


ProgressHook = Callable[[int, int], None]  # (runs finished, runs in all)


def run_batch(
    members: Sequence[BatchRun], cache: ShardCache | None = None, progress: ProgressHook | None = None
) -> list[AlgorithmResult]:
    """Run every member; each result is what `run_algorithm` gives the same run alone."""
    secure = [m.spec.display_name for m in members if m.config.privacy.secure_aggregation]
    if secure:  # one vectorized worker sums no masked rows: such runs go through a pool, one at a time
        raise ValueError(f"runs {secure[:3]} use secure aggregation, which batched runs do not offer")
    narrow = [m.spec.display_name for m in members if m.config.precision != "float64"]
    if narrow:  # the vectorized worker's sums are float64's: such runs go through a pool, one at a time
        raise ValueError(f"runs {narrow[:3]} use precision float32, which batched runs do not offer")
    runs = [_Member(m) for m in members]
    workers = _Workers(runs, cache or ShardCache(size=len(members)))
    dim_x, _ = make_problem(members[0].config.problem).dims()
    z_stars = np.stack([m.z_star for m in runs])
    started = time.perf_counter()
    for member in runs:
        member.event = member.run.advance(None)
    finished = 0
    per_run = functools.cache(_per_run_params)  # (looked up once per computation and batch)
    # Made once per distinct computation and parameters, not per run and round: a sweep's runs send a few (bounded:
    # a plug-in may send new values every round).
    compared: Compared = functools.lru_cache(maxsize=4096)(functools.partial(_compared_params, per_run))
    while True:
        _record_boundaries(runs, z_stars, dim_x)
        waiting = [b for b, m in enumerate(runs) if m.event is not None]
        done_now = len(runs) - len(waiting)
        if progress is not None and done_now != finished:
            progress(done_now, len(runs))
        finished = done_now
        if not waiting:
            break
        groups: dict[tuple[object, ...], list[int]] = {}
        for b in waiting:
            task = runs[b].event
            assert isinstance(task, GradientTask | LocalStepsTask | ComputeTask)
            key = (*_signature(task, runs[b].rounds + 1, compared), runs[b].weights_key)
            groups.setdefault(key, []).append(b)
        for rows in groups.values():
            _exchange(runs, tuple(rows), workers, per_run)
    wall = time.perf_counter() - started
    results = [m.run.result(_traffic_dict(m), wall_s=wall / len(runs)) for m in runs]
    for member, result in zip(runs, results, strict=True):
        result.extra.update(robustness(member.config, member.faulty, member.faulty_rounds))
    return results


def _record_boundaries(runs: list[_Member], z_stars: Array, dim_x: int) -> None:
    """Record every run that stands at a step boundary, then advance it, until none does.

    z_stars: every run's z*, one row each, in the order of `runs`."""
    while True:
        at_boundary = [b for b, m in enumerate(runs) if type(m.event) is StepDone]
        if not at_boundary:
            return
        members = [runs[b] for b in at_boundary]
        states = [m.run.algorithm.iterate(m.event.state) for m in members]  # type: ignore[union-attr]
        iterates = _rows(states)
        z_star = z_stars if len(at_boundary) == len(runs) else z_stars[at_boundary]
        dist_x, dist_z = distances(iterates, z_star, dim_x)
        finite = list(map(bool, np.isfinite(iterates).all(axis=1).ravel()))
        xs, zs = dist_x.tolist(), dist_z.tolist()
        now = time.perf_counter()
        for i, m in enumerate(members):
            done: StepDone = m.event  # type: ignore[assignment]
            going = m.run.record(done, m.rounds, xs[i], zs[i], finite[i], now, states[i])
            m.event = m.run.advance(None) if going else None


def _exchange(
    runs: list[_Member], rows: tuple[int, ...], workers: _Workers, per_run: Callable[[str], frozenset[str]]
) -> None:
    """One round for the runs in `rows` (tasks of one signature): one worker call, then each run goes on."""
    tasks: list[Task] = [runs[b].event for b in rows]  # type: ignore[misc]
    first = runs[rows[0]]
    with np.errstate(over="ignore", invalid="ignore"):
        answer = workers.over(rows, len(runs)).execute(_stacked_task(tasks, per_run), first.rounds + 1)
    vectors, objective = answer.vectors, answer.objective
    finite = np.isfinite(vectors).all(axis=(1, 2))
    if objective is not None:
        finite &= np.isfinite(objective).all(axis=1)
    bad = [not v for v in map(bool, finite.ravel())]
    n, dimension = vectors.shape[1], vectors.shape[2]
    with np.errstate(over="ignore", invalid="ignore"):
        # Every run's aggregate at once, by the rule RoundAnswers.mean() applies to a run alone.
        weights = first.weights  # one for the whole group (the groups are made so)
        means = aggregate(vectors, weights)
        objective_means = None if objective is None else aggregate(objective[:, :, None], weights)[:, 0].tolist()
        if all(runs[b].plain for b in rows):
            # The common round: every client of every run took part, no rule, no attack. One settlement
            # for the group gives each run what `settle` gives it alone.
            tally, settled = settle_everyone(
                tasks[0], n, dimension, vectors, objective, weights, means, objective_means, bad
            )
            for b, answers in zip(rows, settled, strict=True):
                member = runs[b]
                member.rounds += 1
                if member.tally == tally:  # (`count`, inlined: a run's rounds mostly cost what its last did)
                    member.tally_rounds += 1
                else:
                    member.count(tally)
                if answers is None:
                    member.run.stop("diverged", f"round {member.rounds}: non-finite values from the clients")
                    member.event = None
                else:
                    member.event = member.run.advance(answers)
            return
        everyone = tuple(range(n))
        for i, b in enumerate(rows):
            member = runs[b]
            member.rounds += 1
            config = member.config
            sampled = sample_clients(config.seed, config.participation.fraction, n, member.rounds)
            if sampled is None:
                reply = Answer(everyone, vectors[i], None if objective is None else objective[i], bad[i])
                aggregated = (means[i], None if objective_means is None else objective_means[i])
            else:  # as a sampled run alone: only the drawn clients' results count, aggregated on their own
                drawn = list(sampled)
                chosen = vectors[i][drawn], None if objective is None else objective[i][drawn]
                diverged = not (np.isfinite(chosen[0]).all() and (chosen[1] is None or np.isfinite(chosen[1]).all()))
                reply, aggregated = Answer(sampled, *chosen, diverged), None
            replies = [reply]
            rule = None
            if member.attack is not None:  # as ClientPool.exchange: the answers replaced, then settled
                replies = corrupt_round(member.attack, replies, config.seed, member.rounds)
            if member.rule is not None:
                rule, aggregated = round_rule(member.rule, config.seed, member.rounds), None
            elif member.attack is not None:
                aggregated = None
            settlement = settle(tasks[i], n, dimension, sampled, replies, weights, aggregated, rule=rule)
            member.count(settlement.tally)
            if settlement.faulty:
                member.faulty.update(settlement.faulty)
                member.faulty_rounds += 1
            if settlement.answers is None:
                # As a run alone: the round is counted, then the run stops as diverged.
                member.run.stop("diverged", f"round {member.rounds}: non-finite values from the clients")
                member.event = None
                continue
            member.event = member.run.advance(settlement.answers)


def _traffic_dict(member: _Member) -> dict[str, dict[str, object]]:
    counts = fresh_traffic(member.config.problem.num_clients)
    for traffic, times in member.counted().items():
        counts["algorithm"].add(traffic, times)
    return {category: c.as_dict() for category, c in counts.items()}


def _run_chunk(members: Sequence[BatchRun], data: Mapping[int, str] | None) -> list[AlgorithmResult]:
    return run_batch(members, ShardCache(size=len(members), data=data))


def process_context() -> multiprocessing.context.BaseContext:
    """How worker processes of a sweep start: fork is fast, and safe while no gRPC object exists in
    this process (grpc/grpc#13873); forkserver once one may."""
    return multiprocessing.get_context("forkserver" if "grpc" in sys.modules else "fork")


def run_batches(
    batches: Sequence[Sequence[BatchRun]],
    workers: int | None = None,
    progress: ProgressHook | None = None,
    data: Sequence[Mapping[int, str] | None] | None = None,
) -> list[list[AlgorithmResult]]:
    """Run several batches, each split over `workers` processes (default: one per core).

    Results come back in the order of `batches` and of their members.
    `progress(runs finished, runs in all)` is called as pieces complete.
    `data`: for each batch of a problem on real data, the clients' data files.
    """
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    total = sum(len(b) for b in batches)
    files = list(data) if data is not None else [None] * len(batches)
    if workers == 1:
        results, done = [], 0
        for batch, paths in zip(batches, files, strict=True):
            offset = done
            hook = None if progress is None else (lambda d, _t, offset=offset: progress(offset + d, total))
            results.append(run_batch(batch, ShardCache(size=len(batch), data=paths), progress=hook))
            done += len(batch)
        return results
    # Interleaved pieces balance the work: runs of neighbouring s or steps diverge alike.
    pieces = [(b, k) for b, batch in enumerate(batches) for k in range(min(workers, len(batch)))]
    out: list[list[AlgorithmResult | None]] = [[None] * len(batch) for batch in batches]
    done = 0
    with ProcessPoolExecutor(workers, mp_context=process_context()) as pool:
        futures = {
            pool.submit(_run_chunk, list(batches[b][k :: min(workers, len(batches[b]))]), files[b]): (b, k)
            for b, k in pieces
        }
        for future in as_completed(futures):
            b, k = futures[future]
            step = min(workers, len(batches[b]))
            for i, result in zip(range(k, len(batches[b]), step), future.result(), strict=True):
                out[b][i] = result
            done += len(out[b][k::step])
            if progress is not None:
                progress(done, total)
    return [[r for r in batch if r is not None] for batch in out]
