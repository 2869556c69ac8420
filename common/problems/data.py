"""One client's data file: how it is read and checked.

Two formats, each holding a client's training rows and, optionally, held-out rows
for evaluation:

* `.npz` (numpy): arrays `X` (rows x features), `y` (rows), optionally `group`
  (rows; a sensitive attribute, 0 or 1), and `X_test`, `y_test`, `group_test`
  for the held-out rows.
* `.csv`: a header line, then one row per sample. The column `y` is the target
  (or label); `group` is the optional sensitive attribute; `split` is optional,
  `train` (default) or `test`; every other column is a feature, in file order.

Every check names the file and the fault: a missing or unreadable file, a missing
array or column, text where numbers belong, a wrong shape, no rows, NaN or Inf.
Problems add their own checks (feature count, labels) in `DataProblem.check`.
"""

from __future__ import annotations

import csv
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common.numeric import Array


class DataError(ValueError):
    """A client's data file cannot be used; the message names the file and the fault."""


@dataclass(frozen=True)
class ClientData:
    """One client's data, as read from its file."""

    path: str
    X: Array  # (rows, features)
    y: Array  # (rows,)
    group: Array | None = None  # (rows,), a sensitive attribute
    X_test: Array | None = None  # held-out rows, for evaluation
    y_test: Array | None = None
    group_test: Array | None = None

    @property
    def samples(self) -> int:
        return int(self.X.shape[0])

    @property
    def heldout(self) -> int:
        return 0 if self.X_test is None else int(self.X_test.shape[0])


def read_client_data(path: str | Path) -> ClientData:
    """Read and check a client's .npz or .csv file."""
    path = Path(path)
    if path.suffix == ".npz":
        arrays = _read_npz(path)
    elif path.suffix == ".csv":
        arrays = _read_csv(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r} (use .npz or .csv)")
    return _checked(str(path), arrays)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    if not rows:
        raise DataError(f"{path}: empty file (expected a header line, then rows)")
    header = [name.strip() for name in rows[0]]
    if "y" not in header:
        raise DataError(f"{path}: no column named 'y' in the header {header[:20]}")
    split_at = header.index("split") if "split" in header else None
    numeric = [i for i, name in enumerate(header) if i != split_at]
    values = np.empty((len(rows) - 1, len(numeric)))
    test = np.zeros(len(rows) - 1, dtype=bool)
    for r, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{path}: line {r} has {len(row)} fields, the header {len(header)}")
        if split_at is not None:
            kind = row[split_at].strip()
            if kind not in ("train", "test", ""):
                raise DataError(f"{path}: line {r}: split is {kind[:20]!r}, expected 'train' or 'test'")
            test[r - 2] = kind == "test"
        for c, i in enumerate(numeric):
            try:
                values[r - 2, c] = float(row[i])
            except ValueError:
                raise DataError(
                    f"{path}: line {r}, column {header[i][:40]!r}: {row[i][:40]!r} is not a number"
                ) from None
    names = [header[i] for i in numeric]
    target, group = names.index("y"), names.index("group") if "group" in names else None
    features = [c for c, name in enumerate(names) if c not in (target, group)]
    arrays = {"X": values[~test][:, features], "y": values[~test, target]}
    if group is not None:
        arrays["group"] = values[~test, group]
    if test.any():
        arrays["X_test"], arrays["y_test"] = values[test][:, features], values[test, target]
        if group is not None:
            arrays["group_test"] = values[test, group]
    return arrays


