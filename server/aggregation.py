"""Robust aggregation rules: how a round's client rows become the one vector an algorithm receives.

The mean (`RoundAnswers.mean`, server/algorithms/base.py) is fedsaddle's rule by
default, and it has breakdown point 0: one client that lies can move the
aggregate anywhere. The rules here bound what a minority of lying clients can do.
Each is one small object:

    class Rule:
        def aggregate(self, rows, weights, rng) -> vector

`rows` is (m, D): the answering clients' vectors in client-index order; `weights`
their sample counts or None (the built-in robust rules need uniform weighting,
which the config checks); `rng` a generator seeded by the run's seed and the round
id (server/pool.py), the same in every transport, for the rules that draw
(bucketing). A rule never sees a client's identity beyond its row's position.

`tolerates(m)` says how many of m rows may be arbitrary (the config refuses an
attack on more clients than that), and `check(m)` raises ValueError when m rows
are too few for the rule at all (Krum needs m > 2f + 2).

A plug-in implements `aggregate` (and, if it knows them, `tolerates` and `check`)
on a class of its own, named in the config as `{rule: plugin, path: "module:Class",
params: {...}}`, or by an entry point of the group `fedsaddle.aggregations`.

Every rule here is deterministic given its rows and its generator: `simulate`,
`local` and `coordinator` + clients give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.numeric import Array, ordered_sum
from fedsaddle.common.problems.registry import import_plugin_module
from fedsaddle.server.algorithms.base import aggregate as weighted_mean

ENTRY_POINT_GROUP = "fedsaddle.aggregations"

# How much the coordinator may hold of one round's rows (n * D * 8 bytes) under a rule that needs them all.
MAX_ROWS_MIB = 1024.0


class Rule:
    """A robust aggregation rule: rows (m, D) in client-index order, weights, a round's generator -> (D,)."""

    name = "rule"
    draws = True  # whether it reads the round's generator (the built-in rules that do not say False)

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        raise NotImplementedError

    def tolerates(self, m: int) -> int | None:
        """How many of m rows may be arbitrary (Byzantine) with the aggregate still bounded (None: unknown)."""
        return (m - 1) // 2

    def check(self, m: int) -> None:
        """ValueError when m rows are too few for this rule."""
        if m < 1:
            raise ValueError(f"{self.name} needs at least one answer, got {m}")


class Mean(Rule):
    """The plain (weighted) mean, by the same additions as `RoundAnswers.mean`: breakdown point 0."""

    name = "mean"
    draws = False

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        result: Array = weighted_mean(rows[None], weights)[0]
        return result

    def tolerates(self, m: int) -> int:
        return 0


class Median(Rule):
    """Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, "Byzantine-robust distributed learning:
    towards optimal statistical rates", ICML 2018): each entry the median of the clients' entries
    (the mean of the two middle ones when m is even). Breakdown point 1/2."""

    name = "median"
    draws = False

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        return coordinate_median(rows)


def coordinate_median(rows: Array) -> Array:
    """np.median(rows, axis=0), the same values, from one sort (about 6x faster than np.median's
    partition of 2e6 columns of 10 rows)."""
    ordered = np.sort(rows, axis=0)
    half = rows.shape[0] // 2
    if rows.shape[0] % 2:
        middle: Array = ordered[half]
        return middle
    result: Array = (ordered[half - 1] + ordered[half]) / 2
    return result


