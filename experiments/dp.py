"""Differential privacy on a real problem: held-out AUC against epsilon.

    fedsaddle experiment dp [--seeds 10] [--rounds 20] [--epsilons 0.5 1 2 4 8] [--out DIR]

AUC maximization (Ying et al. 2016) on the bundled breast-cancer data, split over
10 clients with Dirichlet(0.5) label skew (a fresh split per seed), FedAvg-S with a
constant local step, in-process (`simulate`). Every private run uses secure
aggregation with the noise added by the clients ("distributed DP"), so the
coordinator only ever sees masked rows and the unmasked sum carries the noise.

For each target epsilon the noise multiplier is the smallest one for which
dp-accounting's RDP accountant, composed over the run's releases, gives at most that
epsilon at delta (`noise_multiplier`); each run's own reported epsilon (its
`summary.json` entry) is checked against the accountant. Distances are to the
non-private solution z* of the same federated objective (uniform weighting),
computed from all clients' data (possible only because this is an experiment).
"""

from __future__ import annotations

import csv
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common import dp
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.problems.auc import roc_auc
from fedsaddle.common.problems.data import data_paths
from fedsaddle.common.worker import ShardCache
from fedsaddle.server.config import RunConfig, parse_config
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool, reference_solution

from .datasets import split
from .grid import quartiles
from .report import markdown

CLIENTS = 10
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
DATASET = "breast_cancer"
CLIP_ONLY_Z = 1e-12  # the config needs z > 0; this noise (about 1e-12) is far below what clipping moves


@dataclass(frozen=True)
class Setup:
    """What every run of the experiment shares (the scope stated in table.md)."""

    rounds: int = 20  # few releases: each one spends privacy
    clip: float = 0.3  # C, the L2 bound of a client's answer: best AUC at epsilon <= 1 of {0.3, 0.5, 1}
    delta: float = 1e-5  # below 1/n for any n the data could have
    gamma_local: float = 0.04
    tau: int = 10
    lam: float = 0.1
    secure_aggregation: bool = True  # the clients add the noise; False: the coordinator does (central DP)


@dataclass(frozen=True)
class DpRun:
    """One row of runs.csv. kind: "dp" (a private run), "plain" (no clipping, no noise) or "clip-only"
    (clipping, noise of multiplier CLIP_ONLY_Z: not private, it shows what clipping alone costs).
    epsilon_target is empty (NaN) unless kind is "dp"."""

    kind: str
    seed: int
    epsilon_target: float
    noise_multiplier: float
    sigma: float
    epsilon_reported: float
    delta: float
    clip: float
    releases: int
    noise_added_by: str
    status: str
    test_auc: float
    dist_to_nonprivate: float
    nonprivate_norm: float
    nonprivate_auc: float
    training_rows: int
    z_sha256: str


def noise_multiplier(epsilon: float, releases: int, delta: float) -> float:
    """The smallest noise multiplier z whose `releases`-fold Gaussian mechanism (every client in every
    round, as fedsaddle accounts it) is (epsilon, delta)-DP by dp-accounting's RDP accountant."""
    import dp_accounting
    from dp_accounting import rdp

    if not (epsilon > 0 and releases > 0 and 0 < delta < 1):
        raise ValueError(f"need epsilon > 0, releases > 0 and 0 < delta < 1, got {epsilon}, {releases}, {delta}")

    def event(z: float) -> dp_accounting.DpEvent:
        # The same event fedsaddle.common.dp.epsilon composes for a run (sampling 1: every client, every round).
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z)), releases
        )

    found = dp_accounting.calibrate_dp_mechanism(
        rdp.RdpAccountant, event, epsilon, delta, dp_accounting.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4
    )
    z = float(found)
    spent = dp.epsilon(DpSettings(1.0, z), 1.0, releases, delta)
    if spent > epsilon:  # checked: a run must never spend more than its target
        raise RuntimeError(f"noise multiplier {z} spends epsilon {spent} > {epsilon}")
    return z


