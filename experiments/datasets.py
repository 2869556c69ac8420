"""Split a real dataset into client files: `fedsaddle data split`.

A dataset is a table of your own (CSV or Parquet: experiments/tables.py reads it
and names its columns' roles), images of your own (an array file or a folder of
class subfolders: experiments/images.py; each image a row, standardized per
channel), or one of those scikit-learn bundles (no download, so they work
offline):

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
client's held-out rows follow the same proportions as its training rows. Or
`by-column`, the natural sites: every distinct value of a column (a hospital, a
region) is one client, in sorted order, and holds out `test_fraction` of its
own rows; a numeric column may be cut into bins first (`binned`: edges or
quantiles, one client per bin, in increasing order), and a bundled dataset's own
feature column may be the site column (`by_dataset_column`). The site column is
never a feature.
Features are standardized with the training rows' mean and deviation (the one
preprocessing step that sees all training rows: it stands for what a
consortium agrees on before federating).

Writes client-000.npz ... (arrays X, y, [group], X_test, y_test, [group_test]:
see common/problems/data.py), test.npz (all held-out rows, for reports: arrays
X_test, y_test, [group_test], so that no client takes it for its own data) and
summary.json (each client's share, and the public statistics a problem's spec
needs: features, positive_rate, group_rate, computed by the problems themselves:
DataProblem.statistics).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, DataProblem, problem_class
from fedsaddle.common.problems.data import deal_by_class
from fedsaddle.experiments.images import ImageError, binary, load_images
from fedsaddle.experiments.tables import TableSpec, read_columns, table_rows

DATASETS = ("diabetes", "diabetes_fair", "breast_cancer")
PARTITIONS = ("iid", "label-skew", "by-column")
DATA_PROBLEMS = ("linear_regression", "auc", "fair_logistic")  # the built-in problems on real data


@dataclass(frozen=True)
class Table:
    X: Array
    y: Array
    group: Array | None
    classes: Array  # the class of each row, for label skew (labels, or target quartiles)
    task: str  # "regression" or "classification"
    feature_names: tuple[str, ...]
    name: str = ""  # a bundled dataset's name, or the file's path
    sites: tuple[str, ...] | None = None  # each row's site (the by-column partition)
    codes: dict[str, dict[str, int]] | None = None  # a file's target and group values, as written (0 and 1)
    skipped: tuple[str, ...] = ()  # a file's columns left out as not numeric
    site_order: tuple[str, ...] | None = None  # the sites' client order, when not their sorted order (bins)
    image_shape: tuple[int, int, int] | None = None  # images: (C, H, W) of each row (experiments/images.py)
    class_names: tuple[str, ...] | None = None  # images of more than two classes: each class index's name


def load_image_table(path: str | Path, labels: str | Path | None = None, positive: str | None = None) -> Table:
    """Images (an array file or a folder of class subfolders, experiments/images.py) as a table: a row per
    image, flattened; a binary task with `positive` (that class against the rest), else one of K classes."""
    images = load_images(path, labels)
    if positive is not None:
        y, codes = binary(images, positive)
        classes = y.astype(int)
        task, names = "classification", None
    else:
        y, classes, codes = images.labels.astype(np.float64), images.labels, {}
        task = "classification" if len(images.names) == 2 else "multiclass"
        names = images.names
        if len(images.names) == 2:
            codes = {name: code for code, name in enumerate(images.names)}
    if len(images.names) < 2:
        raise ImageError(f"{images.source}: one class only ({images.names[0]!r}); a split needs two or more")
    features = tuple(f"pixel_{i}" for i in range(images.rows.shape[1]))
    return Table(
        images.rows,
        y,
        None,
        classes,
        task,
        features,
        images.source,
        codes={"target": codes} if codes else None,
        image_shape=images.shape,
        class_names=names if task == "multiclass" else None,
    )


def load_table(path: str | Path, spec: TableSpec) -> Table:
    """A CSV or Parquet file's rows, with the columns' roles `spec` gives."""
    rows = table_rows(read_columns(path), spec)
    y = rows["y"]
    if rows["task"] == "classification":
        classes = y.astype(int)
    else:
        classes = np.searchsorted(np.quantile(y, [0.25, 0.5, 0.75]), y)
    codes = {k: v for k, v in (("target", rows["labels"]), ("group", rows["groups"])) if v is not None}
    sites = tuple(rows["sites"]) if rows["sites"] is not None else None
    return Table(
        rows["X"],
        y,
        rows["group"],
        classes,
        rows["task"],
        rows["feature_names"],
        str(path),
        sites,
        codes,
        tuple(rows["skipped"]),
    )


def load_dataset(name: str) -> Table:
    try:
        from sklearn import datasets
    except ImportError:
        raise RuntimeError("`fedsaddle data split` needs scikit-learn: pip install 'fedsaddle[data]'") from None
    if name == "diabetes":
        raw = datasets.load_diabetes(scaled=False)
        y = raw.target.astype(float)
        quartiles = np.quantile(y, [0.25, 0.5, 0.75])
        return Table(raw.data, y, None, np.searchsorted(quartiles, y), "regression", tuple(raw.feature_names), name)
    if name == "diabetes_fair":
        raw = datasets.load_diabetes(scaled=False)
        sex = raw.feature_names.index("sex")
        keep = [i for i in range(raw.data.shape[1]) if i != sex]
        group = (raw.data[:, sex] == raw.data[:, sex].max()).astype(float)
        y = (raw.target > np.median(raw.target)).astype(float)
        names = tuple(raw.feature_names[i] for i in keep)
        return Table(raw.data[:, keep], y, group, y.astype(int), "classification", names, name)
    if name == "breast_cancer":
        raw = datasets.load_breast_cancer()
        y = raw.target.astype(float)
        return Table(raw.data, y, None, raw.target, "classification", tuple(raw.feature_names), name)
    raise ValueError(f"unknown dataset {name!r}; choose from {list(DATASETS)}")


def by_dataset_column(table: Table, column: str) -> Table:
    """A bundled dataset with one of its own feature columns as the by-column partition's site column:
    the column (as the dataset holds it, before standardizing) names each row's site and leaves the
    features, as a table's --by column does."""
    if column not in table.feature_names:
        raise ValueError(f"{table.name} has no feature column {column!r}; its columns are {list(table.feature_names)}")
    at = table.feature_names.index(column)
    keep = [i for i in range(len(table.feature_names)) if i != at]
    sites = tuple(f"{v:g}" for v in table.X[:, at])
    order = tuple(f"{v:g}" for v in np.unique(table.X[:, at]))  # increasing values, not text order
    names = tuple(table.feature_names[i] for i in keep)
    return replace(table, X=table.X[:, keep], feature_names=names, sites=sites, site_order=order)


