"""Split a real dataset into client files: `fedsaddle data split`.

The datasets are those scikit-learn bundles (no download, so they work offline):

  diabetes        regression, 442 rows, 10 features (age, sex, bmi, bp, s1..s6);
                  y = disease progression after one year, standardized
  diabetes_fair   classification, the same rows: y = 1 if progression is above the
                  training median, else 0; 9 features (sex left out) and
                  group = sex (0 or 1), the sensitive attribute
  breast_cancer   classification, 569 rows, 30 features; y = 1 benign, 0 malignant

Rows are split first into training and held-out rows (`test_fraction`), then
dealt to the clients: `iid` (shuffled, equal shares) or `label-skew` (each
class's rows divided by Dirichlet(alpha) proportions, a new draw per class, the
usual non-IID benchmark; for regression the classes are target quartiles). Each
client's held-out rows follow the same proportions as its training rows.
Features are standardized with the training rows' mean and deviation (the one
preprocessing step that sees all training rows: it stands for what a
consortium agrees on before federating).

Writes client-000.npz ... (arrays X, y, [group], X_test, y_test, [group_test]:
see common/problems/data.py), test.npz (all held-out rows, for reports) and
summary.json (each client's share, and the public statistics a problem's spec
needs: features, positive_rate, group_rate).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common.numeric import Array

DATASETS = ("diabetes", "diabetes_fair", "breast_cancer")
PARTITIONS = ("iid", "label-skew")


@dataclass(frozen=True)
class Table:
    X: Array
    y: Array
    group: Array | None
    classes: Array  # the class of each row, for label skew (labels, or target quartiles)
    task: str  # "regression" or "classification"
    feature_names: tuple[str, ...]


def load_dataset(name: str) -> Table:
    try:
        from sklearn import datasets
    except ImportError:
        raise RuntimeError("`fedsaddle data split` needs scikit-learn: pip install 'fedsaddle[data]'") from None
    if name == "diabetes":
        raw = datasets.load_diabetes(scaled=False)
        y = raw.target.astype(float)
        quartiles = np.quantile(y, [0.25, 0.5, 0.75])
        return Table(raw.data, y, None, np.searchsorted(quartiles, y), "regression", tuple(raw.feature_names))
    if name == "diabetes_fair":
        raw = datasets.load_diabetes(scaled=False)
        sex = raw.feature_names.index("sex")
        keep = [i for i in range(raw.data.shape[1]) if i != sex]
        group = (raw.data[:, sex] == raw.data[:, sex].max()).astype(float)
        y = (raw.target > np.median(raw.target)).astype(float)
        names = tuple(raw.feature_names[i] for i in keep)
        return Table(raw.data[:, keep], y, group, y.astype(int), "classification", names)
    if name == "breast_cancer":
        raw = datasets.load_breast_cancer()
        y = raw.target.astype(float)
        return Table(raw.data, y, None, raw.target, "classification", tuple(raw.feature_names))
    raise ValueError(f"unknown dataset {name!r}; choose from {list(DATASETS)}")


@dataclass
class ClientShare:
    client: int
    rows: int
    heldout: int
    label_mean: float  # the fraction of positive labels (classification) or the mean target
    group_rate: float | None


def _deal(rows: NDArray[Any], classes: NDArray[Any], shares: Array, rng: np.random.Generator) -> list[NDArray[Any]]:
    """Deal rows to clients: for each class, its rows in the proportions `shares[class]` (clients x 1)."""
    dealt: list[list[int]] = [[] for _ in range(shares.shape[1])]
    for c, proportions in enumerate(shares):
        members = rng.permutation(rows[classes[rows] == c])
        cuts = (np.cumsum(proportions)[:-1] * len(members)).round().astype(int)
        for client, part in enumerate(np.split(members, cuts)):
            dealt[client].extend(part.tolist())
    return [np.array(sorted(d), dtype=int) for d in dealt]


def split(
    dataset: str,
    clients: int,
    partition: str,
    seed: int,
    out: Path,
    test_fraction: float = 0.2,
    alpha: float = 0.5,
    min_rows: int = 5,
) -> dict[str, Any]:
    """Write the client files; returns the summary (also written to summary.json)."""
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; choose from {list(PARTITIONS)}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    table = load_dataset(dataset)
    rng = np.random.default_rng(seed)
    n_rows = len(table.y)
    if clients * min_rows > n_rows * (1 - test_fraction):
        raise ValueError(f"{dataset} has {n_rows} rows: too few for {clients} clients of at least {min_rows} rows")
    order = rng.permutation(n_rows)
    n_test = round(test_fraction * n_rows)
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    classes = np.asarray(table.classes, dtype=int)
    n_classes = int(classes.max()) + 1
    for _ in range(1000):
        if partition == "iid":
            shares = np.full((n_classes, clients), 1 / clients)
        else:
            shares = rng.dirichlet(np.full(clients, alpha), size=n_classes)
        dealt_train = _deal(train, classes, shares, rng)
        if min(len(d) for d in dealt_train) >= min_rows:
            break
    else:
        raise ValueError(f"no label-skew split with at least {min_rows} rows per client; raise --alpha")
    dealt_test = _deal(test, classes, shares, rng)
    mean, scale = table.X[train].mean(axis=0), table.X[train].std(axis=0)
    scale[scale == 0] = 1.0
    X = (table.X - mean) / scale
    y = table.y.copy()
    if table.task == "regression":
        y = (y - y[train].mean()) / y[train].std()
    out.mkdir(parents=True, exist_ok=True)
    shares_out = []
    for client, (rows, held) in enumerate(zip(dealt_train, dealt_test, strict=True)):
        arrays: dict[str, Array] = {"X": X[rows], "y": y[rows], "X_test": X[held], "y_test": y[held]}
        if table.group is not None:
            arrays["group"], arrays["group_test"] = table.group[rows], table.group[held]
        np.savez(out / f"client-{client:03d}.npz", **arrays)  # type: ignore[arg-type]
        group_rate = None if table.group is None else float(table.group[rows].mean())
        shares_out.append(ClientShare(client, len(rows), len(held), float(table.y[rows].mean()), group_rate))
    pooled: dict[str, Array] = {"X": X[test], "y": y[test]}
    if table.group is not None:
        pooled["group"] = table.group[test]
    np.savez(out / "test.npz", **pooled)  # type: ignore[arg-type]
    summary: dict[str, Any] = {
        "dataset": dataset,
        "task": table.task,
        "partition": partition,
        "alpha": alpha if partition == "label-skew" else None,
        "seed": seed,
        "clients": clients,
        "features": int(X.shape[1]),
        "feature_names": list(table.feature_names),
        "training_rows": len(train),
        "heldout_rows": len(test),
        "positive_rate": float(table.y[train].mean()) if table.task == "classification" else None,
        "group_rate": None if table.group is None else float(table.group[train].mean()),
        "files": [f"client-{c:03d}.npz" for c in range(clients)],
        "shares": [asdict(s) for s in shares_out],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def describe(summary: dict[str, Any]) -> str:
    """The summary as a table a person reads."""
    classification = summary["task"] == "classification"
    label = "positive" if classification else "mean y"
    lines = [
        f"{summary['dataset']}: {summary['training_rows']} training and {summary['heldout_rows']} held-out rows, "
        f"{summary['features']} features, {summary['clients']} clients, {summary['partition']}"
        + (f" (alpha {summary['alpha']:g})" if summary["alpha"] else ""),
        f"{'client':>6} {'rows':>6} {'held-out':>8} {label:>9}" + (f" {'group 1':>8}" if summary["group_rate"] else ""),
    ]
    for share in summary["shares"]:
        row = f"{share['client']:>6} {share['rows']:>6} {share['heldout']:>8} {share['label_mean']:>9.3f}"
        if share["group_rate"] is not None:
            row += f" {share['group_rate']:>8.3f}"
        lines.append(row)
    public = {k: summary[k] for k in ("features", "positive_rate", "group_rate") if summary[k] is not None}
    lines.append("public statistics for the problem's spec: " + ", ".join(f"{k} = {v:.6g}" for k, v in public.items()))
    return "\n".join(lines)
