"""Agnostic federated learning on real data: does the model serve its worst client better?

    fedsaddle experiment agnostic [--seeds 10] [--rounds 2000] [--transport grpc] [--out DIR]

For each seed, breast_cancer (scikit-learn's, bundled) is split over 10 clients
with Dirichlet(0.5) label skew (the split's seed is the run's), and the built-in
`agnostic` problem (common/problems/agnostic.py) is solved by the five
algorithms: a logistic model x = (w, b) and client weights lambda on the
simplex,

    min_x max_lambda  sum_i lambda_i L_i(x) + lam/2 ||x||^2 - nu/2 ||lambda - 1/n||^2.

It is compared with the same model trained with uniform weights (lambda = 1/n
fixed: federated logistic regression), on every client's held-out rows: the
worst client's test loss and accuracy.

Both reference points are computed centrally, independently of fedsaddle's
algorithms and of `check-problem`'s solver: the uniform model by Newton's
method; the agnostic saddle point through its dual, phi(lambda) = min_x f(x,
lambda) (Newton's method in x, exact), maximised over the simplex by projected
gradient ascent with exact gradients (phi is nu-strongly concave), to a
projected residual of the federation's G below 1e-12. Distances of each
algorithm's final iterate are to that point.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.numeric import Array, norm
from fedsaddle.common.problems.agnostic import AgnosticLogistic, AgnosticSpec
from fedsaddle.common.problems.base import client_context
from fedsaddle.common.problems.data import ClientData, read_client_data
from fedsaddle.common.problems.domains import Simplex

from .datasets import split
from .problems import NAMES
from .report import fmt, markdown

CLIENTS = 10
FEATURES = 30
LAM = 0.05  # L2 weight on the model
NU = 0.05  # the regulariser toward uniform weights (strong concavity)
ALGORITHMS: tuple[dict[str, Any], ...] = (
    {"name": "minibatch_md", "gamma": 0.3},
    {"name": "mirror_prox", "gamma": 0.5},
    {"name": "fedavg_s", "gamma_local": 0.05},
    {"name": "scaffold_s", "gamma_local": 0.1},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.1},
)


def config(seed: int, rounds: int) -> dict[str, Any]:
    return {
        "name": f"agnostic-seed{seed}",
        "seed": seed,
        "problem": {"name": "agnostic", "num_clients": CLIENTS, "features": FEATURES, "lam": LAM, "nu": NU},
        "rounds": rounds,
        "sync": {"kind": "random", "p": 0.1},
        "evaluate_every": 100,
        "output": {"gradient_norm": True, "plot": False},
        "algorithms": list(ALGORITHMS),
    }


# -- the central, independent solutions ---------------------------------------------------


def _logistic(data: ClientData, x: Array, test: bool = False) -> tuple[float, Array, Array, float]:
    """Mean logistic loss, its gradient and Hessian in x = (w, b), and the accuracy."""
    X, y = (data.X_test, data.y_test) if test else (data.X, data.y)
    assert X is not None and y is not None
    A = np.hstack([X, np.ones((X.shape[0], 1))])
    t = np.where(y > 0, 1.0, -1.0)
    s = A @ x
    p = 1.0 / (1.0 + np.exp(t * s))  # sigma(-t s)
    loss = float(np.mean(np.logaddexp(0.0, -t * s)))
    grad = A.T @ (-t * p) / len(t)
    hess = (A * (p * (1 - p))[:, None]).T @ A / len(t)
    return loss, grad, hess, float(np.mean((s > 0) == (t > 0)))


def model_for(datas: Sequence[ClientData], weights: Array, x0: Array | None = None) -> Array:
    """argmin_x sum_i weights_i L_i(x) + LAM/2 ||x||^2, by Newton's method (strictly convex)."""
    x = np.zeros(FEATURES + 1) if x0 is None else x0.copy()
    for _ in range(100):
        grad, hess = LAM * x, LAM * np.eye(FEATURES + 1)
        for w, data in zip(weights, datas, strict=True):
            _, g, h, _ = _logistic(data, x)
            grad, hess = grad + w * g, hess + w * h
        step = np.asarray(np.linalg.solve(hess, grad), dtype=np.float64)
        x = x - step
        if norm(step) <= 1e-15 * max(1.0, norm(x)):
            break
    return x


