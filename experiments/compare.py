"""Algorithms x problems x s x seeds, each algorithm tuned on its own step grid.

    fedsaddle experiment compare [--algorithms NAME ...] [--problems NAME ...] [--s S ...]
                                 [--seeds N] [--rounds R] [--eps E] [--grid NAME=v1,v2 ...] [--ray ADDRESS]

Algorithms are named as a config's `algorithms:` list names them (the built-in
ones and any installed plug-in), each with its spec's defaults; only its step
(`gamma`; `gamma_local` with gamma_global = gamma_local, as in the paper; `eta` or
`eta_x` for FedGDA-GT and Local SGDA+) is tuned. Problems are `paper` (the paper's regression saddle, n = 10, d = 10,
lambda = 1e-5, at each heterogeneity s), the built-in real problems of
experiments/problems.py (the bundled dataset split over 10 clients with
Dirichlet(0.5) label skew, drawn afresh for each seed), or any other installed
problem that generates its own data from a seed (quadratic_game, plug-ins), with
its spec's defaults and 10 clients. Or the problem of a config of one's own
(`--config run.yaml`, `OwnProblem`): a plug-in, or a problem on the clients'
data files (`--data`), measured against its `reference_solution` or a
`--reference FILE.npy` (check-problem --save-reference); each algorithm's step
in that config is the grid's scale 1 (default 0.1), and the config's
weighting, gradient noise and init are kept.

The grid is cut into tasks (`Task`), each one batch of runs that share their
clients (server/batch.py): for a synthetic problem one (problem, s, algorithm)
with all its steps and seeds, for a real one one (problem, algorithm, seed).
Tasks run in local processes, or on a Ray cluster that places them (`--ray`).
A run's bits do not depend on where it runs or with which runs it is batched,
and runs.csv is sorted and prints floats with a fixed format, so both give the
same runs.csv bytes.

Choosing, for each (problem, s, algorithm): among the steps with no diverged
seed, the one with the fewest median rounds to eps; ties (not reached, or equal)
go to the smallest median final ||z - z*||. Both figures are reported at that step
as median [interquartile range] over the seeds.
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedsaddle.common.problems import SyntheticProblem, problem_class
from fedsaddle.common.problems.registry import registered
from fedsaddle.server.config import ConfigError, RoundConvention, parse_config

from .grid import STEP_GRIDS, quartiles
from .problems import CASES, CLIENTS, STEP_FACTORS
from .report import PLOT_FLOOR, axis_label, fmt, markdown

PAPER = "paper"
DEFAULT_ALGORITHMS = ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s")
DEFAULT_PROBLEMS = (PAPER, "linear_regression")
DEFAULT_S = (1.0, 10.0)
DEFAULT_SEEDS = 3
DEFAULT_ROUNDS = 300
DEFAULT_EPS = 1e-6
# A synthetic problem other than the paper's: steps are these factors times SYNTHETIC_BASE.
SYNTHETIC_BASE = 0.1
FLOOR = 1e-15  # final distances below this are round-off: equal for choosing a step
CASE_OF = {case.problem: case for case in CASES}
# The first of these an algorithm's spec takes is its step (eta, eta_x: FedGDA-GT's and Local SGDA+'s).
STEP_FIELDS = ("gamma", "gamma_local", "eta", "eta_x")


class CompareError(ValueError):
    """A compare request that cannot run; the message names the option and the reason."""


@dataclass(frozen=True)
class OwnProblem:
    """The problem of a config of one's own (a plug-in, or a problem on data files), as compare runs it."""

    name: str  # the problem's name: its key in the report, runs.csv and the figures
    entry: dict[str, Any]  # the config's problem entry
    extra: dict[str, Any]  # the config's fields a run keeps: weighting, gradient_noise, init
    data: dict[int, str]  # each client's data file ({} for a synthetic problem)
    reference: tuple[float, ...] | None  # z*, unless the problem is synthetic (its own from the seed)
    accuracy: float = 0.0  # how far the reference may be from the true z*
    bases: dict[str, float] = field(default_factory=dict)  # each algorithm's step in the config: scale 1


