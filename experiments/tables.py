"""A user's own table (CSV or Parquet) as the rows `fedsaddle data split` deals to clients.

The user names the target column; the feature columns default to every other
numeric column (except the group and site columns), or are named one by one.
A target of two distinct values is a classification target, written as 0 and 1
(the larger number, or the value named by `positive`, is 1); more values make
a regression target. A group column (the sensitive attribute of `fair_logistic`)
must hold two distinct values, written as 0 and 1 the same way. A site column
(for the `by-column` partition) may hold anything: each distinct value is one
client, in sorted order.

Every fault names the file, the column and, where there is one, the line: a
missing column, an empty cell, text in a numeric column, too few rows.
Parquet files are read with pyarrow (the `data` extra).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.numeric import Array


class TableError(ValueError):
    """A table that cannot be split as asked; the message names the file and the fault."""


@dataclass(frozen=True)
class Columns:
    """A table as read: its column names in file order, and each column's cells (None: empty)."""

    path: str
    names: tuple[str, ...]
    cells: dict[str, list[Any]]
    first_line: int  # the file line of the first row (2 for a CSV with a header; 0: no lines, as Parquet)

    @property
    def rows(self) -> int:
        return len(self.cells[self.names[0]]) if self.names else 0

    def where(self, row: int) -> str:
        return f"line {row + self.first_line}" if self.first_line else f"row {row}"


def read_columns(path: str | Path) -> Columns:
    """The columns of a .csv (header line, then rows) or .parquet file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _read_csv(path)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise TableError(f"{path}: unknown table format {path.suffix!r} (use .csv or .parquet)")


def _read_csv(path: Path) -> Columns:
    try:
        with open(path, newline="") as handle:
            lines = list(csv.reader(handle))
    except FileNotFoundError:
        raise TableError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TableError(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    if not lines:
        raise TableError(f"{path}: empty file (expected a header line, then rows)")
    names = tuple(name.strip() for name in lines[0])
    _unique(path, names)
    cells: dict[str, list[Any]] = {name: [] for name in names}
    for number, line in enumerate(lines[1:], start=2):
        if not line:
            continue  # a blank line
        if len(line) != len(names):
            raise TableError(f"{path}: line {number} has {len(line)} fields, the header {len(names)}")
        for name, cell in zip(names, line, strict=True):
            cells[name].append(cell.strip() or None)
    return Columns(str(path), names, cells, first_line=2)


def _read_parquet(path: Path) -> Columns:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise TableError(
            f"{path}: reading Parquet needs pyarrow: pip install 'fedsaddle[data]' (or pip install pyarrow), "
            "or save the table as .csv"
        ) from None
    if not path.exists():
        raise TableError(f"{path}: no such file")
    try:
        table = parquet.read_table(path)
    except Exception as exc:  # pyarrow's own error types differ between versions
        raise TableError(f"{path}: not a readable Parquet file ({exc})") from None
    names = tuple(str(name) for name in table.column_names)
    _unique(path, names)
    return Columns(str(path), names, {name: table.column(name).to_pylist() for name in names}, first_line=0)


def _unique(path: Path, names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not name:
            raise TableError(f"{path}: a column without a name in the header")
        if name in seen:
            raise TableError(f"{path}: two columns are named {name!r}")
        seen.add(name)


def _number(cell: Any) -> float | None:
    """A cell's number, or None if it is not one (text, an empty cell, NaN or Inf)."""
    if cell is None or isinstance(cell, bool):
        return float(cell) if isinstance(cell, bool) else None
    try:
        value = float(cell)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def numeric_column(columns: Columns, name: str) -> Array:
    """A column's numbers; TableError naming the first cell that is not a finite number."""
    values = np.empty(columns.rows)
    for row, cell in enumerate(columns.cells[name]):
        value = _number(cell)
        if value is None:
            shown = "an empty cell" if cell is None else f"{str(cell)[:40]!r}, not a finite number"
            raise TableError(f"{columns.path}: {columns.where(row)}, column {name[:40]!r}: {shown}")
        values[row] = value
    return values


def _is_numeric(columns: Columns, name: str) -> bool:
    """Numbers in every cell that is not empty (an empty cell in a numeric column is an error, not text)."""
    cells = [cell for cell in columns.cells[name] if cell is not None]
    return bool(cells) and all(_number(cell) is not None for cell in cells)


