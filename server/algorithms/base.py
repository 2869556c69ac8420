"""What every algorithm shares: the exchange protocol, answers, costs, checks, state files.

An algorithm is plain single-run code that never touches a transport, in the
style of sans-I/O protocol libraries. `init` and `step` are generators: each
*yields* the exchange it needs next (a `GradientTask` or `LocalStepsTask`, see
common/tasks.py), receives the clients' `RoundAnswers`, and finally *returns* the new
state:

    def step(self, state):
        answers = yield GradientTask(state.z)          # clients send G_i(z)
        return MDState(z=state.z - self.gamma * answers.mean(), ...)

Whoever drives the generator decides how an exchange happens: one run over a
pool (server/driver.py: in-process or over gRPC), or many runs at once whose
pending exchanges go through one vectorized worker call (server/batch.py).

A state is a NamedTuple of arrays and numbers (as in Optax), the synchronization
clock included, so it can be saved after any step and read back (`save_state`).
"""

from __future__ import annotations

import abc
import json
import typing
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from fedsaddle.common.numeric import Array, ordered_sum, running_sum
from fedsaddle.common.problems.domains import Domain
from fedsaddle.common.tasks import Task

State = TypeVar("State")
T = TypeVar("T")


class RoundAnswers:
    """The answers to one exchange: one row per answering client, in client-index order.

    `mean()` is the round's aggregate, what every algorithm calls: by default the
    paper's (1/n) sum_i v_i, or, when the run weights clients by their sample counts,
    sum_i m_i v_i / sum_i m_i. Either way the sum runs in client-index order. A
    driver that aggregates many runs at once may pass the means in (`aggregated`),
    computed by the same rule. A run with a robust rule (server/aggregation.py)
    passes the round's `rule` instead, and `mean()` is that rule's aggregate of the rows
    (and `mean_objective()` of the objective values).
    """

    __slots__ = ("_mean", "_mean_objective", "element", "indices", "objective", "rule", "vectors", "weights")
    _mean: Array | None
    _mean_objective: float | None

    def __init__(
        self,
        vectors: Array | None,
        objective: Array | None = None,
        weights: Array | None = None,
        indices: tuple[int, ...] | None = None,
        aggregated: tuple[Array, float | None] | None = None,
        rule: Callable[[Array, Array | None], Array] | None = None,
    ) -> None:
        self.rule = rule  # the round's robust rule (rows, weights) -> vector; None: the mean
        self.vectors = vectors  # (m, D); None when the pool passed the mean in (large D)
        self.objective = objective  # (m,) f_i(z), when the task asked for it
        self.weights = weights  # (m,) sample counts, or None for uniform weights; (m, D): an evaluation's per metric
        self.indices = indices  # the answering clients; None: all n, in order
        self._mean, self._mean_objective = aggregated if aggregated is not None else (None, None)
        # A run of precision float32 (set by the pool): the mean, summed in float64, is rounded to it once.
        self.element: np.dtype[np.floating] | None = None

    def mean(self) -> Array:
        """The aggregated vector (D,)."""
        if self._mean is None:
            assert self.vectors is not None
            if self.rule is not None:
                self._mean = self.rule(self.vectors, self.weights)
            else:
                self._mean = aggregate(self.vectors[None], self.weights)[0]
        if self.element is not None and self._mean.dtype != self.element:
            self._mean = self._mean.astype(self.element)
        return self._mean

    def mean_objective(self) -> float | None:
        """f(z) = the aggregated f_i(z), when the task asked for objectives."""
        if self._mean_objective is not None:  # passed in (a batch's, or a secure aggregate's)
            return self._mean_objective
        if self.objective is None:
            return None
        if self._mean_objective is None:
            if self.rule is not None:
                self._mean_objective = float(self.rule(self.objective[:, None], self.weights)[0])
            else:
                self._mean_objective = float(aggregate(self.objective[None, :, None], self.weights)[0, 0])
        return self._mean_objective


def aggregate(rows: Array, weights: Array | None = None) -> Array:
    """The aggregation rule over axis 1 of (runs, clients, D): (runs, D), clients added in index order.
    `weights`: one per client (clients,), or one per client and entry (clients, D), as an evaluation of
    metrics on different rows gives (an entry no client weighs in on is NaN)."""
    if weights is None:
        result: Array = ordered_sum(rows.swapaxes(0, 1)) / rows.shape[1]
        return result
    if weights.ndim == 2:
        totals = ordered_sum(weights)
        with np.errstate(invalid="ignore", divide="ignore"):
            by_entry: Array = ordered_sum((weights[None] * rows).swapaxes(0, 1)) / totals
        by_entry[:, totals == 0] = np.nan
        return by_entry
    column = weights[None, :, None]
    total = weight_total(weights)
    if total == 0:  # nobody had anything to weigh in (e.g. no client has held-out rows)
        return np.full((rows.shape[0], rows.shape[2]), np.nan)
    weighted: Array = ordered_sum((column * rows).swapaxes(0, 1)) / total
    return weighted


