"""Minibatch Mirror Descent (paper, section Baselines).

Each round every client averages tau stochastic gradient mappings taken at the
server's iterate and sends the average; the server averages the n answers (tau n
estimates in all) and steps:

    z <- z - gamma * (1/n) sum_i G^_i(z)

With the Euclidean mirror map on an unconstrained domain the mirror step is this
plain step; on a constrained one (Problem.domains) it is followed by the Euclidean
projection onto the domain, the mirror step of the Euclidean mirror map there.
tau is deterministic, as the paper says; under random synchronization it is
round(1/p) (see SyncSchedule.minibatch). Cost: one round per step.

Missing clients (participation.fraction < 1, or a straggler deadline that closed
the round): the step uses the mean over the clients that answered. Under uniform
sampling that is an unbiased estimate of G(z) whose variance grows with the
clients' heterogeneity, so the method behaves like its stochastic version and
converges to a neighbourhood of z* instead of z* itself.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import GradientTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.spec import PAPER, AlgorithmDef, AlgorithmSpecBase, BuildContext


class MinibatchMDSpec(AlgorithmSpecBase):
    name: Literal["minibatch_md"] = "minibatch_md"
    gamma: float = Field(gt=0, description="step size")


_COST = StepCost(exchanges=1, paper=1)


class MDState(NamedTuple):
    z: Array  # the server's iterate
    steps: int  # steps taken


class MinibatchMirrorDescent(Algorithm[MDState]):
    name = "minibatch_md"
    state_type = MDState

    def __init__(self, *, gamma: float, minibatch: int) -> None:
        self.gamma = positive("gamma", gamma)
        self.minibatch = minibatch

    def init(self, z0: Array, seed: int) -> Exchanges[MDState]:
        return no_exchange(MDState(z=z0.copy(), steps=0))

    def step(self, state: MDState) -> Exchanges[MDState]:
        # Clients: the average of tau estimates G^_i(z) at the server's z.
        answers = yield GradientTask(state.z, batch=self.minibatch)
        # Server: z <- z - gamma * (1/n) sum_i G^_i(z)  (then onto the domain, if constrained).
        return MDState(z=self.project(state.z - self.gamma * answers.mean()), steps=state.steps + 1)

    def iterate(self, state: MDState) -> Array:
        return state.z

    def step_cost(self, state: MDState) -> StepCost:
        return _COST


def _build(spec: MinibatchMDSpec, run: BuildContext) -> MinibatchMirrorDescent:
    return MinibatchMirrorDescent(gamma=spec.gamma, minibatch=run.schedule.minibatch)


MINIBATCH_MD = AlgorithmDef(MinibatchMDSpec, _build, paper=PAPER)