@dataclass(frozen=True)
class Setup:
    """What a compare runs: validated at construction, so a bad request fails before any run."""

    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    problems: tuple[str, ...] = DEFAULT_PROBLEMS
    s_values: tuple[float, ...] = DEFAULT_S  # the paper problem's heterogeneity; other problems have none
    seeds: tuple[int, ...] = tuple(range(DEFAULT_SEEDS))
    rounds: int = DEFAULT_ROUNDS
    eps: float = DEFAULT_EPS
    convention: RoundConvention = RoundConvention.EXCHANGES
    tau: int = 20
    grids: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # an algorithm's own scales, if given
    own: OwnProblem | None = None  # a config's problem (--config), by its name among `problems`
    step_fields: dict[str, str] = field(default_factory=dict, compare=False)  # filled by __post_init__

    def __post_init__(self) -> None:
        object.__setattr__(self, "convention", RoundConvention(self.convention))
        for name, values in (("algorithms", self.algorithms), ("problems", self.problems), ("seeds", self.seeds)):
            if not values:
                raise CompareError(f"--{name}: give at least one")
            if len(set(values)) != len(values):
                raise CompareError(f"--{name}: {list(values)} names one twice")
        if PAPER in self.problems and not self.s_values:
            raise CompareError("--s: the paper problem needs at least one value of s")
        if any(not math.isfinite(s) or s < 0 for s in self.s_values):
            raise CompareError(f"--s: values must be finite and >= 0, got {list(self.s_values)}")
        if self.rounds < 1:
            raise CompareError(f"--rounds must be >= 1, got {self.rounds}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise CompareError(f"--eps must be a positive number, got {self.eps}")
        for name, scales in self.grids.items():
            if name not in self.algorithms:
                raise CompareError(f"--grid {name}: not among the compared algorithms {list(self.algorithms)}")
            if not scales or any(not (math.isfinite(v) and v > 0) for v in scales):
                raise CompareError(f"--grid {name}: the step scales must be positive numbers, got {list(scales)}")
            if len(set(scales)) != len(scales):
                raise CompareError(f"--grid {name}: {list(scales)} names a scale twice")
        for problem in self.problems:
            if self.own is None or problem != self.own.name:
                _check_problem(problem)
        if self.own is not None and self.eps < self.own.accuracy:
            raise CompareError(
                f"--eps {self.eps:g} is finer than z*'s accuracy {self.own.accuracy:.1e} (--reference): no run "
                "could be said to reach it"
            )
        for algorithm in self.algorithms:
            self.step_fields[algorithm] = _step_field(algorithm)

    def s_of(self, problem: str) -> tuple[float | None, ...]:
        return tuple(self.s_values) if problem == PAPER else (None,)

    def scales(self, problem: str, algorithm: str) -> tuple[float, ...]:
        """The algorithm's grid: multiples of the problem's base step."""
        if algorithm in self.grids:
            return tuple(self.grids[algorithm])
        if self.is_own(problem):
            return STEP_FACTORS
        if problem == PAPER:
            return STEP_GRIDS.get(algorithm, STEP_GRIDS["scaffold_s"])
        return STEP_FACTORS

    def is_own(self, problem: str) -> bool:
        return self.own is not None and problem == self.own.name

    def step(self, problem: str, s: float | None, algorithm: str, scale: float) -> float:
        """A scale of an algorithm's grid as its step (step_of; a config's own step for its problem)."""
        if self.own is not None and problem == self.own.name:
            return scale * self.own.bases.get(algorithm, SYNTHETIC_BASE)
        return step_of(problem, s, scale)

    def tasks(self) -> list[Task]:
        out = []
        for problem in self.problems:
            for s in self.s_of(problem):
                for algorithm in self.algorithms:
                    # A real problem's split is drawn per seed; a config's data are the same for every seed.
                    per_seed = problem in CASE_OF and not self.is_own(problem)
                    seed_groups = [(seed,) for seed in self.seeds] if per_seed else [self.seeds]
                    for seeds in seed_groups:
                        out.append(Task(self, problem, s, algorithm, seeds))
        return out

    @property
    def size(self) -> int:
        return sum(len(t.seeds) * len(self.scales(t.problem, t.algorithm)) for t in self.tasks())


def _check_problem(name: str) -> None:
    if name == PAPER or name in CASE_OF:
        return
    if name not in registered():
        known = sorted({PAPER, *registered()})
        raise CompareError(f"--problems: no problem {name!r}; installed: {', '.join(known)}")
    kind = problem_class(name)
    if not issubclass(kind, SyntheticProblem):
        raise CompareError(
            f"--problems: {name} reads its clients' data files; compare runs synthetic problems and the "
            f"built-in real ones ({', '.join(sorted(CASE_OF))}) by name, and a problem on your data files from "
            "its config (--config FILE --data PATTERN)"
        )
    try:
        kind.Spec.model_validate({"name": name, "num_clients": CLIENTS})
    except ValidationError as exc:
        missing = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors())
        raise CompareError(f"--problems: {name} cannot run with its spec's defaults ({missing})") from None


