"""The run driver: one algorithm, one run, within its round budget.

`run_loop` is the one run loop of fedsaddle. It is a generator like the
algorithms it drives: it yields each exchange the algorithm asks for and, after
init and after every step, a `StepDone`; it stops before a step that would
exceed the budget. `Run` wraps it with what a run reports (status, per-step
records, final iterate). Two drivers feed it:

* `run_algorithm` here: one run over one pool (in-process or gRPC);
* `server/batch.py`: many runs at once, their exchanges in one worker call.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.dp import epsilon
from fedsaddle.common.numeric import Array, element_type, norm, row_norms, sha256
from fedsaddle.common.problems import Problem, make_problem, solution
from fedsaddle.common.problems.domains import Domain, DomainError, problem_domain
from fedsaddle.common.problems.shards import counts_per_metric
from fedsaddle.common.stop import Stopped
from fedsaddle.common.tasks import EvaluateTask, GradientTask, Task
from fedsaddle.server.algorithms import Algorithm, RoundAnswers, StepCost, build
from fedsaddle.server.algorithms.registry import definition
from fedsaddle.server.config import AlgorithmSpec, RoundConvention, RunConfig
from fedsaddle.server.per_client import OBJECTIVE, metrics_by_client, objective_by_client, summary_of
from fedsaddle.server.pool import ClientPool, Diverged, RunInfo, fresh_traffic
from fedsaddle.server.verdict import DIVERGED_OVER_SCALE, Verdict, judge

# A run has diverged when its iterate is not finite, or when its distance to z* has
# grown this much over the distance it started from (a converging method may rise
# a little first, never by four orders of magnitude).
DIVERGENCE_GROWTH = 1e4

# How a run ended: within its budget, diverged (non-finite or runaway iterates), or stopped by a failure.
RunStatus = Literal["ok", "diverged", "stopped"]

# -- the run loop ---------------------------------------------------------------------------


class StepDone(NamedTuple):
    """The run finished init (steps = 0) or a step, having spent `spent` so far."""

    steps: int
    state: Any
    spent: StepCost


Event = Task | StepDone


def fits(spent: StepCost, cost: StepCost, budget: int, convention: RoundConvention) -> bool:
    """Whether a step of `cost` after `spent` stays within the round budget (counted by the convention)."""
    return convention.rounds_of(StepCost(spent.exchanges + cost.exchanges, spent.paper + cost.paper)) <= budget


def run_loop(
    algorithm: Algorithm[Any],
    z0: Array,
    seed: int,
    budget: int,
    convention: RoundConvention,
    start: StepDone | None = None,
) -> Generator[Event, Any, None]:
    """Init, then one step at a time while the next step fits the budget (counted by `convention`).

    `start`: go on from a step boundary reached before (a resumed run), instead of init.
    """
    if start is None:
        exchanges, paper_rounds = init = algorithm.init_cost()
        if not fits(StepCost(0, 0), init, budget, convention):
            return
        state = yield from algorithm.init(z0, seed)
        yield StepDone(0, state, StepCost(exchanges, paper_rounds))
        steps = 0
    else:
        steps, state, (exchanges, paper_rounds) = start
    # `fits`, one step at a time: a convention counts a step's rounds as the sum of its fields, so the rounds
    # spent so far and the step's add up (run once per run and step of a sweep, this saves a StepCost a step).
    spent = convention.rounds_of(StepCost(exchanges, paper_rounds))
    while True:
        cost = algorithm.step_cost(state)
        spent_after = spent + convention.rounds_of(cost)
        if spent_after > budget:
            return
        state = yield from algorithm.step(state)
        exchanges, paper_rounds, steps, spent = (
            exchanges + cost.exchanges,
            paper_rounds + cost.paper,
            steps + 1,
            spent_after,
        )
        yield StepDone(steps, state, StepCost(exchanges, paper_rounds))


# -- a run and its outcome ------------------------------------------------------------------


# What every step's record holds; any other field is an evaluation metric. (`clients`: the per-client
# results of an evaluated step with output.per_client, server/per_client.py.)
RECORD_FIELDS = frozenset({"step", "rounds", "paper_rounds", "time_s", "dist_x", "dist_z", "epsilon", "clients"})


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The evaluation metrics a step's record carries (none unless the step was evaluated)."""
    return {k: float(v) for k, v in record.items() if k not in RECORD_FIELDS}


