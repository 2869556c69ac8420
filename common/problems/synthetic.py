"""Synthetic problems: a benchmark data source, not private data.

Every client generates its own shard from the public spec and a seed the
coordinator sends (RunSpec.synthetic_seed), so the coordinator could rebuild any
client's data: these problems exist for the paper's experiments, benchmarks and
tests. Real federations use a DataProblem, whose data each client loads from
its own file.

  paper_regression  the paper's federated regression saddle (section Experiments)
  quadratic_game    a dense quadratic game with a planted saddle point z*

Their shards are vectorized over the clients a process hosts (see shards.py) and
over a batch of runs, which is what makes the paper's sweep fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common import seeding
from fedsaddle.common.numeric import Array, blocks, ordered_sum
from fedsaddle.common.problems.base import ProblemSpec, SyntheticProblem

# --------------------------------------------------------------------------------------
# The paper's federated regression saddle (section Experiments)
# --------------------------------------------------------------------------------------


class PaperRegressionSpec(ProblemSpec):
    """f_i(x, y) = -1/2 [ ||y||^2 - b_i^T y + y^T A_i x ] + lam/2 ||x||^2.

    A_i = diag(a_i), a_i = max(N(1, s^2 I), 1) entrywise; b_i = b'_i - mean_j b'_j with
    b'_j ~ N(0, s^2 I). s controls both heterogeneity and conditioning. Since the
    b_i average to zero, z* = 0.
    """

    name: Literal["paper_regression"] = "paper_regression"
    dim: int = Field(10, ge=1, description="d: x and y each live in R^d")
    lam: float = Field(1e-5, gt=0, description="lambda, the L2 weight on x")
    s: float = Field(10.0, ge=0, description="heterogeneity / ill-conditioning")


_ROWS = 1 << 16  # the gradient's rows per block: one block up to d = 65536, a 512 KiB scratch per column


class PaperRegressionShards:
    lam: float | Array  # an array (B,) when stacked runs' lam differ

    def __init__(self, spec: PaperRegressionSpec, seed: int, indices: Sequence[int]) -> None:
        self.indices = tuple(indices)
        self.dim = spec.dim
        self.dimension = 2 * spec.dim
        self.lam = spec.lam
        n, d, s = spec.num_clients, spec.dim, spec.s
        # b'_j is the first draw of client j's stream; every client needs the mean
        # of all b'_j to center its own b_i (this is public randomness, not data).
        # Each draw is scaled in place, and each row written straight into the data: at d = 1e6 the
        # temporaries of whole-array expressions took 46 MiB more than the data itself.
        k = len(self.indices)
        half_a, half_b = np.empty((d, k)), np.empty((d, k))
        b_mean = np.zeros(d)
        draw = np.empty(d)
        for j in range(n):
            seeding.rng(seed, seeding.DATA, j).standard_normal(out=draw)
            draw *= s  # (s * draw, the same product)
            b_mean += draw
            if j in self.indices:
                half_b[:, self.indices.index(j)] = draw
        b_mean /= n
        for column, i in enumerate(self.indices):
            stream = seeding.rng(seed, seeding.DATA, i)
            stream.standard_normal(out=draw)  # skip b'_i, drawn above
            stream.standard_normal(out=draw)
            draw *= s
            draw += 1.0
            np.maximum(draw, 1.0, out=half_a[:, column])
            half_b[:, column] -= b_mean
        # columns, (d, k): a[:, i] is client i's diagonal
        # Only A_i / 2 and b_i / 2 are kept (the gradient's terms); halving and doubling them back is exact.
        half_a *= 0.5
        half_b *= 0.5
        self._half_a, self._half_b = half_a, half_b
        self._scratch: dict[tuple[int, ...], Array] = {}

    @classmethod
    def stack(cls, runs: Sequence[PaperRegressionShards]) -> PaperRegressionShards:
        """One object for a batch of runs: data (d, k, B), lam (B,). Same arithmetic, elementwise."""
        stacked = cls.__new__(cls)
        first = runs[0]
        stacked.indices, stacked.dim, stacked.dimension = first.indices, first.dim, first.dimension
        stacked._half_a = np.stack([r._half_a for r in runs], axis=-1)
        stacked._half_b = np.stack([r._half_b for r in runs], axis=-1)
        # One lam for the batch when every run has the same (the sweep's case): a product with a number costs less
        # than with a (B,) array broadcast along the runs' axis, and gives the same bits.
        lams = [r.lam for r in runs]
        stacked.lam = lams[0] if all(lam == lams[0] for lam in lams) else np.array(lams, dtype=float)
        stacked._scratch = {}
        return stacked

    def select_runs(self, runs: Sequence[int]) -> PaperRegressionShards:
        """The stacked data of some runs of a batch (for a batch whose other runs have stopped)."""
        selected = type(self).__new__(type(self))
        selected.indices, selected.dim, selected.dimension = self.indices, self.dim, self.dimension
        rows = list(runs)
        selected._half_a, selected._half_b = self._half_a[..., rows].copy(), self._half_b[..., rows].copy()
        selected.lam = self.lam if np.ndim(self.lam) == 0 else np.asarray(self.lam)[rows]
        selected._scratch = {}
        return selected

    @property
    def a(self) -> Array:
        """The clients' diagonals a_i, as columns (d, k)."""
        return 2.0 * self._half_a

    @property
    def b(self) -> Array:
        """The clients' b_i, as columns (d, k)."""
        return 2.0 * self._half_b

    def _scratch_for(self, rest: tuple[int, ...]) -> Array:
        """A block's scratch rows for z's trailing shape `rest`, kept: a fresh temporary per call costs more
        than the arithmetic."""
        scratch = self._scratch.get(rest)
        if scratch is None:
            scratch = self._scratch[rest] = np.empty((min(_ROWS, self.dim), *rest))
        return scratch

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        d = self.dim
        out = np.empty_like(z) if out is None else out
        scratch = self._scratch_for(z.shape[1:])
        if d <= _ROWS:
            _gradient_rows(self.lam, z[:d], z[d:], self._half_a, self._half_b, out[:d], out[d:], scratch)
            return out
        for rows in blocks(d, _ROWS):  # entry j of the gradient needs only entry j of x, y and the data
            ys = slice(d + rows.start, d + rows.stop)
            part = scratch[: rows.stop - rows.start]
            _gradient_rows(self.lam, z[rows], z[ys], self._half_a[rows], self._half_b[rows], out[rows], out[ys], part)
        return out

    def gradient_rows(self, z: Array, rows: slice, out: Array) -> Array:
        """Rows `rows` of G_i(z), rows start to stop - 1 of z's first axis (`rows.indices(dimension)`), written
        into out[rows], the rest of out left as it is: the worker's oracle takes this for `gradient(z, out,
        rows=...)` (common/worker.py). Entry j of x's half and entry j of y's need x_j, y_j and the data's row
        j alone, so only the rows asked for are computed, each by `gradient`'s operations."""
        d = self.dim
        start, stop, _ = rows.indices(2 * d)
        scratch = self._scratch_for(z.shape[1:])
        for block in blocks(d, _ROWS) if d > _ROWS else (slice(0, d),):
            xs = slice(max(block.start, start), min(block.stop, stop))  # this block's rows of x asked for
            if xs.start < xs.stop:
                x, y = z[xs], z[d + xs.start : d + xs.stop]
                _gradient_x(self.lam, x, y, self._half_a[xs], out[xs], scratch[: xs.stop - xs.start])
            ys = slice(max(block.start, start - d), min(block.stop, stop - d))  # and of y, as entries of y
            if ys.start < ys.stop:
                x, y, out_y = z[ys], z[d + ys.start : d + ys.stop], out[d + ys.start : d + ys.stop]
                _gradient_y(x, y, self._half_a[ys], self._half_b[ys], out_y, scratch[: ys.stop - ys.start])
        return out

    def gradient_pairs(self, xy: Array, rows: slice, out: Array) -> Array:
        """G_i on some rows of x and the same rows of y alone: entry j of G_i(z) depends only on x_j and
        y_j (A_i is diagonal), so the worker may run local steps a block of rows at a time
        (common/worker.py). `xy` and `out` are (2, len(rows), ...): those rows of x, then of y. The
        operations are `gradient`'s, entry for entry."""
        part = self._scratch_for(xy.shape[2:])[: xy.shape[1]]
        _gradient_rows(self.lam, xy[0], xy[1], self._half_a[rows], self._half_b[rows], out[0], out[1], part)
        return out

    def objective(self, z: Array) -> Array:
        # Each sum over the d entries runs strictly in entry order (ordered_sum): np.sum over axis 0 of a
        # (d, k) block adds pairwise when k = 1 and in order when k > 1, so a client hosted alone got another
        # f_i, in its last bits, than the same client hosted with others.
        d = self.dim
        x, y = z[:d], z[d:]
        inner = ordered_sum(y * y) - ordered_sum(self.b * y) + ordered_sum(y * self.a * x)
        result: Array = -0.5 * inner + 0.5 * self.lam * ordered_sum(x * x)
        return result