def _step_field(algorithm: str) -> str:
    """The spec field that is this algorithm's step: the first of STEP_FIELDS its config entry accepts."""
    errors = []
    for name in STEP_FIELDS:
        try:
            parse_config({"problem": {"name": "paper_regression"}, "algorithms": [{"name": algorithm, name: 0.1}]})
        except ConfigError as exc:
            if "unknown name" in str(exc):  # the config's own message lists what is installed
                raise CompareError(f"--algorithms {algorithm}: {exc}") from None
            errors.append(str(exc))
            continue
        return name
    raise CompareError(
        f"--algorithms {algorithm}: compare tunes a step {' or '.join(STEP_FIELDS)}, and with each the config "
        f"says: {errors[-1]}"
    )


@dataclass(frozen=True)
class Task:
    """One unit of work: runs that share their clients and go through one batched worker."""

    setup: Setup
    problem: str
    s: float | None
    algorithm: str
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """One run's outcome: what runs.csv keeps, and its curve for the figure."""

    problem: str
    s: float | None
    algorithm: str
    step_scale: float
    step: float
    seed: int
    status: str
    rounds: int
    final: float  # ||z - z*|| at the end
    rounds_to_eps: int | None
    z_sha256: str
    curve: tuple[tuple[int, float], ...]  # (rounds, ||z - z*||) at each step

    def sort_key(self) -> tuple[int, str, float, str, float, int]:
        return (
            0 if self.problem == PAPER else 1,
            self.problem,
            -1.0 if self.s is None else self.s,
            self.algorithm,
            self.step_scale,
            self.seed,
        )


@dataclass(frozen=True)
class TaskResult:
    runs: list[Run]
    node: str  # where it ran: the Ray node's id, or "local"


def step_of(problem: str, s: float | None, scale: float) -> float:
    """A scale of the grid as a step: over max(s, 1) on the paper problem (as the paper sweep's grid), times
    the base step of a real problem (as experiments/problems.py's) or of another synthetic one."""
    if problem == PAPER:
        return scale / max(s or 0.0, 1.0)
    return scale * (CASE_OF[problem].base_step if problem in CASE_OF else SYNTHETIC_BASE)


