"""Shards: the clients a process hosts, with their local oracles, vectorized over those clients.

The worker (common/worker.py) computes on shards. Vectors are columns: z has
shape (dimension, k) for k hosted clients, or (dimension, k, B) for a batch of B
runs, so that x = z[:dim_x] and y = z[dim_x:] are contiguous blocks and a per-run
number (B,) broadcasts along the innermost axis. Every client's result depends
only on its own column and its own data, never on which other clients or runs
share the arrays: that is what makes every transport agree bit for bit.

Synthetic problems build their shards directly (fast, for sweeps); a
DataProblem's clients are wrapped by ProblemShards, which hands each client's
column, made contiguous, to the problem's own per-client methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common import seeding
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import DataProblem, accepts_client, client_context
from fedsaddle.common.problems.data import ClientData
from fedsaddle.common.problems.domains import DomainError, problem_domain


class Shards(Protocol):
    """The private data of some clients, with their local oracles."""

    indices: tuple[int, ...]
    dimension: int  # length of z = (x, y)

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        """G_i(z_i) for each hosted client i, the shape of z (written into `out` if given)."""
        ...

    def objective(self, z: Array) -> Array:
        """f_i(z_i) for each hosted client i: z's shape without its first axis."""
        ...


class ProblemError(ValueError):
    """A problem's own code failed, or returned something of the wrong shape; the message names the
    problem, the method and the client."""


METRIC_ROWS = ("held-out", "training")


def metric_rows(problem: Any) -> tuple[str, ...]:
    """The rows each of `problem`'s metrics is computed on, in the order of its metric_names: its
    `metrics_on`, one kind for all of them or one per metric. ProblemError names a declaration that is
    neither."""
    names, declared = tuple(problem.metric_names), problem.metrics_on
    if isinstance(declared, str) and declared in METRIC_ROWS:
        return (declared,) * len(names)
    if (
        isinstance(declared, tuple)
        and len(declared) == len(names)
        and all(isinstance(kind, str) and kind in METRIC_ROWS for kind in declared)
    ):
        return declared
    raise ProblemError(
        f"problem {problem.spec.name!r} declares metrics_on = {declared!r}; it must be 'held-out' or 'training', "
        f"or a tuple of those with one entry per metric name {list(names)}"
    )


def counts_per_metric(problem: Any) -> bool:
    """Whether `problem`'s metrics are on different rows, so that each client sends one row count per metric
    (EVALUATE's sample_counts, docs/reference/client-arithmetic.md) rather than one for all of them."""
    return len(set(metric_rows(problem))) > 1


def minibatch_rows(seed: int, client: int, round_id: int, call: int, rows: int, batch_size: int) -> NDArray[np.int64]:
    """The training rows of client `client`'s stochastic oracle call number `call` (from 0) in round `round_id`:
    the first `batch_size` entries of a permutation of range(rows) drawn from the stream (seed, 9, client,
    round_id, call) (docs/reference/client-arithmetic.md, Minibatches)."""
    permutation = seeding.rng(seed, seeding.MINIBATCH, client, round_id, call).permutation(rows)
    return np.asarray(permutation[:batch_size], dtype=np.int64)


class Minibatches:
    """The minibatch draws of the clients a process hosts, for a problem whose spec sets `batch_size`.

    The worker (common/worker.py) starts each round's streams (`begin_round`) and marks the stochastic oracle
    calls (`stochastic`); inside one, `rows(j)` is hosted client j's next minibatch, and outside, or without a
    batch_size, None: every row. `where` names the problem in errors: a batch_size larger than a client's rows
    is refused here, before any round.
    """

    def __init__(self, indices: Sequence[int], rows: Sequence[int], batch_size: int | None, where: str) -> None:
        self.indices = tuple(indices)
        self.counts = tuple(rows)
        self.batch_size = batch_size
        if batch_size is not None:
            for i, m in zip(self.indices, self.counts, strict=True):
                if batch_size > m:
                    raise ProblemError(
                        f"{where}: batch_size is {batch_size}, larger than client {i}'s {m} training rows; set "
                        "problem.batch_size to at most the smallest client's rows"
                    )
        self._seed: int | None = None
        self._round: int | None = None
        self._calls = [0] * len(self.indices)
        self._drawing = False

    def begin_round(self, seeds: Sequence[int], round_id: int) -> None:
        """Start the round's streams: call counts from 0 again."""
        self._seed, self._round = int(seeds[0]), int(round_id)
        self._calls = [0] * len(self.indices)

    @contextlib.contextmanager
    def stochastic(self) -> Iterator[None]:
        """Oracle calls inside draw their minibatch (when batch_size is set)."""
        self._drawing = True
        try:
            yield
        finally:
            self._drawing = False

    def rows(self, j: int) -> NDArray[np.int64] | None:
        """Hosted client j's rows for this call: its next minibatch inside `stochastic`, else None (every row)."""
        if not self._drawing or self.batch_size is None:
            return None
        if self._seed is None or self._round is None:
            raise RuntimeError("a stochastic oracle call outside a round (begin_round was not called)")
        call, self._calls[j] = self._calls[j], self._calls[j] + 1
        return minibatch_rows(self._seed, self.indices[j], self._round, call, self.counts[j], self.batch_size)


