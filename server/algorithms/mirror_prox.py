"""Minibatch Mirror-prox (paper, section Baselines).

Each step gathers tau n gradient mappings twice, at the server's iterate z^r and
at the extrapolated point z^{r+1/2} (Euclidean mirror map, unconstrained: the
extragradient method):

    z^{r+1/2} <- z^r - gamma * G^(z^r)
    z^{r+1}   <- z^r - gamma * G^(z^{r+1/2})

tau is deterministic, as for Minibatch Mirror Descent. Cost: two rounds per
step, in both conventions (the paper counts both too). On a constrained problem
both points are projected onto the domain (Euclidean mirror-prox on a convex set).

Missing clients: each of the two gathers averages the clients that answered it
(two independent samples), an unbiased but noisy G; as for Minibatch MD the
iterates then settle in a neighbourhood of z*.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import GradientTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.spec import PAPER, AlgorithmDef, AlgorithmSpecBase, BuildContext


class MirrorProxSpec(AlgorithmSpecBase):
    name: Literal["mirror_prox"] = "mirror_prox"
    gamma: float = Field(gt=0, description="step size (both half steps)")


_COST = StepCost(exchanges=2, paper=2)


class MirrorProxState(NamedTuple):
    z: Array  # z^r, the server's iterate
    steps: int


class MirrorProx(Algorithm[MirrorProxState]):
    name = "mirror_prox"
    state_type = MirrorProxState

    def __init__(self, *, gamma: float, minibatch: int) -> None:
        self.gamma = positive("gamma", gamma)
        self.minibatch = minibatch

    def init(self, z0: Array, seed: int) -> Exchanges[MirrorProxState]:
        return no_exchange(MirrorProxState(z=z0.copy(), steps=0))

    def step(self, state: MirrorProxState) -> Exchanges[MirrorProxState]:
        # z^{r+1/2} <- z^r - gamma * G^(z^r)
        answers = yield GradientTask(state.z, batch=self.minibatch)
        z_half = self.project(state.z - self.gamma * answers.mean())
        # z^{r+1} <- z^r - gamma * G^(z^{r+1/2})
        answers = yield GradientTask(z_half, batch=self.minibatch)
        return MirrorProxState(z=self.project(state.z - self.gamma * answers.mean()), steps=state.steps + 1)

    def iterate(self, state: MirrorProxState) -> Array:
        return state.z

    def step_cost(self, state: MirrorProxState) -> StepCost:
        return _COST


def _build(spec: MirrorProxSpec, run: BuildContext) -> MirrorProx:
    return MirrorProx(gamma=spec.gamma, minibatch=run.schedule.minibatch)


MIRROR_PROX = AlgorithmDef(MirrorProxSpec, _build, paper=PAPER)
