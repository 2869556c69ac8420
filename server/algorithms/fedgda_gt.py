"""FedGDA-GT: federated gradient descent ascent with gradient tracking.

Z. Sun and E. Wei, "A Communication-efficient Algorithm with Linear Convergence for
Federated Minimax Learning", NeurIPS 2022 (arXiv:2206.01132), Algorithm 2, line by line:

    box                                                      code
    for t = 0, 1, ...:
      server broadcasts (x_t, y_t)                           GradientTask(z_t, exact)
      each agent computes grad f_i(x_t, y_t) and sends it      ... answered by the task
      server aggregates grad f(x_t, y_t), broadcasts it        the control of the local-steps task
      each agent, from (x_{i,0}, y_{i,0}) = (x_t, y_t),
        for k = 0, ..., K - 1:
          x_{i,k+1} = x_{i,k} - eta (grad_x f_i(z_{i,k})     LocalStepsTask(z_t, K, eta, control = G(z_t)):
                       - grad_x f_i(z_t) + grad_x f(z_t))      the direction G_i(z_i) - G_i(z_t) + G(z_t),
          y_{i,k+1} = y_{i,k} + eta (grad_y f_i(z_{i,k})       with G = (grad_x f, -grad_y f)
                       - grad_y f_i(z_t) + grad_y f(z_t))
        sends (x_{i,K}, y_{i,K})                             sends sum_k of its directions instead
      (x_{t+1}, y_{t+1}) = (1/n) sum_i (x_{i,K}, y_{i,K})    z_t - eta (1/n) sum_i sum_k directions: the same

The correction G(z_t) - G_i(z_t) tracks the global gradient: at the saddle point z*
every local step stays at z*, however heterogeneous the clients, so with a constant
step the iterates converge linearly to z* itself (the paper's Theorem 1), where
FedAvg-S stalls at a distance set by the heterogeneity.

Where the code departs from the box: K is the run's synchronization interval (tau,
or a geometric draw under random synchronization), and the clients send the sum of
their directions, from which the server forms the same average. Against SCAFFOLD-S
(scaffold_s.py, the same direction), FedGDA-GT gathers G(z_t) just before the local
steps, at the point they start from, and its server step is the clients' average
(no separate global step size). Cost: two exchanges per step; one sync in the paper's
convention, as SCAFFOLD-S.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import GradientTask, LocalStepsTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import AlgorithmDef, AlgorithmSpecBase, BuildContext


class FedGdaGtSpec(AlgorithmSpecBase):
    name: Literal["fedgda_gt"] = "fedgda_gt"
    eta: float = Field(gt=0, description="step size of the local steps (and of the average they make)")


_COST = StepCost(exchanges=2, paper=1)


class FedGdaGtState(NamedTuple):
    z: Array  # z_t = (x_t, y_t), the server's iterate
    clock: SyncClock  # the synchronization stream (K per step)
    steps: int


class FedGdaGt(Algorithm[FedGdaGtState]):
    name = "fedgda_gt"
    state_type = FedGdaGtState

    def __init__(self, *, eta: float, schedule: SyncSchedule) -> None:
        self.eta = positive("eta", eta)
        self.schedule = schedule

    def init(self, z0: Array, seed: int) -> Exchanges[FedGdaGtState]:
        return no_exchange(FedGdaGtState(z0.copy(), self.schedule.start(seed), steps=0))

    def step(self, state: FedGdaGtState) -> Exchanges[FedGdaGtState]:
        local_steps, clock = self.schedule.next_interval(state.clock)
        # Agents send grad f_i(z_t); the server forms grad f(z_t).
        gradients = yield GradientTask(state.z, exact=True)
        # K corrected local steps from z_t; each agent sends the sum of its directions.
        sums = yield LocalStepsTask(state.z, local_steps, self.eta, control=gradients.mean())
        # z_{t+1} = the agents' average = z_t - eta (1/n) sum_i sum_k directions.
        z = self.project(state.z - self.eta * sums.mean())
        return FedGdaGtState(z, clock, state.steps + 1)

    def iterate(self, state: FedGdaGtState) -> Array:
        return state.z

    def step_cost(self, state: FedGdaGtState) -> StepCost:
        return _COST


def _build(spec: FedGdaGtSpec, run: BuildContext) -> FedGdaGt:
    return FedGdaGt(eta=spec.eta, schedule=run.schedule)


FEDGDA_GT = AlgorithmDef(FedGdaGtSpec, _build, paper="Sun and Wei, NeurIPS 2022")
