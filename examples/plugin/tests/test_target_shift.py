"""The example plug-in: its oracles are right, and a federation of 10 clients finds its saddle point."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fedsaddle_target_shift import TargetShift, TargetShiftSpec

from fedsaddle import api
from fedsaddle.experiments.datasets import split

PLUGIN = "fedsaddle_target_shift:TargetShift"


def test_the_gradient_mapping_matches_finite_differences(tmp_path: Path) -> None:
    split("diabetes", 10, "iid", seed=0, out=tmp_path)
    problem = TargetShift(TargetShiftSpec(features=10))
    data = problem.load(tmp_path / "client-000.npz")
    z = np.random.default_rng(0).standard_normal(11)
    numeric = np.empty(11)
    for j in range(11):
        step = np.zeros(11)
        step[j] = 1e-6
        derivative = (problem.objective(data, z + step) - problem.objective(data, z - step)) / 2e-6
        numeric[j] = derivative if j < 10 else -derivative  # G = (grad_x f, -grad_u f)
    np.testing.assert_allclose(problem.gradient(data, z), numeric, atol=1e-7)


def test_a_federation_finds_the_saddle_point_of_the_plugin(tmp_path: Path) -> None:
    split("diabetes", 10, "label-skew", seed=2, out=tmp_path / "data")
    config = {
        "problem": {"name": "target_shift", "plugin": PLUGIN, "num_clients": 10, "features": 10},
        "weighting": "samples",
        "evaluate_every": 100,
        "rounds": 401,
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.1}],
        "output": {"plot": False},
    }
    report = api.run(config, data=str(tmp_path / "data" / "client-{i:03d}.npz"), out=tmp_path / "runs")
    (result,) = report.results
    assert result.dist_z < 1e-10  # the distance to the plug-in's own reference solution
    assert result.records[-1]["test_mse"] < 1.0  # held-out error of a standardized target
    assert result.traffic["evaluation"]["rounds"] == 3  # steps 0, 100 and 200 (one step per sync)
