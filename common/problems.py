"""Problems: local gradient mappings G_i(z) = (grad_x f_i, -grad_y f_i) and their data.

A problem is a plug-in of three parts, none of which knows about transports:
  * a pydantic spec (public: it travels to clients as JSON),
  * `make_shards(spec, seed, indices)`, which builds the private data of the
    given clients (each client process calls it for its own indices only),
  * `solution(spec, seed)`, the saddle point z* when the spec determines it
    without the data (used by the coordinator for its metrics), else None.

Shards are vectorized over the clients a process hosts: every method takes and
returns arrays whose first axis is the shard. All arithmetic is elementwise or
per shard, so a client's result does not depend on which other shards share its
process; that is what makes the in-process and gRPC transports agree bit for bit.

Iterates are z = (x, y) with x, y in R^dim, so vectors have 2 * dim entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field

from fedsaddle.common import seeding

Array = NDArray[np.float64]


class Shards(Protocol):
    """The private data of some clients, with their local oracles."""

    indices: tuple[int, ...]
    dimension: int  # length of z = (x, y)

    def gradient(self, z: Array) -> Array:
        """G_i(z_i) for each hosted client i; z and the result have shape (k, dimension)."""
        ...

    def objective(self, z: Array) -> Array:
        """f_i(z_i) for each hosted client i; shape (k,)."""
        ...


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------
# The paper's federated regression saddle (section Experiments)
# --------------------------------------------------------------------------------------


class PaperRegressionSpec(_Spec):
    """f_i(x, y) = -1/2 [ ||y||^2 - b_i^T y + y^T A_i x ] + lam/2 ||x||^2.

    A_i = diag(a_i), a_i = max(N(1, s^2 I), 1) entrywise; b_i = b'_i - mean_j b'_j with
    b'_j ~ N(0, s^2 I). s controls both heterogeneity and conditioning. Since the
    b_i average to zero, z* = 0.
    """

    name: Literal["paper_regression"] = "paper_regression"
    num_clients: int = Field(10, ge=1, description="n, the number of clients")
    dim: int = Field(10, ge=1, description="d: x and y each live in R^d")
    lam: float = Field(1e-5, gt=0, description="lambda, the L2 weight on x")
    s: float = Field(10.0, ge=0, description="heterogeneity / ill-conditioning")


class PaperRegressionShards:
    def __init__(self, spec: PaperRegressionSpec, seed: int, indices: Sequence[int]) -> None:
        self.indices = tuple(indices)
        self.dim = spec.dim
        self.dimension = 2 * spec.dim
        self.lam = spec.lam
        n, d, s = spec.num_clients, spec.dim, spec.s
        # b'_j is the first draw of client j's stream; every client needs the mean
        # of all b'_j to center its own b_i (this is public randomness, not data).
        b_mean = np.zeros(d)
        own_b: dict[int, Array] = {}
        for j in range(n):
            b_j = s * seeding.rng(seed, seeding.DATA, j).standard_normal(d)
            b_mean += b_j
            if j in self.indices:
                own_b[j] = b_j
        b_mean /= n
        a_rows, b_rows = [], []
        for i in self.indices:
            stream = seeding.rng(seed, seeding.DATA, i)
            stream.standard_normal(d)  # skip b'_i, drawn above
            a_rows.append(np.maximum(1.0 + s * stream.standard_normal(d), 1.0))
            b_rows.append(own_b[i] - b_mean)
        self.a = np.array(a_rows).reshape(len(self.indices), d)
        self.b = np.array(b_rows).reshape(len(self.indices), d)

    def gradient(self, z: Array) -> Array:
        d = self.dim
        x, y = z[:, :d], z[:, d:]
        out = np.empty_like(z)
        # grad_x f_i = lam x - A_i^T y / 2;   -grad_y f_i = y - b_i / 2 + A_i x / 2
        out[:, :d] = self.lam * x - 0.5 * self.a * y
        out[:, d:] = y - 0.5 * self.b + 0.5 * self.a * x
        return out

    def objective(self, z: Array) -> Array:
        d = self.dim
        x, y = z[:, :d], z[:, d:]
        inner = np.sum(y * y, axis=1) - np.sum(self.b * y, axis=1) + np.sum(y * self.a * x, axis=1)
        result: Array = -0.5 * inner + 0.5 * self.lam * np.sum(x * x, axis=1)
        return result


def _paper_solution(spec: PaperRegressionSpec, seed: int) -> Array:
    # mean_i b_i = 0 by construction, so G(z) = 0 at z = 0 whatever the data.
    return np.zeros(2 * spec.dim)


# --------------------------------------------------------------------------------------
# A dense strongly-convex-strongly-concave quadratic game with a known z*
# --------------------------------------------------------------------------------------


class QuadraticGameSpec(_Spec):
    """G_i(z) = M_i (z - z*) + r_i, with M_i = [[P_i, B_i], [-B_i^T, Q_i]].

    P_i, Q_i are symmetric with eigenvalues >= mu and B_i is dense, so each f_i is
    mu-strongly convex-concave. The shifts r_i sum to zero, so z* (drawn from the
    seed) is the saddle point of f = mean_i f_i. `heterogeneity` scales how far
    the clients' M_i and r_i stray from a common base.
    """

    name: Literal["quadratic_game"] = "quadratic_game"
    num_clients: int = Field(10, ge=1)
    dim: int = Field(5, ge=1, description="x and y each live in R^dim")
    mu: float = Field(1.0, gt=0, description="strong convexity-concavity of each f_i")
    coupling: float = Field(1.0, ge=0, description="scale of the bilinear term B")
    heterogeneity: float = Field(0.5, ge=0)


class QuadraticGameShards:
    def __init__(self, spec: QuadraticGameSpec, seed: int, indices: Sequence[int]) -> None:
        self.indices = tuple(indices)
        self.dim = spec.dim
        self.dimension = 2 * spec.dim
        d, h = spec.dim, spec.heterogeneity
        base = seeding.rng(seed, seeding.DATA, seeding.SHARED)
        p0, q0, b0 = _psd(base, d), _psd(base, d), base.standard_normal((d, d)) / np.sqrt(d)
        self.z_star = _game_solution(spec, seed)
        shifts = [seeding.rng(seed, seeding.SHIFT, j).standard_normal(2 * d) for j in range(spec.num_clients)]
        shift_mean = np.mean(shifts, axis=0)
        mats, rs = [], []
        for i in self.indices:
            stream = seeding.rng(seed, seeding.DATA, i)
            p = spec.mu * np.eye(d) + p0 + h * _psd(stream, d)
            q = spec.mu * np.eye(d) + q0 + h * _psd(stream, d)
            b = spec.coupling * (b0 + h * stream.standard_normal((d, d)) / np.sqrt(d))
            mats.append(np.block([[p, b], [-b.T, q]]))
            rs.append(h * (shifts[i] - shift_mean))
        self.m = np.array(mats).reshape(len(self.indices), 2 * d, 2 * d)
        self.r = np.array(rs).reshape(len(self.indices), 2 * d)

    def gradient(self, z: Array) -> Array:
        # One matrix-vector product per shard, so the result cannot depend on how
        # shards are batched together.
        return np.stack([m @ (zi - self.z_star) + r for m, zi, r in zip(self.m, z, self.r, strict=True)])

    def objective(self, z: Array) -> Array:
        d = self.dim
        values = []
        for m, zi, r in zip(self.m, z, self.r, strict=True):
            dx, dy = zi[:d] - self.z_star[:d], zi[d:] - self.z_star[d:]
            p, b, q = m[:d, :d], m[:d, d:], m[d:, d:]
            quad = 0.5 * dx @ p @ dx + dx @ b @ dy - 0.5 * dy @ q @ dy
            values.append(quad + r[:d] @ zi[:d] - r[d:] @ zi[d:])
        return np.array(values)


def _psd(stream: np.random.Generator, d: int) -> Array:
    w = stream.standard_normal((d, d))
    result: Array = w @ w.T / d
    return result


def _game_solution(spec: QuadraticGameSpec, seed: int) -> Array:
    return seeding.rng(seed, seeding.SOLUTION).standard_normal(2 * spec.dim)


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

ProblemSpec = Annotated[PaperRegressionSpec | QuadraticGameSpec, Field(discriminator="name")]


def make_shards(spec: PaperRegressionSpec | QuadraticGameSpec, seed: int, indices: Sequence[int]) -> Shards:
    """Build the private shards of the given clients (call only where the data may live)."""
    bad = [i for i in indices if not 0 <= i < spec.num_clients]
    if bad:
        raise ValueError(f"client indices {bad} are outside [0, {spec.num_clients})")
    if isinstance(spec, PaperRegressionSpec):
        return PaperRegressionShards(spec, seed, indices)
    return QuadraticGameShards(spec, seed, indices)


def solution(spec: PaperRegressionSpec | QuadraticGameSpec, seed: int) -> Array | None:
    """z*, when the spec and seed determine it without the clients' data."""
    if isinstance(spec, PaperRegressionSpec):
        return _paper_solution(spec, seed)
    return _game_solution(spec, seed)


def dimension(spec: PaperRegressionSpec | QuadraticGameSpec) -> int:
    """Length of z = (x, y)."""
    return 2 * spec.dim
