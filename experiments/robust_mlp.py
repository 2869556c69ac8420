"""Group-robust training of an MLP across 10 clients: does the worst client do better than under FedAvg?

    fedsaddle experiment robust-mlp [--seeds 10] [--rounds 30] [--jobs N] [--out DIR]

The problem `AgnosticMlp` below is a PyTorch problem (common/problems/pytorch.py) written for this
experiment: scikit-learn's handwritten digits, all ten classes, dealt to 10 clients with Dirichlet(0.5)
label skew (the same split as `deep_auc`'s, by `split_seed`), an MLP 64 -> hidden -> 10 as the min player
and the clients' weights lambda on the simplex as the max player (agnostic federated learning, Mohri et al.
2019; DRFA, Deng et al. 2020):

    min_w max_{lambda in simplex}  sum_i lambda_i L_i(w) + lam/2 ||w||^2 - nu/2 ||lambda - 1/n||^2,
    f_i(w, lambda) = n lambda_i L_i(w) + lam/2 ||w||^2 - nu/2 ||lambda - 1/n||^2,

L_i the cross-entropy on client i's rows. `uniform: true` fixes lambda = 1/n (the same network trained by
plain federated averaging). Seed k splits with `split_seed` k and starts from the seed-k network; each
seed runs FedAvg-S on the uniform problem and Local SGDA+ on the agnostic one, minibatches of 16, tau = 5.
Each client sets a fifth of its training images aside for validation; each training's steps are chosen on its
grid (`RUNS`) by the mean over the first three seeds of the worst client's validation accuracy, and every
client's held-out accuracy is read at the chosen steps.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import NDArray
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientContext, ClientData, SyntheticProblem
from fedsaddle.common.problems.data import deal_by_class
from fedsaddle.common.problems.deep_auc import _digits
from fedsaddle.common.problems.domains import Block, Free, Simplex
from fedsaddle.common.problems.pytorch import Batch, Player, TorchProblem, TorchShards, TorchSpec
from fedsaddle.common.problems.shards import Shards

from .processes import each
from .report import markdown

CLIENTS = 10
PLUGIN = "fedsaddle.experiments.robust_mlp:AgnosticMlp"


class AgnosticMlpSpec(TorchSpec):
    name: Literal["agnostic_mlp"] = "agnostic_mlp"
    hidden: int = Field(32, ge=1, le=4096, description="the hidden layer's width")
    test_fraction: float = Field(0.3, gt=0, lt=1, description="the share of images held out")
    skew_alpha: float = Field(0.5, gt=0, description="Dirichlet concentration of the label skew")
    split_seed: int = Field(0, ge=0, lt=2**63, description="seeds the split")
    lam: float = Field(1e-4, ge=0, description="L2 weight on the network")
    nu: float = Field(0.01, ge=0, description="pull of lambda toward uniform weights")
    uniform: bool = Field(False, description="lambda fixed at 1/n: plain federated training")
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="each client's share of its training images set aside for validation"
    )


def split_classes(spec: AgnosticMlpSpec) -> list[ClientData]:
    """Every client's images with their digit as the label (0..9), dealt as deep_auc deals them, less the
    client's validation images (`validation_fraction`; none by default)."""
    images, digits = _digits()
    labels = digits.astype(np.float64)
    return [
        ClientData(f"agnostic_mlp:client-{i}", images[tr], labels[tr], None, images[te], labels[te])
        for i, (tr, _, te) in enumerate(_dealt(spec))
    ]


def validation_sets(spec: AgnosticMlpSpec) -> list[tuple[Array, Array]]:
    """Each client's validation images and labels (empty without `validation_fraction`)."""
    images, digits = _digits()
    return [(images[va], digits[va].astype(np.float64)) for _, va, _ in _dealt(spec)]


