"""Agnostic federated learning (Mohri, Sivek and Suresh, ICML 2019): a model good for every client.

A logistic model x = (w, b) on the clients' features, and a weight lambda_i per
client on the probability simplex; the adversary puts weight on the clients the
model serves worst:

    f(x, lambda) = sum_i lambda_i L_i(x) + lam/2 ||x||^2 - nu/2 ||lambda - 1/n||^2,

L_i the mean logistic loss on client i's training rows. lam makes f strongly
convex in x; nu, the regulariser toward uniform weights, makes it strongly concave
in lambda (nu -> 0 is the paper's pure minimax; the uniform model is lambda = 1/n).
With f = (1/n) sum_i f_i, client i's share is

    f_i(x, lambda) = n lambda_i L_i(x) + lam/2 ||x||^2 - nu/2 ||lambda - 1/n||^2,

which needs the client's index and n: the problem takes `client=` (base.py). z is
(x, lambda): dim_x = features + 1, dim_y = num_clients, lambda on the simplex
(domains.py). Labels are 0/1 (or -1/1). Metrics on each client's held-out rows:
test_loss (logistic) and test_accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientContext, ClientData, DataProblem, ProblemSpec
from fedsaddle.common.problems.domains import Block, Free, Simplex


class AgnosticSpec(ProblemSpec):
    name: Literal["agnostic"] = "agnostic"
    features: int = Field(ge=1, description="columns of each client's X")
    lam: float = Field(1e-2, gt=0, description="L2 weight on the model (strong convexity)")
    nu: float = Field(1e-2, gt=0, description="weight of -nu/2 ||lambda - 1/n||^2 (strong concavity in lambda)")


class AgnosticLogistic(DataProblem):
    Spec = AgnosticSpec
    spec: AgnosticSpec
    metric_names = ("test_loss", "test_accuracy")
    higher_is_better = ("test_accuracy",)

    def dims(self) -> tuple[int, int]:
        return self.spec.features + 1, self.spec.num_clients

    def domains(self) -> Sequence[Block]:
        return [Free(self.spec.features + 1), Simplex(self.spec.num_clients)]

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        self.expect_labels(data, (-1.0, 0.0, 1.0))
        return data

    def _scores(self, X: Array, z: Array) -> Array:
        d = self.spec.features
        scores: Array = X @ z[:d] + z[d]
        return scores

    def loss(self, data: ClientData, z: Array) -> tuple[float, Array]:
        """L_i(x) and its gradient in x = (w, b), on the client's training rows."""
        t = np.where(data.y > 0, 1.0, -1.0)
        s = self._scores(data.X, z)
        ds = -t / (1.0 + np.exp(t * s))  # d/ds log(1 + exp(-t s))
        grad = np.concatenate([data.X.T @ ds, [ds.sum()]]) / data.samples
        return float(np.mean(np.logaddexp(0.0, -t * s))), grad

    def _share(self, client: ClientContext | None) -> tuple[int, int]:
        if client is None:  # (fedsaddle always passes it: these methods take `client`)
            raise ValueError("agnostic federated learning needs the client's index: call with client=")
        if client.weight is None:
            raise ValueError("agnostic federated learning weighs the clients by lambda itself: use weighting: uniform")
        return client.index, client.num_clients

    def gradient(self, data: ClientData, z: Array, client: ClientContext | None = None) -> Array:
        i, n = self._share(client)
        dx = self.spec.features + 1
        x, weights = z[:dx], z[dx:]
        loss, grad = self.loss(data, z)
        g_x = n * weights[i] * grad + self.spec.lam * x
        g_lambda = self.spec.nu * (weights - 1.0 / n)  # -grad_lambda f_i ...
        g_lambda[i] -= n * loss  # ... of which n lambda_i L_i(x) adds to entry i only
        return np.concatenate([g_x, g_lambda])

    def objective(self, data: ClientData, z: Array, client: ClientContext | None = None) -> float:
        i, n = self._share(client)
        dx = self.spec.features + 1
        x, weights = z[:dx], z[dx:]
        loss, _ = self.loss(data, z)
        spread = weights - 1.0 / n
        return float(n * weights[i] * loss + 0.5 * self.spec.lam * (x @ x) - 0.5 * self.spec.nu * (spread @ spread))

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        t = np.where(data.y_test > 0, 1.0, -1.0)
        s = self._scores(data.X_test, z)
        return float(np.mean(np.logaddexp(0.0, -t * s))), float(np.mean((s > 0) == (t > 0)))
