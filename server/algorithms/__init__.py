"""The algorithms: the public API for writing one, the built-in ones, and `build`.

An algorithm is an `AlgorithmDef` (spec.py): a spec, a server half (an
`Algorithm`, written once as single-run code, see base.py) and optionally a client
half (named local computations, reached by `ComputeTask`). Each built-in one is one
module of this package declaring all three (minibatch_md.py, ..., local_sgda_plus.py),
listed in registry.py; plug-ins register by the entry-point group
`fedsaddle.algorithms` (docs/how-to/own-algorithm.md). `available()` names them all.
"""

from __future__ import annotations

from typing import Any

from fedsaddle.common.computations import ClientOracle, LocalComputation, per_run
from fedsaddle.common.problems.domains import Domain
from fedsaddle.common.tasks import ComputeTask, GradientTask, LocalStepsTask
from fedsaddle.server.algorithms.base import (
    Algorithm,
    Exchanges,
    RoundAnswers,
    StepCost,
    load_state,
    no_exchange,
    positive,
    save_state,
)
from fedsaddle.server.algorithms.catalyst import ScaffoldCatalystS
from fedsaddle.server.algorithms.fedavg_s import FedAvgS
from fedsaddle.server.algorithms.fedgda_gt import FedGdaGt
from fedsaddle.server.algorithms.local_extragradient import LocalExtragradient
from fedsaddle.server.algorithms.local_sgda_plus import LocalSgdaPlus
from fedsaddle.server.algorithms.minibatch_md import MinibatchMirrorDescent
from fedsaddle.server.algorithms.mirror_prox import MirrorProx
from fedsaddle.server.algorithms.registry import (
    AlgorithmNotFound,
    available,
    definition,
    register,
    rescan,
    unregister,
)
from fedsaddle.server.algorithms.scaffold_s import ScaffoldS
from fedsaddle.server.algorithms.schedule import SyncClock, SyncSchedule
from fedsaddle.server.algorithms.spec import AlgorithmDef, AlgorithmSpecBase, BuildContext, FixedSync, RandomSync

__all__ = [
    "Algorithm",
    "AlgorithmDef",
    "AlgorithmNotFound",
    "AlgorithmSpecBase",
    "BuildContext",
    "ClientOracle",
    "ComputeTask",
    "Exchanges",
    "FedAvgS",
    "FedGdaGt",
    "GradientTask",
    "LocalComputation",
    "LocalExtragradient",
    "LocalSgdaPlus",
    "LocalStepsTask",
    "MinibatchMirrorDescent",
    "MirrorProx",
    "RoundAnswers",
    "ScaffoldCatalystS",
    "ScaffoldS",
    "StepCost",
    "SyncClock",
    "SyncSchedule",
    "available",
    "build",
    "definition",
    "load_state",
    "no_exchange",
    "per_run",
    "positive",
    "register",
    "rescan",
    "save_state",
    "unregister",
]


def schedule_of(sync: FixedSync | RandomSync) -> SyncSchedule:
    return SyncSchedule(tau=sync.tau) if sync.kind == "fixed" else SyncSchedule(p=sync.p)


def build(
    spec: AlgorithmSpecBase, sync: FixedSync | RandomSync, dim_x: int | None = None, domain: Domain | None = None
) -> Algorithm[Any]:
    """The algorithm a config entry describes, under the run's synchronization schedule, keeping its
    iterates in `domain` (None: unconstrained)."""
    algorithm = definition(spec.name).build(spec, BuildContext(schedule_of(sync), dim_x))
    algorithm.domain = domain
    return algorithm
