"""Gradient mappings against finite differences, and the planted solutions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedsaddle.common.problems import (
    PaperRegressionSpec,
    ProblemNotFound,
    QuadraticGameSpec,
    make_problem,
    make_shards,
    parse_spec,
    solution,
)
from fedsaddle.common.problems.registry import registered, rescan

SPECS = [
    PaperRegressionSpec(num_clients=4, dim=3, lam=0.1, s=2.0),
    PaperRegressionSpec(num_clients=3, dim=5, lam=1e-5, s=0.0),
    QuadraticGameSpec(num_clients=4, dim=3, mu=0.5, heterogeneity=1.0),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-d{s.dim}")
def test_gradient_mapping_matches_finite_differences(spec: PaperRegressionSpec | QuadraticGameSpec) -> None:
    shards = make_shards(spec, seed=7, indices=range(spec.num_clients))
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2 * spec.dim, spec.num_clients))  # one column per client
    d, h = spec.dim, 1e-6
    numeric = np.empty_like(z)
    for j in range(2 * d):
        step = np.zeros_like(z)
        step[j] = h
        derivative = (shards.objective(z + step) - shards.objective(z - step)) / (2 * h)
        # G = (grad_x f, -grad_y f)
        numeric[j] = derivative if j < d else -derivative
    np.testing.assert_allclose(shards.gradient(z), numeric, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-d{s.dim}")
def test_mean_gradient_vanishes_at_the_planted_solution(spec: PaperRegressionSpec | QuadraticGameSpec) -> None:
    z_star = solution(spec, seed=3)
    assert z_star is not None
    shards = make_shards(spec, seed=3, indices=range(spec.num_clients))
    per_client = shards.gradient(np.tile(z_star[:, None], (1, spec.num_clients)))
    assert np.linalg.norm(per_client.mean(axis=1)) < 1e-12
    if spec.name == "quadratic_game" or spec.s > 0:
        # heterogeneous: each client alone would not stop at z*
        assert np.linalg.norm(per_client, axis=0).min() > 1e-3


def test_paper_data_follows_the_papers_recipe() -> None:
    spec = PaperRegressionSpec(num_clients=10, dim=200, s=3.0)
    shards = make_shards(spec, seed=1, indices=range(10))
    assert shards.a.min() >= 1.0  # type: ignore[attr-defined]
    np.testing.assert_allclose(shards.b.mean(axis=1), 0.0, atol=1e-12)  # type: ignore[attr-defined]
    # b'_i ~ N(0, s^2): after centering over 10 clients the spread is s * sqrt(9/10)
    assert shards.b.std() == pytest.approx(3.0 * np.sqrt(0.9), rel=0.05)  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-d{s.dim}")
def test_a_clients_shard_does_not_depend_on_its_process_mates(spec: PaperRegressionSpec | QuadraticGameSpec) -> None:
    together = make_shards(spec, seed=5, indices=range(spec.num_clients))
    z = np.random.default_rng(1).standard_normal((2 * spec.dim, spec.num_clients))
    for i in range(spec.num_clients):
        alone = make_shards(spec, seed=5, indices=[i])
        assert np.array_equal(alone.gradient(z[:, i : i + 1])[:, 0], together.gradient(z)[:, i])


def test_a_long_paper_gradient_is_the_whole_vector_formula_bit_for_bit() -> None:
    # Long enough to be computed block by block, with a short last block, for two
    # clients and a batch of two runs with their own lambda.
    specs = [PaperRegressionSpec(num_clients=3, dim=2 * 65536 + 5, lam=lam, s=2.0) for lam in (1e-5, 0.3)]
    runs = [make_shards(spec, seed=9, indices=[0, 2]) for spec in specs]
    stacked = type(runs[0]).stack(runs)  # type: ignore[attr-defined]
    d = specs[0].dim
    z = np.random.default_rng(4).standard_normal((2 * d, 2, 2))
    x, y = z[:d], z[d:]
    half_a, half_b = 0.5 * stacked.a, 0.5 * stacked.b  # exact: the shards keep the halves
    lam = np.array([1e-5, 0.3])
    expected = np.concatenate([lam * x - half_a * y, (y - half_b) + half_a * x])
    assert np.array_equal(stacked.gradient(z), expected)
    assert np.array_equal(runs[1].gradient(z[..., 1]), expected[..., 1])


def test_out_of_range_client_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"client indices \[4\] are outside \[0, 4\)"):
        make_shards(SPECS[0], seed=0, indices=[4])


def test_an_installed_plugin_is_found_by_its_entry_point_and_trusted_by_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `pip install` of a plug-in package leaves behind: a distribution with an entry point.
    dist = tmp_path / "fedsaddle_fake-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedsaddle-fake\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedsaddle.problems]\ntarget_shift = fedsaddle_target_shift:TargetShift\n")
    rescan()
    assert "target_shift" not in registered()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "target_shift" not in registered()  # read once per process: a new package needs a new one ...
    rescan()  # ... or this
    try:
        assert registered()["target_shift"] == "fedsaddle_target_shift:TargetShift"
        spec = parse_spec({"name": "target_shift", "features": 3}, trusted=())  # no plugin path, nothing trusted
        assert make_problem(spec, trusted=()).dims() == (3, 1)
    finally:
        monkeypatch.undo()
        rescan()


def test_a_plugin_path_loads_only_where_it_is_trusted() -> None:
    entry = {"name": "target_shift", "plugin": "fedsaddle_target_shift:TargetShift", "features": 3}
    assert parse_spec(entry).name == "target_shift"  # the coordinator's operator wrote the config
    with pytest.raises(ProblemNotFound, match="which this process does not trust"):
        parse_spec(entry, trusted=())
    assert parse_spec(entry, trusted=["fedsaddle_target_shift:TargetShift"]).name == "target_shift"
    with pytest.raises(ProblemNotFound, match="'os' is not a fedsaddle Problem class"):
        parse_spec({"name": "x", "plugin": "json:os"})
    with pytest.raises(ProblemNotFound, match="cannot import 'no_such_module'"):
        parse_spec({"name": "x", "plugin": "no_such_module:Problem"})
    with pytest.raises(ProblemNotFound, match="defines problem 'target_shift', not 'other'"):
        parse_spec({**entry, "name": "other"})


DATA_PROBLEMS = [
    {"name": "linear_regression", "features": 4, "lam": 0.3},
    {"name": "auc", "features": 4, "positive_rate": 0.4, "lam": 0.1},
    {"name": "fair_logistic", "features": 4, "group_rate": 0.3, "lam": 0.1, "rho": 0.5},
]


@pytest.mark.parametrize("entry", DATA_PROBLEMS, ids=lambda e: e["name"])
def test_real_problems_gradient_mappings_match_finite_differences(entry: dict[str, object], tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    rows = 30
    np.savez(
        tmp_path / "c.npz",
        X=rng.standard_normal((rows, 4)),
        y=(rng.random(rows) < 0.5).astype(float),
        group=(rng.random(rows) < 0.3).astype(float),
    )
    problem = make_problem(parse_spec(entry))
    data = problem.load(tmp_path / "c.npz")  # type: ignore[attr-defined]
    dim_x, _ = problem.dims()
    z = rng.standard_normal(problem.dimension)
    numeric = np.empty_like(z)
    for j in range(len(z)):
        step = np.zeros_like(z)
        step[j] = 1e-6
        derivative = (problem.objective(data, z + step) - problem.objective(data, z - step)) / 2e-6  # type: ignore[attr-defined]
        numeric[j] = derivative if j < dim_x else -derivative  # G = (grad_x f, -grad_y f)
    np.testing.assert_allclose(problem.gradient(data, z), numeric, rtol=1e-6, atol=1e-7)  # type: ignore[attr-defined]


def test_a_plugin_that_cannot_be_imported_is_a_problem_plugin_error_that_says_how_to_fix_it(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    problem = {"name": "mine", "plugin": "my_absent_package.problem:Mine", "num_clients": 2}
    path.write_text(yaml.safe_dump({"problem": problem, "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}))
    done = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "simulate", "--config", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "problem.plugin: plugin 'my_absent_package.problem:Mine': cannot import 'my_absent_package.problem'" in (
        done.stderr
    )
    assert "problem.name" not in done.stderr
    for advice in ("pip install -e", "PYTHONPATH", "the coordinator", "every client process", "--problem"):
        assert advice in done.stderr
