"""Federated deep AUC maximization on real images, against centralized LibAUC and cross-entropy.

    fedsaddle experiment deep-auc [--seeds 10] [--rounds 20] [--tau 5] [--libauc-python PATH] [--positive-share S]
                                  [--out DIR]

The built-in `deep_auc` problem (common/problems/deep_auc.py): LibAUC's AUC-M min-max square-margin loss
with its small CNN, on scikit-learn's handwritten digits, 9 against the rest (about 10% positives), dealt
to 10 clients with Dirichlet(0.5) label skew over the ten digits. To make the task hard enough that no
method reaches AUC 1, half of the images are held out for testing and a quarter of the rest for
validation, so each seed trains on about 670 images (about 67 positives) across the 10 clients. Seed k
splits with `split_seed` k and starts the network from the seed-k initialization of the problem
(`init: problem`); minibatches of 16 rows, tau = 5 local steps per sync (`--tau`), the same communication
budget (every exchange counted) for every algorithm. `--positive-share S` thins the positive training images to the
share S (`train_positive_share`) for every method and the baseline alike: a more imbalanced task.

Rows of the table:

* Local SGDA+, FedGDA-GT, SCAFFOLD-S and FedAvg-S (constant step) on AUC-M;
* FedAvg-S on the same network with cross-entropy (`loss_kind: cross_entropy`: no max player);
* LibAUC: the same network, the same initialization, on the pooled training images of the same split,
  trained centrally with LibAUC's own `AUCMLoss` and `PESG` (experiments/libauc_baseline.py, run in a
  Python that has libauc: `--libauc-python`), for as many minibatch gradients as the whole federation
  computes at most (clients x rounds x tau steps of the same batch size).

Steps are chosen on a grid per method by the mean *validation* AUC of the first three seeds (`TUNING_SEEDS`;
the mean, not the median, so that a step at which one of the three collapses is not chosen);
the test AUC is read only for the chosen step, over every seed, and reported as median [interquartile
range].
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .processes import each
from .report import markdown

CLIENTS = 10
BATCH = 16
TAU = 5  # local steps per sync, unless --tau says otherwise
TUNING_SEEDS = 3  # the first seeds, on whose validation images each method's step is chosen
PROBLEM: dict[str, Any] = {
    "name": "deep_auc",
    "num_clients": CLIENTS,
    "positive_digit": 9,
    "test_fraction": 0.5,
    "validation_fraction": 0.25,
    "batch_size": BATCH,
}


@dataclass(frozen=True)
class Method:
    key: str  # in runs.csv
    name: str  # in tables
    algorithm: str
    step_field: tuple[str, ...]  # the spec fields the step sets
    grid: tuple[float, ...]
    extra: dict[str, Any] = field(default_factory=dict)  # other algorithm fields
    loss: str = "aucm"

    def entry(self, step: float) -> dict[str, Any]:
        return {"name": self.algorithm, **dict.fromkeys(self.step_field, step), **self.extra}


# The step of every AUC-M method (eta_x = eta_y for Local SGDA+), and cross-entropy's: wide enough that each chosen
# step is inside its grid at tau = 5 and at tau = 20 (more local steps per sync choose smaller steps).
AUCM_GRID = (0.3, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0)
CE_GRID = (0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0)
METHODS = (
    Method("local_sgda_plus", "Local SGDA+", "local_sgda_plus", ("eta_x", "eta_y"), AUCM_GRID),
    Method("fedgda_gt", "FedGDA-GT", "fedgda_gt", ("eta",), AUCM_GRID),
    Method("scaffold_s", "SCAFFOLD-S", "scaffold_s", ("gamma_local",), AUCM_GRID),
    Method("fedavg_s", "FedAvg-S", "fedavg_s", ("gamma_local",), AUCM_GRID, {"decay": "constant"}),
    Method(
        "fedavg_ce",
        "FedAvg-S, cross-entropy",
        "fedavg_s",
        ("gamma_local",),
        CE_GRID,
        {"decay": "constant"},
        "cross_entropy",
    ),
)
LIBAUC_GRID = (0.03, 0.1, 0.3, 1.0, 3.0)  # PESG's lr (at 2% positives and tau = 20 its best is 0.1)


@dataclass(frozen=True)
class Setting:
    """What every run of one report shares: its rounds, its local steps per sync, and the positive training
    images' share (none: the digits' own)."""

    rounds: int
    tau: int = TAU
    share: float | None = None

    @property
    def steps(self) -> int:
        """The minibatch gradients a whole federated run computes, at most: the LibAUC baseline's steps."""
        return CLIENTS * self.rounds * self.tau