def _dealt(spec: AgnosticMlpSpec) -> list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]]:
    """Each client's training, validation and test rows. The validation rows are drawn from the client's dealt
    training rows by a stream of their own, so the deal itself is the one without them."""
    _, digits = _digits()
    rng = np.random.default_rng([spec.split_seed, 1])
    order = rng.permutation(len(digits))
    n_test = round(spec.test_fraction * len(digits))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    least = max(2, spec.batch_size or 0)

    def held_out(rows: NDArray[np.int64]) -> int:  # how many of a client's dealt rows go to validation
        return round(spec.validation_fraction * len(rows))

    for _ in range(1000):
        shares = rng.dirichlet(np.full(spec.num_clients, spec.skew_alpha), size=10)
        dealt_train = deal_by_class(train, digits, shares, rng)
        if min(len(rows) - held_out(rows) for rows in dealt_train) >= least:
            break
    else:
        raise ValueError(f"problem agnostic_mlp: no label-skew split gives every client {least} training rows")
    dealt_test = deal_by_class(test, digits, shares, rng)
    found = []
    for i, (train_rows, test_rows) in enumerate(zip(dealt_train, dealt_test, strict=True)):
        picked = np.random.default_rng([spec.split_seed, 2, i]).permutation(len(train_rows))
        held = np.sort(train_rows[picked[: held_out(train_rows)]])
        found.append((np.setdiff1d(train_rows, held), held, test_rows))
    return found


