"""`fedsaddle data split` on a user's own table, `data inspect`, and the spec statistics a client checks."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import fedsaddle

from fedsaddle.common.problems import read_client_data
from fedsaddle.common.problems.statistics import SHARE_TOLERANCE, disagreements
from fedsaddle.common.worker import ShardCache
from fedsaddle.experiments.datasets import load_table, split
from fedsaddle.experiments.tables import TableSpec
from fedsaddle.server.config import parse_config

HOSPITALS = ("north", "south", "east")
GOOD = "a,b,y\n" + "1,2,0\n4,5,1\n" * 3  # six good rows, lines 2 to 7


def write_patients(path: Path, rows: int = 240, seed: int = 7) -> dict[str, list[str]]:
    """A table as users have them: text labels, a text column, a site column, a sensitive attribute."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list[str]] = {"age": [], "bmi": [], "city": [], "hospital": [], "sex": [], "outcome": []}
    for r in range(rows):
        age, bmi = rng.normal(50, 10), rng.normal(27, 4)
        columns["age"].append(f"{age:.1f}")
        columns["bmi"].append(f"{bmi:.2f}")
        columns["city"].append(rng.choice(["Lyon", "Graz", "Turku"]))
        columns["hospital"].append(HOSPITALS[r % 3])
        columns["sex"].append("F" if rng.random() < 0.4 else "M")
        columns["outcome"].append("sick" if 0.08 * (age - 50) + 0.2 * (bmi - 27) + rng.normal() > 0.6 else "well")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(zip(*columns.values(), strict=True))
    return columns


