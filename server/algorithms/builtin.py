"""The built-in algorithms' definitions: each spec (server/config.py), its server half, its client half.

Registered by name in server/algorithms/registry.py (BUILT_IN) and loaded from there,
exactly as a plug-in's `AlgorithmDef` is loaded from its entry point.
"""

from __future__ import annotations

from fedsaddle.common import computations
from fedsaddle.server.algorithms.base import Algorithm
from fedsaddle.server.algorithms.catalyst import (
    FixedSyncs,
    GradientMapping,
    InnerStop,
    ObjectiveDecrease,
    ScaffoldCatalystS,
)
from fedsaddle.server.algorithms.fedavg_s import FedAvgS
from fedsaddle.server.algorithms.fedgda_gt import FedGdaGt
from fedsaddle.server.algorithms.local_extragradient import LocalExtragradient
from fedsaddle.server.algorithms.local_sgda_plus import LocalSgdaPlus
from fedsaddle.server.algorithms.minibatch_md import MinibatchMirrorDescent
from fedsaddle.server.algorithms.mirror_prox import MirrorProx
from fedsaddle.server.algorithms.registry import AlgorithmDef, BuildContext
from fedsaddle.server.algorithms.scaffold_s import ScaffoldS
from fedsaddle.server.config import (
    CatalystSpec,
    FedAvgSpec,
    FedGdaGtSpec,
    FixedInnerStop,
    GradientStop,
    LocalExtragradientSpec,
    LocalSgdaPlusSpec,
    MinibatchMDSpec,
    MirrorProxSpec,
    ObjectiveStop,
    ScaffoldSpec,
)

PAPER = "the paper (docs/explanation/algorithms.md)"


def stop_rule(spec: FixedInnerStop | ObjectiveStop | GradientStop) -> InnerStop:
    if isinstance(spec, FixedInnerStop):
        return FixedSyncs(spec.inner_syncs)
    if isinstance(spec, ObjectiveStop):
        return ObjectiveDecrease(spec.rtol, spec.max_inner_syncs)
    return GradientMapping(spec.rtol, spec.max_inner_syncs)


def _minibatch_md(spec: MinibatchMDSpec, run: BuildContext) -> Algorithm[object]:
    return MinibatchMirrorDescent(gamma=spec.gamma, minibatch=run.schedule.minibatch)  # type: ignore[return-value]


def _mirror_prox(spec: MirrorProxSpec, run: BuildContext) -> Algorithm[object]:
    return MirrorProx(gamma=spec.gamma, minibatch=run.schedule.minibatch)  # type: ignore[return-value]


def _fedavg_s(spec: FedAvgSpec, run: BuildContext) -> Algorithm[object]:
    return FedAvgS(  # type: ignore[return-value]
        gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, decay=spec.decay, schedule=run.schedule
    )


def _scaffold_s(spec: ScaffoldSpec, run: BuildContext) -> Algorithm[object]:
    return ScaffoldS(  # type: ignore[return-value]
        gamma_local=spec.gamma_local, gamma_global=spec.gamma_global, schedule=run.schedule
    )


def _catalyst(spec: CatalystSpec, run: BuildContext) -> Algorithm[object]:
    return ScaffoldCatalystS(  # type: ignore[return-value]
        gamma_local=spec.gamma_local,
        gamma_global=spec.gamma_global,
        theta=spec.theta,
        stop=stop_rule(spec.stop),
        theta_rule=spec.theta_rule,
        theta_scale=spec.theta_scale,
        schedule=run.schedule,
        dim_x=run.dim_x,
    )


def _fedgda_gt(spec: FedGdaGtSpec, run: BuildContext) -> Algorithm[object]:
    return FedGdaGt(eta=spec.eta, schedule=run.schedule)  # type: ignore[return-value]


def _local_extragradient(spec: LocalExtragradientSpec, run: BuildContext) -> Algorithm[object]:
    return LocalExtragradient(gamma=spec.gamma, schedule=run.schedule)  # type: ignore[return-value]


def _local_sgda_plus(spec: LocalSgdaPlusSpec, run: BuildContext) -> Algorithm[object]:
    return LocalSgdaPlus(  # type: ignore[return-value]
        eta_x=spec.eta_x,
        eta_y=spec.eta_y,
        snapshot_every=spec.snapshot_every,
        schedule=run.schedule,
        dim_x=run.dim_x,
    )


MINIBATCH_MD = AlgorithmDef(MinibatchMDSpec, _minibatch_md, paper=PAPER)
MIRROR_PROX = AlgorithmDef(MirrorProxSpec, _mirror_prox, paper=PAPER)
FEDAVG_S = AlgorithmDef(FedAvgSpec, _fedavg_s, paper=PAPER)
SCAFFOLD_S = AlgorithmDef(ScaffoldSpec, _scaffold_s, paper=PAPER)
SCAFFOLD_CATALYST_S = AlgorithmDef(CatalystSpec, _catalyst, paper=PAPER)
FEDGDA_GT = AlgorithmDef(FedGdaGtSpec, _fedgda_gt, paper="Sun and Wei, NeurIPS 2022")
LOCAL_EXTRAGRADIENT = AlgorithmDef(
    LocalExtragradientSpec,
    _local_extragradient,
    computations={"local_extragradient": computations.local_extragradient},
    paper="Beznosikov, Samokhin and Gasnikov, 2020",
)
LOCAL_SGDA_PLUS = AlgorithmDef(
    LocalSgdaPlusSpec,
    _local_sgda_plus,
    computations={"local_sgda_plus": computations.local_sgda_plus},
    paper="Deng and Mahdavi, AISTATS 2021",
)
