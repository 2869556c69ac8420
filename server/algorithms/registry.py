"""Where algorithms come from: the built-in ones, and the installed packages' plug-ins.

An algorithm is one `AlgorithmDef`: its spec (a pydantic model holding its
hyper-parameters and their defaults, declared once), a `build` that makes its
server half from a validated spec, and, when it needs one, its client half: named
local computations (common/computations.py) that a client runs on its own data.

A plug-in package registers its `AlgorithmDef` under the entry-point group (or, for
one process only, `register(definition)` does)
`fedsaddle.algorithms`:

    [project.entry-points."fedsaddle.algorithms"]
    my_method = "my_package:MY_METHOD"

The coordinator finds the algorithm by the config's `name`; a client process
finds the local computations by the name a task carries, in the same entry points
(common/computations.py). Both sides read the installed packages once per process
(`rescan()` reads them again).

This module imports neither the config nor any algorithm: the config validates its
`algorithms:` entries through `parse_algorithm`, and the built-in definitions
(server/algorithms/builtin.py) import the config's specs; they are loaded by name.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from fedsaddle.common import computations
from fedsaddle.common.computations import LocalComputation
from fedsaddle.common.problems.registry import import_failure, import_plugin_module

if TYPE_CHECKING:
    from fedsaddle.server.algorithms.base import Algorithm
    from fedsaddle.server.algorithms.schedule import SyncSchedule

ENTRY_POINT_GROUP = "fedsaddle.algorithms"

_BUILTIN_MODULE = "fedsaddle.server.algorithms.builtin"
BUILT_IN = {
    name: f"{_BUILTIN_MODULE}:{name.upper()}"
    for name in (
        "minibatch_md",
        "mirror_prox",
        "fedavg_s",
        "scaffold_s",
        "scaffold_catalyst_s",
        "fedgda_gt",
        "local_extragradient",
        "local_sgda_plus",
    )
}


class AlgorithmSpecBase(BaseModel):
    """What every algorithm's spec has: its `name` (a Literal with a default in each spec) and a `label`.

    A spec declares the algorithm's hyper-parameters with their defaults and ranges; it
    is the only place they are declared (the server half takes each one as required).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    label: str | None = Field(None, description="name in outputs; defaults to the algorithm name")
    name: str

    @property
    def display_name(self) -> str:
        return self.label or self.name


class BuildContext(NamedTuple):
    """What the run gives every algorithm besides its spec."""

    schedule: SyncSchedule  # the run's synchronization schedule (fixed tau or random p)
    dim_x: int | None  # the length of x in z = (x, y), when known


@dataclass(frozen=True)
class AlgorithmDef:
    """One algorithm: spec, server half, and the client half's local computations by name."""

    spec: type[AlgorithmSpecBase]
    build: Callable[[Any, BuildContext], Algorithm[Any]]
    computations: Mapping[str, LocalComputation] = field(default_factory=dict)
    paper: str = ""  # the paper it comes from, for the algorithms table

    @property
    def name(self) -> str:
        return str(self.spec.model_fields["name"].default)


class AlgorithmNotFound(ValueError):
    """No algorithm of that name is built in or installed; the message lists those that are."""


def _load(path: str, name: str) -> AlgorithmDef:
    module_name, _, attribute = path.partition(":")
    try:
        module = import_plugin_module(module_name)
    except ImportError as exc:
        raise AlgorithmNotFound(f"algorithm {name!r} ({path}): cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # the module was found, and failed while it ran: a SyntaxError, a NameError, ...
        raise AlgorithmNotFound(
            f"algorithm {name!r} ({path}): importing {module_name!r} failed: {import_failure(exc)}"
        ) from None
    found = getattr(module, attribute, None)
    if not isinstance(found, AlgorithmDef):
        raise AlgorithmNotFound(f"algorithm {name!r} ({path}): {attribute!r} is not a fedsaddle AlgorithmDef")
    if found.name != name:
        raise AlgorithmNotFound(f"algorithm {name!r} ({path}) defines algorithm {found.name!r}")
    return found


_REGISTERED: dict[str, AlgorithmDef] = {}  # register()ed in this process


def register(algorithm: AlgorithmDef) -> None:
    """Make `algorithm` and its local computations known to this process, without an entry point
    (a notebook, a test, an in-process run). Processes it starts afresh do not inherit it: client
    processes find a plug-in by its entry point."""
    if not isinstance(algorithm, AlgorithmDef):
        raise TypeError(f"register() takes an AlgorithmDef, got {type(algorithm).__name__}")
    if algorithm.name in BUILT_IN:
        raise ValueError(f"{algorithm.name!r} is a built-in algorithm's name")
    for name, computation in algorithm.computations.items():
        computations.register(name, computation)
    _REGISTERED[algorithm.name] = algorithm
    definition.cache_clear()


def unregister(name: str) -> None:
    """Forget an algorithm `register` made known (and its local computations); others are untouched."""
    algorithm = _REGISTERED.pop(name, None)
    if algorithm is not None:
        for computation in algorithm.computations:
            computations.unregister(computation)
    definition.cache_clear()


@functools.cache
def _entry_points() -> dict[str, str]:
    """The installed packages' algorithms, read once per process."""
    found: dict[str, str] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


def rescan() -> None:
    """Read the installed packages' algorithms again (after installing a plug-in in a running process)."""
    _entry_points.cache_clear()
    definition.cache_clear()
    computations.rescan()  # the client side's view of the same entry points


def registered() -> dict[str, str]:
    """name -> 'module:ATTRIBUTE' of every algorithm this process can run (built-in names win)."""
    return {**_entry_points(), **{name: "(registered in this process)" for name in _REGISTERED}, **BUILT_IN}


def available() -> list[str]:
    """The names of every algorithm this process can run: the built-in ones, then the plug-ins, sorted."""
    plugins = sorted(name for name in {*_entry_points(), *_REGISTERED} if name not in BUILT_IN)
    return [*BUILT_IN, *plugins]


@functools.cache
def definition(name: str) -> AlgorithmDef:
    """The algorithm called `name`; AlgorithmNotFound (listing what is installed) if there is none."""
    known = registered()
    if name not in known:
        close = difflib.get_close_matches(name, available(), n=1, cutoff=0.7)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise AlgorithmNotFound(
            f"unknown name {name[:64]!r}{guess}; expected one of {available()} "
            f"(plug-ins register under the entry-point group {ENTRY_POINT_GROUP!r})"
        )
    if name in _REGISTERED and name not in BUILT_IN:
        return _REGISTERED[name]
    return _load(known[name], name)


def parse_algorithm(data: Mapping[str, Any] | AlgorithmSpecBase) -> AlgorithmSpecBase:
    """Validate one `algorithms:` entry with its algorithm's own spec; ValidationError if a field is bad.

    An entry may also be a spec already built (from Python: `api.run`, a config's own `algorithms`): it is
    validated again as its fields, so a spec of an algorithm that is not registered is still refused."""
    if isinstance(data, AlgorithmSpecBase):
        data = data.model_dump()
    if not isinstance(data, Mapping):
        raise AlgorithmNotFound(f"an algorithm must be a mapping of fields, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str):
        raise AlgorithmNotFound(f"an algorithm needs a `name`; expected one of {available()}")
    return definition(name).spec.model_validate(dict(data))
