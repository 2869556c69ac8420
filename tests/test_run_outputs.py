"""The model comes out: each final iterate as .npy in the run directory, and `compare-runs`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from conftest import fedsaddle

from fedsaddle import api
from fedsaddle.common.numeric import sha256

SMALL: dict[str, Any] = {
    "name": "small",
    "problem": {"name": "quadratic_game", "num_clients": 3, "dim": 3},
    "rounds": 12,
    "sync": {"kind": "random", "p": 0.3},
    "algorithms": [
        {"name": "mirror_prox", "gamma": 0.1},
        {"name": "scaffold_s", "gamma_local": 0.05, "label": "scaffold s/fast"},
    ],
}


def run_dir_of(out: Path) -> Path:
    (run_dir,) = list(out.iterdir())
    return run_dir


def test_each_final_iterate_is_written_as_npy_whose_hash_is_the_summarys(tmp_path: Path) -> None:
    report = api.run(SMALL, out=tmp_path / "runs")
    summary = json.loads((report.run_dir / "summary.json").read_text())
    files = [entry["z_file"] for entry in summary["algorithms"]]
    assert files == ["final_z-mirror_prox.npy", "final_z-scaffold_s_fast.npy"]
    for entry, result in zip(summary["algorithms"], report.results, strict=True):
        z = np.load(report.run_dir / entry["z_file"], allow_pickle=False)
        assert z.dtype == np.dtype("<f8") and z.shape == (6,)
        assert sha256(z) == entry["z_sha256"] == result.z_sha256
        assert np.array_equal(z, result.final_z)


def test_compare_runs_exits_0_for_simulate_and_local_and_1_naming_a_difference(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    assert fedsaddle("simulate", "--config", str(config), "--out", str(tmp_path / "sim")).returncode == 0
    done = fedsaddle("local", "--config", str(config), "--out", str(tmp_path / "grpc"), "--quiet-clients")
    assert done.returncode == 0, done.stderr
    sim, grpc = run_dir_of(tmp_path / "sim"), run_dir_of(tmp_path / "grpc")
    same = fedsaddle("compare-runs", str(sim), str(grpc))
    assert same.returncode == 0, same.stdout
    assert same.stdout.startswith("same: ")

    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**SMALL, "seed": 1}))
    assert fedsaddle("simulate", "--config", str(other), "--out", str(tmp_path / "seed1")).returncode == 0
    differ = fedsaddle("compare-runs", str(sim), str(run_dir_of(tmp_path / "seed1")))
    assert differ.returncode == 1
    assert differ.stdout.startswith("differ: ")
    assert "config: seed: 0 vs 1" in differ.stdout
    assert "summary.json mirror_prox: z_sha256" in differ.stdout


def test_compare_runs_names_a_changed_final_iterate_entry(tmp_path: Path) -> None:
    first = api.run(SMALL, out=tmp_path / "a").run_dir
    second = api.run(SMALL, out=tmp_path / "b").run_dir
    assert fedsaddle("compare-runs", str(first), str(second)).returncode == 0
    z = np.load(second / "final_z-mirror_prox.npy")
    z[4] = np.nextafter(z[4], np.inf)
    np.save(second / "final_z-mirror_prox.npy", z)
    differ = fedsaddle("compare-runs", str(first), str(second))
    assert differ.returncode == 1
    assert "mirror_prox: final iterates differ first at entry 4" in differ.stdout


def test_compare_runs_of_a_folder_that_is_no_run_directory_is_a_usage_error(tmp_path: Path) -> None:
    done = fedsaddle("compare-runs", str(tmp_path), str(tmp_path))
    assert done.returncode == 2
    assert f"{tmp_path / 'summary.json'}: no such file" in done.stderr


def test_grad_norm_is_recorded_at_evaluated_steps_and_progress_says_when_it_was_evaluated(tmp_path: Path) -> None:
    config = {
        **SMALL,
        "rounds": 40,
        "evaluate_every": 15,
        "output": {"gradient_norm": True},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    run_dir = run_dir_of(tmp_path / "runs")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if "grad_norm" in r]
    assert evaluated == [0, 15, 30, 40]
    # ||G(z)|| of the federation: for the quadratic game G(z) = mean_i M_i (z - z*) + r_i, which
    # the distance to its planted z* bounds; at the end both have shrunk by orders of magnitude
    first, last = records[0], records[-1]
    assert 0 < last["grad_norm"] < 1e-3 * first["grad_norm"]
    assert "residual" not in last  # unconstrained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithms"][0]["metrics"] == {"grad_norm": last["grad_norm"]}
    assert summary["algorithms"][0]["traffic"]["evaluation"]["rounds"] == 4
    lines = [line for line in done.stderr.splitlines() if line.startswith("minibatch_md")]
    at_20 = next(line for line in lines if "round     20/40" in line)
    assert f"grad_norm {records[15]['grad_norm']:.4g} (evaluated at round 15)" in at_20


def test_compare_runs_of_simulate_and_local_on_data_leaves_out_the_distances_only_simulate_knows(
    tmp_path: Path,
) -> None:
    # simulate computes z* from all clients' files; a gRPC coordinator never has them. The two runs
    # computed the same, and compare-runs used to say "differ: ... dist_x: 5.4e-15 vs None".
    rng = np.random.default_rng(3)
    for i in range(3):
        X = rng.standard_normal((20, 3))
        np.savez(tmp_path / f"client-{i}.npz", X=X, y=X @ np.arange(1.0, 4.0) + i)
    data = str(tmp_path / "client-{i}.npz")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "on-data", "problem": {"name": "linear_regression", "num_clients": 3, "features": 3},
        "rounds": 20, "algorithms": [{"name": "scaffold_s", "gamma_local": 0.05}], "output": {"plot": False},
    }))  # fmt: skip
    done = fedsaddle("simulate", "--config", str(config), "--data", data, "--out", str(tmp_path / "sim"))
    assert done.returncode == 0, done.stderr
    done = fedsaddle(
        "local", "--config", str(config), "--data", data, "--out", str(tmp_path / "grpc"), "--quiet-clients"
    )
    assert done.returncode == 0, done.stderr
    sim, grpc = run_dir_of(tmp_path / "sim"), run_dir_of(tmp_path / "grpc")
    assert json.loads((sim / "summary.json").read_text())["algorithms"][0]["dist_z"] is not None
    same = fedsaddle("compare-runs", str(sim), str(grpc))
    assert same.returncode == 0, same.stdout
    assert same.stdout.startswith("same: ") and "distances to z* known in one run only, not compared" in same.stdout
    # Where both runs know z*, the distances are compared as before.
    summary = json.loads((sim / "summary.json").read_text())
    summary["algorithms"][0]["dist_z"] *= 2
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in sim.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "summary.json").write_text(json.dumps(summary))
    differ = fedsaddle("compare-runs", str(sim), str(copy))
    assert differ.returncode == 1 and "summary.json scaffold_s: dist_z" in differ.stdout