def _gradient_rows(
    lam: float | Array, x: Array, y: Array, half_a: Array, half_b: Array, out_x: Array, out_y: Array, part: Array
) -> None:
    """grad_x f_i = lam x - (A_i / 2)^T y;   -grad_y f_i = y - b_i / 2 + (A_i / 2) x, for some rows."""
    _gradient_x(lam, x, y, half_a, out_x, part)
    _gradient_y(x, y, half_a, half_b, out_y, part)


def _gradient_x(lam: float | Array, x: Array, y: Array, half_a: Array, out_x: Array, part: Array) -> None:
    """grad_x f_i = lam x - (A_i / 2)^T y, for some rows."""
    np.multiply(lam, x, out=out_x)
    np.subtract(out_x, np.multiply(half_a, y, out=part), out=out_x)


def _gradient_y(x: Array, y: Array, half_a: Array, half_b: Array, out_y: Array, part: Array) -> None:
    """-grad_y f_i = y - b_i / 2 + (A_i / 2) x, for some rows."""
    np.subtract(y, half_b, out=out_y)
    np.add(out_y, np.multiply(half_a, x, out=part), out=out_y)


def _paper_solution(spec: PaperRegressionSpec, seed: int) -> Array:
    # mean_i b_i = 0 by construction, so G(z) = 0 at z = 0 whatever the data.
    return np.zeros(2 * spec.dim)


