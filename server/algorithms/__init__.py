"""The five algorithms of the paper, written once against the ClientPool interface."""

from __future__ import annotations

from collections.abc import Mapping
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


def build(
    spec: MinibatchMDSpec | MirrorProxSpec | FedAvgSpec | ScaffoldSpec | CatalystSpec,
    overrides: Mapping[str, Any] | None = None,
) -> Algorithm[Any]:
    """The algorithm a config entry describes; `overrides` replace numeric fields
    (a batch of runs passes one value per run, see server/sweep.py)."""

    def get(field: str) -> Any:
        return overrides[field] if overrides and field in overrides else getattr(spec, field)

    if isinstance(spec, MinibatchMDSpec):
        return MinibatchMirrorDescent(get("gamma"))
    if isinstance(spec, MirrorProxSpec):
        return MirrorProx(get("gamma"))
    if isinstance(spec, FedAvgSpec):
        return FedAvgS(get("gamma_local"), get("gamma_global"), spec.decay)
    if isinstance(spec, ScaffoldSpec):
        return ScaffoldS(get("gamma_local"), get("gamma_global"))
    return ScaffoldCatalystS(
        get("gamma_local"), get("gamma_global"), get("theta"), spec.stop, spec.theta_rule, get("theta_scale")
    )
