"""SCAFFOLD-S (paper, Algorithm SCAFFOLD-S), line by line:

    box                                                 code
    set z~^0 = z^0                                      init: z_tilde = z0, and one round for G(z~^0)
    for k = 0, 1, ...: flip a coin c_k                  step: tau_k ~ Geometric(p) local steps (schedule)
      g_i^k <- G^_i(z_i^k) - G^_i(z~^k) + G(z~^k)       LocalStepsTask(z~, control = G(z~))
      z_i^{k+1} <- z_i^k - gamma_l g_i^k                  (on the clients)
      if c_k = 1: clients communicate sum_l g_i^l       ... answered by the task
        z~^{k+1} <- z~^k - gamma_g (1/n) sum_i sum_l    z_tilde - gamma_global * sums.mean()
        z_i^{k+1} <- z~^{k+1}; broadcast z~^{k+1}       the next GradientTask carries z~^{k+1}
        clients communicate G_i(z~^{k+1})               GradientTask(z~^{k+1}, exact)
        server broadcasts G(z~^{k+1})                   sent as the control of the next sync

So R syncs cost 1 + 2R exchanges (the paper's convention counts R).

Where the code departs from the box, for a real network: clients keep no
G_i(z~) between rounds; each recomputes it from z~, which the local-steps task
carries (an exact local evaluation, no extra communication). The box's separate
broadcasts of the averaged sum and of z~^{k+1} fold into the next task.

`sync` also serves SCAFFOLD-Catalyst-S as its inner solver: with theta > 0 it
runs on the regularized G_i^theta(z) = G_i(z) + theta (z - z_bar) (catalyst.py).

Constrained problems (Problem.domains): every local step and the server step are
projected onto the domain; the clients send the steps actually taken (see
fedavg_s.py). A constrained saddle point z* stays a fixed point: there -G(z*) lies in
the normal cone, so every projected local step from z~ = z* returns z*.

Missing clients: the server step averages the direction sums of the clients that
answered the local-steps round, and the control G(z~) is the mean over those
that answered the gradient round (each round draws its own sample). The control
is then only an estimate of G(z~), so the correction removes client drift only
on average: with full participation (or identical clients) SCAFFOLD-S still
converges to z*; with sampled heterogeneous clients it settles in a
neighbourhood whose size grows with the heterogeneity and shrinks with the
fraction sampled.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, model_validator

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import GradientTask, LocalStepsTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, positive
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import PAPER, AlgorithmDef, AlgorithmSpecBase, BuildContext


class ScaffoldSpec(AlgorithmSpecBase):
    name: Literal["scaffold_s"] = "scaffold_s"
    gamma_local: float = Field(ge=0, description="0 gives the minibatch regime of the paper's analysis")
    gamma_global: float | None = Field(None, gt=0, description="defaults to gamma_local")

    @model_validator(mode="after")
    def _global_step_needed(self) -> ScaffoldSpec:
        if self.gamma_local == 0 and self.gamma_global is None:
            raise ValueError("gamma_global is required when gamma_local is 0")
        return self


_COST = StepCost(exchanges=2, paper=1)
_INIT_COST = StepCost(exchanges=1, paper=0)


class ScaffoldState(NamedTuple):
    z_tilde: Array  # z~, the last synchronized iterate
    grad_tilde: Array  # G(z~) = (1/n) sum_i G_i(z~), gathered after the last sync (unregularized)
    clock: SyncClock  # the synchronization stream
    syncs: int


class ScaffoldS(Algorithm[ScaffoldState]):
    name = "scaffold_s"
    state_type = ScaffoldState

    # The hyper-parameters' defaults are ScaffoldSpec's, declared there only.
    def __init__(self, *, gamma_local: float, gamma_global: float | None, schedule: SyncSchedule) -> None:
        self.gamma_local = positive("gamma_local", gamma_local, allow_zero=True)
        # gamma_global None: the paper's gamma_g = gamma_l.
        self.gamma_global = positive("gamma_global", gamma_local if gamma_global is None else gamma_global)
        self.schedule = schedule

    def init(self, z0: Array, seed: int) -> Exchanges[ScaffoldState]:
        # G(z~^0): one gradient round before the first sync.
        answers = yield GradientTask(z0, exact=True)
        return ScaffoldState(z0.copy(), answers.mean(), self.schedule.start(seed), syncs=0)

    def step(self, state: ScaffoldState) -> Exchanges[ScaffoldState]:
        state, _ = yield from self.sync(state)
        return state

    def sync(
        self, state: ScaffoldState, theta: float = 0.0, z_bar: Array | None = None, want_objective: bool = False
    ) -> Exchanges[tuple[ScaffoldState, float | None]]:
        """One sync, two rounds; on G^theta when z_bar is given. Also returns f(z~^{k+1}) when asked."""
        tau_k, clock = self.schedule.next_interval(state.clock)
        # The control G(z~), or on the regularized problem G^theta(z~) = G(z~) + theta (z~ - z_bar):
        # in G_i^theta(z_i) - G_i^theta(z~) the anchor cancels, so z_bar never travels.
        control = state.grad_tilde if z_bar is None else state.grad_tilde + theta * (state.z_tilde - z_bar)
        sums = yield LocalStepsTask(state.z_tilde, tau_k, self.gamma_local, control=control, theta=theta)
        # z~^{k+1} <- z~^k - gamma_g (1/n) sum_i sum_l g_i^l
        z_tilde = self.project(state.z_tilde - self.gamma_global * sums.mean())
        # Clients communicate G_i(z~^{k+1}); the server forms G(z~^{k+1}).
        answers = yield GradientTask(z_tilde, exact=True, want_objective=want_objective)
        return ScaffoldState(z_tilde, answers.mean(), clock, state.syncs + 1), answers.mean_objective()

    def iterate(self, state: ScaffoldState) -> Array:
        return state.z_tilde

    def init_cost(self) -> StepCost:
        return _INIT_COST

    def step_cost(self, state: ScaffoldState) -> StepCost:
        return _COST


def _build(spec: ScaffoldSpec, run: BuildContext) -> ScaffoldS:
    return ScaffoldS(gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, schedule=run.schedule)


SCAFFOLD_S = AlgorithmDef(ScaffoldSpec, _build, paper=PAPER)