# --------------------------------------------------------------------------------------
# A dense strongly-convex-strongly-concave quadratic game with a known z*
# --------------------------------------------------------------------------------------


class QuadraticGameSpec(ProblemSpec):
    """G_i(z) = M_i (z - z*) + r_i, with M_i = [[P_i, B_i], [-B_i^T, Q_i]].

    P_i, Q_i are symmetric with eigenvalues >= mu and B_i is dense, so each f_i is
    mu-strongly convex-concave. The shifts r_i sum to zero, so z* (drawn from the
    seed) is the saddle point of f = mean_i f_i. `heterogeneity` scales how far
    the clients' M_i and r_i stray from a common base.
    """

    name: Literal["quadratic_game"] = "quadratic_game"
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

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        # One matrix-vector product per shard, so the result cannot depend on how
        # shards are batched together.
        columns = [m @ (zi - self.z_star) + r for m, zi, r in zip(self.m, z.T, self.r, strict=True)]
        return np.stack(columns, axis=-1, out=out)

    def objective(self, z: Array) -> Array:
        d = self.dim
        values = []
        for m, zi, r in zip(self.m, z.T, self.r, strict=True):
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
# The problems
# --------------------------------------------------------------------------------------


class PaperRegression(SyntheticProblem):
    Spec = PaperRegressionSpec
    spec: PaperRegressionSpec

    def dims(self) -> tuple[int, int]:
        return self.spec.dim, self.spec.dim

    def shards(self, seed: int, indices: Sequence[int]) -> PaperRegressionShards:
        _check_indices(self.spec.num_clients, indices)
        return PaperRegressionShards(self.spec, seed, indices)

    def solution(self, seed: int) -> Array:
        return _paper_solution(self.spec, seed)


class QuadraticGame(SyntheticProblem):
    Spec = QuadraticGameSpec
    spec: QuadraticGameSpec

    def dims(self) -> tuple[int, int]:
        return self.spec.dim, self.spec.dim

    def shards(self, seed: int, indices: Sequence[int]) -> QuadraticGameShards:
        _check_indices(self.spec.num_clients, indices)
        return QuadraticGameShards(self.spec, seed, indices)

    def solution(self, seed: int) -> Array:
        return _game_solution(self.spec, seed)


def _check_indices(num_clients: int, indices: Sequence[int]) -> None:
    bad = [i for i in indices if not 0 <= i < num_clients]
    if bad:
        raise ValueError(f"client indices {bad} are outside [0, {num_clients})")
