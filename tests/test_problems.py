"""Gradient mappings against finite differences, and the planted solutions."""

from __future__ import annotations

import numpy as np
import pytest

from fedsaddle.common.problems import (
    PaperRegressionSpec,
    QuadraticGameSpec,
    make_shards,
    solution,
)

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


def test_out_of_range_client_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"client indices \[4\] are outside \[0, 4\)"):
        make_shards(SPECS[0], seed=0, indices=[4])
