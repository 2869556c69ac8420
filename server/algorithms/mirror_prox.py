"""Minibatch Mirror-prox (paper, section Baselines).

Each step gathers two minibatch gradient mappings, at the iterate and at the
extrapolated point (Euclidean mirror map, unconstrained: extragradient):
    z_half <- z - gamma * G^(z)
    z      <- z - gamma * G^(z_half)
Cost: two rounds per step, in both conventions (the paper says so too).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsaddle.common.problems import Array
from fedsaddle.server.algorithms.base import Algorithm, StepCost, SyncSchedule, positive
from fedsaddle.server.pool import ClientPool


@dataclass(frozen=True)
class MirrorProxState:
    z: Array  # z_hat^r, the server's iterate
    steps: int


class MirrorProx(Algorithm[MirrorProxState]):
    name = "mirror_prox"

    def __init__(self, gamma: float | Array) -> None:
        self.gamma = positive("gamma", gamma)

    def init(self, z0: Array, pool: ClientPool, schedule: SyncSchedule) -> MirrorProxState:
        return MirrorProxState(z=z0.copy(), steps=0)

    def step(self, state: MirrorProxState, pool: ClientPool, schedule: SyncSchedule) -> MirrorProxState:
        batch = schedule.next_interval()
        z_half = state.z - self.gamma * pool.gradients(state.z, batch=batch).mean()
        z_next = state.z - self.gamma * pool.gradients(z_half, batch=batch).mean()
        return MirrorProxState(z=z_next, steps=state.steps + 1)

    def iterate(self, state: MirrorProxState) -> Array:
        return state.z

    def step_cost(self, state: MirrorProxState) -> StepCost:
        return StepCost(exchanges=2, paper=2)