@dataclass
class Point:
    """One run: a method at one step on one seed."""

    method: str
    step: float
    seed: int
    validation_auc: float
    test_auc: float
    wall_s: float
    z_sha256: str = ""


def problem_spec(seed: int, loss: str = "aucm", share: float | None = None) -> dict[str, Any]:
    """The problem of seed `seed`; `share`: positive training images thinned to that share (none: all kept)."""
    thinned = {} if share is None else {"train_positive_share": share}
    return {**PROBLEM, "split_seed": seed, "loss_kind": loss, **thinned}


def config(method: Method, step: float, seed: int, setting: Setting) -> dict[str, Any]:
    return {
        "name": f"deep-auc-{method.key}-{step:g}-seed{seed}",
        "seed": seed,
        "problem": problem_spec(seed, method.loss, setting.share),
        "init": "problem",
        "rounds": setting.rounds,
        "sync": {"kind": "fixed", "tau": setting.tau},
        "output": {"plot": False},
        "algorithms": [method.entry(step)],
    }


# api.run's signature, passed in by the command line (experiments never import fedsaddle's front end)
Runner = Callable[..., Any]


def run_point(run: Runner, method: Method, step: float, seed: int, setting: Setting, folder: Path) -> Point:
    from fedsaddle.common.problems.deep_auc import DeepAuc, DeepAucSpec

    problem = DeepAuc(DeepAucSpec(**problem_spec(seed, method.loss, setting.share)))
    started = time.perf_counter()
    report = run(config(method, step, seed, setting), out=folder)
    (result,) = report.results
    z = result.final_z
    finite = result.status == "ok" and bool(np.isfinite(z).all())
    validation = problem.pooled_validation_auc(z) if finite else math.nan
    test = problem.pooled_test_auc(z) if finite else math.nan
    return Point(
        method.key,
        step,
        seed,
        validation,
        test,
        time.perf_counter() - started,
        result.z_sha256,
    )


def choose(points: Sequence[Point], method: str, grid: Sequence[float], tuning: Sequence[int]) -> float:
    """The step of `grid` with the best mean validation AUC over the tuning seeds (a NaN counts as 0)."""

    def score(step: float) -> float:
        values = [p.validation_auc for p in points if p.method == method and p.step == step and p.seed in tuning]
        return float(np.mean([0.0 if math.isnan(v) else v for v in values]))

    return max(grid, key=score)


def run_deep_auc(
    run: Runner,
    out: Path,
    command: str,
    seeds: Sequence[int],
    rounds: int,
    libauc_python: str | None,
    progress: Callable[[int, int], None],
    jobs: int = 1,
    share: float | None = None,
    tau: int = TAU,
) -> list[Point]:
    """Tune on the first seeds, then every seed at the chosen steps, the runs spread over `jobs` processes
    (each run is independent and deterministic: the same points in any order); the report under `out`.
    `share`: the positive training images thinned to that share, for every method and the baseline; `tau`: the
    local steps per sync (the baseline's step count follows it)."""
    out.mkdir(parents=True, exist_ok=True)
    setting = Setting(rounds, tau, share)
    tuning = list(seeds[:TUNING_SEEDS])
    total = sum(len(m.grid) * len(tuning) + len(seeds) - len(tuning) for m in METHODS)
    baseline = None if libauc_python is None else start_libauc(libauc_python, seeds, tuning, setting, out)
    started = time.perf_counter()
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="fedsaddle-deep-auc-") as scratch:
        tune = [(m, step, seed) for m in METHODS for step in m.grid for seed in tuning]
        points += _points(run, tune, setting, Path(scratch), jobs, lambda n: progress(n, total))
        rest = [(m, choose(points, m.key, m.grid, tuning), seed) for m in METHODS for seed in seeds[len(tuning) :]]
        points += _points(run, rest, setting, Path(scratch), jobs, lambda n: progress(len(tune) + n, total))
    federated_s = time.perf_counter() - started
    libauc = [] if baseline is None else finish_libauc(baseline, out)
    write_report(out, command, points, libauc, seeds, tuning, setting, federated_s)
    return points + libauc