@dataclass
class AlgorithmResult:
    """The outcome of one algorithm's run."""

    name: str
    spec: dict[str, Any]
    status: RunStatus
    records: list[dict[str, float | int]]
    final_z: Array
    dist_x: float
    dist_z: float
    traffic: dict[str, dict[str, Any]]
    wall_s: float
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # What the verdict is judged against (server/verdict.py): z*'s accuracy (0: exact; distances finer
    # are below it), max(||z*||, ||z0 - z*||) (nan: no z*), and the config's output.converged_below.
    floor: float = 0.0
    scale: float = math.nan
    converged_below: float = 1e-6

    @property
    def verdict(self) -> Verdict:
        """Converged, not converged (and how it was going) or diverged, by server/verdict.py's rules."""
        return judge(
            self.records,
            self.detail if self.status == "diverged" else None,
            self.scale,
            self.floor,
            self.converged_below,
        )

    @property
    def z_sha256(self) -> str:
        return sha256(self.final_z)

    @property
    def metrics(self) -> dict[str, float]:
        """Each evaluation metric's last value (the final iterate's: the last step is evaluated)."""
        last: dict[str, float] = {}
        for record in self.records:
            last.update(record_metrics(record))
        return last

    def rounds_to(
        self, accuracy: float, convention: RoundConvention = RoundConvention.EXCHANGES, distance: str = "dist_x"
    ) -> int | None:
        """The communication rounds (counted by `convention`, as the config's round_convention) spent
        when ||x - x*|| (or `distance`: "dist_z") was first at most `accuracy`; None if it never was
        (or z* is unknown)."""
        key = RoundConvention(convention).record_key  # a plain "paper" from a caller is the same convention
        for record in self.records:
            if record.get(distance, math.inf) <= accuracy:
                return int(record[key])
        return None

    def summary(self) -> dict[str, Any]:
        verdict = self.verdict
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
            "metrics": self.metrics,
            **({"per_client": clients} if (clients := summary_of(self.records)) else {}),
            "traffic": self.traffic,
            "verdict": verdict.kind,
            "verdict_detail": verdict.detail,
            "distance_scale": self.scale,
            **({"reference_accuracy": self.floor} if self.floor > 0 else {}),
            **self.extra,
        }


COUNTERS = ("meta_iterations", "syncs", "steps", "theta")


def state_counters(state: Any) -> dict[str, Any]:
    """The counters a result reports from an algorithm state."""
    return {} if state is None else {k: getattr(state, k) for k in COUNTERS if hasattr(state, k)}