def _checked(path: str, arrays: dict[str, np.ndarray]) -> ClientData:
    for required in ("X", "y"):
        if required not in arrays:
            raise DataError(f"{path}: no array {required!r} (found {sorted(arrays)[:10]})")
    unknown = sorted(set(arrays) - {"X", "y", "group", "X_test", "y_test", "group_test"})
    if unknown:
        raise DataError(f"{path}: unexpected arrays {unknown[:10]} (expected X, y, group, X_test, y_test, group_test)")
    clean = {name: _numbers(path, name, value) for name, value in arrays.items()}
    for prefix in ("", "_test"):
        X, y = clean.get("X" + prefix), clean.get("y" + prefix)
        if X is None and y is None:
            continue
        if X is None or y is None:
            raise DataError(f"{path}: X{prefix} and y{prefix} go together")
        if X.ndim != 2:
            raise DataError(f"{path}: X{prefix} must have 2 dimensions (rows, features), has shape {X.shape}")
        if y.ndim != 1 or y.shape[0] != X.shape[0]:
            raise DataError(
                f"{path}: y{prefix} must have one entry per row of X{prefix} ({X.shape[0]}), has shape {y.shape}"
            )
        group = clean.get("group" + prefix)
        if group is not None and group.shape != y.shape:
            raise DataError(f"{path}: group{prefix} must have shape {y.shape}, has {group.shape}")
    if clean["X"].shape[0] == 0:
        raise DataError(f"{path}: no training rows (an empty shard)")
    if clean["X"].shape[1] == 0:
        raise DataError(f"{path}: X has no feature columns")
    if "X_test" in clean and clean["X_test"].shape[1] != clean["X"].shape[1]:
        raise DataError(f"{path}: X_test has {clean['X_test'].shape[1]} features, X has {clean['X'].shape[1]}")
    return ClientData(
        path,
        clean["X"],
        clean["y"],
        clean.get("group"),
        clean.get("X_test"),
        clean.get("y_test"),
        clean.get("group_test"),
    )


def _numbers(path: str, name: str, value: np.ndarray) -> Array:
    if value.dtype.kind not in "biuf":
        raise DataError(f"{path}: {name} holds {value.dtype} values; expected numbers")
    numbers = value.astype(np.float64)
    finite = np.isfinite(numbers)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise DataError(f"{path}: {name}{list(where)} is {numbers[where]} (NaN and Inf are refused)")
    return numbers


def data_paths(given: str | Sequence[str] | Mapping[int, str] | None, indices: Sequence[int]) -> dict[int, str]:
    """Each client's data file from what a user gave: one path per index in order, a pattern
    with `{i}` (`data/client-{i:03d}.npz`), or a mapping; ValueError if they do not match."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        return {int(i): str(p) for i, p in given.items()}
    paths = [given] if isinstance(given, str) else [str(p) for p in given]
    if len(paths) == 1 and "{i" in paths[0]:
        try:
            found = {i: paths[0].format(i=i) for i in indices}
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"data pattern {paths[0]!r} must use only {{i}} (e.g. client-{{i:03d}}.npz): {exc}"
            ) from None
    elif len(paths) != len(indices):
        raise ValueError(
            f"{len(indices)} clients need {len(indices)} data files (one per index, in order) "
            f"or one pattern with {{i}}; got {len(paths)}"
        )
    else:
        found = dict(zip(indices, paths, strict=True))
    _each_its_own(found)
    return found


def _each_its_own(paths: Mapping[int, str]) -> None:
    """ValueError if two clients are given the same file: each would train on the other's rows, and
    nothing later could tell."""
    seen: dict[str, int] = {}
    for i, path in paths.items():
        key = os.path.realpath(path)
        if key in seen:
            raise ValueError(f"clients {seen[key]} and {i} are both given {path}: each client loads a file of its own")
        seen[key] = i


def deal_by_class(
    rows: NDArray[np.int64], classes: NDArray[Any], shares: Array, rng: np.random.Generator
) -> list[NDArray[np.int64]]:
    """Deal rows to clients: each class's rows, in a random order, cut in the proportions shares[class]
    (classes x clients); each client's rows sorted."""
    dealt: list[list[int]] = [[] for _ in range(shares.shape[1])]
    for c, proportions in enumerate(shares):
        members = rng.permutation(rows[classes[rows] == c])
        cuts = (np.cumsum(proportions)[:-1] * len(members)).round().astype(int)
        for client, part in enumerate(np.split(members, cuts)):
            dealt[client].extend(part.tolist())
    return [np.array(sorted(d), dtype=np.int64) for d in dealt]