class AgnosticMlp(TorchProblem, SyntheticProblem):
    """An MLP over clients weighted by an adversary on the simplex (module docstring)."""

    Spec = AgnosticMlpSpec
    spec: AgnosticMlpSpec
    synthetic = True
    metric_names = ("test_accuracy",)

    def players(self) -> tuple[Player, Player]:
        mlp = torch.nn.Sequential(
            torch.nn.Linear(64, self.spec.hidden), torch.nn.ReLU(), torch.nn.Linear(self.spec.hidden, 10)
        )
        return mlp, [torch.full((self.spec.num_clients,), 1.0 / self.spec.num_clients)]

    def loss(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> torch.Tensor:
        (weights,) = y
        n = self.spec.num_clients
        value = torch.nn.functional.cross_entropy(x(batch.inputs), batch.targets.long())
        if not self.spec.uniform:
            value = n * weights[client.index] * value - self.spec.nu / 2 * torch.sum((weights - 1.0 / n) ** 2)
        if self.spec.lam:
            value = value + self.spec.lam / 2 * sum(torch.sum(w**2) for w in x.parameters())
        result: torch.Tensor = value.reshape(())
        return result

    def test_metrics(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> Sequence[float]:
        return (float((x(batch.inputs).argmax(1) == batch.targets.long()).double().mean()),)

    def domains(self) -> Sequence[Block]:
        dim_x, dim_y = self.dims()
        return [Free(dim_x), Simplex(dim_y)]

    def shards(self, seed: int, indices: Sequence[int]) -> Shards:
        datas = split_classes(self.spec)
        return TorchShards(self, [datas[i] for i in indices], indices)

    def client_accuracies(self, z: Array, on: Literal["test", "validation"] = "test") -> Array:
        """Each client's accuracy at z on its held-out (test) images, or on its validation images."""
        mlp, _ = self.unflatten(z)
        if on == "test":
            sets: Sequence[tuple[Array | None, Array | None]] = [(d.X_test, d.y_test) for d in split_classes(self.spec)]
        else:
            held = validation_sets(self.spec)
            if not any(len(y) for _, y in held):
                raise ValueError("problem agnostic_mlp: validation_fraction is 0, so there are no validation images")
            sets = held
        found = []
        with torch.no_grad():
            for X, y in sets:
                assert X is not None and y is not None
                predicted = mlp(torch.as_tensor(X, dtype=torch.float32)).argmax(1).numpy()
                found.append(float(np.mean(predicted == y)) if len(y) else math.nan)
        return np.array(found)


# -- the experiment ----------------------------------------------------------------------------------------

# Each training's algorithm and its grid of steps (every combination is a point). A client's ascent moves only
# its own weight: at eta_y = 0.01 every client's local lambda ran to its own vertex of the simplex within a round
# (their mean stayed uniform) and scaled its descent step by n, so the grid of eta_y stays below that.
RUNS: dict[str, tuple[dict[str, Any], str, dict[str, tuple[float, ...]], dict[str, Any]]] = {
    "uniform": ({"uniform": True}, "fedavg_s", {"gamma_local": (0.1, 0.3, 1.0, 3.0)}, {"decay": "constant"}),
    "agnostic": (
        {"uniform": False},
        "local_sgda_plus",
        {"eta_x": (0.1, 0.3, 0.5, 1.0), "eta_y": (0.0002, 0.0005, 0.001, 0.002)},
        {},
    ),
}
BATCH, TAU = 16, 5
VALIDATION = 0.2  # each client's share of its training images on which the steps are chosen
TUNING_SEEDS = 3  # the first seeds, whose validation images choose each training's steps

Steps = tuple[tuple[str, float], ...]  # (field, value) pairs, in the grid's order


def grid(kind: str) -> list[Steps]:
    """Every point of the training's grid."""
    fields = RUNS[kind][2]
    points: list[Steps] = [()]
    for name, values in fields.items():
        points = [(*point, (name, value)) for point in points for value in values]
    return points


def config(kind: str, steps: Steps, seed: int, rounds: int) -> dict[str, Any]:
    fields, algorithm, _, extra = RUNS[kind]
    return {
        "name": f"robust-mlp-{kind}-{'-'.join(f'{v:g}' for _, v in steps)}-seed{seed}",
        "seed": seed,
        "problem": {
            "name": "agnostic_mlp",
            "plugin": PLUGIN,
            "num_clients": CLIENTS,
            "split_seed": seed,
            "batch_size": BATCH,
            "validation_fraction": VALIDATION,
            **fields,
        },
        "init": "problem",
        "rounds": rounds,
        "sync": {"kind": "fixed", "tau": TAU},
        "output": {"plot": False},
        "algorithms": [{"name": algorithm, **dict(steps), **extra}],
    }


@dataclass
class Outcome:
    kind: str
    steps: Steps
    seed: int
    accuracies: Array  # per client, held-out (test)
    validation: Array  # per client, on its validation images
    weights: Array  # the final lambda (uniform: 1/n)
    wall_s: float
    z_sha256: str


Runner = Callable[..., Any]


def run_one(run: Runner, kind: str, steps: Steps, seed: int, rounds: int, folder: Path) -> Outcome:
    setup = config(kind, steps, seed, rounds)
    problem = AgnosticMlp(AgnosticMlpSpec(**{k: v for k, v in setup["problem"].items() if k != "plugin"}))
    started = time.perf_counter()
    (result,) = run(setup, out=folder).results
    z = result.final_z
    ok = result.status == "ok" and bool(np.isfinite(z).all())
    nan = np.full(CLIENTS, math.nan)
    test = problem.client_accuracies(z) if ok else nan
    validation = problem.client_accuracies(z, on="validation") if ok else nan
    took = time.perf_counter() - started
    return Outcome(kind, steps, seed, test, validation, z[-CLIENTS:].copy(), took, result.z_sha256)


def worst(accuracies: Array) -> float:
    """The worst client's accuracy (0 for a run that diverged)."""
    return 0.0 if np.isnan(accuracies).all() else float(np.nanmin(accuracies))


def choose(outcomes: Sequence[Outcome], kind: str, tuning: Sequence[int]) -> Steps:
    """The grid point with the best mean worst-client validation accuracy over the tuning seeds (the mean:
    a point at which one seed collapses is not chosen)."""

    def score(steps: Steps) -> float:
        found = [o for o in outcomes if o.kind == kind and o.steps == steps and o.seed in tuning]
        return float(np.mean([worst(o.validation) for o in found]))

    return max(grid(kind), key=score)


def run_robust_mlp(
    run: Runner,
    out: Path,
    command: str,
    seeds: Sequence[int],
    rounds: int,
    progress: Callable[[int, int], None],
    jobs: int = 1,
) -> list[Outcome]:
    """Every grid point on the tuning seeds, then the rest of the seeds at each training's chosen point."""
    out.mkdir(parents=True, exist_ok=True)
    tuning = list(seeds[:TUNING_SEEDS])
    rest = list(seeds[len(tuning) :])
    total = sum(len(grid(kind)) * len(tuning) + len(rest) for kind in RUNS)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedsaddle-robust-mlp-") as scratch:
        tune = [(kind, steps, seed) for kind in RUNS for steps in grid(kind) for seed in tuning]
        outcomes = _outcomes(run, tune, rounds, Path(scratch), jobs, lambda n: progress(n, total))
        chosen = [(kind, choose(outcomes, kind, tuning), seed) for kind in RUNS for seed in rest]
        outcomes += _outcomes(run, chosen, rounds, Path(scratch), jobs, lambda n: progress(len(tune) + n, total))
    write_report(out, command, outcomes, seeds, tuning, rounds, time.perf_counter() - started)
    return outcomes


def _outcomes(
    run: Runner,
    work: Sequence[tuple[str, Steps, int]],
    rounds: int,
    scratch: Path,
    jobs: int,
    progress: Callable[[int], None],
) -> list[Outcome]:
    """run_one for each (training, steps, seed) of `work`, in its order."""
    return each(run_one, [(run, kind, steps, seed, rounds, scratch) for kind, steps, seed in work], jobs, progress)


def _iqr(values: Sequence[float]) -> str:
    q1, median, q3 = np.nanpercentile(values, [25, 50, 75])
    return f"{median:.3f} [{q1:.3f}, {q3:.3f}]"


def _steps(steps: Steps) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in steps)


def write_report(
    out: Path,
    command: str,
    outcomes: Sequence[Outcome],
    seeds: Sequence[int],
    tuning: Sequence[int],
    rounds: int,
    took: float,
) -> None:
    chosen = {kind: choose(outcomes, kind, tuning) for kind in RUNS}
    by = {(o.kind, o.seed): o for o in outcomes if o.steps == chosen[o.kind]}
    summary = []
    for kind in RUNS:
        mine = [by[kind, s] for s in seeds]
        summary.append(
            (
                f"{kind}: {RUNS[kind][1]}, {_steps(chosen[kind])}",
                [
                    _iqr([worst(o.validation) for o in mine]),
                    _iqr([worst(o.accuracies) for o in mine]),
                    _iqr([float(np.nanmean(o.accuracies)) for o in mine]),
                    _iqr([float(o.weights.max()) for o in mine]),
                ],
            )
        )
    head = markdown(
        f"Accuracy per client, {len(seeds)} seeds (median [IQR]); {rounds} rounds, tau = {TAU}, minibatches of "
        f"{BATCH}; each training's steps chosen on its grid by the mean worst-client validation accuracy of "
        f"seed(s) {', '.join(map(str, tuning))}",
        "training (chosen steps)",
        ["worst client, validation", "worst client, held-out", "mean over clients, held-out", "largest lambda_i"],
        summary,
    )
    tuned = []
    for kind in RUNS:
        for steps in grid(kind):
            found = [o for o in outcomes if o.kind == kind and o.steps == steps and o.seed in tuning]
            scores = [worst(o.validation) for o in found]
            tuned.append((f"{kind}: {_steps(steps)}", [f"{np.mean(scores):.3f}", " ".join(f"{v:.3f}" for v in scores)]))
    tuning_table = markdown(
        f"Worst client's validation accuracy on seed(s) {', '.join(map(str, tuning))}, per grid point (the "
        "highest mean is chosen)",
        "training: steps",
        ["mean", "per seed"],
        tuned,
    )
    rows = []
    for s in seeds:
        for kind in RUNS:
            o = by[kind, s]
            rows.append((f"{s} {kind}", [f"{a:.3f}" for a in o.accuracies] + [f"{worst(o.accuracies):.3f}"]))
    per_client = markdown(
        "Every client's held-out accuracy at the chosen steps, per seed",
        "seed, training",
        [f"client {i}" for i in range(CLIENTS)] + ["worst"],
        rows,
    )
    wins = sum(worst(by["agnostic", s].accuracies) > worst(by["uniform", s].accuracies) for s in seeds)
    (out / "robust_mlp.md").write_text(
        f"<!-- written by `{command}` -->\n\n{head}\n\nThe agnostic model's worst client beats the uniform model's "
        f"on {wins} of {len(seeds)} seeds. The runs took {took:.0f} s.\n\n{per_client}\n\n{tuning_table}\n"
    )
    with (out / "runs.csv").open("w") as f:
        f.write(
            "training,steps,seed,"
            + ",".join(f"client_{i}" for i in range(CLIENTS))
            + ",worst_validation,wall_s,z_sha256\n"
        )
        for o in outcomes:
            f.write(
                f"{o.kind},{_steps(o.steps).replace(', ', ' ')},{o.seed},"
                + ",".join(f"{a:.6f}" for a in o.accuracies)
                + f",{worst(o.validation):.6f},{o.wall_s:.2f},{o.z_sha256}\n"
            )
    _figure(out / "figure_robust_mlp.png", by, seeds)


def _figure(path: Path, by: dict[tuple[str, int], Outcome], seeds: Sequence[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for kind, marker in (("uniform", "o"), ("agnostic", "s")):
        ax.plot(list(seeds), [worst(by[kind, s].accuracies) for s in seeds], marker + "-", label=kind)
    ax.set_xlabel("seed (of the split and the run)")
    ax.set_ylabel("worst client's held-out accuracy")
    ax.set_title("digits over 10 label-skewed clients, MLP")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
