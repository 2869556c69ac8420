"""`fedsaddle experiment compare`: the runs it makes, the medians it reports, and the same bytes anywhere."""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import fedsaddle

from fedsaddle.experiments import compare

# The paper problem with heterogeneity (s = 2), each algorithm on a short grid of its own.
TINY = [
    "--algorithms", "fedavg_s", "scaffold_s",
    "--problems", "paper",
    "--s", "2",
    "--seeds", "3",
    "--rounds", "120",
    "--grid", "fedavg_s=1,0.5",
    "--grid", "scaffold_s=0.5,0.2",
]  # fmt: skip


def tiny_setup(**fields: Any) -> compare.Setup:
    given: dict[str, Any] = {
        "algorithms": ("fedavg_s", "scaffold_s"),
        "problems": ("paper",),
        "s_values": (2.0,),
        "seeds": (0, 1, 2),
        "rounds": 120,
        "grids": {"fedavg_s": (1.0, 0.5), "scaffold_s": (0.5, 0.2)},
    }
    given.update(fields)
    return compare.Setup(**given)


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def reached(row: dict[str, str]) -> float:
    return math.inf if row["rounds_to_eps"] == "" else float(row["rounds_to_eps"])


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare")
    done = fedsaddle("experiment", "compare", *TINY, "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_compare_runs_every_grid_point_once(tiny_report: Path) -> None:
    rows = read_csv(tiny_report / "runs.csv")
    points = {(r["algorithm"], float(r["step_scale"]), int(r["seed"])) for r in rows}
    grids = {"fedavg_s": (1.0, 0.5), "scaffold_s": (0.5, 0.2)}
    assert len(rows) == 12
    assert points == {(a, v, seed) for a, grid in grids.items() for v in grid for seed in range(3)}
    for row in rows:
        assert row["problem"] == "paper" and float(row["s"]) == 2.0
        assert float(row["step"]) == float(row["step_scale"]) / 2.0  # the scale over max(s, 1)
        assert int(row["rounds"]) <= 120
        # Too large a step diverges (SCAFFOLD-S at 0.5/s here): recorded, its distance +inf, never chosen.
        assert (row["status"], row["final_dist_z"]) == ("diverged", "inf") or row["status"] == "ok"
        assert len(row["z_sha256"]) == 64
    assert {(r["algorithm"], r["step_scale"]) for r in rows if r["status"] == "diverged"} == {("scaffold_s", "0.5")}
    # Sorted by problem, s, algorithm, step, seed.
    keys = [(r["algorithm"], float(r["step_scale"]), int(r["seed"])) for r in rows]
    assert keys == sorted(keys)


def test_scaffold_reaches_eps_in_fewer_rounds_than_fedavg_under_heterogeneity(tiny_report: Path) -> None:
    summary = {r["algorithm"]: r for r in read_csv(tiny_report / "summary.csv")}
    scaffold, fedavg = summary["scaffold_s"], summary["fedavg_s"]
    assert math.isfinite(float(scaffold["rounds_to_eps_median"]))
    assert float(scaffold["rounds_to_eps_median"]) < float(fedavg["rounds_to_eps_median"])
    # FedAvg-S stalls at its client-drift floor, far above eps; SCAFFOLD-S's control variates remove it.
    assert float(fedavg["final_median"]) > 1e-4 > 1e-6 > float(scaffold["final_median"])
    report = (tiny_report / "compare.md").read_text()
    assert "3 seeds 0-2" in report and "120 rounds" in report and "every exchange counted" in report
    assert "`scaffold_s` {0.5, 0.2}" in report and "`fedavg_s` {1, 0.5}" in report
    assert (tiny_report / "figure_paper.png").stat().st_size > 10_000


def test_reported_medians_are_the_medians_of_the_runs(tiny_report: Path) -> None:
    rows = read_csv(tiny_report / "runs.csv")
    for cell in read_csv(tiny_report / "summary.csv"):
        mine = [r for r in rows if r["algorithm"] == cell["algorithm"] and r["step_scale"] == cell["step_scale"]]
        assert len(mine) == int(cell["seeds"]) == 3
        assert float(cell["final_median"]) == statistics.median(float(r["final_dist_z"]) for r in mine)
        assert float(cell["rounds_to_eps_median"]) == statistics.median(reached(r) for r in mine)
        assert cell["diverged"] == "0" and all(r["status"] == "ok" for r in mine)
        # The chosen step is the one with the fewest median rounds to eps among its grid's that never diverge.
        others = {r["step_scale"] for r in rows if r["algorithm"] == cell["algorithm"] and r["status"] == "ok"}
        for scale in others:
            theirs = [reached(r) for r in rows if r["algorithm"] == cell["algorithm"] and r["step_scale"] == scale]
            assert float(cell["rounds_to_eps_median"]) <= statistics.median(theirs)


def test_runs_csv_bytes_do_not_depend_on_processes_or_task_order(tiny_report: Path) -> None:
    setup = tiny_setup()
    one = compare.run_local(setup.tasks(), workers=1)
    two = compare.run_local(list(reversed(setup.tasks())), workers=2)
    text = compare.runs_csv(r for result in one for r in result.runs)
    assert text == compare.runs_csv(r for result in two for r in result.runs)
    assert text == (tiny_report / "runs.csv").read_text()  # and the command's, in another process


def test_a_real_problem_splits_its_data_per_seed() -> None:
    setup = compare.Setup(
        algorithms=("scaffold_s",), problems=("linear_regression",), seeds=(0, 1), rounds=40, grids={"scaffold_s": (2,)}
    )
    assert [t.seeds for t in setup.tasks()] == [(0,), (1,)]  # one task per seed: its own split
    runs = [r for result in compare.run_local(setup.tasks(), workers=1) for r in result.runs]
    assert [(r.seed, r.step) for r in runs] == [(0, 0.2), (1, 0.2)]
    assert runs[0].z_sha256 != runs[1].z_sha256
    assert all(r.final < 1e-2 and r.curve[0][1] > r.final for r in runs)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--algorithms", "no_such"], "unknown name 'no_such'; expected one of ['minibatch_md', "),
        (["--problems", "no_such"], "no problem 'no_such'; installed: "),
        (["--problems", "agnostic"], "agnostic reads its clients' data files"),
        (["--grid", "scaffold_s=0.1,x"], "--grid scaffold_s=0.1,x: expected NAME=SCALE"),
        (["--algorithms", "scaffold_s", "--grid", "fedavg_s=1"], "--grid fedavg_s: not among the compared"),
        (["--grid", "scaffold_s=0.2,0.2"], "--grid scaffold_s: [0.2, 0.2] names a scale twice"),
        (["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: no Ray head answers there"),
        (["--transport", "grpc"], "experiment compare does not take --transport (it takes --seeds, --s"),
    ],
)
def test_bad_requests_name_the_problem_and_write_nothing(tmp_path: Path, arguments: list[str], message: str) -> None:
    out = tmp_path / "report"
    done = fedsaddle("experiment", "compare", *arguments, "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not out.exists()


def test_a_plugin_or_other_synthetic_problem_runs_by_name() -> None:
    setup = compare.Setup(algorithms=("mirror_prox",), problems=("quadratic_game",), seeds=(0,), rounds=60)
    runs = [r for result in compare.run_local(setup.tasks(), workers=1) for r in result.runs]
    assert {r.step for r in runs} == {v * compare.SYNTHETIC_BASE for v in compare.STEP_FACTORS}
    best = compare.choose(runs)[0].runs[0]
    assert best.status == "ok" and best.final < best.curve[0][1] / 10  # the chosen step converges
    assert all(r.final >= best.final for r in runs)  # and none of the grid is closer within the budget


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed: pip install '.[ray]'")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (a namespace)")
def test_ray_gives_the_same_runs_csv_bytes_as_local_processes(tiny_report: Path, tmp_path: Path) -> None:
    # A one-node Ray (`--ray local`, ray.init() with no address) listens on every interface of its host:
    # it runs in a network namespace of its own, with only a loopback.
    from test_multihost import Network

    with Network(["solo"]) as net:
        command = [*net.run_in("solo"), sys.executable, "-m", "fedsaddle", "experiment", "compare", *TINY]
        done = subprocess.run(
            [*command, "--ray", "local", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs.csv").read_bytes() == (tiny_report / "runs.csv").read_bytes()
    placement = list(csv.DictReader(io.StringIO((tmp_path / "placement.csv").read_text())))
    assert len(placement) == 2 and all(len(row["node"]) == 56 for row in placement)  # Ray node ids, not "local"


AGES = {
    "name": "ages",
    "problem": {"name": "linear_regression", "num_clients": 4, "features": 9},
    "weighting": "samples",
    "algorithms": [{"name": "mirror_prox", "gamma": 0.1}],
}


@pytest.fixture(scope="module")
def ages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The diabetes data over four age groups, and a config of one's own on them."""
    from fedsaddle.experiments.datasets import binned, by_dataset_column, load_dataset, split

    folder = tmp_path_factory.mktemp("ages")
    split(binned(by_dataset_column(load_dataset("diabetes"), "age"), "age", [40, 50, 60]), None, "by-column", 0, folder)
    (folder / "run.yaml").write_text(yaml.safe_dump(AGES))
    return folder


def own_problem(folder: Path, **options: Any) -> compare.OwnProblem:
    import argparse

    from fedsaddle.cli.experiment import _own_problem

    arguments = {"config": str(folder / "run.yaml"), "data": [str(folder / "client-{i:03d}.npz")], "reference": None}
    return _own_problem(argparse.Namespace(**{**arguments, **options}))  # type: ignore[no-any-return]


def test_a_configs_problem_on_data_files_is_tuned_around_its_own_step_with_the_bits_of_a_run_alone(
    ages: Path, tmp_path: Path
) -> None:
    from fedsaddle import api

    own = own_problem(ages)
    assert own.bases == {"mirror_prox": 0.1} and own.extra["weighting"] == "samples" and own.reference is not None
    setup = compare.Setup(
        algorithms=("mirror_prox",), problems=(own.name,), own=own, seeds=(0, 1), rounds=60,
        grids={"mirror_prox": (1.0, 4.0)},
    )  # fmt: skip
    assert [t.seeds for t in setup.tasks()] == [(0, 1)]  # the same data for every seed: one task
    one = compare.run_local(setup.tasks(), workers=1)
    runs = [r for result in one for r in result.runs]
    assert sorted({r.step for r in runs}) == [0.1, 0.4]
    # Deterministic: the same runs.csv bytes again, and the batch's run is the run alone, bit for bit.
    again = compare.run_local(setup.tasks(), workers=1)
    assert compare.runs_csv(runs) == compare.runs_csv(r for result in again for r in result.runs)
    alone = api.run(
        {**AGES, "rounds": 60, "sync": {"kind": "fixed", "tau": 20}, "output": {"plot": False}},
        data=str(ages / "client-{i:03d}.npz"),
        out=tmp_path,
    ).results[0]
    (batched,) = [r for r in runs if r.step == 0.1 and r.seed == 0]
    assert batched.z_sha256 == alone.z_sha256 and batched.final == alone.dist_z


def test_compare_on_a_configs_problem_writes_the_same_report(ages: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = fedsaddle("experiment", "compare", "--config", str(ages / "run.yaml"), "--data",
                     str(ages / "client-{i:03d}.npz"), "--seeds", "1", "--rounds", "40",
                     "--grid", "mirror_prox=1,2", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO((out / "runs.csv").read_text())))
    assert [(r["problem"], r["algorithm"], r["step"]) for r in rows] == [
        ("linear_regression", "mirror_prox", "0.1"),
        ("linear_regression", "mirror_prox", "0.2"),
    ]
    report = (out / "compare.md").read_text()
    assert "`linear_regression` (the config's problem): step = scale x the config's step" in report
    assert "runs on its 4 clients' own data files, the same for every seed" in report
    assert (out / "figure_linear_regression.png").exists() and (out / "summary.csv").exists()


def test_a_configs_problem_without_a_solution_needs_a_reference(tmp_path: Path) -> None:
    from fedsaddle.cli.shared import UsageError
    from fedsaddle.experiments.datasets import split

    split("breast_cancer", 3, "label-skew", 1, tmp_path)
    config = {"problem": {"name": "agnostic", "num_clients": 3, "features": 30},
              "algorithms": [{"name": "mirror_prox", "gamma": 0.1}]}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UsageError, match=r"computes no reference_solution\(\): give z\* with --reference FILE\.npy"):
        own_problem(tmp_path)
    np.save(tmp_path / "short.npy", np.zeros(3))
    with pytest.raises(UsageError, match="z\\* has 3 entries, but problem 'agnostic' has z of 34 entries"):
        own_problem(tmp_path, reference=str(tmp_path / "short.npy"))