def _points(
    run: Runner,
    work: Sequence[tuple[Method, float, int]],
    setting: Setting,
    scratch: Path,
    jobs: int,
    progress: Callable[[int], None],
) -> list[Point]:
    """run_point for each (method, step, seed) of `work`, in its order (each run is independent and
    deterministic: the same points in any process)."""
    return each(run_point, [(run, m, step, seed, setting, scratch) for m, step, seed in work], jobs, progress)


def start_libauc(
    python: str, seeds: Sequence[int], tuning: Sequence[int], setting: Setting, out: Path
) -> subprocess.Popen[bytes]:
    """experiments/libauc_baseline.py in `python` (which must have libauc, torch and fedsaddle), started beside
    the federated runs."""
    target = out / "libauc.json"
    target.unlink(missing_ok=True)
    command = [
        python,
        "-m",
        "fedsaddle.experiments.libauc_baseline",
        "--seeds",
        ",".join(str(s) for s in seeds),
        "--tuning",
        ",".join(str(s) for s in tuning),
        "--steps",
        str(setting.steps),
        "--lrs",
        ",".join(f"{lr:g}" for lr in LIBAUC_GRID),
        "--out",
        str(target),
        *([] if setting.share is None else ["--positive-share", f"{setting.share:g}"]),
    ]
    try:
        return subprocess.Popen(command)
    except OSError as exc:
        raise RuntimeError(f"cannot start the LibAUC baseline in {python}: {exc}") from None


def finish_libauc(process: subprocess.Popen[bytes], out: Path) -> list[Point]:
    if process.wait() != 0:
        raise RuntimeError(f"the LibAUC baseline failed (exit status {process.returncode}); its output is above")
    return [Point(**p) for p in json.loads((out / "libauc.json").read_text())]


