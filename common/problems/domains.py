"""Constrained domains: where each block of z = (x, y) may live, and the Euclidean projection onto it.

A problem declares its domain in `Problem.domains()` as a sequence of blocks that
cover z in order, e.g. `[Free(10), Simplex(5)]` for a model x in R^10 and weights
y on the 5-point simplex. Kinds:

    Free(size)                    no constraint
    Box(size, low, high)          low <= z_j <= high entrywise (either bound may be infinite)
    Ball(size, radius)            ||z_block||_2 <= radius
    Simplex(size)                 z_j >= 0, sum_j z_j = 1

Every algorithm projects its iterates after every local and every global step
(server/algorithms, common/worker.py). The projection is Euclidean for every kind,
the simplex's included (sort-based, Held, Wolfe and Crowder 1974; Duchi et al.
2008): one rule for all five algorithms, exact at the vertices and faces where
constrained saddle points sit (the entropic mirror map never reaches a face), and
the same Euclidean geometry the paper's analysis uses.

Bits: a block is always projected one vector at a time, as a contiguous 1-D array,
so a client's result does not depend on how many clients share the arrays (the
in-process pool holds all of them, a client process one): simulation and gRPC
stay bit-identical.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsaddle.common.numeric import Array


class DomainError(ValueError):
    """A domain that does not fit the problem, or a point outside its domain; the message says which."""


@dataclass(frozen=True)
class Free:
    """A block without constraint."""

    size: int

    def project(self, v: Array) -> Array:
        return v

    def violation(self, v: Array) -> str | None:
        return None


@dataclass(frozen=True)
class Box:
    """low <= v_j <= high for every entry of the block."""

    size: int
    low: float = -math.inf
    high: float = math.inf

    def project(self, v: Array) -> Array:
        return np.clip(v, self.low, self.high)

    def violation(self, v: Array) -> str | None:
        bad = np.flatnonzero((v < self.low) | (v > self.high))
        if bad.size:
            return f"entry {int(bad[0])} is {float(v[bad[0]])!r}, outside [{self.low:g}, {self.high:g}]"
        return None


@dataclass(frozen=True)
class Ball:
    """||v||_2 <= radius (centred at 0)."""

    size: int
    radius: float

    def project(self, v: Array) -> Array:
        length = math.sqrt(float(np.sum(v * v)))  # (no BLAS: the same bits in every process)
        return v if length <= self.radius else v * (self.radius / length)

    def violation(self, v: Array) -> str | None:
        length = math.sqrt(float(np.sum(v * v)))
        # a projected point may exceed the radius by rounding: allow a few ulps
        if length > self.radius * (1 + 8 * np.finfo(float).eps):
            return f"its norm is {length!r}, above the radius {self.radius:g}"
        return None


@dataclass(frozen=True)
class Simplex:
    """v_j >= 0 and sum_j v_j = 1: the probability simplex."""

    size: int

    def project(self, v: Array) -> Array:
        """The Euclidean projection: max(v - t, 0) with the threshold t that makes the sum 1."""
        descending = np.sort(v)[::-1]
        sums = np.cumsum(descending) - 1.0
        ranks = np.arange(1, v.size + 1)
        # the largest rank k whose k-th largest entry stays positive after the shift (k >= 1 for finite v)
        positive = np.flatnonzero(descending - sums / ranks > 0)
        if positive.size == 0:  # v holds a NaN or +inf: a diverged iterate stays one, for the run to report
            return np.full(v.shape, np.nan)
        k = int(positive[-1]) + 1
        result: Array = np.maximum(v - sums[k - 1] / k, 0.0)
        return result

    def violation(self, v: Array) -> str | None:
        if (v < 0).any():
            j = int(np.argmax(v < 0))
            return f"entry {j} is {float(v[j])!r}, negative"
        total = float(np.sum(v))
        if abs(total - 1.0) > 1e-9:
            return f"its entries sum to {total!r}, not 1"
        return None


Block = Free | Box | Ball | Simplex


class Domain:
    """The domain of z: blocks in order, covering all of it (checked at construction)."""

    def __init__(self, blocks: Sequence[Block], dimension: int, problem: str = "the problem") -> None:
        self.blocks = tuple(blocks)
        for position, block in enumerate(self.blocks):
            _check_block(block, position, problem)
        total = sum(block.size for block in self.blocks)
        if total != dimension:
            sizes = " + ".join(str(block.size) for block in self.blocks)
            raise DomainError(
                f"{problem}: its domain's blocks cover {sizes} = {total} entries, but z has dim_x + dim_y = {dimension}"
            )
        self.dimension = dimension
        starts = np.cumsum([0] + [block.size for block in self.blocks])
        self.slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(starts)]
        self.constrained = [(s, b) for s, b in zip(self.slices, self.blocks, strict=True) if not isinstance(b, Free)]

    def project(self, z: Array) -> Array:
        """z projected onto the domain: a new array shaped like z, whose axis 0 is z's entries
        ((D,) one vector; (D, k) or (D, k, B) columns, each projected on its own)."""
        out: Array = np.array(z, dtype=np.float64, copy=True)
        self.project_into(out)
        return out

    def project_into(self, z: Array) -> None:
        """Project z in place (axis 0 its entries, as for `project`)."""
        for rows, block in self.constrained:
            for rest in np.ndindex(*z.shape[1:]):
                where = (rows, *rest)
                z[where] = block.project(np.ascontiguousarray(z[where]))

    def check(self, z: Array, what: str) -> None:
        """DomainError naming `what`, the block and the entry if z (one vector) is outside the domain."""
        if np.shape(z) != (self.dimension,):
            raise DomainError(f"{what} has shape {np.shape(z)}; z has {self.dimension} entries")
        for position, (rows, block) in enumerate(zip(self.slices, self.blocks, strict=True)):
            fault = block.violation(np.asarray(z[rows], dtype=np.float64))
            if fault is not None:
                raise DomainError(
                    f"{what} is outside its domain: block {position} ({describe(block)}, z[{rows.start}:{rows.stop}]): "
                    f"{fault}"
                )

    def describe(self) -> str:
        return ", ".join(f"z[{s.start}:{s.stop}] {describe(b)}" for s, b in zip(self.slices, self.blocks, strict=True))


def describe(block: Block) -> str:
    if isinstance(block, Box):
        return f"box [{block.low:g}, {block.high:g}]"
    if isinstance(block, Ball):
        return f"ball of radius {block.radius:g}"
    if isinstance(block, Simplex):
        return "simplex"
    return "free"


def _check_block(block: object, position: int, problem: str) -> None:
    if not isinstance(block, Free | Box | Ball | Simplex):
        raise DomainError(
            f"{problem}: domain block {position} is a {type(block).__name__}; use Free, Box, Ball or Simplex"
        )
    if not (isinstance(block.size, int | np.integer) and block.size >= 1):
        raise DomainError(f"{problem}: domain block {position} has size {block.size!r}; it must be a whole number >= 1")
    if isinstance(block, Box) and not (block.low <= block.high and block.low < math.inf and block.high > -math.inf):
        raise DomainError(f"{problem}: box block {position} has low {block.low} > high {block.high} (or NaN)")
    if isinstance(block, Ball) and not (math.isfinite(block.radius) and block.radius > 0):
        raise DomainError(f"{problem}: ball block {position} has radius {block.radius}; it must be finite and > 0")


def problem_domain(problem: object) -> Domain | None:
    """The checked domain a problem declares, or None for an unconstrained one (or all-Free blocks)."""
    declare = getattr(problem, "domains", None)
    blocks = declare() if declare is not None else None
    if blocks is None:
        return None
    name = getattr(getattr(problem, "spec", None), "name", type(problem).__name__)
    domain = Domain(blocks, problem.dimension, f"problem {name!r}")  # type: ignore[attr-defined]
    return domain if domain.constrained else None
