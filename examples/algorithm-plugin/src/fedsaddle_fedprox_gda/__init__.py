"""FedProx-GDA: local gradient descent ascent with a proximal pull towards the last sync.

A fedsaddle algorithm plug-in, written only against the public API
(`fedsaddle.server.algorithms`). Per sync the clients start from z~ and take tau
local steps along

    d_i = G^_i(z_i) + mu (z_i - z~)        (FedProx's proximal term, on both x and y)
    z_i <- z_i - gamma_local d_i

and send sum_l d_i^l; the server steps z~ <- z~ - gamma_global (1/n) sum_i sum_l d_i^l.
With mu = 0 this is FedAvg-S with a constant step, bit for bit.

The three parts of an algorithm: the spec (hyper-parameters, defaults, ranges:
declared here only), the server half (a generator over an explicit NamedTuple
state) and the client half (a local computation, registered by name).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
from pydantic import Field

from fedsaddle.server.algorithms import (
    Algorithm,
    AlgorithmDef,
    AlgorithmSpecBase,
    BuildContext,
    ClientOracle,
    ComputeTask,
    Exchanges,
    StepCost,
    SyncClock,
    SyncSchedule,
    no_exchange,
    per_run,
    positive,
)

__all__ = ["FEDPROX_GDA", "FedProxGda", "FedProxGdaSpec", "fedprox_gda_steps"]


class FedProxGdaSpec(AlgorithmSpecBase):
    name: Literal["fedprox_gda"] = "fedprox_gda"
    gamma_local: float = Field(gt=0, description="local step size")
    gamma_global: float | None = Field(None, gt=0, description="server step size; defaults to gamma_local")
    mu: float = Field(0.1, ge=0, description="weight of the proximal pull towards the last synchronized z~")


@per_run("gamma")  # elementwise in gamma: a sweep's runs of different steps share each call (not mu: `if mu`)
def fedprox_gda_steps(oracle: ClientOracle, z: np.ndarray, *, steps: float, gamma: float, mu: float) -> np.ndarray:
    """The client half: `steps` proximal local steps from z (one column per hosted client)."""
    z_i = z.copy()
    direction_sum = np.zeros(z.shape)
    for _ in range(int(steps)):
        direction = oracle.stochastic_gradient(z_i)
        if mu:
            direction += mu * (z_i - z)
        direction_sum += direction
        z_i = oracle.project(z_i - gamma * direction)
    return direction_sum


class FedProxGdaState(NamedTuple):
    z_tilde: np.ndarray  # the last synchronized iterate
    clock: SyncClock  # the synchronization stream
    syncs: int


class FedProxGda(Algorithm[FedProxGdaState]):
    name = "fedprox_gda"
    state_type = FedProxGdaState

    def __init__(self, *, gamma_local: float, gamma_global: float | None, mu: float, schedule: SyncSchedule) -> None:
        self.gamma_local = positive("gamma_local", gamma_local)
        self.gamma_global = positive("gamma_global", gamma_local if gamma_global is None else gamma_global)
        self.mu = positive("mu", mu, allow_zero=True)
        self.schedule = schedule

    def init(self, z0: np.ndarray, seed: int) -> Exchanges[FedProxGdaState]:
        return no_exchange(FedProxGdaState(z0.copy(), self.schedule.start(seed), syncs=0))

    def step(self, state: FedProxGdaState) -> Exchanges[FedProxGdaState]:
        tau_k, clock = self.schedule.next_interval(state.clock)
        params = (("steps", float(tau_k)), ("gamma", self.gamma_local), ("mu", self.mu))
        sums = yield ComputeTask("fedprox_gda_steps", state.z_tilde, params=params)
        z_tilde = self.project(state.z_tilde - self.gamma_global * sums.mean())
        return FedProxGdaState(z_tilde, clock, state.syncs + 1)

    def iterate(self, state: FedProxGdaState) -> np.ndarray:
        return state.z_tilde

    def step_cost(self, state: FedProxGdaState) -> StepCost:
        return StepCost(exchanges=1, paper=1)


def _build(spec: FedProxGdaSpec, run: BuildContext) -> FedProxGda:
    return FedProxGda(gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, mu=spec.mu, schedule=run.schedule)


FEDPROX_GDA = AlgorithmDef(
    FedProxGdaSpec,
    _build,
    computations={"fedprox_gda_steps": fedprox_gda_steps},
    paper="example plug-in (FedProx's proximal term on local GDA)",
)
