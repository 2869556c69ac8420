"""A numerical saddle point of the federation's f, for problems without `reference_solution`.

From all clients' data in one process (an author's machine, a test), with G(z) the
aggregated G_i(z):

* unconstrained: Newton's method on G(z) = 0 with a Jacobian of central differences
  of G (D + 1 evaluations per iteration), each step damped until ||G|| decreases; an
  inexact Jacobian still contracts the error by its relative error per step, so a
  few steps reach round-off;
* constrained (or when Newton stalls): extragradient, z_half = P(z - g G(z)),
  z <- P(z - g G(z_half)), with the step g halved while g ||G(z) - G(z_half)|| >
  0.9 ||z - z_half|| (Khobotov's rule), which converges for any monotone Lipschitz G.

Both stop at the residual r(z) = ||z - P(z - G(z))|| (= ||G(z)|| unconstrained) <= tol,
or when the budget runs out. The result says the residual reached and what it
implies for the distance: with G mu-strongly monotone and L-Lipschitz,
||z - z*|| <= r / mu unconstrained and <= (1 + L) r / mu on a domain (unit step).
mu and L come from the secants sampled (estimates, not certificates); `accuracy`
is infinite when no positive mu was seen, and then no distance should be trusted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from fedsaddle.common.numeric import Array, norm
from fedsaddle.common.problems.domains import Domain

Field = Callable[[Array], Array]


class NumericalSaddle(NamedTuple):
    z: Array
    residual: float  # ||z - P(z - G(z))||, ||G(z)|| when unconstrained
    accuracy: float  # a bound on ||z - z*|| from the residual and the estimated mu, L (inf: none)
    method: str  # "newton" or "extragradient"
    iterations: int


def residual(field: Field, z: Array, domain: Domain | None) -> float:
    g = field(z)
    return norm(g) if domain is None else norm(z - domain.project(z - g))


def numerical_saddle(
    field: Field,
    z0: Array,
    domain: Domain | None = None,
    mu: float = math.nan,
    lipschitz: float = math.nan,
    tol: float = 1e-12,
    seconds: float = 60.0,
) -> NumericalSaddle:
    """A point with residual <= tol if it can be found within `seconds` (else the best reached).

    `mu`, `lipschitz`: estimates of G's strong monotonicity and Lipschitz constant (e.g. from
    `check.monotonicity`), used only for the accuracy bound."""
    z = z0 if domain is None else domain.project(z0)
    method, iterations = "extragradient", 0
    if domain is None:
        z, iterations, done = _newton(field, z, tol, time.monotonic() + seconds / 2)
        method = "newton"
        if done:
            return _result(field, z, domain, mu, lipschitz, method, iterations)
    z, more = _extragradient(field, z, domain, tol, time.monotonic() + seconds / 2)
    if more:
        method = "extragradient" if domain is not None else "newton, then extragradient"
    return _result(field, z, domain, mu, lipschitz, method, iterations + more)


def _result(
    field: Field, z: Array, domain: Domain | None, mu: float, lipschitz: float, method: str, iterations: int
) -> NumericalSaddle:
    r = residual(field, z, domain)
    if not (mu > 0):
        accuracy = math.inf
    elif domain is None:
        accuracy = r / mu
    else:
        accuracy = (1 + lipschitz) * r / mu
    return NumericalSaddle(z, r, accuracy, method, iterations)


def _newton(field: Field, z: Array, tol: float, deadline: float) -> tuple[Array, int, bool]:
    g = field(z)
    size = norm(g)
    for iteration in range(1, 51):
        if size <= tol or time.monotonic() > deadline:
            return z, iteration - 1, size <= tol
        jacobian = _jacobian(field, z)
        try:
            step = np.linalg.solve(jacobian, g)
        except np.linalg.LinAlgError:
            return z, iteration, False
        scale = 1.0
        while scale > 1e-4:  # damped: accept the first fraction of the step that lowers ||G||
            candidate = z - scale * step
            g_new = field(candidate)
            if norm(g_new) < size:
                break
            scale /= 2
        else:
            return z, iteration, False
        z, g, size = candidate, g_new, norm(g_new)
    return z, 50, size <= tol


def _jacobian(field: Field, z: Array) -> Array:
    columns = []
    for j in range(z.size):
        h = 1e-6 * max(1.0, abs(float(z[j])))
        step = np.zeros_like(z)
        step[j] = h
        columns.append((field(z + step) - field(z - step)) / (2 * h))
    return np.column_stack(columns)


def _extragradient(field: Field, z: Array, domain: Domain | None, tol: float, deadline: float) -> tuple[Array, int]:
    def project(v: Array) -> Array:
        return v if domain is None else domain.project(v)

    gamma = 1.0
    g = field(z)
    iterations = 0
    while time.monotonic() < deadline:
        if (norm(g) if domain is None else norm(z - project(z - g))) <= tol:
            break
        iterations += 1
        while True:
            z_half = project(z - gamma * g)
            g_half = field(z_half)
            if gamma * norm(g - g_half) <= 0.9 * norm(z - z_half) or gamma < 1e-12:
                break
            gamma /= 2
        z_next = project(z - gamma * g_half)
        g_next = field(z_next)
        if norm(z_next - z) == 0.0:  # at round-off: no step changes z any more
            z, g = z_next, g_next
            break
        z, g = z_next, g_next
        gamma *= 1.2  # let the step grow back where G is flatter
    return z, iterations