class TrimmedMean(Rule):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): each entry drops the floor(beta m) largest and
    the floor(beta m) smallest of the clients' entries and averages the rest (sorted, added in order).
    Tolerates floor(beta m) Byzantine clients."""

    name = "trimmed_mean"
    draws = False

    def __init__(self, beta: float) -> None:
        if not 0 <= beta < 0.5:
            raise ValueError(f"trimmed_mean's beta must be in [0, 0.5), got {beta}")
        self.beta = beta

    def cut(self, m: int) -> int:
        return math.floor(self.beta * m)

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        m = rows.shape[0]
        k = self.cut(m)
        kept = np.sort(rows, axis=0)[k : m - k]
        result: Array = ordered_sum(kept) / (m - 2 * k)
        return result

    def tolerates(self, m: int) -> int:
        return self.cut(m)


class Krum(Rule):
    """Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine learning with adversaries:
    Byzantine tolerant gradient descent", NeurIPS 2017). Each row's score is the sum of its squared
    distances to its m - f - 2 nearest other rows; Krum returns the row of least score, Multi-Krum
    (`m` > 1 here, `select`) the mean of the `select` rows of least score (ties: the lower client index).
    Needs m > 2f + 2 rows (the config checks the round's clients); tolerates f. A round left with fewer
    (clients left out for reporting non-finite results, stragglers) takes the largest f its rows allow,
    floor((m - 3) / 2): the clients left out are the likeliest of the f to be Byzantine."""

    name = "krum"
    draws = False

    def __init__(self, f: int, select: int = 1) -> None:
        if f < 0 or select < 1:
            raise ValueError(f"krum needs f >= 0 and m >= 1, got f={f}, m={select}")
        self.f, self.select = f, select

    def check(self, m: int) -> None:
        if m <= 2 * self.f + 2:
            raise ValueError(f"krum with f={self.f} needs more than 2f + 2 = {2 * self.f + 2} answers, got {m}")
        if self.select > m:
            raise ValueError(f"multi-krum selects m={self.select} of {m} answers")

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        m = rows.shape[0]
        if m <= 2:  # nothing to compare: no neighbours to score
            mean: Array = ordered_sum(rows) / m
            return mean
        f = min(self.f, (m - 3) // 2)
        gram = rows @ rows.T
        squares = np.diag(gram)
        distances = np.maximum(squares[:, None] + squares[None, :] - 2 * gram, 0.0)
        np.fill_diagonal(distances, np.inf)
        nearest = np.sort(distances, axis=1)[:, : m - f - 2]
        scores = nearest.sum(axis=1)
        chosen = np.sort(np.argsort(scores, kind="stable")[: min(self.select, m)])
        result: Array = ordered_sum(rows[chosen]) / len(chosen)
        return result

    def tolerates(self, m: int) -> int:
        return self.f


class GeometricMedian(Rule):
    """The geometric median argmin_v sum_i ||v - x_i|| by the smoothed Weiszfeld iteration of RFA
    (Pillutla, Kakade, Harchaoui, "Robust aggregation for federated learning", IEEE TSP 2022):
    v <- sum_i b_i x_i / sum_i b_i with b_i = 1 / max(eps, ||v - x_i||), from the mean, for at most
    `iterations` steps or until a step moves v by at most `tol` ||v||. Breakdown point 1/2."""

    name = "geometric_median"
    draws = False

    def __init__(self, iterations: int = 100, eps: float = 1e-8, tol: float = 1e-10) -> None:
        if iterations < 1 or eps <= 0 or tol < 0:
            raise ValueError(
                f"geometric_median needs iterations >= 1, eps > 0, tol >= 0; got {iterations}, {eps}, {tol}"
            )
        self.iterations, self.eps, self.tol = iterations, eps, tol

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        v: Array = ordered_sum(rows) / rows.shape[0]
        for _ in range(self.iterations):
            offsets = rows - v
            b = 1.0 / np.maximum(self.eps, np.sqrt(np.einsum("ij,ij->i", offsets, offsets)))
            previous, v = v, ordered_sum(b[:, None] * rows) / float(b.cumsum()[-1])
            step, size = v - previous, float(np.dot(v, v))
            if float(np.dot(step, step)) <= self.tol**2 * max(size, self.eps**2):
                break
        return v


class CenteredClipping(Rule):
    """Centered clipping (Karimireddy, He, Jaggi, "Learning from history for Byzantine robust optimization",
    ICML 2021): v <- v + (1/m) sum_i (x_i - v) min(1, tau / ||x_i - v||), `iterations` times.
    The paper starts from the previous round's aggregate (with momentum); a round here does not know which
    exchange of which step came before it (an algorithm aggregates several kinds of vector), so it starts
    from the coordinate-wise median, a centre a minority cannot move far."""

    name = "centered_clipping"
    draws = False

    def __init__(self, tau: float = 1.0, iterations: int = 3) -> None:
        if not tau > 0 or iterations < 1:
            raise ValueError(f"centered_clipping needs tau > 0 and iterations >= 1, got {tau}, {iterations}")
        self.tau, self.iterations = tau, iterations

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        v: Array = coordinate_median(rows)
        for _ in range(self.iterations):
            offsets = rows - v
            norms = np.linalg.norm(offsets, axis=1)
            scale = self.tau / np.maximum(norms, self.tau)  # min(1, tau / ||x_i - v||)
            v = v + ordered_sum(scale[:, None] * offsets) / rows.shape[0]
        return v


class Bucketing(Rule):
    """Bucketing (Karimireddy, He, Jaggi, "Byzantine-robust learning on heterogeneous datasets via
    bucketing", ICLR 2022) in front of another rule: the rows in a random order (the round's generator),
    cut into buckets of s, each bucket averaged, and the rule applied to the bucket means. It shrinks the
    spread that heterogeneity puts between honest rows, at the cost of the rule tolerating Byzantine
    buckets rather than clients (each lying client can spoil one bucket)."""

    def __init__(self, inner: Any, s: int) -> None:
        if s < 1:
            raise ValueError(f"bucketing needs s >= 1, got {s}")
        self.inner, self.s = inner, s
        self.draws = True
        self.name = f"{inner.name} after bucketing s={s}"

    def buckets(self, m: int) -> int:
        return -(-m // self.s)

    def aggregate(self, rows: Array, weights: Array | None, rng: np.random.Generator) -> Array:
        m = rows.shape[0]
        order = rng.permutation(m)
        means = np.stack(
            [
                ordered_sum(rows[np.sort(order[k : k + self.s])]) / len(order[k : k + self.s])
                for k in range(0, m, self.s)
            ]
        )
        result: Array = self.inner.aggregate(means, None, rng)
        return result

    def tolerates(self, m: int) -> int | None:
        return rule_tolerates(self.inner, self.buckets(m))

    def check(self, m: int) -> None:
        rule_check(self.inner, self.buckets(m))


def rule_tolerates(rule: Any, m: int) -> int | None:
    """What a rule (built in, or a plug-in that may not say) tolerates of m rows; None: it does not say."""
    tolerates = getattr(rule, "tolerates", None)
    found = None if tolerates is None else tolerates(m)
    return None if found is None else int(found)


def rule_check(rule: Any, m: int) -> None:
    check = getattr(rule, "check", None)
    if check is not None:
        check(m)


class PluginNotFound(ValueError):
    """An aggregation plug-in that cannot be loaded or made; the message says why."""


def load_plugin(path: str, params: Mapping[str, Any]) -> Any:
    """The rule a plug-in names: "module:Class" or an entry point of `fedsaddle.aggregations`, made with params."""
    target = path
    if ":" not in path:
        found = {entry.name: entry.value for entry in entry_points(group=ENTRY_POINT_GROUP)}
        if path not in found:
            known = sorted(found) or ["none installed"]
            raise PluginNotFound(f"no aggregation rule {path!r} among the entry points {ENTRY_POINT_GROUP} ({known})")
        target = found[path]
    module_name, _, attribute = target.partition(":")
    try:
        module = import_plugin_module(module_name)
    except Exception as exc:  # a missing module, or one that fails as it runs
        raise PluginNotFound(f"aggregation rule {path!r}: cannot import {module_name!r}: {exc}") from None
    factory: Callable[..., Any] | None = getattr(module, attribute, None)
    if factory is None:
        raise PluginNotFound(f"aggregation rule {path!r}: {module_name!r} has no {attribute!r}")
    try:
        rule = factory(**params)
    except Exception as exc:  # the plug-in's own check of its parameters
        raise PluginNotFound(f"aggregation rule {path!r}: {exc}") from None
    if not callable(getattr(rule, "aggregate", None)):
        raise PluginNotFound(f"aggregation rule {path!r}: {attribute!r} made an object without aggregate()")
    return rule


_NO_DRAWS = np.random.default_rng(0)  # given to rules that say they draw nothing (never read)


def round_rule(rule: Rule, seed: int, round_id: int) -> Callable[[Array, Array | None], Array]:
    """The rule as one round applies it: its generator named by (run seed, round id), drawn afresh for
    each call, so a round's vector and its objective values are bucketed alike in every transport."""

    draws = getattr(rule, "draws", True)

    def apply(rows: Array, weights: Array | None) -> Array:
        rng = seeding.rng(seed, seeding.BUCKETS, round_id) if draws else _NO_DRAWS
        result: Array = rule.aggregate(rows, weights, rng)
        return result

    return apply