def _cell(values: Sequence[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "diverged"
    q1, median, q3 = np.percentile(finite, [25, 50, 75])
    cell = f"{median:.4f} [{q1:.4f}, {q3:.4f}]"
    return cell if len(finite) == len(values) else f"{cell} ({len(values) - len(finite)} diverged)"


def chosen_points(points: Sequence[Point], seeds: Sequence[int]) -> dict[str, tuple[float, list[Point]]]:
    """Per method: the chosen step (the one every seed ran) and its points."""
    found = {}
    for key in dict.fromkeys(p.method for p in points):
        mine = [p for p in points if p.method == key]
        for step in dict.fromkeys(p.step for p in mine):
            at = [p for p in mine if p.step == step]
            if {p.seed for p in at} == set(seeds):
                found[key] = (step, sorted(at, key=lambda p: p.seed))
    return found


def write_report(
    out: Path,
    command: str,
    points: Sequence[Point],
    libauc: Sequence[Point],
    seeds: Sequence[int],
    tuning: Sequence[int],
    setting: Setting,
    federated_s: float,
) -> None:
    every = [*points, *libauc]
    with (out / "runs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "step", "seed", "validation_auc", "test_auc", "wall_s", "z_sha256"])
        for p in every:
            writer.writerow(
                [
                    p.method,
                    f"{p.step:g}",
                    p.seed,
                    f"{p.validation_auc:.6f}",
                    f"{p.test_auc:.6f}",
                    f"{p.wall_s:.2f}",
                    p.z_sha256,
                ]
            )
    names = {m.key: m.name for m in METHODS} | {"libauc": "LibAUC AUCMLoss + PESG, centralized"}
    task = "" if setting.share is None else f" (positive training images thinned to {setting.share:g})"
    local = "" if setting.tau == TAU else f" of tau = {setting.tau} local steps"
    chosen = chosen_points(every, seeds)
    rows = []
    for key, (step, at) in chosen.items():
        grid = sorted({p.step for p in every if p.method == key})
        rows.append(
            (
                names[key],
                [
                    f"{step:g} of {{{', '.join(f'{g:g}' for g in grid)}}}",
                    _cell([p.validation_auc for p in at]),
                    _cell([p.test_auc for p in at]),
                    f"{np.median([p.wall_s for p in at]):.1f}",
                ],
            )
        )
    table = markdown(
        f"Test AUC, digit 9 against the rest{task}, {len(seeds)} seed(s) (median [IQR]); {setting.rounds} rounds"
        f"{local}, every exchange counted; steps chosen by the mean validation AUC of seed(s) "
        f"{', '.join(map(str, tuning))}",
        "method",
        ["step (grid)", "validation AUC", "test AUC", "median wall s"],
        rows,
    )
    verdict = _verdict(chosen, names)
    libauc_line = (
        f"LibAUC ran {setting.steps} minibatch steps of {BATCH} rows: clients x rounds x tau, the most minibatch "
        "gradients a federated run computes."
        if libauc
        else "LibAUC not run this time: `--libauc-python PATH` names a Python with libauc "
        "(docs/experiments.md says how to make one)."
    )
    (out / "deep_auc.md").write_text(
        f"<!-- written by `{command}` -->\n\n{table}\n\n{verdict}\n\n{libauc_line} "
        f"The federated runs took {federated_s:.0f} s in all.\n"
    )
    _figure(out / "figure_deep_auc.png", chosen, names)


def _verdict(chosen: dict[str, tuple[float, list[Point]]], names: dict[str, str]) -> str:
    def median(key: str) -> float:
        return float(np.nanmedian([p.test_auc for p in chosen[key][1]]))

    federated = [m.key for m in METHODS if m.loss == "aucm" and m.key in chosen]
    if not federated:
        return ""
    best = max(federated, key=median)
    lines = [f"Best federated AUC-M method by median test AUC: {names[best]} ({median(best):.4f})."]
    if "fedavg_ce" in chosen:
        gap = median(best) - median("fedavg_ce")
        lines.append(f"Against federated cross-entropy ({median('fedavg_ce'):.4f}): {gap:+.4f}.")
    if "libauc" in chosen:
        gap = median(best) - median("libauc")
        met = "above it" if gap > 0 else "within 0.01" if gap >= -0.01 else "not within 0.01"
        lines.append(f"Against centralized LibAUC ({median('libauc'):.4f}): {gap:+.4f}, {met}.")
    return " ".join(lines)


def _figure(path: Path, chosen: dict[str, tuple[float, list[Point]]], names: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(chosen)
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    values = [[p.test_auc for p in chosen[k][1] if not math.isnan(p.test_auc)] for k in keys]
    # boxplot's `orientation` arrived in matplotlib 3.10, which deprecates `vert`; the project allows 3.8.
    sideways = {"orientation": "horizontal"} if _at_least(matplotlib.__version__, (3, 10)) else {"vert": False}
    ax.boxplot(values, **sideways)
    ax.set_yticks(range(1, len(keys) + 1), [names[k] for k in keys], fontsize=8)
    ax.set_xlabel("test AUC (digit 9 against the rest), one point per seed")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _at_least(version: str, wanted: tuple[int, ...]) -> bool:
    parts = tuple(int(p) for p in version.split(".")[: len(wanted)] if p.isdigit())
    return parts >= wanted