def central_saddle(datas: Sequence[ClientData]) -> tuple[Array, float]:
    """The agnostic saddle point (x*, lambda*) via the dual, and its projected residual."""
    n = len(datas)
    simplex = Simplex(n)
    weights = np.full(n, 1.0 / n)
    x = model_for(datas, weights)
    step = 1.0
    for _ in range(200000):
        losses = np.array([_logistic(d, x)[0] for d in datas])
        ascent = losses - NU * (weights - 1.0 / n)  # grad phi(lambda) (Danskin)
        moved = simplex.project(weights + step * ascent)
        if norm(moved - weights) <= 1e-16:
            break
        x_new = model_for(datas, moved, x)
        losses_new = np.array([_logistic(d, x_new)[0] for d in datas])
        ascent_new = losses_new - NU * (moved - 1.0 / n)
        # keep the step below 1 / (local Lipschitz constant of grad phi)
        if step * norm(ascent_new - ascent) > 0.9 * norm(moved - weights):
            step /= 2
            continue
        weights, x = moved, x_new
        step *= 1.1
    z = np.concatenate([x, weights])
    return z, federation_residual(datas, z)


def federation_residual(datas: Sequence[ClientData], z: Array) -> float:
    """||z - P(z - G(z))|| with G the federation's, from the problem's own client oracles."""
    problem = AgnosticLogistic(AgnosticSpec(num_clients=len(datas), features=FEATURES, lam=LAM, nu=NU))
    g = np.mean(
        [problem.gradient(d, z, client=client_context(i, len(datas), d.samples)) for i, d in enumerate(datas)], axis=0
    )
    projected = z.copy()
    projected[FEATURES + 1 :] = Simplex(len(datas)).project(z[FEATURES + 1 :] - g[FEATURES + 1 :])
    projected[: FEATURES + 1] = z[: FEATURES + 1] - g[: FEATURES + 1]
    return norm(z - projected)


def per_client(datas: Sequence[ClientData], x: Array) -> tuple[Array, Array]:
    """Each client's held-out loss and accuracy (clients without held-out rows: NaN)."""
    losses, accuracies = [], []
    for data in datas:
        if not data.heldout:
            losses.append(math.nan)
            accuracies.append(math.nan)
            continue
        loss, _, _, accuracy = _logistic(data, x, test=True)
        losses.append(loss)
        accuracies.append(accuracy)
    return np.array(losses), np.array(accuracies)


# -- the experiment -------------------------------------------------------------------------


@dataclass
class SeedResult:
    seed: int
    z_star_residual: float
    uniform: tuple[Array, Array]  # per-client held-out (loss, accuracy)
    agnostic: tuple[Array, Array]
    training: tuple[float, float]  # the worst client's training loss, uniform and agnostic
    weights: Array  # lambda*
    distances: dict[str, float]  # ||z - z*|| of each algorithm's final iterate
    curves: dict[str, list[tuple[int, float]]]  # (rounds, ||z - z*||)
    hashes: dict[str, str]
    grpc_same: bool | None = None


# api.run's signature, passed in by the command line (experiments never import fedsaddle's front end)
Runner = Callable[..., Any]


def run_seed(run: Runner, seed: int, rounds: int, folder: Path, grpc: bool) -> SeedResult:
    split("breast_cancer", CLIENTS, "label-skew", seed, folder / "data")
    pattern = str(folder / "data" / "client-{i:03d}.npz")
    datas = [read_client_data(pattern.format(i=i)) for i in range(CLIENTS)]
    uniform = model_for(datas, np.full(CLIENTS, 1.0 / CLIENTS))
    z_star, residual = central_saddle(datas)
    report = run(config(seed, rounds), data=pattern, out=folder / "runs", reference=z_star)
    distances = {r.name: r.dist_z for r in report.results}
    curves = {r.name: [(int(rec["rounds"]), float(rec["dist_z"])) for rec in r.records] for r in report.results}
    hashes = {r.name: r.z_sha256 for r in report.results}
    same = None
    if grpc:
        remote = run(config(seed, rounds), data=pattern, out=folder / "grpc", transport="grpc", reference=z_star)
        same = [r.z_sha256 for r in remote.results] == list(hashes.values()) and all(
            a.traffic["algorithm"]["floats_up"] == b.traffic["algorithm"]["floats_up"]
            for a, b in zip(report.results, remote.results, strict=True)
        )
    return SeedResult(
        seed,
        residual,
        per_client(datas, uniform),
        per_client(datas, z_star[: FEATURES + 1]),
        (
            max(_logistic(d, uniform)[0] for d in datas),
            max(_logistic(d, z_star[: FEATURES + 1])[0] for d in datas),
        ),
        z_star[FEATURES + 1 :],
        distances,
        curves,
        hashes,
        same,
    )


