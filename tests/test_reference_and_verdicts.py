"""`--reference FILE` (z* with its accuracy), run verdicts, and iterates kept along a run (output.save_every)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import fedsaddle, strict_json

from fedsaddle import api
from fedsaddle.common.numeric import norm, sha256
from fedsaddle.common.problems import solution
from fedsaddle.server.config import ConfigError, parse_config
from fedsaddle.server.reference import ReferenceError, load_reference, save_reference, shown
from fedsaddle.server.verdict import judge, trend

# -- the reference file ----------------------------------------------------------------------


def test_a_saved_reference_reads_back_with_its_accuracy_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    z = np.array([0.5, -1.0, 2.0])
    npy, note = save_reference(tmp_path / "z.npy", z, 3e-9, 1e-12, "newton", "quadratic_game")
    assert note == tmp_path / "z.json" and json.loads(note.read_text())["z_sha256"] == sha256(z)
    back = load_reference(npy, "quadratic_game", 3)
    assert back.accuracy == 3e-9 and np.array_equal(back.z, z)

    with pytest.raises(ReferenceError, match=r"z\.npy: z\* has 3 entries, but problem 'quadratic_game' has z of 4"):
        load_reference(npy, "quadratic_game", 4)
    with pytest.raises(ReferenceError, match="solved for problem 'quadratic_game', and this run's problem is 'auc'"):
        load_reference(npy, "auc", 3)  # the same length, another problem
    with pytest.raises(ReferenceError, match=r"must end in \.npy"):
        save_reference(tmp_path / "z.bin", z, 1e-9, 1e-12, "newton", "quadratic_game")
    np.save(npy, z + 1)  # another z* beside the old note
    with pytest.raises(ReferenceError, match="was written for another z"):
        load_reference(npy, "quadratic_game", 3)
    note.unlink()  # a bare .npy: a z* of one's own, taken as exact
    assert load_reference(npy, "quadratic_game", 3).accuracy == 0.0
    save_reference(npy, z, math.inf, 1e-3, "extragradient", "quadratic_game")
    with pytest.raises(ReferenceError, match="its accuracy is unknown"):
        load_reference(npy, "quadratic_game", 3)
    assert json.loads(note.read_text())["accuracy"] is None
    assert shown(4e-7, 1e-6) == "<1.0e-06" and shown(4e-7, 0.0) == "4.000e-07" and shown(math.nan, 0.0) == "-"


def test_check_problems_reference_drives_simulate_and_distances_finer_than_it_are_not_printed(tmp_path: Path) -> None:
    from fedsaddle.experiments.datasets import split

    split("breast_cancer", 4, "label-skew", 2, tmp_path / "data")
    config = {
        "name": "afl",
        "problem": {"name": "agnostic", "num_clients": 4, "features": 30, "lam": 0.2, "nu": 0.2},
        "rounds": 300,
        "algorithms": [{"name": "mirror_prox", "gamma": 0.5}],
        "output": {"plot": False},
    }
    path = tmp_path / "afl.yaml"
    path.write_text(yaml.safe_dump(config))
    data = str(tmp_path / "data" / "client-{i:03d}.npz")
    zs = tmp_path / "z_star.npy"
    checked = fedsaddle("check-problem", "--config", str(path), "--data", data, "--save-reference", str(zs))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    accuracy = json.loads((tmp_path / "z_star.json").read_text())["accuracy"]
    assert 0 < accuracy < 1e-9

    def simulate(*extra: str) -> tuple[Any, str, Path]:
        done = fedsaddle("simulate", "--config", str(path), "--data", data, "--out", str(tmp_path / "runs"), *extra)
        assert done.returncode == 0, done.stderr
        run_dir = Path(done.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
        return strict_json((run_dir / "summary.json").read_text())["algorithms"][0], done.stdout, run_dir

    given, _, run_dir = simulate("--reference", str(zs))
    z = np.load(run_dir / given["z_file"])
    assert given["dist_z"] == pytest.approx(norm(z - np.load(zs)), rel=1e-12)
    assert given["reference_accuracy"] == accuracy and given["verdict"] == "converged"

    # The same z*, said to be known to 1e-3 only: the distances it cannot tell are shown as below it.
    note = json.loads((tmp_path / "z_star.json").read_text())
    (tmp_path / "z_star.json").write_text(json.dumps({**note, "accuracy": 1e-3}))
    coarse, printed, _ = simulate("--reference", str(zs))
    row = next(line for line in printed.splitlines() if line.startswith("mirror_prox "))
    assert row.split()[1:3] == ["<1.0e-03", "<1.0e-03"]
    assert coarse["rounds_to"]["1e-04"] is None and coarse["rounds_to"]["1e-02"] is not None
    assert "n/a: finer than z*'s accuracy (1.0e-03" in printed
    assert "below z*'s accuracy 1.0e-03" in coarse["verdict_detail"]

    # A reference for another problem size: refused before the run, naming the file and both lengths.
    np.save(tmp_path / "short.npy", np.zeros(7))
    done = fedsaddle("simulate", "--config", str(path), "--data", data, "--reference", str(tmp_path / "short.npy"))
    assert done.returncode == 2
    assert f"--reference {tmp_path / 'short.npy'}: z* has 7 entries, but problem 'agnostic' has z of 35" in done.stderr


def test_local_and_coordinator_measure_against_the_given_reference(tmp_path: Path) -> None:
    config = {
        "name": "game",
        "problem": {"name": "quadratic_game", "num_clients": 2, "dim": 2},
        "rounds": 30,
        "algorithms": [{"name": "mirror_prox", "gamma": 0.1}],
        "output": {"plot": False},
    }
    path = tmp_path / "game.yaml"
    path.write_text(yaml.safe_dump(config))
    z_star = solution(parse_config(config).problem, 0)
    assert z_star is not None
    shifted = z_star + 0.25  # not the problem's own z*: the distances must be to this one
    np.save(tmp_path / "ref.npy", shifted)
    done = fedsaddle("local", "--config", str(path), "--out", str(tmp_path / "runs"), "--quiet-clients",
                     "--reference", str(tmp_path / "ref.npy"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = Path(done.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    entry = strict_json((run_dir / "summary.json").read_text())["algorithms"][0]
    final = np.load(run_dir / entry["z_file"])
    assert entry["dist_z"] == pytest.approx(norm(final - shifted), rel=1e-12)
    assert "reference_accuracy" not in entry  # a bare .npy is exact
    assert entry["distance_scale"] == pytest.approx(max(norm(shifted), norm(np.ones(4) - shifted)), rel=1e-12)

    np.save(tmp_path / "long.npy", np.zeros(5))
    refused = fedsaddle("coordinator", "--config", str(path), "--listen", "127.0.0.1:0",
                        "--reference", str(tmp_path / "long.npy"), timeout=30)  # fmt: skip
    assert refused.returncode == 2  # before it listens: no client is waited for
    assert "z* has 5 entries, but problem 'quadratic_game' has z of 4 entries" in refused.stderr
    assert "listening" not in refused.stderr


# -- verdicts --------------------------------------------------------------------------------


def records(key: str, values: list[float]) -> list[dict[str, float | int]]:
    return [{"step": i, "rounds": i, key: v} for i, v in enumerate(values)]


def test_the_verdict_rules() -> None:
    falling = [4.0 * 0.5**i for i in range(30)]
    assert judge(records("dist_z", falling), None, 4.0, 0.0, 1e-6).kind == "converged"
    slow = judge(records("dist_z", [4.0 * 0.9**i for i in range(30)]), None, 4.0, 0.0, 1e-6)
    assert (
        slow.kind == "not converged"
        and "decreasing" in slow.detail
        and "1.884e-01 at the end, decreasing (x0.229" in slow.detail
    )
    rising = [1.0 * 1.05**i for i in range(30)]
    grows = judge(records("dist_z", rising), None, 4.0, 0.0, 1e-6)
    assert grows.kind == "not converged" and "growing" in grows.detail
    # Far beyond the problem's scale: diverged, though 10^4-fold growth (the run's stop rule) was not reached.
    far = judge(records("dist_z", [4.0, 10.0, 50.0]), None, 4.0, 0.0, 1e-6)
    assert far.kind == "diverged" and "scale" in far.detail
    assert trend([1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.1])[0] == "oscillating"
    assert trend([1.0, 1.0, 1.01, 1.0, 1.02])[0] == "stalled"
    # Without z*: ||G|| (or the projected residual), judged against its first value.
    assert judge(records("grad_norm", [1.0, 0.5, 1e-8]), None, math.nan, 0.0, 1e-6).kind == "converged"
    assert judge(records("grad_norm", [1.0, 50.0, 200.0]), None, math.nan, 0.0, 1e-6).kind == "diverged"
    assert judge(records("residual", [1.0, 0.9, 0.95]), None, math.nan, 0.0, 1e-6).detail.startswith(
        "||z-P(z-G(z))|| 9.500e-01"
    )
    assert judge([{"step": 0, "rounds": 0}], None, math.nan, 0.0, 1e-6).kind == "unknown"
    assert judge(records("dist_z", [1.0, math.inf]), None, 1.0, 0.0, 1e-6).kind == "diverged"
    assert judge(records("dist_z", [1.0, 1e-4]), "it blew up", 1.0, 0.0, 1e-6) == ("diverged", "it blew up")
    below = judge(records("dist_z", [1.0, 1e-4]), None, 1.0, 1e-3, 1e-6)
    assert below == ("converged", "||z-z*|| below z*'s accuracy 1.0e-03")


def test_a_run_that_ends_ok_far_from_z_star_is_not_called_converged(tmp_path: Path) -> None:
    def run(gamma: float, rounds: int) -> Any:
        config = {
            "name": "mp",
            "rounds": rounds,
            "problem": {"name": "paper_regression", "num_clients": 4},
            "algorithms": [{"name": "mirror_prox", "gamma": gamma}],
            "output": {"plot": False},
        }
        report = api.run(config, out=tmp_path)
        return report.results[0], strict_json((report.run_dir / "summary.json").read_text())["algorithms"][0]

    # gamma just under the step that blows up (0.36 does by round 314): status ok, a distance near the start.
    ok_far, entry = run(0.35, 400)
    assert ok_far.status == "ok" and 1 < ok_far.dist_z < 10
    assert entry["verdict"] == "not converged" and "growing" in entry["verdict_detail"]
    # Too large a step, cut short before the 10^4-fold stop: the problem's scale calls it diverged.
    early, entry = run(0.4, 30)
    assert early.status == "ok" and entry["verdict"] == "diverged"
    good, entry = run(0.3, 400)
    assert entry["verdict"] == "converged" and good.dist_z < 1e-6


# -- iterates along the way ------------------------------------------------------------------


def test_save_every_keeps_a_bounded_evenly_spaced_path_and_changes_no_hash(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "name": "path",
        "rounds": 96,
        "problem": {"name": "paper_regression", "num_clients": 4},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    plain = api.run(config, out=tmp_path / "plain").results[0]
    kept = api.run({**config, "output": {"plot": False, "save_every": 4, "save_max": 5}}, out=tmp_path / "kept")
    assert kept.results[0].z_sha256 == plain.z_sha256
    folder = kept.run_dir / "iterates-minibatch_md"
    steps = sorted(int(p.stem.removeprefix("step-")) for p in folder.glob("step-*.npy"))
    # 96 steps every 4 is 25 files; at most 5 kept: the interval doubled to 16, then to 32 (0, 32, 64 ... 96).
    assert steps == [0, 32, 64, 96]
    np.testing.assert_array_equal(np.load(folder / "step-000096.npy"), plain.final_z)
    assert np.array_equal(np.load(folder / "step-000000.npy"), np.ones(plain.final_z.size))

    with pytest.raises(ConfigError, match=r"output\.save_every: must be a number of steps >= 1, got 0"):
        parse_config({**config, "output": {"save_every": 0}})


def test_stop_beyond_scale_ends_a_runaway_run_sooner_and_changes_nothing_else(tmp_path: Path) -> None:
    def run(gamma: float, stop: bool) -> Any:
        config = {
            "name": "mp",
            "rounds": 400,
            "problem": {"name": "paper_regression", "num_clients": 4},
            "algorithms": [{"name": "mirror_prox", "gamma": gamma}],
            "output": {"plot": False, "stop_beyond_scale": stop},
        }
        return api.run(config, out=tmp_path).results[0]

    late, early = run(0.4, False), run(0.4, True)
    assert late.status == early.status == "diverged"
    assert late.traffic["algorithm"]["rounds"] == 66 and "grew from 4.47 to 4.61e+04" in late.detail
    assert early.traffic["algorithm"]["rounds"] == 22
    assert "over 10 times the problem's scale max(||z*||, ||z0-z*||) = 4.47" in early.detail
    # A run that converges is the same run with it on: the same bits.
    assert run(0.3, True).z_sha256 == run(0.3, False).z_sha256
