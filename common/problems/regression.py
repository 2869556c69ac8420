"""The paper's saddle-point form of L2-regularized linear regression, on each client's own rows.

Client i holds rows X_i (m_i x p) and targets t_i, and forms from them alone

    A_i = X_i^T X_i / m_i,   b_i = X_i^T t_i / m_i,
    f_i(x, y) = -1/2 [ ||y||^2 - b_i^T y + y^T A_i x ] + lam/2 ||x||^2,   x, y in R^p,

the paper's f_i (section Experiments) with data-built A_i, b_i. Maximizing over y
gives f(x) = 1/8 ||A x - b||^2 + lam/2 ||x||^2 with A, b the mean of the clients'
(weighted by samples: the moments of the pooled data, so that for small lam x*
is the least-squares fit). f is lam-strongly convex in x and 1-strongly concave in y.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientData, DataProblem, ProblemSpec


class LinearRegressionSpec(ProblemSpec):
    name: Literal["linear_regression"] = "linear_regression"
    features: int = Field(ge=1, description="p: columns of each client's X (x and y live in R^p)")
    lam: float = Field(1e-2, gt=0, description="lambda, the L2 weight on x")


class LinearRegression(DataProblem):
    Spec = LinearRegressionSpec
    spec: LinearRegressionSpec
    metric_names = ("test_mse",)

    def __init__(self, spec: LinearRegressionSpec) -> None:
        super().__init__(spec)
        self._moments: dict[str, tuple[Array, Array]] = {}

    def dims(self) -> tuple[int, int]:
        return self.spec.features, self.spec.features

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        return data

    @classmethod
    def statistics(cls, datas: Sequence[ClientData]) -> dict[str, int | float]:
        return {"features": int(datas[0].X.shape[1])}

    def moments(self, data: ClientData) -> tuple[Array, Array]:
        """(A_i, b_i) of one client, computed once."""
        if data.path not in self._moments:
            m = data.samples
            self._moments[data.path] = (data.X.T @ data.X / m, data.X.T @ data.y / m)
        return self._moments[data.path]

    def gradient(self, data: ClientData, z: Array) -> Array:
        a, b = self.moments(data)
        p = self.spec.features
        x, y = z[:p], z[p:]
        # grad_x f_i = lam x - A_i^T y / 2;   -grad_y f_i = y - b_i / 2 + A_i x / 2
        return np.concatenate([self.spec.lam * x - 0.5 * (a.T @ y), y - 0.5 * b + 0.5 * (a @ x)])

    def objective(self, data: ClientData, z: Array) -> float:
        a, b = self.moments(data)
        p = self.spec.features
        x, y = z[:p], z[p:]
        return float(-0.5 * (y @ y - b @ y + y @ (a @ x)) + 0.5 * self.spec.lam * (x @ x))

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        residual = data.X_test @ z[: self.spec.features] - data.y_test
        return (float(residual @ residual / len(residual)),)

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array:
        """z* from the clients' moments: x* = (A^2 / 4 + lam I)^{-1} A b / 4, y* = (b - A x*) / 2."""
        w = np.ones(len(datas)) if weights is None else np.asarray(weights, dtype=float)
        moments = [self.moments(d) for d in datas]
        a = sum(wi * m[0] for wi, m in zip(w, moments, strict=True)) / w.sum()
        b = sum(wi * m[1] for wi, m in zip(w, moments, strict=True)) / w.sum()
        x = np.linalg.solve(a @ a / 4 + self.spec.lam * np.eye(self.spec.features), a @ b / 4)
        return np.concatenate([x, (b - a @ x) / 2])
