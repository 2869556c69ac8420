"""Long runs stay where they converged, and a run that blows up is called diverged."""

from __future__ import annotations

from typing import Any

import numpy as np
from conftest import config

from fedsaddle.experiments.grid import STEP_SCALES, Grid, run_grid
from fedsaddle.server.algorithms import build
from fedsaddle.server.algorithms.catalyst import CatalystSpec, ScaffoldCatalystS
from fedsaddle.server.algorithms.spec import FixedSync
from fedsaddle.server.driver import DIVERGENCE_GROWTH, run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool


def test_every_default_runs_2000_rounds_at_every_s_without_diverging_or_drifting() -> None:
    # The paper's grid (s = 0..15, its three step scales), every algorithm's default variant (and FedAvg-S
    # with a constant step), 2000 rounds in the paper's convention: four times the paper's budget, so the runs
    # that reach round-off spend hundreds of rounds there. Each s is run with one of three seeds (s mod 3): a
    # seed draws another instance of the same problem, through the same code, so every s, step scale,
    # algorithm and seed is run, at a third of the cost of every seed at every s.
    grids = [
        Grid(
            rounds=2000,
            convention="paper",
            seeds=(seed,),
            s_values=tuple(float(s) for s in range(seed, 16, 3)),
            step_scales=STEP_SCALES,
            variants={},
        )
        for seed in (0, 1, 2)
    ]
    rows = [row for grid in grids for row in run_grid(grid)]
    assert len(rows) == len(grids[0].algorithms) * 16 * 3
    assert {(row.key["s"], row.key["seed"]) for row in rows} == {(float(s), s % 3) for s in range(16)}
    problems = []
    for row in rows:
        distances = [float(r["dist_z"]) for r in row.result.records]
        best = int(np.argmin(distances))
        worst_after = max(distances[best:])
        if row.result.status != "ok" or worst_after > 4 * distances[best] + 1e-15:
            problems.append((row.key, row.result.status, distances[best], worst_after))
    assert not problems, problems[:10]


def test_catalyst_keeps_its_theta_estimate_at_round_off() -> None:
    # s = 1, step 0.05, seed 0 drifted to theta = 154 at round-off and then to NaN
    # (about 1100 paper rounds) before the estimate was safeguarded.
    run = Grid(rounds=2000, convention="paper").config("catalyst_ours", 1.0, 0.05, 0)
    result = run_algorithm(run.algorithms[0], run, LocalPool())
    assert result.status == "ok"
    assert result.dist_z < 1e-14
    catalyst = build(CatalystSpec(gamma_local=0.05, theta_rule="estimated"), FixedSync())
    assert isinstance(catalyst, ScaffoldCatalystS)
    assert catalyst.theta_max == 20.0  # 1 / gamma_local


def _run(algorithm: dict[str, Any], rounds: int) -> Any:
    run = config(
        problem={"name": "paper_regression", "num_clients": 4, "dim": 4, "s": 1.0},
        algorithms=[algorithm],
        rounds=rounds,
    )
    return run_algorithm(run.algorithms[0], run, LocalPool())


def test_growth_far_beyond_the_start_is_reported_as_diverged() -> None:
    # Gradient descent on a strongly monotone problem with a step far too large grows
    # geometrically but stays finite for many rounds: it must not be reported ok.
    result = _run({"name": "minibatch_md", "gamma": 3.0}, rounds=60)
    assert result.status == "diverged"
    assert "||z - z*|| grew from" in result.detail
    start = float(result.records[0]["dist_z"])
    last = float(result.records[-1]["dist_z"])
    assert np.isfinite(last) and last > DIVERGENCE_GROWTH * start


def test_a_converging_run_is_ok() -> None:
    result = _run({"name": "minibatch_md", "gamma": 0.1}, rounds=60)
    assert result.status == "ok"
    assert result.dist_z < float(result.records[0]["dist_z"])
