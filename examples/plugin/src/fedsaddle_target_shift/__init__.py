"""Least squares against an adversary who shifts every target by u: an example fedsaddle plug-in.

    f_i(x, u) = mean over client i's rows of 1/2 (a^T x - t - u)^2 + lam/2 ||x||^2 - rho/2 u^2

x is the regressor, u the shift the adversary picks to hurt it most; rho > 1
keeps the adversary's side strongly concave (its cost of shifting). The whole
plug-in is the spec (public hyper-parameters) and the problem (the client-side
oracles on one client's rows); fedsaddle does the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, DataProblem, ProblemSpec


class TargetShiftSpec(ProblemSpec):
    name: Literal["target_shift"] = "target_shift"
    features: int = Field(ge=1, description="columns of each client's X")
    lam: float = Field(0.1, gt=0, description="L2 weight on x")
    rho: float = Field(2.0, gt=1, description="the adversary's cost of a shift (> 1)")


class TargetShift(DataProblem):
    Spec = TargetShiftSpec
    spec: TargetShiftSpec
    metric_names = ("test_mse",)

    def dims(self) -> tuple[int, int]:
        return self.spec.features, 1  # x, then u

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        return data

    def _errors(self, data: ClientData, z: Array) -> Array:
        return data.X @ z[:-1] - data.y - z[-1]  # a^T x - t - u, one per row

    def gradient(self, data: ClientData, z: Array) -> Array:
        e = self._errors(data, z)
        grad_x = data.X.T @ e / data.samples + self.spec.lam * z[:-1]
        grad_u = -e.mean() - self.spec.rho * z[-1]
        return np.concatenate([grad_x, [-grad_u]])  # G = (grad_x f, -grad_u f)

    def objective(self, data: ClientData, z: Array) -> float:
        e = self._errors(data, z)
        x, u = z[:-1], z[-1]
        return float(0.5 * e @ e / data.samples + 0.5 * self.spec.lam * x @ x - 0.5 * self.spec.rho * u * u)

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        residual = data.X_test @ z[:-1] - data.y_test
        return (float(residual @ residual / len(residual)),)

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array:
        """G is affine in z: solve G(z*) = 0 for the weighted mean of the clients' G."""
        w = np.ones(len(datas)) if weights is None else np.asarray(weights, dtype=float)

        def mean_gradient(z: Array) -> Array:
            return sum(wi * self.gradient(d, z) for wi, d in zip(w, datas, strict=True)) / w.sum()

        n = self.dimension
        at_zero = mean_gradient(np.zeros(n))
        matrix = np.column_stack([mean_gradient(np.eye(n)[j]) - at_zero for j in range(n)])
        return np.linalg.solve(matrix, -at_zero)