def binned(table: Table, column: str, edges: Sequence[float] | None = None, quantiles: int | None = None) -> Table:
    """The table with its numeric site column cut into bins, one client per bin, in increasing order:
    `edges` e_1 < ... < e_k make k + 1 bins (-inf, e_1), [e_1, e_2), ..., [e_k, inf); `quantiles` q makes
    q bins of about equal row counts (the edges are the column's q-quantiles). ValueError naming the
    column when a value is not a number, the edges do not increase, or a bin holds no row (a client
    with no data)."""
    assert table.sites is not None
    if (edges is None) == (quantiles is None):
        raise ValueError("bins need either edges or a number of quantiles")
    try:
        values = np.array([float(v) for v in table.sites])
    except ValueError:
        bad = next(v for v in table.sites if not _is_number(v))
        raise ValueError(f"column {column!r} must be numeric to be cut into bins; it holds {bad[:40]!r}") from None
    if not np.isfinite(values).all():
        raise ValueError(f"column {column!r} must hold finite numbers to be cut into bins")
    if quantiles is not None:
        if quantiles < 2:
            raise ValueError(f"--quantiles must be at least 2 (one bin is one client: use iid), got {quantiles}")
        cuts = np.quantile(values, np.linspace(0, 1, quantiles + 1)[1:-1])
        if np.any(np.diff(cuts) <= 0):
            raise ValueError(
                f"column {column!r} has too few distinct values for {quantiles} quantile bins (tied edges "
                f"{', '.join(f'{c:g}' for c in cuts)}): some bin would leave a client empty; give fewer "
                "quantiles or --bins edges"
            )
    else:
        assert edges is not None
        cuts = np.asarray(edges, dtype=float)
        if cuts.size == 0 or np.any(np.diff(cuts) <= 0):
            raise ValueError(f"bin edges must be increasing numbers, got {', '.join(f'{c:g}' for c in cuts)}")
    labels = _bin_labels(column, cuts)
    which = np.searchsorted(cuts, values, side="right")
    counts = np.bincount(which, minlength=len(labels))
    for label, count in zip(labels, counts, strict=True):
        if count == 0:
            raise ValueError(
                f"bin {label!r} of column {column!r} holds no rows, so its client would have no data "
                f"(the column runs from {values.min():g} to {values.max():g}); choose other edges"
            )
    return replace(table, sites=tuple(labels[i] for i in which), site_order=tuple(labels))


