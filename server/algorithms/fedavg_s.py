"""FedAvg-S (paper, Algorithm FedAvg-S in the appendix).

Per sync k the clients start from z~, take tau_k local steps

    z_i <- z_i - gamma_l * w_l * g_i^l,   g_i^l = G^_i(z_i),

and communicate sum_l w_l g_i^l; the server steps

    z~ <- z~ - gamma_g * (1/n) sum_i sum_l w_l g_i^l.

w_l is the step's schedule weight: 1, or 1/(sqrt(k_l) + 1) for the decaying step
of the paper's Experiments, with k_l the global local-step index (the k of the
framework). The box sends the unweighted sum under a constant step; weighting the
sum keeps z~ equal to the clients' average iterate when gamma_g = gamma_l, which
is how the paper defines FedAvg-S. Cost: one round per sync.

Constrained problems: each local step is projected onto the domain and the clients
send the sum of the steps actually taken, sum_l (z_i^l - z_i^{l+1}) / gamma_l (equal
to sum_l w_l g_i^l where no projection acts); the server step is projected too.

Missing clients: the server step averages the direction sums of the clients that
answered. FedAvg-S's client drift is then joined by the sampling noise; with
heterogeneous clients it settles further from z*.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import Decay, LocalStepsTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import PAPER, AlgorithmDef, AlgorithmSpecBase, BuildContext


# The hyper-parameters' defaults are declared here, and only here (the class below takes each one). decay's is
# the decaying step of the paper's Experiments: README.md, docs/experiments.md and examples/*.yaml run it.
class FedAvgSpec(AlgorithmSpecBase):
    name: Literal["fedavg_s"] = "fedavg_s"
    gamma_local: float = Field(gt=0)
    gamma_global: float | None = Field(None, gt=0, description="defaults to gamma_local, as in the paper")
    decay: Decay = Field(
        "inverse_sqrt", description="inverse_sqrt: step k uses gamma / (sqrt(k) + 1), as in the Experiments"
    )


_COST = StepCost(exchanges=1, paper=1)


class FedAvgState(NamedTuple):
    z_tilde: Array  # z~, the last synchronized iterate
    clock: SyncClock  # the synchronization stream
    syncs: int
    local_steps: int  # k: local steps taken so far (indexes the decay)


class FedAvgS(Algorithm[FedAvgState]):
    name = "fedavg_s"
    state_type = FedAvgState

    # The hyper-parameters' defaults are FedAvgSpec's, declared there only.
    def __init__(self, *, gamma_local: float, gamma_global: float | None, decay: Decay, schedule: SyncSchedule) -> None:
        self.gamma_local = positive("gamma_local", gamma_local)
        # gamma_global None: the paper's gamma_g = gamma_l.
        self.gamma_global = positive("gamma_global", gamma_local if gamma_global is None else gamma_global)
        self.decay = decay
        self.schedule = schedule

    def init(self, z0: Array, seed: int) -> Exchanges[FedAvgState]:
        return no_exchange(FedAvgState(z0.copy(), self.schedule.start(seed), syncs=0, local_steps=0))

    def step(self, state: FedAvgState) -> Exchanges[FedAvgState]:
        tau_k, clock = self.schedule.next_interval(state.clock)  # the coin: steps until the next sync
        # Clients: tau_k local steps from z~ along G^_i(z_i); they communicate sum_l w_l g_i^l.
        sums = yield LocalStepsTask(
            state.z_tilde,
            steps=tau_k,
            gamma_local=self.gamma_local,
            step_offset=state.local_steps,
            decay=self.decay,
        )
        # Server: z~ <- z~ - gamma_g * (1/n) sum_i sum_l w_l g_i^l.
        z_tilde = self.project(state.z_tilde - self.gamma_global * sums.mean())
        return FedAvgState(z_tilde, clock, syncs=state.syncs + 1, local_steps=state.local_steps + tau_k)

    def iterate(self, state: FedAvgState) -> Array:
        return state.z_tilde

    def step_cost(self, state: FedAvgState) -> StepCost:
        return _COST


def _build(spec: FedAvgSpec, run: BuildContext) -> FedAvgS:
    return FedAvgS(
        gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, decay=spec.decay, schedule=run.schedule
    )


FEDAVG_S = AlgorithmDef(FedAvgSpec, _build, paper=PAPER)
