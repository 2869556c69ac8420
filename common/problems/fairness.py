"""Logistic regression under a demographic-parity penalty, in its Lagrangian (min-max) form.

Each client's rows carry features u, a label t in {-1, 1} (or {0, 1}) and a group
g in {0, 1} (a sensitive attribute). With pi = Pr(g = 1) over the federation (a
public statistic) and c = 1/pi for group 1, -1/(1-pi) for group 0, the mean of
c * (x^T u) over all rows is the gap between the groups' mean scores. The
multiplier nu prices that gap:

    f_i(x, nu) = mean over client i's rows of [ log(1 + exp(-t x^T u)) + nu c x^T u ]
                 + lam/2 ||x||^2 - rho/2 nu^2.

Maximizing over nu gives nu* = gap(x) / rho and f(x) = logistic loss + lam/2 ||x||^2
+ gap(x)^2 / (2 rho): a smaller rho asks for fairer scores. f is lam-strongly
convex in x and rho-strongly concave in nu.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientData, DataError, DataProblem, ProblemSpec


class FairLogisticSpec(ProblemSpec):
    name: Literal["fair_logistic"] = "fair_logistic"
    features: int = Field(ge=1, description="columns of each client's X")
    group_rate: float = Field(gt=0, lt=1, description="pi: the fraction of rows in group 1 over all clients")
    lam: float = Field(1e-2, gt=0, description="L2 weight on x")
    rho: float = Field(0.1, gt=0, description="strong concavity in nu: the penalty is gap^2 / (2 rho)")


class FairLogistic(DataProblem):
    Spec = FairLogisticSpec
    spec: FairLogisticSpec
    metric_names = ("test_accuracy",)
    higher_is_better = ("test_accuracy",)

    def dims(self) -> tuple[int, int]:
        return self.spec.features, 1

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        self.expect_labels(data, (-1.0, 0.0, 1.0))
        if data.group is None:
            raise DataError(f"{data.path}: no 'group' (the sensitive attribute, 0 or 1) for its rows")
        bad = ~np.isin(data.group, (0.0, 1.0))
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{data.path}: group[{row}] is {data.group[row]:g}; groups must be 0 or 1")
        return data

    @classmethod
    def statistics(cls, datas: Sequence[ClientData]) -> dict[str, int | float]:
        if any(d.group is None for d in datas):
            return {"features": int(datas[0].X.shape[1])}
        rows = sum(d.samples for d in datas)
        in_group = sum(int(np.count_nonzero(d.group)) for d in datas if d.group is not None)
        return {"features": int(datas[0].X.shape[1]), "group_rate": in_group / rows}

    def _weights(self, data: ClientData) -> Array:
        assert data.group is not None
        pi = self.spec.group_rate
        return np.where(data.group > 0, 1 / pi, -1 / (1 - pi))

    def gradient(self, data: ClientData, z: Array) -> Array:
        d = self.spec.features
        x, nu = z[:d], z[d]
        t = np.where(data.y > 0, 1.0, -1.0)
        s = data.X @ x
        c = self._weights(data)
        # d/ds log(1 + exp(-t s)) = -t / (1 + exp(t s))
        ds = -t / (1 + np.exp(t * s)) + nu * c
        grad_x = data.X.T @ ds / data.samples + self.spec.lam * x
        grad_nu = np.mean(c * s) - self.spec.rho * nu
        return np.concatenate([grad_x, [-grad_nu]])

    def objective(self, data: ClientData, z: Array) -> float:
        d = self.spec.features
        x, nu = z[:d], z[d]
        t = np.where(data.y > 0, 1.0, -1.0)
        s = data.X @ x
        loss = np.logaddexp(0.0, -t * s) + nu * self._weights(data) * s
        return float(loss.mean() + 0.5 * self.spec.lam * (x @ x) - 0.5 * self.spec.rho * nu**2)

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        predicted = data.X_test @ z[: self.spec.features] > 0
        return (float(np.mean(predicted == (data.y_test > 0))),)

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array:
        """z* with G(z*) = 0, by Newton's method on the weighted mean of the clients' G (its Jacobian is exact)."""
        w = np.ones(len(datas)) if weights is None else np.asarray(weights, dtype=float)
        w = w / w.sum()
        d = self.spec.features
        z = np.zeros(d + 1)
        for _ in range(100):
            gradient = sum(wi * self.gradient(data, z) for wi, data in zip(w, datas, strict=True))
            jacobian = np.zeros((d + 1, d + 1))
            for wi, data in zip(w, datas, strict=True):
                t = np.where(data.y > 0, 1.0, -1.0)
                sigma = 1 / (1 + np.exp(-t * (data.X @ z[:d])))
                curvature = data.X.T @ (data.X * (sigma * (1 - sigma))[:, None]) / data.samples
                coupling = data.X.T @ self._weights(data) / data.samples
                jacobian[:d, :d] += wi * curvature
                jacobian[:d, d] += wi * coupling
                jacobian[d, :d] -= wi * coupling
            jacobian[:d, :d] += self.spec.lam * np.eye(d)
            jacobian[d, d] += self.spec.rho
            step = np.linalg.solve(jacobian, gradient)
            z = z - step
            if float(np.linalg.norm(step)) <= 1e-15 * max(1.0, float(np.linalg.norm(z))):
                break
        return z