def _bin_labels(column: str, cuts: Array) -> list[str]:
    inner = [f"{low:g} <= {column} < {high:g}" for low, high in itertools.pairwise(cuts)]
    return [f"{column} < {cuts[0]:g}", *inner, f"{column} >= {cuts[-1]:g}"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass
class ClientShare:
    client: int
    rows: int
    heldout: int
    label_mean: float  # the fraction of positive labels (classification) or the mean target
    group_rate: float | None
    site: str | None = None  # its value of the by-column partition's column
    class_counts: list[int] | None = None  # images of more than two classes: its rows of each class


def split(
    dataset: str | Table,
    clients: int | None,
    partition: str,
    seed: int,
    out: Path,
    test_fraction: float = 0.2,
    alpha: float = 0.5,
    min_rows: int = 5,
) -> dict[str, Any]:
    """Write the client files; returns the summary (also written to summary.json). `dataset`: a bundled
    name or a Table (load_table); `clients`: None with `by-column` (one client per site)."""
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; choose from {list(PARTITIONS)}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    table = load_dataset(dataset) if isinstance(dataset, str) else dataset
    rng = np.random.default_rng(seed)
    n_rows = len(table.y)
    classes = np.asarray(table.classes, dtype=int)
    site_names: list[str] | None = None
    if partition == "by-column":
        if table.sites is None:
            raise ValueError("the by-column partition needs a column whose values are the sites (--by COLUMN)")
        site_names = list(table.site_order) if table.site_order is not None else sorted(set(table.sites))
        if clients is not None and clients != len(site_names):
            raise ValueError(
                f"the site column has {len(site_names)} distinct values, so {len(site_names)} clients, "
                f"not {clients} (leave out --clients)"
            )
        clients = len(site_names)
        dealt_train, dealt_test = _by_site(table.sites, site_names, test_fraction, min_rows, rng)
        train = np.sort(np.concatenate(dealt_train))
        test = np.sort(np.concatenate(dealt_test))
    else:
        if clients is None:
            raise ValueError(f"the {partition} partition needs a number of clients")
        if clients * min_rows > n_rows * (1 - test_fraction):
            raise ValueError(
                f"{table.name} has {n_rows} rows: too few for {clients} clients of at least {min_rows} rows"
            )
        order = rng.permutation(n_rows)
        n_test = round(test_fraction * n_rows)
        test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
        n_classes = int(classes.max()) + 1
        for _ in range(1000):
            if partition == "iid":
                shares = np.full((n_classes, clients), 1 / clients)
            else:
                shares = rng.dirichlet(np.full(clients, alpha), size=n_classes)
            dealt_train = deal_by_class(train, classes, shares, rng)
            if min(len(d) for d in dealt_train) >= min_rows:
                break
        else:
            raise ValueError(f"no label-skew split with at least {min_rows} rows per client; raise --alpha")
        dealt_test = deal_by_class(test, classes, shares, rng)
    X = _standardized(table, train)
    y = table.y.copy()
    standardized = None
    if table.task == "regression":
        standardized = {"mean": float(y[train].mean()), "scale": float(y[train].std())}
        y = (y - standardized["mean"]) / standardized["scale"]
    out.mkdir(parents=True, exist_ok=True)
    shares_out = []
    written: list[ClientData] = []
    for client, (rows, held) in enumerate(zip(dealt_train, dealt_test, strict=True)):
        arrays: dict[str, Array] = {"X": X[rows], "y": y[rows], "X_test": X[held], "y_test": y[held]}
        if table.group is not None:
            arrays["group"], arrays["group_test"] = table.group[rows], table.group[held]
        path = out / f"client-{client:03d}.npz"
        np.savez(path, **arrays)  # type: ignore[arg-type]
        written.append(ClientData(str(path), arrays["X"], arrays["y"], arrays.get("group")))
        group_rate = None if table.group is None else float(table.group[rows].mean())
        site = None if site_names is None else site_names[client]
        # In the units the files hold: a regression target standardized, as written.
        counts = None
        if table.class_names is not None:
            counts = np.bincount(classes[rows], minlength=len(table.class_names)).tolist()
        share = ClientShare(client, len(rows), len(held), float(y[rows].mean()), group_rate, site, counts)
        shares_out.append(share)
    # Named as held-out rows, not X and y: a client given this file by mistake is refused (no array 'X'),
    # instead of training on rows that every client holds out.
    pooled: dict[str, Array] = {"X_test": X[test], "y_test": y[test]}
    if table.group is not None:
        pooled["group_test"] = table.group[test]
    np.savez(out / "test.npz", **pooled)  # type: ignore[arg-type]
    summary: dict[str, Any] = {
        "dataset": table.name,
        "task": table.task,
        # y as the files hold it is (y - mean) / scale, with the training rows' mean and deviation
        "target_standardized": standardized,
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
        "statistics": problem_statistics(written, table.task),
        "files": [f"client-{c:03d}.npz" for c in range(clients)],
        "shares": [asdict(s) for s in shares_out],
    }
    if table.codes:
        summary["codes"] = table.codes
    if table.skipped:
        summary["skipped_columns"] = list(table.skipped)
    if table.image_shape is not None:
        summary["image_shape"] = list(table.image_shape)
        summary["feature_names"] = []  # (pixel_0, ...: the shape says it)
    if table.class_names is not None:
        summary["classes"] = list(table.class_names)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _standardized(table: Table, train: NDArray[Any]) -> Array:
    """The features standardized with the training rows' mean and deviation: each column's, or, for images,
    each channel's over its pixels (a pixel that is the same in every image, a digit's border, is no
    feature of its own)."""
    if table.image_shape is None:
        mean, scale = table.X[train].mean(axis=0), table.X[train].std(axis=0)
        scale[scale == 0] = 1.0
        standardized: Array = (table.X - mean) / scale
        return standardized
    channels = table.image_shape[0]
    pixels = table.X.reshape(len(table.X), channels, -1)
    seen = pixels[train]
    mean = seen.mean(axis=(0, 2))[None, :, None]
    scale = seen.std(axis=(0, 2))[None, :, None]
    scale[scale == 0] = 1.0
    images: Array = ((pixels - mean) / scale).reshape(table.X.shape)
    return images


def _by_site(
    sites: Sequence[str], names: Sequence[str], test_fraction: float, min_rows: int, rng: np.random.Generator
) -> tuple[list[NDArray[Any]], list[NDArray[Any]]]:
    """Each site's rows, shuffled, cut into held-out (`test_fraction`) and training rows."""
    of_site = np.asarray(sites, dtype=object)
    train, test = [], []
    for name in names:
        members = rng.permutation(np.flatnonzero(of_site == name))
        n_test = round(test_fraction * len(members))
        if len(members) - n_test < min_rows:
            raise ValueError(
                f"site {name[:40]!r} has {len(members)} rows: fewer than {min_rows} training rows after holding "
                f"out {test_fraction:g} of them"
            )
        test.append(np.sort(members[:n_test]))
        train.append(np.sort(members[n_test:]))
    return train, test


def problem_statistics(datas: Sequence[ClientData], task: str) -> dict[str, dict[str, int | float]]:
    """The spec fields each built-in problem on real data takes from these clients' training rows."""
    found: dict[str, dict[str, int | float]] = {}
    if task == "multiclass":
        return found  # every built-in problem on real data takes two classes or a numeric target
    for name in DATA_PROBLEMS:
        if name != "linear_regression" and task != "classification":
            continue  # AUC and the fair problem need labels
        cls = problem_class(name)
        assert issubclass(cls, DataProblem)
        statistics = cls.statistics(datas)
        if name == "fair_logistic" and "group_rate" not in statistics:
            continue  # no group column
        found[name] = statistics
    return found


def describe(summary: dict[str, Any]) -> str:
    """The summary as a table a person reads; the public statistics at full precision (as they must be
    copied into the spec: a client compares them with its data)."""
    classification = summary["task"] == "classification"
    multiclass = summary["task"] == "multiclass"
    label = "positive" if classification else "classes" if multiclass else "mean y"
    sites = any(share.get("site") is not None for share in summary["shares"])
    lines = [
        f"{summary['dataset']}: {summary['training_rows']} training and {summary['heldout_rows']} held-out rows, "
        f"{summary['features']} features, {summary['clients']} clients, {summary['partition']}"
        + (f" (alpha {summary['alpha']:g})" if summary["alpha"] else ""),
    ]
    codes = summary.get("codes", {})
    for role, mapping in codes.items():
        lines.append(f"{role} values written as " + ", ".join(f"{value} -> {code}" for value, code in mapping.items()))
    standardized = summary.get("target_standardized")
    if standardized:  # the shares' mean y are in the files' units, not the table's
        lines.append(
            f"y is standardized in the files, as shown below: (y - {standardized['mean']:.6g}) / "
            f"{standardized['scale']:.6g} (the training rows' mean and deviation)"
        )
    if summary.get("image_shape"):
        channels, height, width = summary["image_shape"]
        lines.append(
            f"images of {channels} x {height} x {width} (C x H x W), each a row of {summary['features']} pixels"
        )
    if multiclass:
        lines.append(
            f"{len(summary['classes'])} classes: {summary['classes']} (labels 0..{len(summary['classes']) - 1})"
        )
    if summary.get("skipped_columns"):
        lines.append(f"left out (not numeric; name them with --features to see why): {summary['skipped_columns']}")
    lines.append(
        f"{'client':>6} {'rows':>6} {'held-out':>8} {label:>12}"
        + (f" {'group 1':>8}" if summary["group_rate"] is not None else "")
        + ("  site" if sites else "")
    )
    for share in summary["shares"]:
        row = f"{share['client']:>6} {share['rows']:>6} {share['heldout']:>8} {share['label_mean']:>12.3f}"
        if multiclass:  # how many of the classes it holds, and its rows of each
            held = sum(1 for c in share["class_counts"] if c)
            row = f"{share['client']:>6} {share['rows']:>6} {share['heldout']:>8} {held:>12}  {share['class_counts']}"
        if share["group_rate"] is not None:
            row += f" {share['group_rate']:>8.3f}"
        if sites:
            row += f"  {share['site']}"
        lines.append(row)
    if multiclass:
        lines.append(
            "no built-in problem takes more than two classes: --positive CLASS makes one class against the rest"
        )
    if summary["statistics"]:
        lines.append("public statistics for each problem's spec (training rows of all clients):")
    for name, statistics in summary["statistics"].items():
        fields = ", ".join(f"{field}: {value!r}" for field, value in statistics.items())
        lines.append(f"  {name}: {{name: {name}, num_clients: {summary['clients']}, {fields}}}")
    return "\n".join(lines)


def problem_entry(summary: dict[str, Any], problem: str | None) -> dict[str, Any]:
    """The config's `problem` for this split: `problem` (default: auc for classes, fair_logistic with a group,
    linear_regression for a numeric target) with the split's client count and statistics."""
    choices = summary["statistics"]
    if problem is None:
        problem = "linear_regression"
        if summary["task"] == "classification":
            problem = "fair_logistic" if "fair_logistic" in choices else "auc"
    if problem not in choices:
        why = "it needs two classes" if problem in DATA_PROBLEMS else "it is not a built-in problem on real data"
        raise ValueError(f"problem {problem!r} does not fit this split ({why}); it fits {sorted(choices)}")
    return {"name": problem, "num_clients": summary["clients"], **choices[problem]}


STARTER = {
    "weighting": "samples",
    "evaluate_every": 50,
    "rounds": 1000,
    "sync": {"kind": "fixed", "tau": 10},
    "algorithms": [
        {"name": "scaffold_s", "gamma_local": 0.04},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.04},
    ],
}


def write_config(path: Path, entry: dict[str, Any], name: str) -> str:
    """Put `entry` into the config at `path`: a new file starts from STARTER; an existing one keeps every
    other field (and its problem's other fields, such as `lam`, when it names the same problem). The result
    is validated before it is written. Returns what was done, for a person."""
    import yaml

    from fedsaddle.server.config import parse_config

    existed = path.exists()
    if existed:
        try:
            config = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read the config {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"the config {path} is not a mapping of fields")
        old = config.get("problem")
        kept = {k: v for k, v in old.items() if k not in entry} if isinstance(old, dict) else {}
        config["problem"] = {**entry, **kept} if isinstance(old, dict) and old.get("name") == entry["name"] else entry
    else:
        config = {"name": name, "problem": entry, **STARTER}
    parse_config(config, source=str(path))  # ConfigError, naming the field, before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=120))
    return f"{'updated the problem in' if existed else 'wrote'} {path}"