def _config(problem: dict[str, Any], setup: Setup, seed: int, privacy: dict[str, Any]) -> RunConfig:
    return parse_config(
        {
            "problem": problem,
            "seed": seed,
            "init": "zeros",  # ||z*|| is about 0.95: clipped steps from the all-ones default (5.7 away) barely move
            "weighting": "uniform",  # differential privacy refuses sample weights (they would be released)
            "rounds": setup.rounds,
            "sync": {"kind": "fixed", "tau": setup.tau},
            "algorithms": [{"name": "fedavg_s", "gamma_local": setup.gamma_local, "decay": "constant"}],
            "privacy": privacy,
        }
    )


def run_dp(
    out: Path,
    command: str,
    seeds: Sequence[int] = tuple(range(10)),
    epsilons: Sequence[float] = EPSILONS,
    setup: Setup = Setup(),
    progress: Callable[[int], None] | None = None,
) -> list[DpRun]:
    """Every (seed, epsilon) run and, per seed, a non-private and a clipping-only run; runs.csv, table.md
    and figure_dp.png under `out`. Returns the runs."""
    if not seeds or not epsilons:
        raise ValueError("the dp experiment needs at least one seed and one epsilon")
    out.mkdir(parents=True, exist_ok=True)
    started = time.process_time()
    runs: list[DpRun] = []
    multipliers: dict[float, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedsaddle-dp-") as scratch:
        for seed in seeds:
            runs.extend(_seed_runs(Path(scratch) / f"seed-{seed}", seed, epsilons, setup, multipliers))
            if progress is not None:
                progress(len(runs))
    cpu = time.process_time() - started
    _write_csv(out / "runs.csv", runs)
    (out / "table.md").write_text(_table(runs, epsilons, setup, seeds, command, cpu))
    _figure(out / "figure_dp.png", runs, epsilons, setup, seeds)
    return runs


def _seed_runs(
    folder: Path, seed: int, epsilons: Sequence[float], setup: Setup, multipliers: dict[float, float]
) -> list[DpRun]:
    summary = split(DATASET, CLIENTS, "label-skew", seed=seed, out=folder)
    features = int(summary["features"])
    problem = {
        "name": "auc",
        "num_clients": CLIENTS,
        "features": features,
        "positive_rate": summary["positive_rate"],
        "lam": setup.lam,
    }
    cache = ShardCache(data=data_paths(str(folder / "client-{i:03d}.npz"), range(CLIENTS)))
    test = np.load(folder / "test.npz")

    def auc(z: np.ndarray[Any, Any]) -> float:
        return roc_auc(test["X_test"] @ z[:features], test["y_test"] > 0)

    plain = _config(problem, setup, seed, {})
    reference = reference_solution(plain, cache)
    assert reference is not None  # the auc problem computes its solution from the data
    nonprivate_auc = auc(reference)

    def row(kind: str, result: AlgorithmResult, target: float, z: float, reported: float, by: str) -> DpRun:
        ok = result.status == "ok"
        return DpRun(
            kind=kind,
            seed=seed,
            epsilon_target=target,
            noise_multiplier=z,
            sigma=z * setup.clip,
            epsilon_reported=reported,
            delta=setup.delta,
            clip=setup.clip,
            releases=int(result.records[-1]["rounds"]) if result.records else 0,
            noise_added_by=by,
            status=result.status,
            test_auc=auc(result.final_z) if ok else math.nan,
            dist_to_nonprivate=float(np.linalg.norm(result.final_z - reference)) if ok else math.nan,
            nonprivate_norm=float(np.linalg.norm(reference)),
            nonprivate_auc=nonprivate_auc,
            training_rows=int(summary["training_rows"]),
            z_sha256=result.z_sha256,
        )

    baseline = run_algorithm(plain.algorithms[0], plain, LocalPool(cache=cache), reference=reference)
    rows = [row("plain", baseline, math.nan, 0.0, 0.0, "none")]
    releases = rows[0].releases
    # Clipping alone, with the coordinator's negligible seeded noise: deterministic, and not private.
    spec = {"clip": setup.clip, "noise_multiplier": CLIP_ONLY_Z, "delta": setup.delta}
    clipped = _config(problem, setup, seed, {"dp": spec})
    result = run_algorithm(clipped.algorithms[0], clipped, LocalPool(cache=cache), reference=reference)
    rows.append(
        row("clip-only", result, math.nan, CLIP_ONLY_Z, float(result.summary()["privacy"]["epsilon"]), "coordinator")
    )
    for target in epsilons:
        if target not in multipliers:
            multipliers[target] = noise_multiplier(target, releases, setup.delta)
        z = multipliers[target]
        spec = {"clip": setup.clip, "noise_multiplier": z, "delta": setup.delta}
        config = _config(problem, setup, seed, {"secure_aggregation": setup.secure_aggregation, "dp": spec})
        result = run_algorithm(config.algorithms[0], config, LocalPool(cache=cache), reference=reference)
        privacy = result.summary()["privacy"]
        reported = float(privacy["epsilon"])
        accountant = dp.epsilon(DpSettings(setup.clip, z), 1.0, int(result.records[-1]["rounds"]), setup.delta)
        if reported != accountant or reported > target:  # the run must spend exactly what was calibrated
            raise RuntimeError(
                f"seed {seed}, epsilon {target}: the run reports {reported}, the accountant {accountant}"
            )
        rows.append(row("dp", result, target, z, reported, str(privacy["noise_added_by"])))
    return rows


def _write_csv(path: Path, runs: Sequence[DpRun]) -> None:
    with path.open("w", newline="") as handle:
        fields = list(asdict(runs[0]))
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for run in runs:
            writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(run).items()})