class ProblemShards:
    """A DataProblem's clients in one process: each computes on its own file's data.

    What the problem's methods return is checked (a plug-in's mistakes are named, not
    left to surface as a numpy broadcasting error), and once when the shards are made,
    at z = 0: so a problem that cannot serve fails the run before its first round,
    naming the client and the fault, instead of ending the client process mid-round.
    """

    def __init__(
        self,
        problem: DataProblem,
        datas: Sequence[ClientData],
        indices: Sequence[int],
        weighting: Literal["uniform", "samples"] = "uniform",
    ) -> None:
        if len(datas) != len(indices):
            raise ValueError(f"{len(indices)} clients need {len(indices)} data files, got {len(datas)}")
        self.problem = problem
        self.datas = list(datas)
        self.indices = tuple(indices)
        self.dimension = problem.dimension
        n = problem.spec.num_clients
        self.contexts = [
            client_context(i, n, data.samples, weighting) for i, data in zip(self.indices, self.datas, strict=True)
        ]
        self.domain = problem_domain(problem)
        # Minibatch oracle calls, for a problem whose spec has a batch_size (a plug-in's; none of the built-in
        # numpy problems has one).
        where = f"problem {problem.spec.name!r}"
        batch_size = getattr(problem.spec, "batch_size", None)
        self.draws = Minibatches(self.indices, [d.samples for d in self.datas], batch_size, where)
        self.batch_size = batch_size
        self.begin_round, self.stochastic = self.draws.begin_round, self.draws.stochastic
        # Which of the problem's methods take the client's context (detected once, by signature).
        self._with_context = {
            name: accepts_client(getattr(problem, name)) for name in ("gradient", "objective", "metrics")
        }
        zero = np.zeros((self.dimension, len(self.datas)))
        gradient = self.gradient(zero)
        if self._inside(zero[:, 0]):  # (z = 0 outside the domain, a simplex's say, is a point no run visits)
            self._no_nan_at_zero(gradient)
        self.objective(zero)
        if problem.metric_names:
            self.evaluate(zero[:, 0])

    def _call(self, name: str, j: int, z: Array, data: ClientData | None = None) -> Any:
        """The problem's method `name` on client j's data (or `data`, some of its rows) at z (with its context,
        if the method takes it); ProblemError if it raises."""
        method: Callable[..., Any] = getattr(self.problem, name)
        data = self.datas[j] if data is None else data
        try:
            if self._with_context[name]:
                return method(data, z, client=self.contexts[j])
            return method(data, z)
        except Exception as exc:
            raise ProblemError(f"{self._where(name, j)} raised {type(exc).__name__}: {exc}") from exc

    def _inside(self, z: Array) -> bool:
        """Whether z lies in the problem's domain (every z does when it has none)."""
        if self.domain is None:
            return True
        try:
            self.domain.check(z, "z")
        except DomainError:
            return False
        return True

    def _no_nan_at_zero(self, g: Array) -> None:
        """ProblemError if the start-up check's gradient at z = 0 holds a NaN: nothing a run does from
        there would mean anything, and it would end as 'diverged', as if a step were too large."""
        for j in range(len(self.datas)):
            nan = np.flatnonzero(np.isnan(g[:, j]))
            if nan.size:
                dim_x, _ = self.problem.dims()
                entry = int(nan[0])
                name = f"x[{entry}]" if entry < dim_x else f"y[{entry - dim_x}]"
                raise ProblemError(
                    f"{self._where('gradient', j)} returned nan at z = 0 in entry {name} "
                    f"({nan.size} of its {self.dimension} entries are nan)"
                )

    def _require_numbers(self, name: str, j: int, value: Any) -> None:
        """ProblemError naming what `name` returned if its entries are not real numbers (None, text, ...)."""
        if np.asarray(value).dtype.kind in "biuf":
            return
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ProblemError(f"{self._where(name, j)} returned {shown} ({type(value).__name__}); it must return numbers")

    def _where(self, name: str, j: int) -> str:
        return f"problem {self.problem.spec.name!r}: {name}() on client {self.indices[j]}'s data"

    def _columns(self, z: Array) -> list[tuple[int, tuple[int, ...], Array]]:
        return shard_columns(z, len(self.datas))

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        out = np.empty_like(z) if out is None else out
        for j, where, column in self._columns(z):
            g = self._call("gradient", j, column, self._drawn(j))
            if np.shape(g) != (self.dimension,):
                dim_x, dim_y = self.problem.dims()
                raise ProblemError(
                    f"{self._where('gradient', j)} returned shape {np.shape(g)}; "
                    f"G_i(z) has dim_x + dim_y = {dim_x} + {dim_y} = {self.dimension} entries"
                )
            self._require_numbers("gradient", j, g)
            target: tuple[slice | int, ...] = (slice(None), *where)
            out[target] = g
        return out

    def _drawn(self, j: int) -> ClientData | None:
        """Client j's training rows for a stochastic call: its minibatch, None for every row."""
        rows = self.draws.rows(j)
        if rows is None:
            return None
        data = self.datas[j]
        group = None if data.group is None else data.group[rows]
        # Another path: a problem that caches per file (LinearRegression's moments) must not take these rows for it.
        path = f"{data.path}#minibatch"
        return ClientData(path, data.X[rows], data.y[rows], group, data.X_test, data.y_test, data.group_test)

    def objective(self, z: Array) -> Array:
        values = np.empty(z.shape[1:])
        for j, where, column in self._columns(z):
            value = self._call("objective", j, column)
            if np.ndim(value) != 0:
                raise ProblemError(
                    f"{self._where('objective', j)} returned shape {np.shape(value)}; f_i(z) is a number"
                )
            self._require_numbers("objective", j, value)
            values[where] = value
        return values

    def evaluate(self, z: Array) -> tuple[Array, Array]:
        """The problem's metrics at z on each client's held-out rows, or its training rows for the metrics its
        `metrics_on` puts there, (k, metrics), and the counts of those rows: the clients' weights, (k,) when
        every metric is on the same rows, else (k, metrics). A client without those rows gives no metrics; with
        metrics on different rows, a client with some of them gives them all (those it lacks the rows of weigh
        0, whatever their value)."""
        names = self.problem.metric_names
        kinds = metric_rows(self.problem)
        values = np.zeros((len(self.datas), len(names)))
        counts = np.zeros((len(self.datas), len(names)) if len(set(kinds)) > 1 else len(self.datas))
        for j, data in enumerate(self.datas):
            rows = [data.samples if kind == "training" else data.heldout for kind in kinds]
            if rows and (all(rows) if counts.ndim == 1 else any(rows)):
                found = self._call("metrics", j, np.ascontiguousarray(z))
                if np.shape(found) != (len(names),):
                    raise ProblemError(
                        f"{self._where('metrics', j)} returned shape {np.shape(found)}; "
                        f"it must give one value per metric name {list(names)}"
                    )
                self._require_numbers("metrics", j, found)
                values[j] = found
                counts[j] = rows if counts.ndim == 2 else rows[0]
        return values, counts

    def sample_counts(self) -> list[int]:
        return [data.samples for data in self.datas]


