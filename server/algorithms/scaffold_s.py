"""SCAFFOLD-S (paper, Algorithm SCAFFOLD-S).

Per sync k, with z~ the last synchronized iterate and G(z~) its gathered mapping:
  round 1: clients take tau_k local steps from z~ along
               g_i = G^_i(z_i) - G^_i(z~) + G(z~)
           and send sum_l g_i^l;  z~ <- z~ - gamma_global * (1/n) sum_i sum_l g_i^l.
  round 2: clients send G_i(z~) at the new z~; the server forms G(z~) for the
           next sync (the box's "communicate G_i(z~^{k+1})").
Before the first sync one gradient round gathers G(z~^0). So R syncs cost
1 + 2R exchanges (the paper's convention counts R).

Differences from the box, for a real network: clients do not keep G_i(z~)
between rounds; each recomputes it locally from z~, which the local-steps task
carries (an exact local evaluation, no extra communication). The box's separate
broadcasts of the averaged sum and of z~ fold into that next task.

`scaffold_sync` also serves Catalyst: with theta > 0 it solves the regularized
problem G^theta(z) = G(z) + theta (z - z_bar); see catalyst.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsaddle.common.problems import Array
from fedsaddle.server.algorithms.base import Algorithm, StepCost, SyncSchedule, positive
from fedsaddle.server.pool import ClientPool, mean_over_clients


@dataclass(frozen=True)
class ScaffoldState:
    z_tilde: Array  # the last synchronized iterate
    grad_tilde: Array  # G(z~) = (1/n) sum_i G_i(z~), gathered after the last sync
    syncs: int


@dataclass(frozen=True)
class SyncResult:
    z_tilde: Array
    grad_tilde: Array  # unregularized G(z~) at the new z~
    objective: Array | None  # f(z~) = (1/n) sum_i f_i(z~) with a trailing axis of 1, when asked


def check_steps(gamma_local: float | Array, gamma_global: float | Array | None) -> tuple[float | Array, float | Array]:
    """Validate SCAFFOLD's step sizes; gamma_global defaults to gamma_local."""
    positive("gamma_local", gamma_local, allow_zero=True)
    gamma_global = gamma_local if gamma_global is None else gamma_global
    return gamma_local, positive("gamma_global", gamma_global)


def gather_gradient(pool: ClientPool, z: Array, want_objective: bool = False) -> tuple[Array, Array | None]:
    """One round: the exact G(z), and f(z) when asked."""
    answers = pool.gradients(z, exact=True, want_objective=want_objective)
    return answers.mean(), answers.mean_objective()


def scaffold_sync(
    pool: ClientPool,
    z_tilde: Array,
    grad_tilde: Array,
    *,
    tau: int,
    gamma_local: float | Array,
    gamma_global: float | Array,
    theta: float | Array = 0.0,
    anchor: Array | None = None,
    want_objective: bool = False,
) -> SyncResult:
    """One sync of SCAFFOLD-S on G^theta(z) = G(z) + theta (z - anchor): two rounds."""
    control = grad_tilde if anchor is None else grad_tilde + theta * (z_tilde - anchor)
    direction_sums = pool.local_steps(z_tilde, steps=tau, gamma_local=gamma_local, control=control, theta=theta)
    z_next = z_tilde - gamma_global * mean_over_clients(direction_sums)
    grad_next, objective = gather_gradient(pool, z_next, want_objective)
    return SyncResult(z_next, grad_next, objective)


class ScaffoldS(Algorithm[ScaffoldState]):
    name = "scaffold_s"

    def __init__(self, gamma_local: float | Array, gamma_global: float | Array | None = None) -> None:
        self.gamma_local, self.gamma_global = check_steps(gamma_local, gamma_global)

    def init(self, z0: Array, pool: ClientPool, schedule: SyncSchedule) -> ScaffoldState:
        grad, _ = gather_gradient(pool, z0)
        return ScaffoldState(z_tilde=z0.copy(), grad_tilde=grad, syncs=0)

    def step(self, state: ScaffoldState, pool: ClientPool, schedule: SyncSchedule) -> ScaffoldState:
        result = scaffold_sync(
            pool,
            state.z_tilde,
            state.grad_tilde,
            tau=schedule.next_interval(),
            gamma_local=self.gamma_local,
            gamma_global=self.gamma_global,
        )
        return ScaffoldState(z_tilde=result.z_tilde, grad_tilde=result.grad_tilde, syncs=state.syncs + 1)

    def iterate(self, state: ScaffoldState) -> Array:
        return state.z_tilde

    def init_cost(self) -> StepCost:
        return StepCost(exchanges=1, paper=0)

    def step_cost(self, state: ScaffoldState) -> StepCost:
        return StepCost(exchanges=2, paper=1)