def _cell(values: Sequence[float], digits: int) -> str:
    done = [v for v in values if math.isfinite(v)]
    if not done:
        return "diverged"
    q1, median, q3 = quartiles(done)
    return f"{median:.{digits}f} [{q1:.{digits}f}, {q3:.{digits}f}]"


def _of(runs: Sequence[DpRun], target: float | str) -> list[DpRun]:
    """The private runs at a target epsilon, or the runs of a kind ("plain", "clip-only")."""
    if isinstance(target, str):
        return [r for r in runs if r.kind == target]
    return [r for r in runs if r.kind == "dp" and r.epsilon_target == target]


def _table(
    runs: Sequence[DpRun], epsilons: Sequence[float], setup: Setup, seeds: Sequence[int], command: str, cpu: float
) -> str:
    plain, clipped = _of(runs, "plain"), _of(runs, "clip-only")
    releases = plain[0].releases
    by = "the clients, under secure aggregation" if setup.secure_aggregation else "the coordinator (central DP)"
    lines = [
        "# Differential privacy: held-out AUC against epsilon\n",
        f"Made by `{command}` ({cpu:.0f} s of CPU). AUC maximization on {DATASET} "
        f"({plain[0].training_rows} training rows, 30 features), "
        f"{CLIENTS} clients with Dirichlet(0.5) label skew, a fresh split per seed ({len(seeds)} seeds, "
        f"{seeds[0]}-{seeds[-1]}); in-process. FedAvg-S, constant local step {setup.gamma_local:g}, tau = "
        f"{setup.tau}, {setup.rounds} rounds = {releases} releases (every exchange is one), z0 = 0, lam = "
        f"{setup.lam:g}, uniform weighting. Client-level DP: each client's answer clipped to L2 norm "
        f"C = {setup.clip:g}, Gaussian noise of standard deviation z C on each round's sum, added by {by}; "
        f"delta = {setup.delta:g}. z per epsilon: the smallest for which dp-accounting's RDP accountant "
        f"(sampled Gaussian, sampling 1, composed over the {releases} releases) gives at most epsilon; "
        "'epsilon spent' is what each run reported in its summary (the same accountant; all seeds agree).\n",
        "Cells: median over seeds [interquartile range]. Distances are to the non-private solution z* "
        "of the same federated objective (uniform weighting), computed from all clients' data; "
        f"median ‖z*‖ = {float(np.median([r.nonprivate_norm for r in plain])):.3f}.\n",
    ]
    rows: list[tuple[str, list[str]]] = []
    for target in epsilons:
        mine = _of(runs, target)
        failed = sum(r.status != "ok" for r in mine)
        rows.append(
            (
                f"{target:g}",
                [
                    f"{mine[0].noise_multiplier:.3f}",
                    f"{max(r.epsilon_reported for r in mine):.4f}",
                    _cell([r.test_auc for r in mine], 3),
                    _cell([r.dist_to_nonprivate for r in mine], 3),
                    f"{failed}/{len(mine)}",
                ],
            )
        )
    rows.append(
        (
            "no DP (same run, no clipping or noise)",
            ["0", "", _cell([r.test_auc for r in plain], 3), _cell([r.dist_to_nonprivate for r in plain], 3), ""],
        )
    )
    rows.append(
        (
            f"clipping only (C = {setup.clip:g}, z = {CLIP_ONLY_Z:g}: not private)",
            ["", "", _cell([r.test_auc for r in clipped], 3), _cell([r.dist_to_nonprivate for r in clipped], 3), ""],
        )
    )
    rows.append(("non-private solution z*", ["", "", _cell([r.nonprivate_auc for r in plain], 3), "0", ""]))
    columns = ["noise multiplier z", "epsilon spent", "held-out AUC", "‖z − z*‖", "not ok"]
    lines.append(markdown("", "target epsilon", columns, rows).lstrip("\n"))
    return "\n".join(lines)


