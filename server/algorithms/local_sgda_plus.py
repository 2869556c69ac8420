"""Local SGDA+: local stochastic gradient descent ascent whose ascent looks at a snapshot of x.

Y. Deng and M. Mahdavi, "Local Stochastic Gradient Descent Ascent: Convergence Analysis
and Communication Efficiency", AISTATS 2021, Algorithm 2 (Local SGDA+), line by line:

    box                                                      code
    x~ = x^0                                                 init: x_snapshot = x0
    for t = 0, ..., T - 1:                                   a step is tau local steps, then a sync
      x_i^{t+1} = x_i^t - eta_x grad_x f_i(x_i^t, y_i^t; xi)   ComputeTask("local_sgda_plus") runs
      y_i^{t+1} = y_i^t + eta_y grad_y f_i(x~, y_i^t; xi)        common/computations.py's local_sgda_plus
      if t + 1 mod tau = 0:                                  the answer: each client's direction sums
        x_i^{t+1} = (1/n) sum_j x_j^{t+1}                    x -= eta_x (1/n) sum_i sum_l grad_x f_i
        y_i^{t+1} = (1/n) sum_j y_j^{t+1}                    y -= eta_y (1/n) sum_i sum_l (-grad_y f_i)
      if t + 1 mod S = 0: x~ = x^{t+1}                       every `snapshot_every` syncs (S = snapshot_every tau)

The ascent on y uses the gradient at the snapshot x~, refreshed every S local
steps, instead of at the moving x_i: that is what lets the paper prove convergence
for nonconvex-concave objectives (Local SGDA needs strong concavity). Each local
step costs two gradient evaluations (at (x_i, y_i) and at (x~, y_i)).

Where the code departs from the box: the sync interval is the run's (tau, or a
geometric draw under random synchronization) and S counts syncs, so it is a
multiple of the interval as the paper asks. The clients send the sums of their
directions and the server forms the average iterate from them. Cost: one exchange
per sync in both conventions; x~ travels with the task (dim_x more floats down).

With tau = 1, snapshot_every = 1 and eta_x = eta_y, every ascent sees x~ = x and a
sync is one step of gradient descent ascent: Minibatch Mirror Descent's step.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
from pydantic import Field

from fedsaddle.common.computations import local_sgda_plus
from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import ComputeTask
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, StepCost, no_exchange, positive
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import AlgorithmDef, AlgorithmSpecBase, BuildContext


class LocalSgdaPlusSpec(AlgorithmSpecBase):
    name: Literal["local_sgda_plus"] = "local_sgda_plus"
    eta_x: float = Field(gt=0, description="descent step size on x")
    eta_y: float | None = Field(None, gt=0, description="ascent step size on y; defaults to eta_x")
    snapshot_every: int = Field(
        1, ge=1, le=1_000_000, description="syncs between refreshes of the snapshot x~ the ascent looks at (S / tau)"
    )


_COST = StepCost(exchanges=1, paper=1)
COMPUTATION = "local_sgda_plus"  # the client half, common/computations.py (clients never import the server)


class LocalSgdaPlusState(NamedTuple):
    z: Array  # (x, y) after the last sync
    x_snapshot: Array  # x~, where the ascent directions are taken
    clock: SyncClock
    syncs: int


class LocalSgdaPlus(Algorithm[LocalSgdaPlusState]):
    name = "local_sgda_plus"
    state_type = LocalSgdaPlusState

    def __init__(
        self, *, eta_x: float, eta_y: float | None, snapshot_every: int, schedule: SyncSchedule, dim_x: int | None
    ) -> None:
        self.eta_x = positive("eta_x", eta_x)
        self.eta_y = positive("eta_y", eta_x if eta_y is None else eta_y)
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if dim_x is None:
            raise ValueError("Local SGDA+ needs the problem's split z = (x, y) (dim_x)")
        self.snapshot_every = snapshot_every
        self.schedule = schedule
        self.dim_x = dim_x
        self._scale: Array | None = None  # `scale`'s array, made at the first sync

    def init(self, z0: Array, seed: int) -> Exchanges[LocalSgdaPlusState]:
        return no_exchange(LocalSgdaPlusState(z0.copy(), z0[: self.dim_x].copy(), self.schedule.start(seed), syncs=0))

    def step(self, state: LocalSgdaPlusState) -> Exchanges[LocalSgdaPlusState]:
        tau_k, clock = self.schedule.next_interval(state.clock)
        params = (("steps", float(tau_k)), ("gamma_x", self.eta_x), ("gamma_y", self.eta_y))
        sums = yield ComputeTask(COMPUTATION, state.z, arrays=(("x_snapshot", state.x_snapshot),), params=params)
        z = self.project(state.z - self.scale(state.z) * sums.mean())
        syncs = state.syncs + 1
        x_snapshot = z[: self.dim_x].copy() if syncs % self.snapshot_every == 0 else state.x_snapshot
        return LocalSgdaPlusState(z, x_snapshot, clock, syncs)

    def scale(self, z: Array) -> Array:
        """The server's step per entry, (eta_x, ..., eta_y, ...), in z's shape and element type: the same every
        sync, so it is made once (a sweep makes it once per run, not per run and sync)."""
        if self._scale is None or self._scale.shape != z.shape or self._scale.dtype != z.dtype:
            self._scale = np.full(z.shape, self.eta_y, dtype=z.dtype)
            self._scale[: self.dim_x] = self.eta_x
        return self._scale

    def iterate(self, state: LocalSgdaPlusState) -> Array:
        return state.z

    def step_cost(self, state: LocalSgdaPlusState) -> StepCost:
        return _COST


def _build(spec: LocalSgdaPlusSpec, run: BuildContext) -> LocalSgdaPlus:
    return LocalSgdaPlus(
        eta_x=spec.eta_x,
        eta_y=spec.eta_y,
        snapshot_every=spec.snapshot_every,
        schedule=run.schedule,
        dim_x=run.dim_x,
    )


LOCAL_SGDA_PLUS = AlgorithmDef(
    LocalSgdaPlusSpec,
    _build,
    computations={COMPUTATION: local_sgda_plus},
    paper="Deng and Mahdavi, AISTATS 2021",
)