def two_values(columns: Columns, name: str, positive: str | None, role: str) -> tuple[Array, dict[str, int]]:
    """A column of two distinct values as 0.0 and 1.0, and which value became which."""
    cells = columns.cells[name]
    for row, cell in enumerate(cells):
        if cell is None:
            raise TableError(f"{columns.path}: {columns.where(row)}, column {name[:40]!r}: an empty cell")
    keys = [str(cell) if _number(cell) is None else repr(_number(cell)) for cell in cells]
    distinct = sorted(set(keys), key=lambda k: (_number(k) is None, _number(k) or 0.0, k))
    if len(distinct) != 2:
        shown = ", ".join(distinct[:5]) + (", ..." if len(distinct) > 5 else "")
        raise TableError(f"{columns.path}: the {role} column {name!r} must hold two distinct values, has {shown}")
    if positive is not None:
        wanted = [
            k for k in distinct if k == positive or (_number(positive) is not None and k == repr(_number(positive)))
        ]
        if not wanted:
            raise TableError(
                f"{columns.path}: column {name!r} has no value {positive!r} (it has {', '.join(distinct)})"
            )
        one = wanted[0]
    else:
        one = distinct[1]  # the larger number, or the later text in sort order
    zero = distinct[0] if distinct[1] == one else distinct[1]
    return np.array([1.0 if k == one else 0.0 for k in keys]), {zero: 0, one: 1}


@dataclass(frozen=True)
class TableSpec:
    """What to take from a table: its columns' roles."""

    target: str
    features: tuple[str, ...] = ()  # empty: every other numeric column
    group: str | None = None
    site: str | None = None  # the by-column partition's column
    task: str | None = None  # "classification" or "regression"; None: two target values make a classification
    positive: str | None = None  # the target value that is class 1


def table_rows(columns: Columns, spec: TableSpec) -> dict[str, Any]:
    """The arrays a split needs: X, y, group, the task, the feature names, the label and group codes,
    each row's site value, and the numeric columns left out (text)."""
    path = columns.path
    named = [spec.target, *spec.features] + [c for c in (spec.group, spec.site) if c]
    for name in named:
        if name not in columns.cells:
            raise TableError(f"{path}: no column {name!r}; the columns are {list(columns.names)[:30]}")
    if columns.rows == 0:
        raise TableError(f"{path}: no rows")
    roles = {spec.target: "target", spec.group: "group", spec.site: "site"}
    for feature in spec.features:
        if feature in roles:
            raise TableError(f"{path}: column {feature!r} is the {roles[feature]}; it cannot be a feature too")
    skipped: list[str] = []
    if spec.features:
        features = list(spec.features)
    else:
        candidates = [n for n in columns.names if n not in roles]
        features = [n for n in candidates if _is_numeric(columns, n)]
        skipped = [n for n in candidates if n not in features]
        if not features:
            raise TableError(f"{path}: no numeric column besides the target, group and site ones")
    X = np.column_stack([numeric_column(columns, name) for name in features])
    task = spec.task
    target_numeric = _is_numeric(columns, spec.target)
    if task is None:
        distinct = len({str(c) for c in columns.cells[spec.target]})
        task = "classification" if distinct == 2 or not target_numeric else "regression"
    labels: dict[str, int] | None = None
    if task == "classification":
        y, labels = two_values(columns, spec.target, spec.positive, "target")
    elif task == "regression":
        y = numeric_column(columns, spec.target)
    else:
        raise TableError(f"task must be 'classification' or 'regression', got {task!r}")
    group, groups = None, None
    if spec.group:
        group, groups = two_values(columns, spec.group, None, "group")
    sites = None
    if spec.site:
        for row, cell in enumerate(columns.cells[spec.site]):
            if cell is None:
                raise TableError(f"{path}: {columns.where(row)}, column {spec.site!r}: an empty cell (no site)")
        sites = [str(cell) for cell in columns.cells[spec.site]]
    return {
        "X": X,
        "y": y,
        "group": group,
        "task": task,
        "feature_names": tuple(features),
        "labels": labels,
        "groups": groups,
        "sites": sites,
        "skipped": skipped,
    }