def run_agnostic(
    run: Runner,
    out: Path,
    command: str,
    seeds: Sequence[int],
    rounds: int,
    grpc: bool,
    progress: Callable[[int], None],
) -> list[SeedResult]:
    """Every seed, in-process (and over gRPC with `grpc`), with `run` = fedsaddle.api.run."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for done, seed in enumerate(seeds, start=1):
        with tempfile.TemporaryDirectory() as folder:
            results.append(run_seed(run, seed, rounds, Path(folder), grpc))
        progress(done)
    write_report(out, command, results, rounds)
    return results


def _worst(values: Array, largest: bool) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max() if largest else finite.min())


def write_report(out: Path, command: str, results: Sequence[SeedResult], rounds: int) -> None:
    rows = []
    for r in results:
        cells = [
            f"{r.training[0]:.4f}",
            f"{r.training[1]:.4f}",
            f"{_worst(r.uniform[0], True):.4f}",
            f"{_worst(r.agnostic[0], True):.4f}",
            f"{_worst(r.uniform[1], False):.3f}",
            f"{_worst(r.agnostic[1], False):.3f}",
            f"{np.nanmean(r.uniform[1]):.3f}",
            f"{np.nanmean(r.agnostic[1]):.3f}",
            f"{r.weights.max():.3f}",
            fmt(r.z_star_residual),
        ]
        rows.append((str(r.seed), cells))
    table = markdown(
        f"Worst client, uniform weights vs agnostic ({len(results)} seeds; held-out rows of each client)",
        "seed",
        [
            "worst training loss, uniform",
            "worst training loss, agnostic",
            "worst test loss, uniform",
            "worst test loss, agnostic",
            "worst accuracy, uniform",
            "worst accuracy, agnostic",
            "mean accuracy, uniform",
            "mean accuracy, agnostic",
            "max lambda*_i",
            "z* residual",
        ],
        rows,
    )
    distance_rows = []
    for spec in ALGORITHMS:
        name = spec["name"]
        values = np.array([r.distances[name] for r in results])
        distance_rows.append((NAMES[name], [fmt(float(np.median(values))), fmt(float(values.max()))]))
    distances = markdown(
        f"Distance of each algorithm's final iterate to the central saddle point, after {rounds} rounds",
        "algorithm",
        ["median ||z - z*||", "max ||z - z*||"],
        distance_rows,
    )
    grpc = [r.grpc_same for r in results if r.grpc_same is not None]
    grpc_line = (
        f"gRPC (10 client processes) vs in-process: {sum(grpc)}/{len(grpc)} seeds identical bit for bit "
        "(every algorithm's z_sha256 and counts)."
        if grpc
        else "Not run over gRPC this time (`--transport grpc` runs every seed over 10 client processes too)."
    )
    (out / "agnostic.md").write_text(f"<!-- written by `{command}` -->\n\n{table}\n\n{distances}\n\n{grpc_line}\n")
    _figure(out / "figure_agnostic.png", results, rounds)


def _figure(path: Path, results: Sequence[SeedResult], rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    seeds = [r.seed for r in results]
    left.plot(seeds, [_worst(r.uniform[0], True) for r in results], "o-", label="uniform weights")
    left.plot(seeds, [_worst(r.agnostic[0], True) for r in results], "s-", label="agnostic (lambda*)")
    left.set_xlabel("seed (of the split and the run)")
    left.set_ylabel("worst client's held-out logistic loss")
    left.set_title("the worst client, breast_cancer over 10 label-skewed clients")
    left.grid(True, alpha=0.3)
    left.legend()
    for spec in ALGORITHMS:
        name = spec["name"]
        grid = sorted({point[0] for r in results for point in r.curves[name]})
        median = []
        for x in grid:
            values = [dict(r.curves[name]).get(x) for r in results]
            found = [v for v in values if v is not None]
            median.append(float(np.median(found)) if found else math.nan)
        right.semilogy(grid, np.maximum(median, 1e-17), label=NAMES[name])
    right.set_xlabel("communication rounds (every exchange counted)")
    right.set_ylabel(r"median $\|z - z^\star\|$ over seeds")
    right.set_title(f"distance to the central saddle point ({rounds} rounds)")
    right.grid(True, which="both", alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