def distances(z: Array, z_star: Array, dim_x: int) -> tuple[Array, Array]:
    """||x - x*|| and ||z - z*|| for each row of a stack of iterates (one row per run)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return row_norms(z[:, :dim_x] - z_star[:, :dim_x]), row_norms(z - z_star)


@dataclass(frozen=True)
class Resume:
    """Where a checkpointed run left off: enough to go on with the same bits."""

    run_id: str
    at: StepDone  # the step boundary of the checkpoint (state, steps, spent)
    round_id: int  # the pool's round counter (noise streams are named by it)
    traffic: dict[str, dict[str, Any]]  # the pool's counters
    records: list[dict[str, float | int]]  # this run's records up to the checkpoint
    elapsed_s: float
    # Under a robust rule, the clients left out of rounds for reporting non-finite results, and those rounds
    faulty_reports: dict[int, int] = field(default_factory=dict)
    faulty_rounds: int = 0


class Run:
    """One run of one algorithm: its loop, and what it records and reports.

    A driver advances it with `advance(answers)`, which returns the next exchange
    or step boundary (None at the end), and reports boundaries with `record`.
    """

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        algorithm: Algorithm[Any],
        z0: Array,
        config: RunConfig,
        resume: Resume | None = None,
    ) -> None:
        self.name, self.spec, self.algorithm = name, spec, algorithm
        start = None if resume is None else resume.at
        self.loop = run_loop(algorithm, z0, config.seed, config.rounds, config.round_convention, start)
        self.budget, self.convention = config.rounds, config.round_convention
        self.converged_below = config.output.converged_below
        # output.stop_beyond_scale: the distance beyond which the run stops as diverged (set by a driver that
        # knows z*: DIVERGED_OVER_SCALE times max(||z*||, ||z0 - z*||)); inf: only the growth rule.
        self.diverged_beyond = math.inf
        self.started = time.perf_counter() - (resume.elapsed_s if resume else 0.0)
        self.records: list[dict[str, float | int]] = list(resume.records) if resume else []
        self.state: Any = None if resume is None else resume.at.state
        self.final_z = z0 if resume is None else algorithm.iterate(resume.at.state)
        self.status: RunStatus = "ok"
        self.detail = ""
        self.finished = False

    def advance(self, answers: RoundAnswers | None) -> Event | None:
        """Send the answers to the pending exchange (None after a boundary); the next event."""
        try:
            return self.loop.send(answers)
        except StopIteration:
            self.finished = True
            return None

    def record(
        self,
        done: StepDone,
        rounds: int,
        dist_x: float | None,
        dist_z: float | None,
        finite: bool | None = None,
        now: float | None = None,
        iterate: Array | None = None,
    ) -> bool:
        """Record a step boundary; False if the iterate is no longer finite (the run diverged).

        `finite`, `now` and the state's `iterate` may be passed in by a driver that handles many runs at once.
        """
        time_s = (time.perf_counter() if now is None else now) - self.started
        entry: dict[str, float | int]
        if dist_x is not None and dist_z is not None:
            entry = {
                "step": done.steps,
                "rounds": rounds,
                "paper_rounds": done.spent.paper,
                "time_s": time_s,
                "dist_x": dist_x,
                "dist_z": dist_z,
            }
        else:
            entry = {"step": done.steps, "rounds": rounds, "paper_rounds": done.spent.paper, "time_s": time_s}
        self.records.append(entry)
        self.state = done.state
        self.final_z = self.algorithm.iterate(done.state) if iterate is None else iterate
        if finite is None:
            finite = bool(np.isfinite(self.final_z).all())
        if done.steps > 0 and not finite:
            self.stop("diverged", f"the iterate is not finite after round {rounds}")
            return False
        start = self.records[0].get("dist_z")
        if dist_z is not None and start is not None and dist_z > DIVERGENCE_GROWTH * max(float(start), 1e-12):
            self.stop("diverged", f"||z - z*|| grew from {start:.3g} to {dist_z:.3g} by round {rounds}")
            return False
        if dist_z is not None and dist_z > self.diverged_beyond:
            limit = self.diverged_beyond / DIVERGED_OVER_SCALE
            self.stop(
                "diverged",
                f"||z - z*|| = {dist_z:.3g} by round {rounds}, over {DIVERGED_OVER_SCALE:g} times the problem's scale "
                f"max(||z*||, ||z0-z*||) = {limit:.3g} (output.stop_beyond_scale)",
            )
            return False
        return True

    def ends_at(self, done: StepDone) -> bool:
        """Whether the run ends at this step boundary: its next step would not fit the budget."""
        return not fits(done.spent, self.algorithm.step_cost(done.state), self.budget, self.convention)

    def stop(self, status: RunStatus, detail: str) -> None:
        """End the run early (diverged, or stopped by a failure); its loop is closed."""
        self.status, self.detail = status, detail
        self.loop.close()
        self.finished = True

    def result(self, traffic: dict[str, dict[str, Any]], wall_s: float | None = None) -> AlgorithmResult:
        last = self.records[-1] if self.records and self.status != "diverged" else {}
        return AlgorithmResult(
            name=self.name,
            spec=self.spec,
            status=self.status,
            records=self.records,
            final_z=self.final_z,
            dist_x=float(last.get("dist_x", float("nan"))),
            dist_z=float(last.get("dist_z", float("nan"))),
            traffic=traffic,
            wall_s=time.perf_counter() - self.started if wall_s is None else wall_s,
            detail=self.detail,
            extra=state_counters(self.state),
            converged_below=self.converged_below,
        )


# -- driving one run over a pool ------------------------------------------------------------

ProgressHook = Callable[[str, int, int, float], None]
StepHook = Callable[["Run", StepDone, ClientPool], None]


class RunStopped(Exception):
    """A run ended early by something other than divergence (a lost client, a signal).

    Carries the partial result, so the metrics so far are never lost, and the cause.
    """

    def __init__(self, result: AlgorithmResult, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.result = result
        self.cause = cause


def initial_point(config: RunConfig) -> Array:
    """z0 as the config's `init` says; on a constrained problem, projected onto its domain (zeros
    onto the simplex are its centre, ones onto a ball of radius r its point r/sqrt(size) (1, ..., 1))."""
    problem = make_problem(config.problem)
    dim = problem.dimension
    if config.init == "ones":
        z0 = np.ones(dim)
    elif config.init == "zeros":
        z0 = np.zeros(dim)
    elif config.init == "random":
        z0 = seeding.rng(config.seed, seeding.INIT).standard_normal(dim)
    else:
        found = problem.initial_point(config.seed)
        if found is None or np.shape(found) != (dim,):
            shape = None if found is None else np.shape(found)
            raise ValueError(f"problem {config.problem.name}: initial_point gave {shape}, not a vector of {dim}")
        z0 = np.asarray(found, dtype=np.float64)
    domain = problem_domain(problem)
    z0 = z0 if domain is None else domain.project(z0)
    return z0.astype(element_type(config.precision), copy=False)  # float64: z0 itself, the same bits


def make_run(spec: AlgorithmSpec, config: RunConfig, resume: Resume | None = None) -> Run:
    problem = make_problem(config.problem)
    dim_x, _ = problem.dims()
    algorithm = build(spec, config.sync, dim_x=dim_x, domain=problem_domain(problem))
    return Run(spec.display_name, spec.model_dump(mode="json"), algorithm, initial_point(config), config, resume)


def privacy_spent(config: RunConfig, rounds: int) -> float:
    """epsilon (at the config's delta) after `rounds` algorithm rounds of a run with differential privacy."""
    dp = config.privacy.dp
    assert dp is not None
    return epsilon(dp.settings(), config.participation.fraction, rounds, dp.delta)


def run_info(config: RunConfig, run_id: str, computations: tuple[str, ...] = ()) -> RunInfo:
    """What the clients are told of a run; `computations`: the local computations its algorithm names."""
    fraction = config.participation.fraction
    privacy = config.privacy
    secure = config.secure_settings() if privacy.secure_aggregation else None
    dp = privacy.dp.settings() if privacy.dp is not None else None
    attack = config.attack.attack() if config.attack is not None else None
    return RunInfo(
        run_id,
        config.problem,
        config.seed,
        config.gradient_noise,
        config.weighting,
        fraction,
        secure,
        dp,
        computations,
        config.precision,
        config.aggregation.build(),
        attack,
    )


def norms_of(gradient: Array, z: Array, domain: Domain | None) -> dict[str, float]:
    """||G(z)|| of the federation's objective at z, from G(z) gathered exactly from the clients (an
    evaluation exchange); on a constrained problem also the projected residual ||z - P(z - G(z))||,
    which is zero at the constrained saddle point (where G need not vanish)."""
    found = {"grad_norm": norm(gradient)}
    if domain is not None:
        found["residual"] = norm(z - domain.project(z - gradient))
    return found


def evaluate(config: RunConfig, problem: Problem, pool: ClientPool, z: Array, domain: Domain | None) -> dict[str, Any]:
    """An evaluated step's additions to its record: the metrics averaged over the clients; ||G(z)||
    (output.gradient_norm); each client's metrics and training objective (output.per_client, which
    asks the same exact gradient round for f_i(z) too: one exchange for both)."""
    found: dict[str, Any] = {}
    clients: dict[str, Any] = {}
    n = config.problem.num_clients
    if problem.metric_names:
        metrics = EvaluateTask(z, problem.metric_names, counts_per_metric(problem))
        evaluated = pool.exchange(metrics, "evaluation")
        found.update(zip(problem.metric_names, evaluated.mean().tolist(), strict=True))
        if config.output.per_client:
            clients.update(metrics_by_client(evaluated, problem.metric_names, problem.higher_is_better, n))
    if config.output.gradient_norm or config.output.per_client:
        task = GradientTask(z, exact=True, want_objective=config.output.per_client)
        answers = pool.exchange(task, "evaluation")
        if config.output.gradient_norm:
            found.update(norms_of(answers.mean(), z, domain))
        if config.output.per_client:
            clients = {OBJECTIVE: objective_by_client(answers, n), **clients}
    if clients:
        found["clients"] = clients
    return found


def distance_scale(z_star: Array, z0: Array) -> float:
    """The scale a distance to z* is judged against: max(||z*||, ||z0 - z*||)."""
    return max(norm(z_star), norm(z0 - z_star))


def check_reference(problem: Problem, z_star: Array | None) -> None:
    """DomainError if a reference z* is not a vector of the problem's size inside its domain."""
    if z_star is None:
        return
    if np.shape(z_star) != (problem.dimension,) or not np.isfinite(z_star).all():
        raise DomainError(
            f"the reference z* has shape {np.shape(z_star)}"
            + ("" if np.shape(z_star) != (problem.dimension,) else " with entries that are not finite")
            + f"; problem {problem.spec.name!r} has z of {problem.dimension} finite entries"
        )
    domain = problem_domain(problem)
    if domain is not None:
        domain.check(z_star, "the reference z*")


def run_algorithm(
    spec: AlgorithmSpec,
    config: RunConfig,
    pool: ClientPool,
    run_id: str | None = None,
    progress: ProgressHook | None = None,
    reference: Array | None = None,
    resume: Resume | None = None,
    on_step: StepHook | None = None,
    reference_accuracy: float = 0.0,
) -> AlgorithmResult:
    """Run one algorithm on a pool until its next step would exceed the round budget.

    Records carry ||x - x*|| and ||z - z*|| when z* is known: a synthetic
    problem's, or `reference` (e.g. a centralized solution computed from all the
    data, where that is allowed). With `config.evaluate_every`, they also carry
    the problem's metrics on the clients' held-out data (evaluation traffic),
    and so does the last.
    `on_step(run, step, pool)` sees every step's finished record (to stream it,
    to checkpoint); `resume` goes on from a checkpoint. `reference_accuracy`: how far `reference`
    may be from the true z* (distances finer than it are below what z* can tell).
    """
    run = make_run(spec, config, resume)
    problem = make_problem(config.problem)
    z_star = reference if reference is not None else solution(config.problem, config.seed)
    check_reference(problem, z_star)
    if z_star is not None and config.output.stop_beyond_scale:
        run.diverged_beyond = DIVERGED_OVER_SCALE * distance_scale(z_star, initial_point(config))
    domain = problem_domain(problem)
    dim_x, _ = problem.dims()
    stopped_by: BaseException | None = None
    try:
        needs = tuple(definition(spec.name).computations)
        if resume is None:
            pool.start_run(run_info(config, run_id or f"{run.name}-{uuid.uuid4().hex[:8]}", needs))
        else:
            pool.start_run(run_info(config, resume.run_id, needs))
            pool.restore(resume.round_id, resume.traffic, resume.faulty_reports, resume.faulty_rounds)
        event = run.advance(None)
        while event is not None:
            if isinstance(event, StepDone):
                rounds = pool.traffic["algorithm"].rounds
                dist_x = dist_z = None
                iterate = run.algorithm.iterate(event.state)
                if z_star is not None:
                    xs, zs = distances(iterate[None], z_star[None], dim_x)
                    dist_x, dist_z = float(xs[0]), float(zs[0])
                going = run.record(event, rounds, dist_x, dist_z)
                if config.privacy.dp is not None:  # spent so far, in every record (metrics.jsonl: live)
                    run.records[-1]["epsilon"] = privacy_spent(config, rounds)
                # Every `evaluate_every` steps, and at the end: the final iterate's metrics are the result.
                every = config.evaluate_every
                if going and every and (event.steps % every == 0 or run.ends_at(event)):
                    run.records[-1].update(evaluate(config, problem, pool, iterate, domain))
                if on_step is not None:
                    on_step(run, event, pool)
                if not going:
                    break
                if progress is not None and event.steps > 0:
                    spent = event.spent.paper if config.round_convention is RoundConvention.PAPER else rounds
                    progress(run.name, spent, config.rounds, float("nan") if dist_z is None else dist_z)
                event = run.advance(None)
            else:
                with np.errstate(over="ignore", invalid="ignore"):  # divergence is reported, not warned about
                    answers = pool.exchange(event)
                    event = run.advance(answers)
    except Diverged as exc:
        run.stop("diverged", str(exc))
    except (Exception, KeyboardInterrupt, Stopped) as exc:  # re-raised below, with the partial result
        run.stop("stopped", str(exc) or type(exc).__name__)
        stopped_by = exc
    traffic = pool.traffic or fresh_traffic(config.problem.num_clients)  # empty if the run never started
    result = run.result({category: counts.as_dict() for category, counts in traffic.items()})
    if z_star is not None:
        result.floor = reference_accuracy if reference is not None else 0.0
        result.scale = distance_scale(z_star, initial_point(config))
    dp = config.privacy.dp
    if dp is not None:
        epsilon_spent = privacy_spent(config, traffic["algorithm"].rounds if "algorithm" in traffic else 0)
        result.extra["privacy"] = {
            "epsilon": epsilon_spent,
            "delta": dp.delta,
            "clip": dp.clip,
            "noise_multiplier": dp.noise_multiplier,
            "noise_added_by": "clients" if config.privacy.secure_aggregation else "coordinator",
            "accountant": "dp-accounting RDP, sampled Gaussian mechanism, one release per algorithm round",
        }
    result.extra.update(robustness(config, pool.faulty_reports, pool.faulty_rounds))
    if stopped_by is not None:
        raise RunStopped(result, stopped_by) from stopped_by
    return result


def robustness(config: RunConfig, reports: Mapping[int, int], rounds: int) -> dict[str, Any]:
    """What summary.json says of a run's aggregation rule and attack (nothing for the plain mean, unattacked):
    the rule, and the clients a robust rule left out of rounds for reporting non-finite results."""
    extra: dict[str, Any] = {}
    aggregation = config.aggregation
    if aggregation.keeps_rows:
        extra["aggregation"] = {
            **aggregation.model_dump(mode="json", exclude_defaults=True),
            "rule": aggregation.rule,
            "diverged_reports": {str(client): count for client, count in sorted(reports.items())},
            "rounds_with_diverged_reports": rounds,
        }
    if config.attack is not None:
        extra["attack"] = config.attack.model_dump(mode="json")
    return extra


def run_all(config: RunConfig, pool: ClientPool, progress: ProgressHook | None = None) -> list[AlgorithmResult]:
    """Run every algorithm of the config, one after another, on the same pool."""
    return [run_algorithm(spec, config, pool, progress=progress) for spec in config.algorithms]
