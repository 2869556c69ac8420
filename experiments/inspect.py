"""`fedsaddle data inspect FILE`: what a client's data file holds, as a person checks it before a run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import DataError, DataProblem, problem_class, read_client_data
from fedsaddle.experiments.datasets import DATA_PROBLEMS

MAX_FEATURES_SHOWN = 12


def _values(name: str, values: Array) -> str:
    """A column's distinct values and their counts (few), or its range and mean (many)."""
    distinct, counts = np.unique(values, return_counts=True)
    if len(distinct) <= 10:
        shown = ", ".join(f"{v:g}: {c}" for v, c in zip(distinct, counts, strict=True))
        return f"{name}: {len(values)} values ({shown})"
    return (
        f"{name}: {len(values)} values in [{values.min():.4g}, {values.max():.4g}], "
        f"mean {values.mean():.4g}, deviation {values.std():.4g}"
    )


def inspect_file(path: str | Path) -> str:
    """A description of the file; DataError (a ValueError) if it cannot be read."""
    data = read_client_data(path)
    lines = [
        f"{data.path}: {data.samples} training rows, {data.heldout} held-out rows, {data.X.shape[1]} features",
        _values("y", data.y),
    ]
    if data.y_test is not None:
        lines.append(_values("y_test", data.y_test))
    if data.group is not None:
        lines.append(_values("group", data.group))
    lines.append(f"{'feature':>8} {'mean':>10} {'deviation':>10} {'min':>10} {'max':>10}")
    for j in range(min(data.X.shape[1], MAX_FEATURES_SHOWN)):
        column = data.X[:, j]
        lines.append(f"{j:>8} {column.mean():>10.4g} {column.std():>10.4g} {column.min():>10.4g} {column.max():>10.4g}")
    if data.X.shape[1] > MAX_FEATURES_SHOWN:
        lines.append(f"{'':>8} ... and {data.X.shape[1] - MAX_FEATURES_SHOWN} more")
    lines.append("as the built-in problems see it (this file's training rows alone):")
    for name in DATA_PROBLEMS:
        cls = problem_class(name)
        assert issubclass(cls, DataProblem)
        fits = _fits(cls, data)
        statistics = ", ".join(f"{k} = {v!r}" for k, v in cls.statistics([data]).items()) if fits is None else ""
        lines.append(f"  {name}: {statistics}" if fits is None else f"  {name}: cannot use it: {fits}")
    return "\n".join(lines)


def _fits(cls: type[DataProblem], data: object) -> str | None:
    """Why `cls` refuses the data, or None: its own check, with a spec made to match the file."""
    from fedsaddle.common.problems.data import ClientData

    assert isinstance(data, ClientData)
    fields = {"num_clients": 1, "features": int(data.X.shape[1])}
    optional = {"positive_rate": 0.5, "group_rate": 0.5}
    spec_fields = cls.Spec.model_fields
    spec = cls.Spec(**fields, **{k: v for k, v in optional.items() if k in spec_fields})
    try:
        cls(spec).check(data)
    except DataError as exc:
        return str(exc).removeprefix(f"{data.path}: ")
    return None
