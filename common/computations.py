"""The client half of an algorithm: named local computations a client runs on its own data.

A local computation is a function

    fn(oracle: ClientOracle, z: Array, **named) -> Array

called once per task for all the clients a process hosts. `z` holds one column per
hosted client, shape (D, k) (or (D, k, B) for a batch of B runs in a sweep): write it
with elementwise numpy and the oracle's calls, and it serves any k and B. `named`
are the task's named arrays (each as columns, like z) and scalar parameters
(floats). It returns the clients' answers as columns of z's shape. The oracle is the
client's data: `gradient`, `stochastic_gradient` (the run's seeded noise, drawn
from each client's own stream, so the result is the same in-process and over
gRPC), `objective`, `project` (onto the problem's domain) and `constrained`.
The gradients may be written into an array the computation keeps from step to
step (`out=`), which saves an allocation per call, and only some of their rows
(`rows=`), which the paper problem computes alone (Local SGDA+ takes x's rows of
one gradient and y's of another).

In a sweep's batch, runs share one call when their tasks' parameters are equal.
A computation that takes some parameters elementwise may declare them with
`@per_run("gamma", ...)`: then runs whose values of those differ share the call
too, and each such parameter arrives as an array (B,), one value per run, that
broadcasts along z's run axis (d, k, B). Each run gets the bits it gets alone
(the same operations on the same numbers, element for element); a parameter used
in Python's control flow (a loop count, an `if`) must not be declared.

A computation is looked up by name: the built-in ones below, then those of the
installed packages' `AlgorithmDef`s (entry-point group `fedsaddle.algorithms`, see
server/algorithms/registry.py). A client that has no computation of a task's name
refuses the task, naming it (client/session.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar

import numpy as np

from fedsaddle.common.numeric import Array

ENTRY_POINT_GROUP = "fedsaddle.algorithms"  # the same group as server/algorithms/registry.py's


class ClientOracle(Protocol):
    """A process's clients' data, as a local computation sees it (common/worker.py implements it)."""

    @property
    def constrained(self) -> bool:
        """Whether the problem has a domain that `project` maps onto."""

    def gradient(self, z: Array, out: Array | None = None, rows: slice | None = None) -> Array:
        """G_i(z) exactly, one column per client: a new array, or written into `out` (a float64 array of
        z's shape that does not share memory with z) and returned. With `rows` (a slice of consecutive rows,
        which needs `out`), only out[rows] is written, with the bits of G_i(z)[rows]; the rest of out is left
        as it is. Problems whose shards offer `gradient_rows` compute only those rows; others compute the whole
        gradient."""

    def stochastic_gradient(self, z: Array, out: Array | None = None, rows: slice | None = None) -> Array:
        """G_i(z) plus the run's gradient noise (a fresh draw from each client's stream per call, of every row
        whatever `rows`); `out` and `rows` as for `gradient`."""

    def objective(self, z: Array) -> Array:
        """f_i(z), one value per client."""

    def project(self, z: Array) -> Array:
        """z projected onto the problem's domain (z itself when unconstrained)."""


LocalComputation = Callable[..., Array]
_Computation = TypeVar("_Computation", bound=LocalComputation)
_PER_RUN = "fedsaddle_per_run"  # the attribute `per_run` sets on a computation


def per_run(*names: str) -> Callable[[_Computation], _Computation]:
    """Declare the parameters `names` of a local computation elementwise: in a sweep's batch, runs whose
    values of them differ share one call, each such parameter an array (B,) of the runs' values."""
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()):
            raise TypeError(f"per_run takes the names of a computation's parameters, got {name!r}")

    def declare(computation: _Computation) -> _Computation:
        try:
            setattr(computation, _PER_RUN, frozenset(names))
        except AttributeError:
            raise TypeError(f"per_run declares a function's parameters; {computation!r} takes no attributes") from None
        return computation

    return declare


def per_run_names(computation: LocalComputation) -> frozenset[str]:
    """The parameters `computation` takes one per run in a batch (`per_run`); none if it declares none."""
    declared = getattr(computation, _PER_RUN, None)
    return declared if isinstance(declared, frozenset) else frozenset()


