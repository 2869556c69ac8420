"""Client data files: both formats read the same, and every fault is named with its file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import fedsaddle

from fedsaddle.common.problems import DataError, data_paths, make_problem, parse_spec, read_client_data
from fedsaddle.experiments.datasets import split

ROWS = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -3.0], [-2.0, 4.0, 0.0]])


def write_npz(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def test_npz_and_csv_give_the_same_data(tmp_path: Path) -> None:
    npz = write_npz(tmp_path / "a.npz", X=ROWS[:2], y=[1.0, 0.0], group=[0.0, 1.0], X_test=ROWS[2:], y_test=[1.0])
    csv = tmp_path / "a.csv"
    csv.write_text("f1,y,f2,group,f3,split\n0.5,1,-1,0,2,train\n1.5,0,0.25,1,-3,\n-2,1,4,0,0,test\n")
    a, b = read_client_data(npz), read_client_data(csv)
    for name in ("X", "y", "group", "X_test", "y_test"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.samples, a.heldout) == (2, 1)


@pytest.mark.parametrize(
    ("arrays", "fault"),
    [
        ({"X": ROWS}, "no array 'y'"),
        ({"X": ROWS, "y": [1.0, np.nan, 0.0]}, "y[1] is nan (NaN and Inf are refused)"),
        ({"X": ROWS * np.array([1, np.inf, 1]), "y": [1.0, 2.0, 3.0]}, "X[0, 1] is -inf"),
        ({"X": np.zeros((0, 3)), "y": np.zeros(0)}, "no training rows (an empty shard)"),
        ({"X": np.array([["a", "b"], ["c", "d"]]), "y": [1.0, 2.0]}, "X holds <U1 values; expected numbers"),
        ({"X": ROWS, "y": [1.0, 2.0]}, "y must have one entry per row of X (3)"),
        ({"X": ROWS[0], "y": [1.0]}, "X must have 2 dimensions"),
        ({"X": ROWS, "y": [1.0, 2.0, 3.0], "weights": [1, 2, 3]}, "unexpected arrays ['weights']"),
        ({"X": ROWS, "y": [1.0, 2.0, 3.0], "X_test": ROWS[:, :2], "y_test": [1.0, 2.0, 3.0]}, "X_test has 2 features"),
    ],
)
def test_bad_npz_files_are_refused_naming_the_file_and_the_fault(
    tmp_path: Path, arrays: dict[str, Any], fault: str
) -> None:
    path = write_npz(tmp_path / "client-3.npz", **arrays)
    with pytest.raises(DataError) as error:
        read_client_data(path)
    assert str(error.value).startswith(str(path))
    assert fault in str(error.value)


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        (None, "no such file"),
        ("", "empty file"),
        ("a,b\n1,2\n", "no column named 'y'"),
        ("a,y\n1,x\n", "line 2, column 'y': 'x' is not a number"),
        ("a,y\n1\n", "line 2 has 1 fields, the header 2"),
        ("a,y,split\n1,2,validation\n", "split is 'validation'"),
        ("a,y\n1,nan\n", "y[0] is nan"),
    ],
)
def test_bad_csv_files_are_refused_naming_the_file_and_the_fault(tmp_path: Path, text: str | None, fault: str) -> None:
    path = tmp_path / "client-0.csv"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataError, match=fault.replace("[", r"\[").replace("(", r"\(")):
        read_client_data(path)


def test_unknown_formats_and_broken_archives_are_named(tmp_path: Path) -> None:
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"unknown data format '\.parquet'"):
        read_client_data(tmp_path / "data.parquet")
    (tmp_path / "broken.npz").write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match=r"broken\.npz: not a readable \.npz file"):
        read_client_data(tmp_path / "broken.npz")


def test_problems_refuse_data_they_cannot_use(tmp_path: Path) -> None:
    auc = make_problem(parse_spec({"name": "auc", "features": 3, "positive_rate": 0.5}))
    labels = write_npz(tmp_path / "labels.npz", X=ROWS, y=[1.0, 2.0, 0.0])
    with pytest.raises(DataError, match=r"labels.npz: y\[1\] is 2; this problem accepts labels \[-1.0, 0.0, 1.0\]"):
        auc.load(labels)  # type: ignore[attr-defined]
    narrow = make_problem(parse_spec({"name": "linear_regression", "features": 4}))
    with pytest.raises(DataError, match=r"labels\.npz: 3 features, but the problem expects 4"):
        narrow.load(labels)  # type: ignore[attr-defined]
    fair = make_problem(parse_spec({"name": "fair_logistic", "features": 3, "group_rate": 0.5}))
    with pytest.raises(DataError, match="no 'group'"):
        fair.load(write_npz(tmp_path / "nogroup.npz", X=ROWS, y=[1.0, 0.0, 1.0]))  # type: ignore[attr-defined]


def test_data_paths_take_a_pattern_a_list_or_a_mapping() -> None:
    assert data_paths("d/client-{i:03d}.npz", [2, 5]) == {2: "d/client-002.npz", 5: "d/client-005.npz"}
    assert data_paths(["a.npz", "b.npz"], [3, 4]) == {3: "a.npz", 4: "b.npz"}
    assert data_paths({7: "x.csv"}, [7]) == {7: "x.csv"}
    with pytest.raises(ValueError, match="3 clients need 3 data files"):
        data_paths(["a.npz"], [0, 1, 2])


def test_two_clients_given_the_same_file_is_refused_naming_them() -> None:
    # Each would train on the other's rows: a wrong result nothing later could tell from a right one.
    message = "clients 0 and 2 are both given d/./a.npz: each client loads a file of its own"
    with pytest.raises(ValueError, match=re.escape(message)):
        data_paths(["d/a.npz", "d/b.npz", "d/./a.npz"], [0, 1, 2])
    # A client process says so at once, exit 2, before it looks for a coordinator.
    done = fedsaddle(
        "client", "--coordinator", "127.0.0.1:9", "--clients", "0-1", "--data", "a.npz", "--data", "./a.npz"
    )
    assert done.returncode == 2
    assert (
        "fedsaddle: --data: clients 0 and 1 are both given ./a.npz: each client loads a file of its own" in done.stderr
    )


def test_label_skew_split_writes_one_file_per_client_with_a_summary(tmp_path: Path) -> None:
    summary = split("breast_cancer", 10, "label-skew", seed=3, out=tmp_path, alpha=0.3)
    files = sorted(tmp_path.glob("client-*.npz"))
    assert len(files) == 10 and (tmp_path / "test.npz").exists()
    datas = [read_client_data(f) for f in files]
    assert sum(d.samples for d in datas) == summary["training_rows"] == 455
    assert sum(d.heldout for d in datas) == summary["heldout_rows"] == 114
    pooled = np.load(tmp_path / "test.npz")  # every client's held-out rows, named so
    assert sorted(pooled) == ["X_test", "y_test"] and pooled["X_test"].shape[0] == 114
    with pytest.raises(DataError, match=r"test.npz: no array 'X'"):  # no client trains on it by mistake
        read_client_data(tmp_path / "test.npz")
    assert min(d.samples for d in datas) >= 5
    positives = [float(d.y.mean()) for d in datas]
    assert max(positives) - min(positives) > 0.5  # skewed: some clients are mostly one class
    pooled_positive = sum(d.y.sum() for d in datas) / summary["training_rows"]
    assert summary["positive_rate"] == pytest.approx(pooled_positive)
    assert json.loads((tmp_path / "summary.json").read_text())["shares"][0]["rows"] == datas[0].samples
    iid = split("breast_cancer", 10, "iid", seed=3, out=tmp_path / "iid")
    sizes = [s["rows"] for s in iid["shares"]]
    assert max(sizes) - min(sizes) <= 3  # equal shares, up to the classes' rounding