def _config(task: Task, seed: int, step: float, problem: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
    setup = task.setup
    return parse_config(
        {
            "name": "compare",
            "seed": seed,
            "problem": dict(problem),
            "sync": {"kind": "fixed", "tau": setup.tau},
            "rounds": setup.rounds,
            "round_convention": setup.convention,
            "algorithms": [{"name": task.algorithm, setup.step_fields[task.algorithm]: step}],
            **extra,
        }
    )


def run_task(task: Task, node: str = "local") -> TaskResult:
    """Every run of the task, in one process: the same bits wherever that process is."""
    from fedsaddle.common import blas
    from fedsaddle.common.worker import ShardCache
    from fedsaddle.server.batch import BatchRun, run_batch

    from .problems import case_setup

    blas.apply()  # BLAS's sums depend on its thread count: the count every fedsaddle process uses
    setup = task.setup
    scales = setup.scales(task.problem, task.algorithm)
    steps = {scale: setup.step(task.problem, task.s, task.algorithm, scale) for scale in scales}
    runs: list[Run] = []
    if setup.own is not None and setup.is_own(task.problem):
        import numpy as np

        own = setup.own
        reference = None if own.reference is None else np.array(own.reference)
        keys = [(scale, step, seed) for scale, step in steps.items() for seed in task.seeds]
        configs = [_config(task, seed, step, own.entry, own.extra) for _, step, seed in keys]
        members = [BatchRun(config, config.algorithms[0], reference) for config in configs]
        results = run_batch(members, ShardCache(size=len(keys), data=own.data or None))
        runs = [_run(task, scale, step, seed, r) for (scale, step, seed), r in zip(keys, results, strict=True)]
        return TaskResult(runs, node)
    if task.problem in CASE_OF:
        with tempfile.TemporaryDirectory(prefix="fedsaddle-compare-") as scratch:
            for seed in task.seeds:
                # The split is drawn from the seed here, on the node that runs the task: no data travels.
                problem, paths, reference = case_setup(CASE_OF[task.problem], seed, Path(scratch) / str(seed))
                configs = [_config(task, seed, step, problem, {"weighting": "samples"}) for step in steps.values()]
                members = [BatchRun(config, config.algorithms[0], reference) for config in configs]
                results = run_batch(members, ShardCache(size=len(members), data=paths))
                done = zip(steps.items(), results, strict=True)
                runs += [_run(task, scale, step, seed, result) for (scale, step), result in done]
        return TaskResult(runs, node)
    if task.problem == PAPER:
        problem = {"name": "paper_regression", "num_clients": CLIENTS, "dim": 10, "lam": 1e-5, "s": task.s}
    else:
        problem = {"name": task.problem, "num_clients": CLIENTS}
    keys = [(scale, step, seed) for scale, step in steps.items() for seed in task.seeds]
    configs = [_config(task, seed, step, problem, {}) for _, step, seed in keys]
    results = run_batch([BatchRun(config, config.algorithms[0]) for config in configs], ShardCache(size=len(keys)))
    runs = [_run(task, scale, step, seed, r) for (scale, step, seed), r in zip(keys, results, strict=True)]
    return TaskResult(runs, node)


def _run(task: Task, scale: float, step: float, seed: int, result: Any) -> Run:
    convention = task.setup.convention
    key = convention.record_key
    final = result.dist_z if result.status == "ok" and math.isfinite(result.dist_z) else math.inf
    return Run(
        problem=task.problem,
        s=task.s,
        algorithm=task.algorithm,
        step_scale=scale,
        step=step,
        seed=seed,
        status=result.status,
        rounds=int(result.records[-1][key]) if result.records else 0,
        final=final,
        rounds_to_eps=result.rounds_to(task.setup.eps, convention, distance="dist_z"),
        z_sha256=result.z_sha256,
        curve=tuple((int(r[key]), float(r["dist_z"])) for r in result.records),
    )


# -- executing the tasks: local processes, or Ray --------------------------------------------


Progress = Callable[[int], None]


def run_local(tasks: Sequence[Task], workers: int | None = None, progress: Progress | None = None) -> list[TaskResult]:
    """The tasks over `workers` local processes (default: one per core), in the order given."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from fedsaddle.server.batch import process_context

    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    if workers == 1:
        out = []
        for task in tasks:
            out.append(run_task(task))
            if progress is not None:
                progress(sum(len(r.runs) for r in out))
        return out
    results: list[TaskResult | None] = [None] * len(tasks)
    done = 0
    with ProcessPoolExecutor(workers, mp_context=process_context()) as pool:
        futures = {pool.submit(run_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            result = future.result()
            results[futures[future]] = result
            done += len(result.runs)
            if progress is not None:
                progress(done)
    return [r for r in results if r is not None]


# -- choosing and reporting ------------------------------------------------------------------


@dataclass
class Cell:
    """One (problem, s, algorithm): its chosen step and that step's runs, one per seed."""

    problem: str
    s: float | None
    algorithm: str
    step_scale: float
    runs: list[Run]
    edge: bool

    @property
    def finals(self) -> list[float]:
        return [r.final for r in self.runs]

    @property
    def reached(self) -> list[float]:
        return [math.inf if r.rounds_to_eps is None else float(r.rounds_to_eps) for r in self.runs]

    @property
    def diverged(self) -> int:
        return sum(r.status == "diverged" for r in self.runs)


def _score(runs: Sequence[Run]) -> tuple[bool, float, float]:
    diverged = any(r.status == "diverged" for r in runs)
    reached = quartiles([math.inf if r.rounds_to_eps is None else float(r.rounds_to_eps) for r in runs])[1]
    final = quartiles([max(r.final, FLOOR) for r in runs])[1]
    return diverged, reached, final


def choose(runs: Iterable[Run]) -> list[Cell]:
    """For each (problem, s, algorithm), the step of its grid with the best score, in runs.csv's order."""
    groups: dict[tuple[str, float | None, str], dict[float, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in sorted(runs, key=Run.sort_key):
        groups[(run.problem, run.s, run.algorithm)][run.step_scale].append(run)
    cells = []
    for (problem, s, algorithm), by_scale in groups.items():
        scale = min(by_scale, key=lambda v: (_score(by_scale[v]), v))
        edge = len(by_scale) > 1 and scale in (min(by_scale), max(by_scale))
        cells.append(Cell(problem, s, algorithm, scale, by_scale[scale], edge))
    return cells


def number(value: float) -> str:
    """A float as runs.csv prints it: the shortest text that reads back as the same double."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value))


RUN_COLUMNS = (
    "problem",
    "s",
    "algorithm",
    "step_scale",
    "step",
    "seed",
    "status",
    "rounds",
    "final_dist_z",
    "rounds_to_eps",
    "z_sha256",
)


def runs_csv(runs: Iterable[Run]) -> str:
    """Every run, sorted by (problem, s, algorithm, step, seed): the same bytes for the same runs."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(RUN_COLUMNS)
    for r in sorted(runs, key=Run.sort_key):
        writer.writerow(
            [
                r.problem,
                "" if r.s is None else number(r.s),
                r.algorithm,
                number(r.step_scale),
                number(r.step),
                r.seed,
                r.status,
                r.rounds,
                number(r.final),
                "" if r.rounds_to_eps is None else r.rounds_to_eps,
                r.z_sha256,
            ]
        )
    return text.getvalue()


SUMMARY_COLUMNS = (
    "problem",
    "s",
    "algorithm",
    "step_scale",
    "step",
    "seeds",
    "diverged",
    "rounds_to_eps_q1",
    "rounds_to_eps_median",
    "rounds_to_eps_q3",
    "final_q1",
    "final_median",
    "final_q3",
)


def summary_csv(cells: Iterable[Cell]) -> str:
    """Each cell's chosen step and its quartiles over seeds (inf: not reached, or diverged)."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(SUMMARY_COLUMNS)
    for c in cells:
        writer.writerow(
            [
                c.problem,
                "" if c.s is None else number(c.s),
                c.algorithm,
                number(c.step_scale),
                number(c.runs[0].step),
                len(c.runs),
                c.diverged,
                *(number(v) for v in quartiles(c.reached)),
                *(number(v) for v in quartiles(c.finals)),
            ]
        )
    return text.getvalue()


def _label(problem: str, s: float | None) -> str:
    return problem if s is None else f"{problem}, s = {s:g}"


def _spread(values: Sequence[float], integer: bool) -> str:
    def show(v: float) -> str:
        if not math.isfinite(v):
            return "not reached" if integer else "diverged"
        return f"{v:.0f}" if integer else fmt(v)

    q1, median, q3 = quartiles(values)
    return f"{show(median)} [{show(q1)}, {show(q3)}]"


def scope(setup: Setup, command: str) -> str:
    """What the report covers, in words: its first paragraph."""
    seeds = setup.seeds
    consecutive = seeds == tuple(range(seeds[0], seeds[-1] + 1))
    seed_text = f"seeds {seeds[0]}-{seeds[-1]}" if consecutive and len(seeds) > 1 else f"seeds {list(seeds)}"
    grids = []
    for problem in setup.problems:
        if setup.own is not None and setup.is_own(problem):
            each = "; ".join(
                f"`{a}` {{{', '.join(f'{v:g}' for v in setup.scales(problem, a))}}} x "
                f"{setup.step(problem, None, a, 1.0):g}"
                for a in setup.algorithms
            )
            grids.append(f"- `{problem}` (the config's problem): step = scale x the config's step, scales: {each}")
            continue
        base = "1/max(s, 1)" if problem == PAPER else f"{step_of(problem, None, 1.0):g}"
        each = "; ".join(f"`{a}` {{{', '.join(f'{v:g}' for v in setup.scales(problem, a))}}}" for a in setup.algorithms)
        grids.append(f"- `{problem}`: step = scale x {base}, scales: {each}")
    s_text = ", ".join(f"{s:g}" for s in setup.s_values) if PAPER in setup.problems else "-"
    clients = "10" if setup.own is None else f"10 ({setup.own.entry['num_clients']} for the config's problem)"
    return (
        f"Made by `{command}`.\n\n"
        f"**Scope.** Algorithms: {', '.join(f'`{a}`' for a in setup.algorithms)}, each with its spec's defaults "
        f"but for its step ({', '.join(f'`{a}`: `{setup.step_fields[a]}`' for a in setup.algorithms)}; "
        "a built-in algorithm's gamma_global defaults to its gamma_local, as in the paper). "
        f"Problems: {', '.join(f'`{p}`' for p in setup.problems)}; s = {s_text} (the paper problem's "
        f"heterogeneity; the others have none). {len(seeds)} {seed_text}, {clients} clients, "
        f"tau = {setup.tau} local steps per sync, a budget of {setup.rounds} rounds, {setup.convention.words}. "
        f"eps = {setup.eps:g} on ||z - z*|| (z* of the paper and synthetic problems from their seed; of a real "
        "problem, the centralized solution from all clients' data, and its data split over the clients with "
        "Dirichlet(0.5) label skew drawn from the seed)." + _own_scope(setup.own) + "\n\n"
        "**Grid.** Each algorithm is tuned on its own grid of steps:\n\n" + "\n".join(grids) + "\n\n"
        "**Choosing.** For each (problem, s, algorithm): among the steps with no diverged seed, the fewest median "
        f"rounds to eps; ties (not reached) go to the smallest median final distance (below {FLOOR:g} counting as "
        "equal). Both columns are at that step: median [interquartile range] over the seeds. 'edge': the chosen step "
        "is its grid's smallest or largest. Every run is in runs.csv; the cells are in summary.csv.\n"
    )


def _own_scope(own: OwnProblem | None) -> str:
    """What the report says of a config's problem: its data, its z*, the fields it keeps."""
    if own is None:
        return ""
    data = f"its {len(own.data)} clients' own data files, the same for every seed" if own.data else "its own seed"
    if own.reference is None:
        z_star = "z* its own, from the seed"
    elif own.accuracy > 0:
        z_star = f"z* from --reference, accurate to {own.accuracy:.1e}"
    else:
        z_star = "z* its reference_solution() from all the clients' data (or an exact --reference)"
    kept = ", ".join(f"{k} {v}" for k, v in own.extra.items())
    return f" The config's problem `{own.name}` runs on {data}, {z_star}, with the config's {kept}."


def report(out: Path, setup: Setup, results: Sequence[TaskResult], command: str) -> list[Cell]:
    """runs.csv, summary.csv, compare.md and one figure per problem under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for result in results for run in result.runs]
    (out / "runs.csv").write_text(runs_csv(runs))
    cells = choose(runs)
    (out / "summary.csv").write_text(summary_csv(cells))
    by_group: dict[tuple[str, float | None], list[Cell]] = defaultdict(list)
    for cell in cells:
        by_group[(cell.problem, cell.s)].append(cell)
    lines = [f"# Comparison: {', '.join(setup.algorithms)}\n", scope(setup, command)]
    order = {name: i for i, name in enumerate(setup.algorithms)}
    for (problem, s), group in by_group.items():
        group.sort(key=lambda c: order[c.algorithm])
        if s == setup.s_of(problem)[0]:
            lines.append(f"## {problem}\n\n![{problem}](figure_{problem}.png)\n")
        rows = [
            (
                f"`{c.algorithm}`",
                [
                    f"{c.runs[0].step:.4g} ({c.step_scale:g}{', edge' if c.edge else ''})",
                    _spread(c.reached, integer=True),
                    _spread(c.finals, integer=False),
                    str(c.diverged),
                ],
            )
            for c in group
        ]
        lines.append(
            markdown(
                f"### {_label(problem, s)}\n",
                "algorithm",
                ["step (scale)", f"rounds to ‖z − z*‖ ≤ {setup.eps:g}", "final ‖z − z*‖", "diverged seeds"],
                rows,
            )
        )
    (out / "compare.md").write_text("\n".join(lines))
    for problem in setup.problems:
        figure(out / f"figure_{problem}.png", [c for c in cells if c.problem == problem], setup)
    return cells


def figure(path: Path, cells: Sequence[Cell], setup: Setup) -> None:
    """One panel per s: each algorithm's median ||z - z*|| over seeds at its chosen step, with the IQR band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s_values = sorted({c.s for c in cells}, key=lambda s: -1.0 if s is None else s)
    fig, axes = plt.subplots(1, len(s_values), figsize=(4.6 * len(s_values), 4.0), dpi=110, sharey=True)
    for ax, s in zip(np.atleast_1d(axes), s_values, strict=True):
        for cell in (c for c in cells if c.s == s):
            length = max(len(r.curve) for r in cell.runs)
            xs = [x for x, _ in max(cell.runs, key=lambda r: len(r.curve)).curve]
            # A run that ended early keeps its last value (or +inf if it diverged) to the longest run's end.
            ys = np.array(
                [
                    [y if math.isfinite(y) else math.inf for _, y in r.curve]
                    + [math.inf if r.status == "diverged" else (r.curve[-1][1] if r.curve else math.inf)]
                    * (length - len(r.curve))
                    for r in cell.runs
                ]
            )
            if not xs:
                continue
            with np.errstate(invalid="ignore"):  # a column of diverged runs (inf) has no quartiles: not drawn
                q1, median, q3 = np.percentile(ys, [25, 50, 75], axis=0, method="median_unbiased")
            shown = np.isfinite(median)
            label = f"{cell.algorithm} (step {cell.runs[0].step:.3g})"
            (line,) = ax.semilogy(np.array(xs)[shown], np.maximum(median[shown], PLOT_FLOOR), label=label)
            band = shown & np.isfinite(q3)
            ax.fill_between(
                np.array(xs)[band],
                np.maximum(q1[band], PLOT_FLOOR),
                np.maximum(q3[band], PLOT_FLOOR),
                color=line.get_color(),
                alpha=0.15,
            )
        ax.axhline(setup.eps, color="0.5", lw=0.8, ls=":")
        ax.set_title(cells[0].problem if s is None else f"{cells[0].problem}, $s = {s:g}$")
        ax.set_xlabel(axis_label(setup.convention))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)  # in each panel: the chosen steps differ with s
    np.atleast_1d(axes)[0].set_ylabel(r"$\|z - z^\star\|$, median over seeds (band: IQR)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def placement_csv(setup: Setup, results: Sequence[TaskResult]) -> str:
    """Where each task ran (the Ray node's id, or `local`), in the order of `setup.tasks()`."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(("problem", "s", "algorithm", "seeds", "runs", "node"))
    for task, result in zip(setup.tasks(), results, strict=True):
        s = "" if task.s is None else number(task.s)
        seeds = " ".join(str(seed) for seed in task.seeds)
        writer.writerow((task.problem, s, task.algorithm, seeds, len(result.runs), result.node))
    return text.getvalue()