def aggregate_rows(rows: Sequence[Array], weights: Array | None = None) -> Array:
    """The same rule for one run whose client rows are separate long vectors (more than
    SUMMED_BY_LOOP_ABOVE entries, where `aggregate` adds them one by one too): the same
    additions in the same order, without stacking the rows into one array first."""
    if weights is None:
        mean: Array = running_sum(rows) / len(rows)
        return mean
    total = weight_total(weights)
    if total == 0:
        return np.full(rows[0].shape, np.nan)
    weighted: Array = running_sum(w * v for w, v in zip(weights, rows, strict=True)) / total
    return weighted


def weight_total(weights: Array) -> float:
    """sum_i m_i, added in client-index order."""
    return float(ordered_sum(weights[:, None])[0])


# What `init` and `step` are: generators of exchanges that return a value.
Exchanges = Generator[Task, RoundAnswers, T]


def no_exchange(value: T) -> Exchanges[T]:
    """An exchange generator that needs no round and returns `value` (for pure steps)."""
    yield from ()
    return value


class StepCost(NamedTuple):
    """Rounds one step spends, counted both ways (docs/reference/traffic.md)."""

    exchanges: int  # every coordinator <-> clients exchange
    paper: int  # the paper's convention: syncs (and Mirror-prox's two gathers)


class Algorithm(abc.ABC, Generic[State]):
    """One of the paper's algorithms, as generators of exchanges over an explicit state.

    On a constrained problem (`domain` set) every global step is followed by the Euclidean
    projection onto the domain (the clients project their local steps, common/worker.py);
    unconstrained, `project` returns its argument untouched, so nothing changes by a bit.
    """

    name: str
    state_type: type  # the NamedTuple of its state (to read one back from a file)
    domain: Domain | None = None

    def project(self, z: Array) -> Array:
        """z projected onto the problem's domain (z itself when unconstrained), in z's element type."""
        return z if self.domain is None else self.domain.project(z).astype(z.dtype, copy=False)

    @abc.abstractmethod
    def init(self, z0: Array, seed: int) -> Exchanges[State]:
        """The starting state from z0 (SCAFFOLD-S spends a round on G(z0))."""

    @abc.abstractmethod
    def step(self, state: State) -> Exchanges[State]:
        """One sync (or one Minibatch MD / Mirror-prox step)."""

    @abc.abstractmethod
    def iterate(self, state: State) -> Array:
        """The coordinator's current iterate: where metrics are taken."""

    @abc.abstractmethod
    def step_cost(self, state: State) -> StepCost:
        """Rounds the next step will spend."""

    def init_cost(self) -> StepCost:
        return StepCost(0, 0)


def positive(name: str, value: float, allow_zero: bool = False) -> float:
    """Check a step size or weight once, at construction, naming it if it is out of range."""
    if not (np.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


# -- state files -----------------------------------------------------------------------


def flatten_state(state: Any, prefix: str = "") -> tuple[dict[str, Array], dict[str, Any]]:
    """A state's arrays (by dotted field name) and its other fields (JSON), nested states included."""
    arrays: dict[str, Array] = {}
    scalars: dict[str, Any] = {}
    for name, value in zip(state._fields, state, strict=True):
        if isinstance(value, np.ndarray):
            arrays[prefix + name] = value
        elif hasattr(value, "_fields"):
            inner_arrays, scalars[name] = flatten_state(value, f"{prefix}{name}.")
            arrays.update(inner_arrays)
        else:
            scalars[name] = value
    return arrays, scalars


def build_state(cls: type[Any], scalars: dict[str, Any], arrays: dict[str, Array], prefix: str = "") -> Any:
    """The state of type cls that `flatten_state` took apart (nested states are rebuilt by their field types)."""
    types = typing.get_type_hints(cls)
    values = []
    for name in cls._fields:
        if prefix + name in arrays:
            values.append(arrays[prefix + name])
        elif hasattr(types[name], "_fields"):
            values.append(build_state(types[name], scalars[name], arrays, f"{prefix}{name}."))
        else:
            values.append(scalars[name])
    return cls(*values)


def save_state(state: Any, path: str | Path) -> None:
    """Write a state (a NamedTuple, nested ones too) to an .npz file: arrays exact, the rest as JSON."""
    arrays, scalars = flatten_state(state)
    meta = json.dumps({"type": type(state).__name__, "scalars": scalars})
    np.savez(Path(path), __meta__=np.array(meta), **arrays)  # type: ignore[arg-type]


def load_state(cls: type[State], path: str | Path) -> State:
    """Read a state written by save_state back into an instance of cls."""
    with np.load(Path(path)) as data:
        meta = json.loads(str(data["__meta__"]))
        if meta["type"] != cls.__name__:
            raise ValueError(f"{path} holds a {meta['type']}, not a {cls.__name__}")
        arrays = {name: data[name].copy() for name in data.files if name != "__meta__"}
    result: State = build_state(cls, meta["scalars"], arrays)
    return result
