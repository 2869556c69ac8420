"""Local Extragradient: extragradient steps on each client, averaged at every sync.

A. Beznosikov, V. Samokhin and A. Gasnikov, "Distributed Saddle-Point Problems: Lower
Bounds, Near-Optimal and Robust Algorithms" (arXiv:2010.13112), Algorithm "Local SGD
(extragradient)"; also A. Beznosikov, P. Dvurechensky et al., "Decentralized Local
Stochastic Extra-Gradient for Variational Inequalities", NeurIPS 2022. In the
centralized federated form, line by line:

    box                                                  code
    z_i^0 = z^0 for every client                          init: z_tilde = z0
    for k = 0, 1, ...:                                    step: tau_k local steps (schedule)
      z_i^{k+1/2} = P(z_i^k - gamma G^_i(z_i^k))          ComputeTask("local_extragradient") runs
      z_i^{k+1}   = P(z_i^k - gamma G^_i(z_i^{k+1/2}))      common/computations.py's local_extragradient
      if k + 1 is a sync: z_i^{k+1} = (1/n) sum_j z_j^{k+1}
                                                          z_tilde - gamma (1/n) sum_i sum_l G^_i(z_i^{l+1/2})

The clients send the sum of their update directions (the steps actually taken,
divided by gamma, on a constrained problem) and the server steps by gamma times
their average: that is the average of the clients' iterates, with one vector each
way per sync. Cost: one exchange per sync in both conventions.

With tau = 1 and a single client (or identical ones) a sync is one extragradient
step on G: the same arithmetic as Minibatch Mirror-prox (mirror_prox.py), which
gathers G at z and at the extrapolated point in two exchanges. With heterogeneous
clients each extrapolates with its own G_i, and the local steps drift as FedAvg-S's do.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from fedsaddle.common.computations import local_extragradient
from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import ComputeTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import AlgorithmDef, AlgorithmSpecBase, BuildContext


class LocalExtragradientSpec(AlgorithmSpecBase):
    name: Literal["local_extragradient"] = "local_extragradient"
    gamma: float = Field(gt=0, description="step size of both half steps of every local extragradient step")


_COST = StepCost(exchanges=1, paper=1)
COMPUTATION = "local_extragradient"  # the client half, common/computations.py (clients never import the server)


class LocalExtragradientState(NamedTuple):
    z_tilde: Array  # the last synchronized iterate
    clock: SyncClock
    syncs: int


class LocalExtragradient(Algorithm[LocalExtragradientState]):
    name = "local_extragradient"
    state_type = LocalExtragradientState

    def __init__(self, *, gamma: float, schedule: SyncSchedule) -> None:
        self.gamma = positive("gamma", gamma)
        self.schedule = schedule

    def init(self, z0: Array, seed: int) -> Exchanges[LocalExtragradientState]:
        return no_exchange(LocalExtragradientState(z0.copy(), self.schedule.start(seed), syncs=0))

    def step(self, state: LocalExtragradientState) -> Exchanges[LocalExtragradientState]:
        tau_k, clock = self.schedule.next_interval(state.clock)
        params = (("steps", float(tau_k)), ("gamma", self.gamma))
        sums = yield ComputeTask(COMPUTATION, state.z_tilde, params=params)
        z_tilde = self.project(state.z_tilde - self.gamma * sums.mean())
        return LocalExtragradientState(z_tilde, clock, state.syncs + 1)

    def iterate(self, state: LocalExtragradientState) -> Array:
        return state.z_tilde

    def step_cost(self, state: LocalExtragradientState) -> StepCost:
        return _COST


def _build(spec: LocalExtragradientSpec, run: BuildContext) -> LocalExtragradient:
    return LocalExtragradient(gamma=spec.gamma, schedule=run.schedule)


LOCAL_EXTRAGRADIENT = AlgorithmDef(
    LocalExtragradientSpec,
    _build,
    computations={COMPUTATION: local_extragradient},
    paper="Beznosikov, Samokhin and Gasnikov, 2020",
)
