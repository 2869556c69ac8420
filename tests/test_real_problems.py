"""The real problems on real data split across 10 clients: the federation finds the centralized solution.

Each centralized solution is computed here independently of fedsaddle's
gradient code, from the pooled training rows, with numpy, scipy or
scikit-learn. The federation (SCAFFOLD-S, in-process, weighting by samples)
must land on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.optimize import minimize
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.metrics import roc_auc_score

from fedsaddle import api
from fedsaddle.common.problems import make_problem, parse_spec, read_client_data
from fedsaddle.experiments.datasets import split

CLIENTS = 10


def pooled(folder: Path) -> tuple[np.ndarray[Any, Any], ...]:
    datas = [read_client_data(folder / f"client-{i:03d}.npz") for i in range(CLIENTS)]
    X = np.vstack([d.X for d in datas])
    y = np.concatenate([d.y for d in datas])
    group = np.concatenate([d.group for d in datas]) if datas[0].group is not None else np.zeros(0)
    return X, y, group


def federated(tmp_path: Path, folder: Path, problem: dict[str, Any], gamma: float, rounds: int) -> np.ndarray[Any, Any]:
    config = {
        "name": problem["name"],
        "problem": {**problem, "num_clients": CLIENTS},
        "weighting": "samples",
        "rounds": rounds,
        "sync": {"kind": "fixed", "tau": 10},
        "algorithms": [{"name": "scaffold_s", "gamma_local": gamma}],
        "output": {"plot": False},
    }
    report = api.run(config, data=str(folder / "client-{i:03d}.npz"), out=tmp_path / "runs")
    (result,) = report.results
    assert result.status == "ok", result.detail
    return result.final_z


def test_linear_regression_on_diabetes_finds_the_centralized_least_squares_saddle(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    split("diabetes", CLIENTS, "label-skew", seed=1, out=folder)
    X, t, _ = pooled(folder)
    lam, p = 0.1, X.shape[1]
    z = federated(tmp_path, folder, {"name": "linear_regression", "features": p, "lam": lam}, 0.2, 501)
    # min_x 1/8 ||A x - b||^2 + lam/2 ||x||^2 with the pooled moments, as a least-squares problem
    a, b = X.T @ X / len(t), X.T @ t / len(t)
    x_star = np.linalg.lstsq(np.vstack([a / 2, np.sqrt(lam) * np.eye(p)]), np.concatenate([b / 2, np.zeros(p)]))[0]
    np.testing.assert_allclose(z[:p], x_star, atol=1e-9)
    np.testing.assert_allclose(z[p:], (b - a @ x_star) / 2, atol=1e-9)
    # ... and it is linear regression: with a tiny lam, x* is scikit-learn's least-squares fit.
    tiny = make_problem(parse_spec({"name": "linear_regression", "features": p, "lam": 1e-12, "num_clients": CLIENTS}))
    datas = [tiny.load(folder / f"client-{i:03d}.npz") for i in range(CLIENTS)]  # type: ignore[attr-defined]
    reference = tiny.reference_solution(datas, np.array([d.samples for d in datas], dtype=float))  # type: ignore[attr-defined]
    np.testing.assert_allclose(reference[:p], LinearRegression(fit_intercept=False).fit(X, t).coef_, atol=1e-6)


def test_auc_maximization_on_breast_cancer_finds_the_centralized_saddle(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    summary = split("breast_cancer", CLIENTS, "label-skew", seed=1, out=folder)
    X, y, _ = pooled(folder)
    p_pos, lam, d = summary["positive_rate"], 0.1, X.shape[1]
    problem = {"name": "auc", "features": d, "positive_rate": p_pos, "lam": lam}
    z = federated(tmp_path, folder, problem, 0.03, 2001)
    positive = y > 0

    def primal(x: np.ndarray[Any, Any]) -> float:
        """Ying et al.'s objective with alpha maximized out, from the pooled rows."""
        w, a, b = x[:d], x[d], x[d + 1]
        s = X @ w
        alpha = (p_pos * s[~positive].sum() - (1 - p_pos) * s[positive].sum()) / len(y) / (p_pos * (1 - p_pos))
        rows = np.where(
            positive,
            (1 - p_pos) * (s - a) ** 2 - 2 * (1 + alpha) * (1 - p_pos) * s,
            p_pos * (s - b) ** 2 + 2 * (1 + alpha) * p_pos * s,
        )
        return float(rows.mean() - p_pos * (1 - p_pos) * alpha**2 + lam / 2 * (w @ w + a * a + b * b))

    # The primal is a convex quadratic: read its Hessian and gradient at 0 off function values, then solve.
    n, basis, q0 = d + 2, np.eye(d + 2), primal(np.zeros(d + 2))
    values = [primal(basis[j]) for j in range(n)]
    gradient = np.array([(values[j] - primal(-basis[j])) / 2 for j in range(n)])
    hessian = np.array([[primal(basis[j] + basis[k]) - values[j] - values[k] + q0 for k in range(n)] for j in range(n)])
    x_star = np.linalg.solve(hessian, -gradient)
    np.testing.assert_allclose(z[:n], x_star, atol=1e-6)
    test = np.load(folder / "test.npz")
    ours = roc_auc_score(test["y_test"], test["X_test"] @ z[:d])
    logistic = LogisticRegression(max_iter=5000).fit(X, y).decision_function(test["X_test"])
    logistic = roc_auc_score(test["y_test"], logistic)
    assert ours > 0.95 and abs(ours - logistic) < 0.03, (ours, logistic)


def test_fair_logistic_regression_on_diabetes_finds_the_centralized_solution(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    summary = split("diabetes_fair", CLIENTS, "label-skew", seed=1, out=folder)
    X, y, group = pooled(folder)
    pi, lam, rho, d = summary["group_rate"], 0.1, 1.0, X.shape[1]
    problem = {"name": "fair_logistic", "features": d, "group_rate": pi, "lam": lam, "rho": rho}
    z = federated(tmp_path, folder, problem, 0.2, 501)
    t = np.where(y > 0, 1.0, -1.0)
    c = np.where(group > 0, 1 / pi, -1 / (1 - pi))

    def primal(x: np.ndarray[Any, Any]) -> tuple[float, np.ndarray[Any, Any]]:
        """Logistic loss + lam/2 ||x||^2 + gap(x)^2 / (2 rho), and its gradient, from the pooled rows."""
        s = X @ x
        gap = float(np.mean(c * s))
        value = np.mean(np.log1p(np.exp(-t * s))) + lam / 2 * x @ x + gap**2 / (2 * rho)
        grad = X.T @ (-t / (1 + np.exp(t * s))) / len(t) + lam * x + gap / rho * (X.T @ c) / len(t)
        return float(value), grad

    found = minimize(primal, np.zeros(d), jac=True, method="L-BFGS-B", options={"gtol": 1e-13, "ftol": 0})
    x_star = found.x
    np.testing.assert_allclose(z[:d], x_star, atol=1e-6)
    assert z[d] == pytest.approx(np.mean(c * (X @ x_star)) / rho, abs=1e-6)  # nu* = gap / rho