def _figure(path: Path, runs: Sequence[DpRun], epsilons: Sequence[float], setup: Setup, seeds: Sequence[int]) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, clipped = _of(runs, "plain"), _of(runs, "clip-only")
    xs = list(epsilons)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=110)
    for ax, key, label in (
        (left, "test_auc", "held-out AUC"),
        (right, "dist_to_nonprivate", r"$\|z - z^\star\|$ to the non-private solution"),
    ):
        stats = [quartiles([getattr(r, key) for r in _of(runs, e) if r.status == "ok"]) for e in xs]
        median = np.array([s[1] for s in stats])
        below = median - np.array([s[0] for s in stats])
        above = np.array([s[2] for s in stats]) - median
        ax.errorbar(xs, median, yerr=[below, above], marker="o", capsize=3, label="DP (median, IQR)")
        q1, mid, q3 = quartiles([getattr(r, key) for r in plain])
        ax.axhline(mid, color="k", linestyle="--", label="no DP, same run (median)")
        ax.axhspan(q1, q3, color="k", alpha=0.1)
        clip_median = float(np.median([getattr(r, key) for r in clipped]))
        ax.axhline(clip_median, color="tab:orange", linestyle="-.", label="clipping only, no noise (median)")
        if key == "test_auc":
            ax.axhline(
                float(np.median([r.nonprivate_auc for r in plain])),
                color="g",
                linestyle=":",
                label="non-private solution z* (median)",
            )
        else:
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{e:g}" for e in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the epsilons are labelled
        ax.set_xlabel(rf"$\varepsilon$ ($\delta$ = {setup.delta:g})")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    by = "the clients (secure aggregation)" if setup.secure_aggregation else "the coordinator"
    fig.suptitle(
        f"AUC on {DATASET}, {CLIENTS} clients, FedAvg-S, {setup.rounds} rounds, C = {setup.clip:g}, "
        f"{len(seeds)} seeds; noise added by {by}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
