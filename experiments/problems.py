"""The real problems with the paper's five algorithms: how fast each reaches the centralized solution.

    fedsaddle experiment problems [--rounds 1000] [--out DIR]

Three problems on real data split across 10 clients with Dirichlet(0.5) label
skew, aggregation weighted by samples, tau = 10 local steps per sync:

  linear_regression  the paper's saddle form of ridge regression, diabetes
  auc                AUC maximization (Ying et al. 2016), breast cancer
  fair_logistic      demographic-parity logistic regression, diabetes by sex

Each algorithm runs on a grid of step sizes (gamma_g = gamma_l, as in the
paper); for each, the step with the smallest final distance is shown, distances
within round-off of z* counting as equal (ties go to the fewest rounds to 1e-6,
which round-off does not move, as in the paper's sweep). Distances
are to the centralized solution, computed from all clients' data (possible only
because this is an experiment: the coordinator never has the data). Rounds
count every exchange. Held-out metrics are computed on the pooled held-out rows.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import problem_class
from fedsaddle.common.problems.auc import roc_auc
from fedsaddle.common.problems.data import data_paths, read_client_data
from fedsaddle.common.worker import ShardCache
from fedsaddle.server.batch import BatchRun, run_batches
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import AlgorithmResult
from fedsaddle.server.transport.local_pool import reference_solution

from .datasets import split
from .report import PLOT_FLOOR, fmt, markdown

CLIENTS = 10
ALGORITHMS = ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s")
STEP_FACTORS = (8.0, 4.0, 2.0, 1.0, 0.5, 0.25)
NAMES = {
    "minibatch_md": "Minibatch MD",
    "mirror_prox": "Minibatch Mirror-prox",
    "fedavg_s": "FedAvg-S",
    "scaffold_s": "SCAFFOLD-S",
    "scaffold_catalyst_s": "SCAFFOLD-Catalyst-S",
}


@dataclass(frozen=True)
class Case:
    problem: str
    dataset: str
    base_step: float  # the middle of the step grid
    spec: dict[str, Any]  # public hyper-parameters beyond those the split provides
    metric: str  # what is reported on the pooled held-out rows


CASES = (
    Case("linear_regression", "diabetes", 0.1, {"lam": 0.1}, "held-out MSE"),
    Case("auc", "breast_cancer", 0.02, {"lam": 0.1}, "held-out AUC"),
    Case("fair_logistic", "diabetes_fair", 0.1, {"lam": 0.1, "rho": 1.0}, "held-out accuracy"),
)


def _entry(algorithm: str, step: float) -> dict[str, Any]:
    if algorithm in ("minibatch_md", "mirror_prox"):
        return {"name": algorithm, "gamma": step}
    if algorithm == "fedavg_s":
        return {"name": algorithm, "gamma_local": step, "decay": "constant"}
    return {"name": algorithm, "gamma_local": step}


def _held_out(case: Case, z: np.ndarray[Any, Any], test: Any, features: int) -> float:
    scores = test["X_test"] @ z[:features]
    if case.problem == "linear_regression":
        return float(np.mean((scores - test["y_test"]) ** 2))
    if case.problem == "auc":
        return roc_auc(scores, test["y_test"] > 0)
    return float(np.mean((scores > 0) == (test["y_test"] > 0)))


def case_setup(case: Case, seed: int, folder: Path) -> tuple[dict[str, Any], dict[int, str], Array]:
    """The case's dataset split over CLIENTS with label skew drawn from `seed`, written under `folder`:
    the problem entry (with the split's public statistics), the clients' files, and the centralized z*."""
    summary = split(case.dataset, CLIENTS, "label-skew", seed=seed, out=folder)
    fields = problem_class(case.problem).Spec.model_fields
    problem: dict[str, Any] = {"name": case.problem, "num_clients": CLIENTS, "features": summary["features"]}
    problem.update({k: summary[k] for k in ("positive_rate", "group_rate") if k in fields})
    problem.update(case.spec)
    paths = data_paths(str(folder / "client-{i:03d}.npz"), range(CLIENTS))
    config = parse_config({"problem": problem, "weighting": "samples", "algorithms": [_entry("scaffold_s", 1.0)]})
    reference = reference_solution(config, ShardCache(data=paths))
    if reference is None:
        raise ValueError(f"problem {case.problem} computes no centralized solution")
    return problem, paths, reference


def run_problems(out: Path, command: str, rounds: int = 1000, progress: Callable[[int], None] | None = None) -> None:
    """Every (problem, algorithm, step) run; figures and a table under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedsaddle-problems-") as scratch:
        _run_problems(out, Path(scratch), command, rounds, progress)


def _run_problems(out: Path, scratch: Path, command: str, rounds: int, progress: Callable[[int], None] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches: list[list[BatchRun]] = []
    contexts = []
    for case in CASES:
        folder = scratch / case.dataset  # the split is reproducible from its seed; only the report is kept
        problem, paths, reference = case_setup(case, 0, folder)
        summary = json.loads((folder / "summary.json").read_text())
        base = {"problem": problem, "weighting": "samples", "rounds": rounds, "sync": {"kind": "fixed", "tau": 10}}
        members = []
        for algorithm in ALGORITHMS:
            for factor in STEP_FACTORS:
                config = parse_config({**base, "algorithms": [_entry(algorithm, factor * case.base_step)]})
                members.append(BatchRun(config, config.algorithms[0], reference))
        batches.append(members)
        contexts.append((case, folder, summary, reference, paths))

    def counted(finished: int, _total: int) -> None:
        if progress is not None:
            progress(finished)

    results = run_batches(batches, progress=counted, data=[c[4] for c in contexts])
    lines = [
        "# Real problems, five algorithms\n",
        f"Made by `{command}`. 10 clients, Dirichlet(0.5) label skew, weighting by samples, tau = 10, "
        f"{rounds} rounds (every exchange counted). Each algorithm at the best of the step grid "
        f"{{{', '.join(f'{f:g}' for f in STEP_FACTORS)}}} x the problem's base step (gamma_g = gamma_l); final "
        f"distances below {ROUND_OFF:g} max(1, ||z*||) are round-off and count as equal, ties going to the fewest "
        "rounds to 1e-6. Distances are to the centralized solution; the held-out metric is taken on the pooled "
        "held-out rows.\n",
    ]
    fig, axes = plt.subplots(1, len(CASES), figsize=(5.2 * len(CASES), 4.2), dpi=110)
    for ax, (case, folder, summary, reference, _), batch, batch_results in zip(
        np.atleast_1d(axes), contexts, batches, results, strict=True
    ):
        test = np.load(folder / "test.npz")
        features = summary["features"]
        cells = []
        round_off = ROUND_OFF * max(1.0, float(np.linalg.norm(reference)))
        for algorithm in ALGORITHMS:
            mine = [(m, r) for m, r in zip(batch, batch_results, strict=True) if m.spec.name == algorithm]
            best_member, best = min(mine, key=lambda mr: _score(mr[1], round_off))
            step = best_member.spec.model_dump().get("gamma", best_member.spec.model_dump().get("gamma_local"))
            xs = [r["rounds"] for r in best.records]
            ys = [max(r["dist_z"], PLOT_FLOOR) if math.isfinite(r["dist_z"]) else math.nan for r in best.records]
            ax.semilogy(xs, ys, label=f"{NAMES[algorithm]} (step {step:g})")
            reached = best.rounds_to(1e-6, distance="dist_z")
            metric = _held_out(case, best.final_z, test, features) if best.status == "ok" else math.nan
            cells.append(
                (
                    NAMES[algorithm],
                    [
                        f"{step:g}",
                        fmt(_final(best)),
                        "not reached" if reached is None else str(reached),
                        f"{metric:.4f}",
                    ],
                )
            )
        centralized = _held_out(case, reference, test, features)
        cells.append(("centralized solution", ["", "0", "", f"{centralized:.4f}"]))
        if case.problem == "auc":
            from sklearn.linear_model import LogisticRegression

            datas = [read_client_data(folder / f"client-{i:03d}.npz") for i in range(CLIENTS)]
            X, y = np.vstack([d.X for d in datas]), np.concatenate([d.y for d in datas])
            logistic = LogisticRegression(max_iter=5000).fit(X, y).decision_function(test["X_test"])
            cells.append(
                (
                    "scikit-learn LogisticRegression (reference)",
                    ["", "", "", f"{roc_auc(logistic, test['y_test'] > 0):.4f}"],
                )
            )
        ax.set_title(f"{case.problem} ({case.dataset})")
        ax.set_xlabel("rounds (every exchange)")
        ax.grid(True, which="both", alpha=0.3)
        lines.append(
            markdown(
                f"## {case.problem} on {case.dataset}\n\n{summary['training_rows']} training rows, "
                f"{summary['features']} features; {case.metric} on {summary['heldout_rows']} held-out rows.",
                "algorithm",
                ["step", "final ||z - z*||", "rounds to 1e-6", case.metric],
                cells,
            )
        )
    np.atleast_1d(axes)[0].set_ylabel(f"||z - z*|| to the centralized solution (floor {PLOT_FLOOR:g})")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(
        handles, [label.split(" (step")[0] for label in labels], loc="lower center", ncol=len(ALGORITHMS), fontsize=8
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out / "figure_problems.png")
    plt.close(fig)
    (out / "problems.md").write_text("\n".join(lines))


def _final(result: AlgorithmResult) -> float:
    return result.dist_z if result.status == "ok" and math.isfinite(result.dist_z) else math.inf


# Final distances below this (times max(1, ||z*||)) are round-off: which step lands lowest there
# depends on the last bits of the arithmetic, not on the method.
ROUND_OFF = 1e-14


def _score(result: AlgorithmResult, round_off: float) -> tuple[float, float, float]:
    """What choosing a step minimizes: the final distance (round-off counting as equal), then the
    rounds to 1e-6, then the final distance itself."""
    final = _final(result)
    reached = result.rounds_to(1e-6, distance="dist_z")
    return max(final, round_off), math.inf if reached is None else float(reached), final