class StackedShards:
    """A batch of runs' shards for any problem: each run computes with its own object."""

    def __init__(self, runs: Sequence[Shards]) -> None:
        self.runs = list(runs)
        self.indices = runs[0].indices
        self.dimension = runs[0].dimension
        self.domain = getattr(runs[0], "domain", None)

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        return np.stack([run.gradient(z[..., b]) for b, run in enumerate(self.runs)], axis=-1, out=out)

    def objective(self, z: Array) -> Array:
        return np.stack([run.objective(z[..., b]) for b, run in enumerate(self.runs)], axis=-1)

    def select_runs(self, runs: Sequence[int]) -> StackedShards:
        return StackedShards([self.runs[r] for r in runs])

    # Minibatch oracles (shards with a `batch_size`, common/worker.py): each run draws from its own seed's streams.

    @property
    def batch_size(self) -> int | None:
        return getattr(self.runs[0], "batch_size", None)

    def begin_round(self, seeds: Sequence[int], round_id: int) -> None:
        for seed, run in zip(seeds, self.runs, strict=True):
            begin = getattr(run, "begin_round", None)
            if begin is not None:
                begin((seed,), round_id)

    @contextlib.contextmanager
    def stochastic(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for run in self.runs:
                stochastic = getattr(run, "stochastic", None)
                if stochastic is not None:
                    stack.enter_context(stochastic())
            yield


def stack_shards(runs: Sequence[Shards]) -> Shards:
    """Shards for a batch of runs (same problem kind, clients and dimension)."""
    from fedsaddle.common.problems.synthetic import PaperRegressionShards

    if len({(r.indices, r.dimension, type(r)) for r in runs}) != 1:
        raise ValueError("a batch needs runs of one problem kind with the same clients and dimension")
    if all(isinstance(r, PaperRegressionShards) for r in runs):
        return PaperRegressionShards.stack(runs)  # type: ignore[arg-type]
    return StackedShards(runs)


def shard_columns(z: Array, clients: int) -> list[tuple[int, tuple[int, ...], Array]]:
    """(client position, index of its column in z[0], its z as a contiguous vector) for every column of z,
    a (D, clients, ...) block of iterates: one client's columns after another, each run's in order."""
    columns = []
    for j in range(clients):
        for rest in np.ndindex(*z.shape[2:]):
            where = (j, *rest)
            columns.append((j, where, np.ascontiguousarray(z[(slice(None), *where)])))
    return columns
