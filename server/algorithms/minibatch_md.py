"""Minibatch Mirror Descent (paper, section Baselines).

Every round, each client averages tau stochastic gradient mappings taken at the
server's iterate; the server averages the n answers and steps:
    z <- z - gamma * (1/n) sum_i G^_i(z).
With the Euclidean mirror map on an unconstrained domain the mirror step is this
plain step. Cost: one round per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsaddle.common.problems import Array
from fedsaddle.server.algorithms.base import Algorithm, StepCost, SyncSchedule, positive
from fedsaddle.server.pool import ClientPool


@dataclass(frozen=True)
class MDState:
    z: Array  # the server's iterate
    steps: int  # steps taken


class MinibatchMirrorDescent(Algorithm[MDState]):
    name = "minibatch_md"

    def __init__(self, gamma: float | Array) -> None:
        self.gamma = positive("gamma", gamma)

    def init(self, z0: Array, pool: ClientPool, schedule: SyncSchedule) -> MDState:
        return MDState(z=z0.copy(), steps=0)

    def step(self, state: MDState, pool: ClientPool, schedule: SyncSchedule) -> MDState:
        batch = schedule.next_interval()  # tau gradient estimates per client
        g = pool.gradients(state.z, batch=batch).mean()
        return MDState(z=state.z - self.gamma * g, steps=state.steps + 1)

    def iterate(self, state: MDState) -> Array:
        return state.z

    def step_cost(self, state: MDState) -> StepCost:
        return StepCost(exchanges=1, paper=1)