def test_a_csv_is_split_with_the_exact_public_statistics_and_a_config(tmp_path: Path) -> None:
    table = tmp_path / "patients.csv"
    columns = write_patients(table)
    out, config = tmp_path / "data", tmp_path / "run.yaml"
    done = fedsaddle(
        "data", "split", str(table), "--target", "outcome", "--positive", "sick", "--partition", "label-skew",
        "--clients", "3", "--seed", "2", "--out", str(out), "--config", str(config),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    datas = [read_client_data(out / f"client-{c:03d}.npz") for c in range(3)]
    assert (out / "test.npz").exists()
    # Every row is somewhere, training or held out; 'city' is text and left out, the features are age and bmi.
    assert sum(d.samples + d.heldout for d in datas) == 240
    assert all(d.X.shape[1] == 2 for d in datas)
    assert "left out (not numeric" in done.stdout and "'city'" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["feature_names"] == ["age", "bmi"]
    assert summary["codes"]["target"] == {"well": 0, "sick": 1}
    # The printed positive rate is the pooled one over the training rows, in full: not rounded to 6 digits.
    positive = sum(int(d.y.sum()) for d in datas) / sum(d.samples for d in datas)
    assert f"positive_rate: {positive!r}" in done.stdout
    assert len(repr(positive)) > 8  # (a rate with a short decimal form would not test the precision)
    written = yaml.safe_load(config.read_text())
    assert written["problem"] == {"name": "auc", "num_clients": 3, "features": 2, "positive_rate": positive}
    assert parse_config(written).problem.name == "auc"
    # The held-out rows carry the same coding of the labels.
    sick = sum(v == "sick" for v in columns["outcome"])
    assert sum(int(d.y.sum()) + int(d.y_test.sum()) for d in datas if d.y_test is not None) == sick


def test_natural_sites_become_clients_in_sorted_order(tmp_path: Path) -> None:
    table = tmp_path / "patients.csv"
    columns = write_patients(table)
    spec = TableSpec("outcome", ("age", "bmi"), group="sex", site="hospital", positive="sick")
    summary = split(load_table(table, spec), None, "by-column", seed=0, out=tmp_path / "sites", test_fraction=0.25)
    assert summary["clients"] == 3
    assert [share["site"] for share in summary["shares"]] == sorted(HOSPITALS)
    for share in summary["shares"]:
        assert share["rows"] + share["heldout"] == 80 and share["heldout"] == 20
    # group: F and M as 0 and 1; its rate over the training rows is the fair problem's group_rate.
    datas = [read_client_data(tmp_path / "sites" / f"client-{c:03d}.npz") for c in range(3)]
    pooled = sum(float(d.group.sum()) for d in datas if d.group is not None) / sum(d.samples for d in datas)
    assert summary["statistics"]["fair_logistic"]["group_rate"] == pooled
    assert summary["codes"]["group"] == {"F": 0, "M": 1}
    # Client 0 is 'east' and holds exactly its rows: its standardized ages are an affine image of theirs.
    east = np.sort([float(a) for a, h in zip(columns["age"], columns["hospital"], strict=True) if h == "east"])
    assert datas[0].X_test is not None
    held = np.sort(np.concatenate([datas[0].X[:, 0], datas[0].X_test[:, 0]]))
    scale = (held[-1] - held[0]) / (east[-1] - east[0])
    np.testing.assert_allclose(held, held[0] + (east - east[0]) * scale, atol=1e-9)


def test_a_parquet_table_splits_like_the_same_csv(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    table = tmp_path / "patients.csv"
    columns = write_patients(table)
    typed = {k: [float(v) for v in vs] if k in ("age", "bmi") else vs for k, vs in columns.items()}
    parquet.write_table(pyarrow.table(typed), tmp_path / "patients.parquet")
    spec = TableSpec("outcome", positive="sick")
    a = split(load_table(table, spec), 4, "iid", seed=5, out=tmp_path / "a")
    b = split(load_table(tmp_path / "patients.parquet", spec), 4, "iid", seed=5, out=tmp_path / "b")
    assert a["statistics"] == b["statistics"]
    for c in range(4):
        left, right = (np.load(tmp_path / d / f"client-{c:03d}.npz") for d in ("a", "b"))
        assert all(np.array_equal(left[k], right[k]) for k in left.files)


@pytest.mark.parametrize(
    ("lines", "arguments", "fault"),
    [
        (GOOD + "3,,1\n", ["--target", "y"], "line 8, column 'b': an empty cell"),
        (GOOD + "3,x,1\n", ["--target", "y", "--features", "a,b"], "line 8, column 'b': 'x', not a finite"),
        ("a,b,y\n1,2,0\n3,4,1\n", ["--target", "label"], "no column 'label'; the columns are ['a', 'b', 'y']"),
        ("a,b,y\n1,2,0\n3,4,1\n", ["--target", "y", "--positive", "7"], "column 'y' has no value '7'"),
        ("a,b,y\n1,2,0\n3,4,1\n", ["--target", "y", "--features", "a,y"], "column 'y' is the target"),
        (
            GOOD + "7,8,1\n",
            ["--target", "y", "--group", "a"],
            "group column 'a' must hold two distinct values, has 1.0, 4.0, 7.0",
        ),
        ("a,b,y\n1,2,0\n3,4\n", ["--target", "y"], "line 3 has 2 fields, the header 3"),
        ("a,b,y\n" + "1,2,0\n" * 9, ["--target", "y", "--clients", "3"], "too few for 3 clients"),
    ],
)
def test_bad_tables_are_refused_naming_the_column_and_line(
    tmp_path: Path, lines: str, arguments: list[str], fault: str
) -> None:
    table = tmp_path / "t.csv"
    table.write_text(lines)
    if "--clients" not in arguments:
        arguments = [*arguments, "--clients", "1"]
    done = fedsaddle("data", "split", str(table), *arguments, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert fault in done.stderr, done.stderr
    assert not (tmp_path / "out" / "client-000.npz").exists()


def test_the_bundled_names_and_a_file_by_dataset_both_work(tmp_path: Path) -> None:
    table = tmp_path / "patients.csv"
    write_patients(table)
    done = fedsaddle("data", "split", "--dataset", str(table), "--target", "outcome", "--clients", "2", "--out",
                     str(tmp_path / "a"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    unknown = fedsaddle("data", "split", "--dataset", "iris", "--clients", "2", "--out", str(tmp_path / "b"))
    assert unknown.returncode == 2
    assert "'iris' is neither a bundled dataset ['diabetes', 'diabetes_fair', 'breast_cancer']" in unknown.stderr


def test_a_config_keeps_its_other_fields_when_the_statistics_are_written_into_it(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "name: mine\nrounds: 77\nproblem: {name: auc, num_clients: 3, features: 2, positive_rate: 0.5, lam: 0.25}\n"
        "sync: {kind: fixed, tau: 5}\nalgorithms: [{name: scaffold_s, gamma_local: 0.01}]\n"
    )
    table = tmp_path / "patients.csv"
    write_patients(table)
    done = fedsaddle("data", "split", str(table), "--target", "outcome", "--clients", "3", "--out",
                     str(tmp_path / "d"), "--config", str(config))  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load(config.read_text())
    assert written["rounds"] == 77 and written["name"] == "mine"
    assert written["problem"]["lam"] == 0.25 and written["problem"]["positive_rate"] != 0.5
    wrong = fedsaddle("data", "split", str(table), "--target", "age", "--clients", "3", "--out",
                      str(tmp_path / "e"), "--config", str(config), "--problem", "auc")  # fmt: skip
    assert wrong.returncode == 2 and "problem 'auc' does not fit this split (it needs two classes)" in wrong.stderr


def test_inspect_describes_a_client_file(tmp_path: Path) -> None:
    split("diabetes_fair", 4, "iid", seed=1, out=tmp_path)
    done = fedsaddle("data", "inspect", str(tmp_path / "client-001.npz"))
    assert done.returncode == 0, done.stderr
    data = read_client_data(tmp_path / "client-001.npz")
    assert f"{data.samples} training rows, {data.heldout} held-out rows, 9 features" in done.stdout
    positive = int(data.y.sum())
    assert f"y: {data.samples} values (0: {data.samples - positive}, 1: {positive})" in done.stdout
    assert f"positive_rate = {positive / data.samples!r}" in done.stdout
    assert "fair_logistic: features = 9, group_rate = " in done.stdout
    missing = fedsaddle("data", "inspect", str(tmp_path / "nope.npz"))
    assert missing.returncode == 2 and "nope.npz: no such file" in missing.stderr


def _auc_spec(rate: float, clients: int = 4) -> dict[str, object]:
    return {"name": "auc", "num_clients": clients, "features": 30, "positive_rate": rate}


def test_a_wrong_positive_rate_is_a_warning_naming_the_field_and_both_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    summary = split("breast_cancer", 4, "iid", seed=1, out=tmp_path)
    true_rate = summary["statistics"]["auc"]["positive_rate"]
    files = {i: str(tmp_path / f"client-{i:03d}.npz") for i in range(4)}
    from fedsaddle.common.problems import parse_spec

    with caplog.at_level(logging.WARNING, logger="fedsaddle.data"):
        ShardCache(data=files).get(parse_spec(_auc_spec(true_rate)), None, range(4))
        assert not caplog.records  # the value split printed passes
        ShardCache(data=files).get(parse_spec(_auc_spec(0.5)), None, range(4))
    (warning,) = caplog.records
    assert f"problem.positive_rate is 0.5 in the spec, but all clients' training rows give {true_rate!r}" in (
        warning.getMessage()
    )
    # A process with some of the clients compares with a wide tolerance: its share may differ by design.
    from fedsaddle.common.problems import make_problem

    problem = make_problem(parse_spec(_auc_spec(0.5)))
    datas = [read_client_data(files[0])]
    share = float(datas[0].y.mean())
    found = disagreements(problem, datas, [0])  # type: ignore[arg-type]
    assert bool(found) == (abs(share - 0.5) > SHARE_TOLERANCE)
    far = make_problem(parse_spec(_auc_spec(0.05)))
    (text,) = disagreements(far, datas, [0])  # type: ignore[arg-type]
    assert f"the {datas[0].samples} training rows of clients [0] hosted here give {share!r}" in text


def test_simulate_and_local_warn_once_about_a_wrong_statistic(tmp_path: Path) -> None:
    split("breast_cancer", 3, "label-skew", seed=1, out=tmp_path)
    config = tmp_path / "run.yaml"
    spec = {**_auc_spec(0.5, clients=3), "lam": 0.1}
    config.write_text(
        yaml.safe_dump({"name": "w", "problem": spec, "rounds": 4, "sync": {"kind": "fixed", "tau": 2},
                        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}], "output": {"plot": False}})
    )  # fmt: skip
    pattern = str(tmp_path / "client-{i:03d}.npz")
    for command in ("simulate", "local"):
        done = fedsaddle(command, "--config", str(config), "--data", pattern, "--out", str(tmp_path / "runs"))
        assert done.returncode == 0, done.stderr
        said = [line for line in done.stderr.splitlines() if "problem.positive_rate is 0.5 in the spec" in line]
        # `local` checks all the files once, and its client processes (each with one skewed share) stay quiet.
        assert len(said) == 1, (command, done.stderr)
        assert "all clients' training rows give 0.63" in said[0]


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "pyarrow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('pyarrow is not installed here')\n")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    done = fedsaddle(
        "data", "split", str(tmp_path / "t.parquet"), "--target", "y", "--clients", "2", "--out", str(tmp_path / "out"),
        timeout=60, env={"PYTHONPATH": str(tmp_path / "blocker")},
    )  # fmt: skip
    assert done.returncode == 2
    assert "reading Parquet needs pyarrow: pip install 'fedsaddle[data]'" in done.stderr, done.stderr


def test_a_bundled_datasets_own_numeric_column_is_cut_into_bins_one_client_each(tmp_path: Path) -> None:
    from sklearn.datasets import load_diabetes

    done = fedsaddle("data", "split", "--dataset", "diabetes", "--partition", "by-column", "--by", "age",
                     "--bins", "40,50,60", "--out", str(tmp_path / "age"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "age" / "summary.json").read_text())
    assert [s["site"] for s in summary["shares"]] == ["age < 40", "40 <= age < 50", "50 <= age < 60", "age >= 60"]
    # Each bin's rows are exactly the dataset's rows of those ages; the --by column left the features.
    ages = load_diabetes(scaled=False).data[:, 0]
    counts = np.bincount(np.searchsorted([40, 50, 60], ages, side="right"))
    assert [s["rows"] + s["heldout"] for s in summary["shares"]] == counts.tolist()
    assert summary["features"] == 9 and "age" not in summary["feature_names"]
    # The summary is in the units the files hold: a standardized target.
    datas = [read_client_data(tmp_path / "age" / f"client-{c:03d}.npz") for c in range(4)]
    for share, data in zip(summary["shares"], datas, strict=True):
        assert share["label_mean"] == pytest.approx(float(data.y.mean()), abs=1e-12)
        assert f"{share['label_mean']:>12.3f}  {share['site']}" in done.stdout
    pooled = np.concatenate([d.y for d in datas])
    assert abs(pooled.mean()) < 1e-12 and abs(pooled.std() - 1) < 1e-12
    standardized = summary["target_standardized"]
    assert f"y is standardized in the files, as shown below: (y - {standardized['mean']:.6g})" in done.stdout

    # The same in this process (the command's functions), for the other bins and their faults.
    from fedsaddle.experiments.datasets import binned, by_dataset_column, load_dataset

    bmi = binned(by_dataset_column(load_dataset("diabetes"), "bmi"), "bmi", quantiles=4)
    rows = np.unique(np.asarray(bmi.sites), return_counts=True)[1]
    assert len(rows) == 4 and rows.max() - rows.min() <= 6  # about equal counts (ties at the edges)
    assert bmi.site_order is not None and bmi.site_order[0].startswith("bmi < ")
    age = by_dataset_column(load_dataset("diabetes"), "age")
    with pytest.raises(ValueError, match="bin 'age < 10' of column 'age' holds no rows, so its client would have no"):
        binned(age, "age", [10, 15, 50])
    with pytest.raises(ValueError, match="column 'age' has too few distinct values for 3 quantile bins"):
        binned(replace(age, sites=("30",) * 400 + ("40",) * 42), "age", quantiles=3)
    with pytest.raises(ValueError, match="diabetes has no feature column 'height'"):
        by_dataset_column(load_dataset("diabetes"), "height")


def test_a_tables_numeric_site_column_is_cut_at_edges_in_increasing_order(tmp_path: Path) -> None:
    from fedsaddle.experiments.datasets import binned

    table = tmp_path / "patients.csv"
    columns = write_patients(table)
    spec = TableSpec("outcome", ("bmi",), site="age", positive="sick")
    summary = split(binned(load_table(table, spec), "age", [45, 55]), None, "by-column", seed=0, out=tmp_path / "o")
    assert [s["site"] for s in summary["shares"]] == ["age < 45", "45 <= age < 55", "age >= 55"]
    ages = np.array([float(a) for a in columns["age"]])
    expected = [int((ages < 45).sum()), int(((ages >= 45) & (ages < 55)).sum()), int((ages >= 55).sum())]
    assert [s["rows"] + s["heldout"] for s in summary["shares"]] == expected
    with pytest.raises(ValueError, match="bin edges must be increasing numbers, got 55, 45"):
        binned(load_table(table, spec), "age", [55, 45])
    with pytest.raises(ValueError, match="column 'city' must be numeric to be cut into bins; it holds"):
        binned(load_table(table, TableSpec("outcome", ("bmi",), site="city")), "city", [1.0])
