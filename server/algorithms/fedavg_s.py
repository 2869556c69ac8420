"""FedAvg-S (paper, Algorithm FedAvg-S in the appendix).

Per sync k: the clients start from z~, take tau_k local steps along
g_i = G^_i(z_i), and send sum_l w_l g_i^l; the server steps
    z~ <- z~ - gamma_global * (1/n) sum_i sum_l w_l g_i^l.
w_l is the step's schedule weight: 1, or 1/(sqrt(k_l) + 1) for the decaying
step the Experiments use, with k_l the global local-step index (the k of the
framework). The box sends the unweighted sum with a constant gamma; weighting the
sum keeps z~ equal to the clients' average iterate when gamma_global equals
gamma_local, which is FedAvg-S's definition. Cost: one round per sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsaddle.common.problems import Array
from fedsaddle.server.algorithms.base import Algorithm, StepCost, SyncSchedule, positive
from fedsaddle.server.pool import ClientPool, mean_over_clients


@dataclass(frozen=True)
class FedAvgState:
    z_tilde: Array  # the last synchronized iterate
    syncs: int
    local_steps: int  # k: local steps taken so far (indexes the decay)


class FedAvgS(Algorithm[FedAvgState]):
    name = "fedavg_s"

    def __init__(
        self,
        gamma_local: float | Array,
        gamma_global: float | Array | None = None,
        decay: Literal["constant", "inverse_sqrt"] = "constant",
    ) -> None:
        self.gamma_local = positive("gamma_local", gamma_local)
        self.gamma_global = positive("gamma_global", gamma_local if gamma_global is None else gamma_global)
        self.decay: Literal["constant", "inverse_sqrt"] = decay

    def init(self, z0: Array, pool: ClientPool, schedule: SyncSchedule) -> FedAvgState:
        return FedAvgState(z_tilde=z0.copy(), syncs=0, local_steps=0)

    def step(self, state: FedAvgState, pool: ClientPool, schedule: SyncSchedule) -> FedAvgState:
        tau_k = schedule.next_interval()
        direction_sums = pool.local_steps(
            state.z_tilde,
            steps=tau_k,
            gamma_local=self.gamma_local,
            step_offset=state.local_steps,
            decay=self.decay,
        )
        z_tilde = state.z_tilde - self.gamma_global * mean_over_clients(direction_sums)
        return FedAvgState(z_tilde=z_tilde, syncs=state.syncs + 1, local_steps=state.local_steps + tau_k)

    def iterate(self, state: FedAvgState) -> Array:
        return state.z_tilde

    def step_cost(self, state: FedAvgState) -> StepCost:
        return StepCost(exchanges=1, paper=1)
