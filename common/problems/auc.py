"""AUC maximization in its min-max square-loss form (Ying, Wen, Lyu, "Stochastic Online AUC
Maximization", NeurIPS 2016), made strongly convex-concave with an L2 term.

With p = Pr(label = 1) over the whole federation (a public statistic, printed by
`fedsaddle data split`), a linear score s = w^T u, and x = (w, a, b), y = alpha:

    F(x, alpha; u, +1) = (1-p)(s - a)^2 - 2(1+alpha)(1-p) s - p(1-p) alpha^2
    F(x, alpha; u, -1) = p (s - b)^2    + 2(1+alpha) p s     - p(1-p) alpha^2
    f_i(x, alpha) = mean over client i's rows of F + lam/2 (||w||^2 + a^2 + b^2).

Minimizing over x and maximizing over alpha is equivalent to minimizing the
square-loss AUC risk E[(1 - (s - s'))^2 | y = 1, y' = -1] (plus the L2 term).
f is lam-strongly convex in x and 2p(1-p)-strongly concave in alpha. Labels may
be {0, 1} or {-1, 1}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientData, DataError, DataProblem, ProblemSpec


class AucSpec(ProblemSpec):
    name: Literal["auc"] = "auc"
    features: int = Field(ge=1, description="columns of each client's X")
    positive_rate: float = Field(gt=0, lt=1, description="p: the fraction of positive labels over all clients")
    lam: float = Field(1e-3, gt=0, description="L2 weight on (w, a, b)")


def roc_auc(scores: Array, positive: NDArray[np.bool_]) -> float:
    """Area under the ROC curve (ties count one half), by the Mann-Whitney rank sum."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    start = 0
    for end in range(1, len(scores) + 1):  # average ranks over ties
        if end == len(scores) or sorted_scores[end] != sorted_scores[start]:
            ranks[order[start:end]] = (start + end + 1) / 2
            start = end
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class AucMaximization(DataProblem):
    Spec = AucSpec
    spec: AucSpec
    metric_names = ("test_auc",)
    higher_is_better = ("test_auc",)

    def dims(self) -> tuple[int, int]:
        return self.spec.features + 2, 1

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        self.expect_labels(data, (-1.0, 0.0, 1.0))
        if np.any(data.y == 0) and np.any(data.y == -1):
            raise DataError(f"{data.path}: labels mix 0 and -1; use {{0, 1}} or {{-1, 1}}")
        return data

    @classmethod
    def statistics(cls, datas: Sequence[ClientData]) -> dict[str, int | float]:
        rows = sum(d.samples for d in datas)
        positive = sum(int(np.count_nonzero(d.y > 0)) for d in datas)
        return {"features": int(datas[0].X.shape[1]), "positive_rate": positive / rows}

    def gradient(self, data: ClientData, z: Array) -> Array:
        p, lam, d = self.spec.positive_rate, self.spec.lam, self.spec.features
        w, a, b, alpha = z[:d], z[d], z[d + 1], z[d + 2]
        pos = data.y > 0
        s = data.X @ w
        m = data.samples
        # dF/ds per row; then grad_w = X^T (dF/ds) / m
        ds = np.where(pos, 2 * (1 - p) * (s - a) - 2 * (1 + alpha) * (1 - p), 2 * p * (s - b) + 2 * (1 + alpha) * p)
        grad_w = data.X.T @ ds / m + lam * w
        grad_a = -2 * (1 - p) * np.sum((s - a)[pos]) / m + lam * a
        grad_b = -2 * p * np.sum((s - b)[~pos]) / m + lam * b
        grad_alpha = (2 * p * np.sum(s[~pos]) - 2 * (1 - p) * np.sum(s[pos])) / m - 2 * p * (1 - p) * alpha
        return np.concatenate([grad_w, [grad_a, grad_b, -grad_alpha]])

    def objective(self, data: ClientData, z: Array) -> float:
        p, lam, d = self.spec.positive_rate, self.spec.lam, self.spec.features
        w, a, b, alpha = z[:d], z[d], z[d + 1], z[d + 2]
        pos = data.y > 0
        s = data.X @ w
        rows = np.where(
            pos, (1 - p) * (s - a) ** 2 - 2 * (1 + alpha) * (1 - p) * s, p * (s - b) ** 2 + 2 * (1 + alpha) * p * s
        )
        return float(rows.mean() - p * (1 - p) * alpha**2 + 0.5 * lam * (w @ w + a * a + b * b))

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        return (roc_auc(data.X_test @ z[: self.spec.features], data.y_test > 0),)

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array:
        """z* with G(z*) = 0. f is quadratic, so G is affine: G(z) = M z + G(0), M read off column by column."""
        w = np.ones(len(datas)) if weights is None else np.asarray(weights, dtype=float)

        def mean_gradient(z: Array) -> Array:
            total: Array = np.zeros(self.dimension)
            for wi, data in zip(w, datas, strict=True):
                total += wi * self.gradient(data, z)
            return total / float(w.sum())

        n = self.dimension
        at_zero = mean_gradient(np.zeros(n))
        matrix = np.column_stack([mean_gradient(np.eye(n)[j]) - at_zero for j in range(n)])
        return np.asarray(np.linalg.solve(matrix, -at_zero), dtype=np.float64)