@per_run("gamma")
def local_extragradient(oracle: ClientOracle, z: Array, *, steps: float, gamma: float) -> Array:
    """Local Extragradient's client half (server/algorithms/local_extragradient.py): `steps` stochastic
    extragradient steps from z, answering the sum of the update directions actually taken,
    sum_l (z_i^l - z_i^{l+1}) / gamma (sum_l G^_i(z_i^{l+1/2}) when unconstrained)."""
    # The step's two gradients are written into two arrays kept from step to step, and its products and
    # differences into them: the same operations, with no array allocated per step.
    z_i = z.copy()
    direction_sum = np.zeros(z.shape)
    g, g_half = np.empty(z.shape), np.empty(z.shape)
    # A batch's steps, one per run (B,), spread over z's shape once: a product with them broadcast along z's run
    # axis, twice a step, cost more than the array (the same numbers, so the same bits).
    step = np.broadcast_to(gamma, z.shape).copy() if np.ndim(gamma) else gamma
    for _ in range(int(steps)):
        oracle.stochastic_gradient(z_i, out=g)
        z_half = oracle.project(np.subtract(z_i, np.multiply(step, g, out=g), out=g))
        oracle.stochastic_gradient(z_half, out=g_half)
        if oracle.constrained:
            z_next = oracle.project(z_i - step * g_half)
            direction_sum += (z_i - z_next) / step
            z_i = z_next
        else:
            direction_sum += g_half
            z_i -= np.multiply(step, g_half, out=g_half)
    return direction_sum


@per_run("gamma_x", "gamma_y")
def local_sgda_plus(
    oracle: ClientOracle, z: Array, *, x_snapshot: Array, steps: float, gamma_x: float, gamma_y: float
) -> Array:
    """Local SGDA+'s client half (server/algorithms/local_sgda_plus.py): `steps` local steps
    x_i <- x_i - gamma_x grad_x f_i(x_i, y_i),  y_i <- y_i + gamma_y grad_y f_i(x_snapshot, y_i),
    answering the sum of the directions, (sum_l grad_x f_i, sum_l -grad_y f_i at the snapshot)."""
    dim_x = x_snapshot.shape[0]
    xs, ys = slice(0, dim_x), slice(dim_x, None)
    z_i = z.copy()
    direction_sum = np.zeros(z.shape)
    anchored = z.copy()  # (x_snapshot, y_i): where the ascent direction is taken
    anchored[xs] = x_snapshot
    runs = np.broadcast(gamma_x, gamma_y).shape  # (B,) for a batch's per-run steps, else ()
    scale = np.empty((z.shape[0],) + (1,) * (z.ndim - 1 - len(runs)) + runs)
    scale[xs], scale[ys] = gamma_x, gamma_y
    direction = np.empty(z.shape)  # kept from step to step, as in local_extragradient
    for _ in range(int(steps)):
        # Each half of the step's direction is the rows of one gradient: x's at (x_i, y_i), y's at the anchor.
        oracle.stochastic_gradient(z_i, out=direction, rows=xs)
        anchored[ys] = z_i[ys]
        oracle.stochastic_gradient(anchored, out=direction, rows=ys)
        if oracle.constrained:  # the directions actually taken, as for the other local methods
            z_next = oracle.project(z_i - scale * direction)
            direction_sum += (z_i - z_next) / scale
            z_i = z_next
        else:
            direction_sum += direction
            z_i -= np.multiply(scale, direction, out=direction)
    return direction_sum


BUILT_IN: dict[str, LocalComputation] = {
    "local_extragradient": local_extragradient,
    "local_sgda_plus": local_sgda_plus,
}


_REGISTERED: dict[str, LocalComputation] = {}


def register(name: str, computation: LocalComputation) -> None:
    """Make a local computation known to this process (server/algorithms/registry.py's register)."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in local computation's name")
    if not callable(computation):
        raise TypeError(f"local computation {name!r} must be callable")
    _REGISTERED[name] = computation


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


_BROKEN: dict[str, str] = {}  # installed plug-ins that failed to load: entry name -> why


@functools.cache
def _installed() -> dict[str, LocalComputation]:
    """The local computations of the installed packages' algorithms, read once per process."""
    found: dict[str, LocalComputation] = {}
    _BROKEN.clear()
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            definition: Any = entry.load()
        except Exception as exc:  # a broken plug-in lacks its computations; a task naming one says why
            _BROKEN[entry.name] = f"{entry.value}: {type(exc).__name__}: {exc}"[:300]
            continue
        computations = getattr(definition, "computations", None)
        if isinstance(computations, Mapping):
            for name, fn in computations.items():
                if callable(fn):
                    found.setdefault(str(name), fn)
    return found


def find_computation(name: str) -> LocalComputation | None:
    """The local computation called `name`, built in or installed; None if this process has none."""
    return BUILT_IN.get(name) or _REGISTERED.get(name) or _installed().get(name)


def broken_plugins() -> dict[str, str]:
    """The installed algorithm plug-ins that could not be loaded here, and why."""
    _installed()
    return dict(_BROKEN)


def rescan() -> None:
    """Read the installed packages' computations again."""
    _installed.cache_clear()
