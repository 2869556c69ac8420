"""The five algorithms of the paper, each written once as single-run code (see base.py)."""

from __future__ import annotations

from typing import Any

from fedsaddle.common.problems.domains import Domain
from fedsaddle.server.algorithms.base import Algorithm, Exchanges, RoundAnswers, StepCost, load_state, save_state
from fedsaddle.server.algorithms.catalyst import (
    FixedSyncs,
    GradientMapping,
    InnerStop,
    ObjectiveDecrease,
    ScaffoldCatalystS,
)
from fedsaddle.server.algorithms.fedavg_s import FedAvgS
from fedsaddle.server.algorithms.minibatch_md import MinibatchMirrorDescent
from fedsaddle.server.algorithms.mirror_prox import MirrorProx
from fedsaddle.server.algorithms.scaffold_s import ScaffoldS
from fedsaddle.server.algorithms.schedule import SyncSchedule
from fedsaddle.server.config import (
    AlgorithmSpec,
    CatalystSpec,
    FedAvgSpec,
    FixedInnerStop,
    FixedSync,
    GradientStop,
    MinibatchMDSpec,
    MirrorProxSpec,
    ObjectiveStop,
    RandomSync,
    ScaffoldSpec,
)

__all__ = [
    "Algorithm",
    "Exchanges",
    "FedAvgS",
    "MinibatchMirrorDescent",
    "MirrorProx",
    "RoundAnswers",
    "ScaffoldCatalystS",
    "ScaffoldS",
    "StepCost",
    "SyncSchedule",
    "build",
    "load_state",
    "save_state",
]


def schedule_of(sync: FixedSync | RandomSync) -> SyncSchedule:
    return SyncSchedule(tau=sync.tau) if isinstance(sync, FixedSync) else SyncSchedule(p=sync.p)


def stop_rule(spec: FixedInnerStop | ObjectiveStop | GradientStop) -> InnerStop:
    if isinstance(spec, FixedInnerStop):
        return FixedSyncs(spec.inner_syncs)
    if isinstance(spec, ObjectiveStop):
        return ObjectiveDecrease(spec.rtol, spec.max_inner_syncs)
    return GradientMapping(spec.rtol, spec.max_inner_syncs)


def build(
    spec: AlgorithmSpec, sync: FixedSync | RandomSync, dim_x: int | None = None, domain: Domain | None = None
) -> Algorithm[Any]:
    """The algorithm a config entry describes, under the run's synchronization schedule, keeping its
    iterates in `domain` (None: unconstrained)."""
    algorithm = _build(spec, sync, dim_x)
    algorithm.domain = domain
    if isinstance(algorithm, ScaffoldCatalystS):
        algorithm.inner_solver.domain = domain
    return algorithm


def _build(spec: AlgorithmSpec, sync: FixedSync | RandomSync, dim_x: int | None = None) -> Algorithm[Any]:
    schedule = schedule_of(sync)
    if isinstance(spec, MinibatchMDSpec):
        return MinibatchMirrorDescent(gamma=spec.gamma, minibatch=schedule.minibatch)
    if isinstance(spec, MirrorProxSpec):
        return MirrorProx(gamma=spec.gamma, minibatch=schedule.minibatch)
    if isinstance(spec, FedAvgSpec):
        return FedAvgS(
            gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, decay=spec.decay, schedule=schedule
        )
    if isinstance(spec, ScaffoldSpec):
        return ScaffoldS(gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, schedule=schedule)
    assert isinstance(spec, CatalystSpec)
    return ScaffoldCatalystS(
        gamma_local=spec.gamma_local,
        gamma_global=spec.gamma_global,
        theta=spec.theta,
        stop=stop_rule(spec.stop),
        theta_rule=spec.theta_rule,
        theta_scale=spec.theta_scale,
        schedule=schedule,
        dim_x=dim_x,
    )
