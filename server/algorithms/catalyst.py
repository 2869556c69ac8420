"""SCAFFOLD-Catalyst-S (paper, Algorithm SCAFFOLD-Catalyst-S), line by line:

    box                                                    code
    for t = 0, 1, ...:                                     CatalystState.meta_iterations = t
      communicate z_bar^t to all clients                   (not needed, see below)
      f_i^theta = f_i + theta/2 ||x - x_bar^t||^2          step: inner SCAFFOLD-S syncs on
                      - theta/2 ||y - y_bar^t||^2            G_i^theta(z) = G_i(z) + theta (z - z_bar^t)
      z_bar^{t+1} <- SCAFFOLD-S({f_i^theta}, p)            when the inner stop rule says the subproblem
                                                             is solved: z_bar^{t+1} = z~, t <- t + 1

One `step` is one sync of the inner solver, so the round budget, metrics and
checkpoints work per sync as for the other algorithms; the meta-loop is the
state's (z_bar, meta_iterations, inner_syncs). Each meta-iteration warm-starts
SCAFFOLD-S where the last one stopped, whose G(z~) was just gathered, so R inner
syncs cost 1 + 2R exchanges whatever the number of meta-iterations.

Where the code departs from the box: z_bar^t never travels. In SCAFFOLD's local
direction G_i^theta(z_i) - G_i^theta(z~) + G^theta(z~) the anchor cancels except
in the control G(z~) + theta (z~ - z_bar), which the coordinator computes and
broadcasts anyway. The gradient rounds gather the plain G_i(z~).

The inner stop rule is a small strategy (config `stop`):
  fixed      exactly `inner_syncs` syncs per meta-iteration;
  objective  our reading of the paper's heuristic (Experimental Details, "sufficient
             objective decrease", given without a formula): stop when f^theta(z~)
             changes by at most rtol relative to its previous value, up or down;
             f_i(z~) rides on the gradient round (one more float per client);
  gradient   stop when ||G^theta(z~)|| <= rtol ||G(z_bar)||. By strong
             monotonicity (mu + theta) this bounds the distance to the proximal
             point, and it costs no communication. On a constrained domain both
             norms are of the projected residual z - P(z - G(z)).

theta is fixed (the paper's theta = 1) or estimated: the theory sets theta = c mu
(low heterogeneity) or beta - mu (high), with mu the strong monotonicity, which
the paper's mu = lambda = 1e-5 badly understates where the iterates live. So mu
is estimated along the way by the secant monotonicity
    mu_hat = sum_k <G(z~_k) - G(z~_{k-1}), z~_k - z~_{k-1}> / sum_k ||z~_k - z~_{k-1}||^2
over one meta-iteration's syncs, from the G(z~) SCAFFOLD-S gathers anyway, and
the next meta-iteration uses theta = c mu_hat (the first uses the configured
theta). Once the iterates reach round-off the secants measure noise: theta is
kept when they are within a few ulps of z~, and it never exceeds 1/gamma_local
(without these safeguards the estimate drifted up at round-off until the local
steps diverged, hundreds of rounds after convergence). Metrics are taken at z~,
the newest synchronized iterate.

Missing clients: as SCAFFOLD-S, its inner solver (the control and both rounds
average the clients that answered); the stop rules see that sampled G.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import numpy as np
from pydantic import Field, model_validator

from fedsaddle.common.numeric import Array, dot, norm
from fedsaddle.common.problems.domains import Domain
from fedsaddle.common.tasks import GradientTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, positive
from fedsaddle.server.algorithms.scaffold_s import ScaffoldS, ScaffoldState
from fedsaddle.server.algorithms.schedule import SyncSchedule
from fedsaddle.server.algorithms.spec import PAPER, AlgorithmDef, AlgorithmSpecBase, BuildContext, StrictModel

# -- the spec ------------------------------------------------------------------------------

# How Catalyst sets theta: kept as configured, or estimated from the last meta-iteration's secants.
ThetaRule = Literal["fixed", "estimated"]


class FixedInnerStop(StrictModel):
    """Leave each meta-iteration after exactly `inner_syncs` syncs."""

    rule: Literal["fixed"] = "fixed"
    inner_syncs: int = Field(10, ge=1)


class ObjectiveStop(StrictModel):
    """The paper's heuristic: leave when the regularized objective stops changing,
    |f^theta(z~_k) - f^theta(z~_{k-1})| <= rtol * |f^theta(z~_{k-1})|."""

    rule: Literal["objective"] = "objective"
    rtol: float = Field(1e-3, gt=0)
    max_inner_syncs: int = Field(50, ge=1)


class GradientStop(StrictModel):
    """Leave when ||G^theta(z~)|| <= rtol * ||G(z_bar)||: the regularized gradient
    mapping, free to the coordinator since SCAFFOLD-S gathers G(z~) anyway."""

    rule: Literal["gradient"] = "gradient"
    rtol: float = Field(0.1, gt=0, lt=1)
    max_inner_syncs: int = Field(50, ge=1)


InnerStopSpec = Annotated[FixedInnerStop | ObjectiveStop | GradientStop, Field(discriminator="rule")]


# The hyper-parameters' defaults are declared here, and only here (the class below takes each one). theta_rule's
# is the one the documented results use: README.md, docs/experiments.md and examples/*.yaml estimate theta.
class CatalystSpec(AlgorithmSpecBase):
    name: Literal["scaffold_catalyst_s"] = "scaffold_catalyst_s"
    gamma_local: float = Field(ge=0)
    gamma_global: float | None = Field(None, gt=0, description="defaults to gamma_local")
    theta: float = Field(1.0, gt=0, description="proximal weight (the first meta-iteration's, when estimated)")
    theta_rule: ThetaRule = Field(
        "estimated", description="estimated: theta = theta_scale x the secant monotonicity of the last meta-iteration"
    )
    theta_scale: float = Field(1.0, gt=0, description="c in theta = c mu_hat")
    stop: InnerStopSpec = Field(default_factory=GradientStop)

    @model_validator(mode="after")
    def _global_step_needed(self) -> CatalystSpec:
        if self.gamma_local == 0 and self.gamma_global is None:
            raise ValueError("gamma_global is required when gamma_local is 0")
        return self


# -- the inner stop rule -----------------------------------------------------------------


EPS = float(np.finfo(np.float64).eps)
SECANT_FLOOR = 100.0  # secants within this many ulps of z~ are round-off (see _next_theta)

_COST = StepCost(exchanges=2, paper=1)
_INIT_COST = StepCost(exchanges=1, paper=0)


class InnerProgress(NamedTuple):
    """What a stop rule may look at after an inner sync of meta-iteration t."""

    inner_syncs: int  # syncs of this meta-iteration so far
    z_tilde: Array
    grad_tilde: Array  # G(z~), unregularized
    z_bar: Array
    theta: float
    anchor_grad_norm: float  # ||G(z_bar^t)||
    objective: float  # f^theta(z~) now (objective rule only)
    previous_objective: float  # f^theta(z~) at the previous inner sync, or f(z_bar^t)
    domain: Domain | None = None  # a constrained problem's domain (the gradient rule measures its residual)


class FixedSyncs:
    """Leave each meta-iteration after exactly `syncs` inner syncs."""

    wants_objective = False

    def __init__(self, syncs: int) -> None:
        self.syncs = syncs

    def done(self, progress: InnerProgress) -> bool:
        return progress.inner_syncs >= self.syncs


class ObjectiveDecrease:
    """The paper's heuristic as read here (it gives no formula): |f^theta(z~_k) - f^theta(z~_{k-1})| <=
    rtol |f^theta(z~_{k-1})|, a change either way (a saddle's objective need not decrease)."""

    wants_objective = True

    def __init__(self, rtol: float, max_syncs: int) -> None:
        self.rtol, self.max_syncs = rtol, max_syncs

    def done(self, progress: InnerProgress) -> bool:
        change = abs(progress.objective - progress.previous_objective)
        return progress.inner_syncs >= self.max_syncs or change <= self.rtol * abs(progress.previous_objective)


class GradientMapping:
    """||G^theta(z~)|| <= rtol ||G(z_bar)||, with G^theta(z~) = G(z~) + theta (z~ - z_bar)."""

    wants_objective = False

    def __init__(self, rtol: float, max_syncs: int) -> None:
        self.rtol, self.max_syncs = rtol, max_syncs

    def done(self, progress: InnerProgress) -> bool:
        grad_theta = progress.grad_tilde + progress.theta * (progress.z_tilde - progress.z_bar)
        size = residual(progress.z_tilde, grad_theta, progress.domain)
        return progress.inner_syncs >= self.max_syncs or size <= self.rtol * progress.anchor_grad_norm


def residual(z: Array, gradient: Array, domain: Domain | None) -> float:
    """||G(z)||, or on a constrained domain the projected one ||z - P(z - G(z))||: zero exactly at
    the (constrained) saddle point, where G itself need not vanish."""
    return norm(gradient) if domain is None else norm(z - domain.project(z - gradient))


InnerStop = FixedSyncs | ObjectiveDecrease | GradientMapping


def stop_rule(spec: FixedInnerStop | ObjectiveStop | GradientStop) -> InnerStop:
    """The inner stop rule a spec's `stop` describes."""
    if isinstance(spec, FixedInnerStop):
        return FixedSyncs(spec.inner_syncs)
    if isinstance(spec, ObjectiveStop):
        return ObjectiveDecrease(spec.rtol, spec.max_inner_syncs)
    return GradientMapping(spec.rtol, spec.max_inner_syncs)


# -- the algorithm -------------------------------------------------------------------------


class CatalystState(NamedTuple):
    z_bar: Array  # z_bar^t: the meta-iterate, anchor of the regularizer
    inner: ScaffoldState  # the inner SCAFFOLD-S on f^theta: z~, G(z~) (unregularized), its clock
    theta: float  # theta of meta-iteration t
    meta_iterations: int  # t: meta-iterations completed
    inner_syncs: int  # syncs of meta-iteration t so far
    anchor_grad_norm: float  # ||G(z_bar^t)||, the gradient rule's yardstick
    last_objective: float  # f^theta(z~) at the previous inner sync (objective rule)
    secant_inner: float  # sum over meta-iteration t's syncs of <dG, dz~> (theta estimate)
    secant_norm: float  # ... and of ||dz~||^2

    @property
    def syncs(self) -> int:
        return self.inner.syncs


class ScaffoldCatalystS(Algorithm[CatalystState]):
    name = "scaffold_catalyst_s"
    state_type = CatalystState

    # The hyper-parameters' defaults are CatalystSpec's, declared there only.
    def __init__(
        self,
        *,
        gamma_local: float,
        gamma_global: float | None,
        theta: float,
        stop: InnerStop,
        theta_rule: ThetaRule,
        theta_scale: float,
        schedule: SyncSchedule,
        dim_x: int | None,
    ) -> None:
        self.inner_solver = ScaffoldS(gamma_local=gamma_local, gamma_global=gamma_global, schedule=schedule)
        self.theta = positive("theta", theta)
        self.stop = stop
        self.theta_rule = theta_rule
        self.theta_scale = positive("theta_scale", theta_scale)
        gamma = self.inner_solver.gamma_local
        self.theta_max = 1.0 / gamma if gamma > 0 else float("inf")
        self.dim_x = dim_x  # length of x in z = (x, y); None: half of z

    @property
    def domain(self) -> Domain | None:
        """The problem's domain, the inner solver's too (its local and global steps are projected onto it)."""
        return self.inner_solver.domain

    @domain.setter
    def domain(self, domain: Domain | None) -> None:
        self.inner_solver.domain = domain

    def init(self, z0: Array, seed: int) -> Exchanges[CatalystState]:
        # G(z_bar^0), and f(z_bar^0) for the objective rule: one gradient round.
        answers = yield GradientTask(z0, exact=True, want_objective=self.stop.wants_objective)
        grad = answers.mean()
        objective = answers.mean_objective()
        inner = ScaffoldState(z0.copy(), grad, self.inner_solver.schedule.start(seed), syncs=0)
        return CatalystState(
            z_bar=z0.copy(),
            inner=inner,
            theta=self.theta,
            meta_iterations=0,
            inner_syncs=0,
            anchor_grad_norm=residual(z0, grad, self.domain),
            last_objective=0.0 if objective is None else objective,
            secant_inner=0.0,
            secant_norm=0.0,
        )

    def step(self, state: CatalystState) -> Exchanges[CatalystState]:
        # One sync of SCAFFOLD-S on the regularized clients f_i^theta of meta-iteration t.
        inner, f = yield from self.inner_solver.sync(
            state.inner, state.theta, state.z_bar, want_objective=self.stop.wants_objective
        )
        objective = state.last_objective if f is None else self._regularized(f, inner.z_tilde, state.z_bar, state.theta)
        dz, dg = inner.z_tilde - state.inner.z_tilde, inner.grad_tilde - state.inner.grad_tilde
        secant_inner, secant_norm = state.secant_inner + dot(dg, dz), state.secant_norm + dot(dz, dz)
        progress = InnerProgress(
            state.inner_syncs + 1,
            inner.z_tilde,
            inner.grad_tilde,
            state.z_bar,
            state.theta,
            state.anchor_grad_norm,
            objective,
            state.last_objective,
            self.domain,
        )
        if not self.stop.done(progress):
            return state._replace(
                inner=inner,
                inner_syncs=state.inner_syncs + 1,
                last_objective=objective,
                secant_inner=secant_inner,
                secant_norm=secant_norm,
            )
        # The subproblem is solved: z_bar^{t+1} <- z~. There the regularizer vanishes,
        # so G^theta = G and f^theta = f at the new anchor.
        return CatalystState(
            z_bar=inner.z_tilde,
            inner=inner,
            theta=self._next_theta(state.theta, secant_inner, secant_norm, inner.z_tilde),
            meta_iterations=state.meta_iterations + 1,
            inner_syncs=0,
            anchor_grad_norm=residual(inner.z_tilde, inner.grad_tilde, self.domain),
            last_objective=objective if f is None else f,
            secant_inner=0.0,
            secant_norm=0.0,
        )

    def _next_theta(self, theta: float, secant_inner: float, secant_norm: float, z: Array) -> float:
        """theta = c mu_hat from this meta-iteration's secants, when estimated and measurable.

        Safeguards: steps at round-off (the secants shorter than SECANT_FLOOR ulps of z~)
        measure noise, not curvature, so theta stays; and theta never exceeds 1/gamma_local,
        beyond which the regularizer's own term overshoots in every local step.
        """
        if self.theta_rule != "estimated" or secant_inner <= 0:
            return theta
        if secant_norm <= (SECANT_FLOOR * EPS * max(norm(z), 1.0)) ** 2:
            return theta
        return min(self.theta_scale * (secant_inner / secant_norm), self.theta_max)

    def _regularized(self, f: float, z: Array, z_bar: Array, theta: float) -> float:
        """f^theta(z) = f(z) + theta/2 ||x - x_bar||^2 - theta/2 ||y - y_bar||^2."""
        split = self.dim_x if self.dim_x is not None else z.shape[-1] // 2
        dx, dy = z[:split] - z_bar[:split], z[split:] - z_bar[split:]
        return f + 0.5 * theta * (dot(dx, dx) - dot(dy, dy))

    def iterate(self, state: CatalystState) -> Array:
        return state.inner.z_tilde

    def init_cost(self) -> StepCost:
        return _INIT_COST

    def step_cost(self, state: CatalystState) -> StepCost:
        return _COST


def _build(spec: CatalystSpec, run: BuildContext) -> ScaffoldCatalystS:
    return ScaffoldCatalystS(
        gamma_local=spec.gamma_local,
        gamma_global=spec.gamma_global,
        theta=spec.theta,
        stop=stop_rule(spec.stop),
        theta_rule=spec.theta_rule,
        theta_scale=spec.theta_scale,
        schedule=run.schedule,
        dim_x=run.dim_x,
    )


SCAFFOLD_CATALYST_S = AlgorithmDef(CatalystSpec, _build, paper=PAPER)
