"""The differential-privacy experiment, small: 2 seeds, 2 epsilons, a few rounds, with real runs."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsaddle.common import dp
from fedsaddle.common.dp import DpSettings
from fedsaddle.experiments.dp import Setup, noise_multiplier, run_dp

ROUNDS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    out = tmp_path_factory.mktemp("dp")
    run_dp(out, "test", seeds=(0, 1), epsilons=(0.1, 8.0), setup=Setup(rounds=ROUNDS))
    with (out / "runs.csv").open() as handle:
        return out, list(csv.DictReader(handle))


def rows(runs: list[dict[str, str]], kind: str, epsilon: str = "") -> list[dict[str, str]]:
    return [r for r in runs if r["kind"] == kind and r["epsilon_target"] == epsilon]


def test_every_run_is_written_with_its_kind(tiny: tuple[Path, list[dict[str, str]]]) -> None:
    out, runs = tiny
    assert len(runs) == 2 * (2 + 2)  # per seed: plain, clipping only, and one run per epsilon
    assert [len(rows(runs, k, e)) for k, e in [("plain", ""), ("clip-only", ""), ("dp", "0.1"), ("dp", "8.0")]] == [
        2,
        2,
        2,
        2,
    ]
    assert all(r["status"] == "ok" and int(r["releases"]) == ROUNDS for r in runs)
    assert {r["noise_added_by"] for r in rows(runs, "dp", "0.1") + rows(runs, "dp", "8.0")} == {"clients"}
    assert (out / "figure_dp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| 0.1 | " in table and "| 8 | " in table and "secure aggregation" in table


def test_the_reported_epsilon_is_the_accountants_and_meets_the_target(tiny: tuple[Path, list[dict[str, str]]]) -> None:
    _, runs = tiny
    for target in (0.1, 8.0):
        for run in rows(runs, "dp", str(target)):
            z, clip, delta = float(run["noise_multiplier"]), float(run["clip"]), float(run["delta"])
            assert z == noise_multiplier(target, ROUNDS, delta)
            assert float(run["epsilon_reported"]) == dp.epsilon(DpSettings(clip, z), 1.0, ROUNDS, delta)
            assert 0.999 * target < float(run["epsilon_reported"]) <= target  # calibrated, not merely below
            assert float(run["sigma"]) == pytest.approx(z * clip)


def test_more_noise_moves_the_result_further_from_the_non_private_solution(
    tiny: tuple[Path, list[dict[str, str]]],
) -> None:
    _, runs = tiny

    def mean(kind: str, epsilon: str, key: str) -> float:
        return float(np.mean([float(r[key]) for r in rows(runs, kind, epsilon)]))

    plain = mean("plain", "", "dist_to_nonprivate")
    clipped = mean("clip-only", "", "dist_to_nonprivate")
    little_noise, much_noise = mean("dp", "8.0", "dist_to_nonprivate"), mean("dp", "0.1", "dist_to_nonprivate")
    assert plain < clipped  # clipped steps are shorter: after a few rounds the run is further from z*
    assert much_noise > little_noise  # z = 83 against z = 1.6 for the same clip
    assert much_noise > clipped
    # The non-private run's AUC is close to z*'s; each seed has its own split, so its own z*.
    for run in rows(runs, "plain", ""):
        assert abs(float(run["test_auc"]) - float(run["nonprivate_auc"])) < 0.05


def test_the_runs_without_client_noise_are_reproducible(
    tiny: tuple[Path, list[dict[str, str]]], tmp_path: Path
) -> None:
    _, runs = tiny
    again = run_dp(tmp_path, "test", seeds=(1,), epsilons=(8.0,), setup=Setup(rounds=ROUNDS))
    for kind in ("plain", "clip-only"):
        (first,) = [r for r in rows(runs, kind, "") if r["seed"] == "1"]
        (second,) = [r for r in again if r.kind == kind]
        assert second.z_sha256 == first["z_sha256"]
    # The clients' noise is their own (operating-system entropy): a private run is not repeated bit for bit.
    (first_private,) = [r for r in rows(runs, "dp", "8.0") if r["seed"] == "1"]
    assert [r.z_sha256 for r in again if r.kind == "dp"] != [first_private["z_sha256"]]


def test_the_noise_multiplier_falls_as_epsilon_grows_and_bad_input_is_refused() -> None:
    zs = [noise_multiplier(e, 20, 1e-5) for e in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert zs == sorted(zs, reverse=True)
    assert noise_multiplier(1.0, 80, 1e-5) > zs[1]  # more releases need more noise for the same epsilon
    with pytest.raises(ValueError, match="epsilon > 0"):
        noise_multiplier(0.0, 20, 1e-5)
    with pytest.raises(ValueError, match="at least one seed"):
        run_dp(Path("unused"), "test", seeds=())


def test_the_command_line_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    args = ["experiment", "dp", "--seeds", "1", "--epsilons", "4", "--rounds", "3", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "fedsaddle", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "table.md" in done.stdout
    with (out / "runs.csv").open() as handle:
        written = list(csv.DictReader(handle))
    assert [(r["kind"], r["epsilon_target"], r["releases"]) for r in written] == [
        ("plain", "", "3"),
        ("clip-only", "", "3"),
        ("dp", "4.0", "3"),
    ]
    refused = ["experiment", "dp", "--epsilons", "-1", "--out", str(tmp_path / "refused")]
    bad = subprocess.run([sys.executable, "-m", "fedsaddle", *refused], capture_output=True, timeout=300)
    assert bad.returncode != 0 and b"--epsilons" in bad.stderr
    grpc = ["experiment", "dp", "--transport", "grpc", "--out", str(tmp_path / "refused")]
    bad = subprocess.run([sys.executable, "-m", "fedsaddle", *grpc], capture_output=True, timeout=300)
    named = b"experiment dp does not take --transport (it takes --seeds, --rounds, --epsilons, --out)"
    assert bad.returncode != 0 and named in bad.stderr
    assert not (tmp_path / "refused").exists()
