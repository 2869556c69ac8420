"""The five algorithms of the paper, written once against the ClientPool interface."""

from __future__ import annotations

from typing import Any

from fedsaddle.common.config import (
    CatalystSpec,
    FedAvgSpec,
    MinibatchMDSpec,
    MirrorProxSpec,
    ScaffoldSpec,
)
from fedsaddle.server.algorithms.base import Algorithm, StepCost, SyncSchedule, load_state, save_state
from fedsaddle.server.algorithms.catalyst import ScaffoldCatalystS
from fedsaddle.server.algorithms.fedavg_s import FedAvgS
from fedsaddle.server.algorithms.minibatch_md import MinibatchMirrorDescent
from fedsaddle.server.algorithms.mirror_prox import MirrorProx
from fedsaddle.server.algorithms.scaffold_s import ScaffoldS

__all__ = [
    "Algorithm",
    "FedAvgS",
    "MinibatchMirrorDescent",
    "MirrorProx",
    "ScaffoldCatalystS",
    "ScaffoldS",
    "StepCost",
    "SyncSchedule",
    "build",
    "load_state",
    "save_state",
]


def build(spec: MinibatchMDSpec | MirrorProxSpec | FedAvgSpec | ScaffoldSpec | CatalystSpec) -> Algorithm[Any]:
    """The algorithm a config entry describes."""
    if isinstance(spec, MinibatchMDSpec):
        return MinibatchMirrorDescent(spec.gamma)
    if isinstance(spec, MirrorProxSpec):
        return MirrorProx(spec.gamma)
    if isinstance(spec, FedAvgSpec):
        return FedAvgS(spec.gamma_local, spec.gamma_global, spec.decay)
    if isinstance(spec, ScaffoldSpec):
        return ScaffoldS(spec.gamma_local, spec.gamma_global)
    return ScaffoldCatalystS(spec.gamma_local, spec.gamma_global, spec.theta, spec.stop)
