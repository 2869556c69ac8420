"""Where algorithms come from: the built-in ones, and the installed packages' plug-ins.

An algorithm is one `AlgorithmDef` (spec.py), declared in one module beside its spec
(a pydantic model holding its hyper-parameters and their defaults, declared once), its
server half (built from a validated spec) and, when it needs one, its client half:
named local computations that a client runs on its own data. The built-in algorithms
are the modules of this package, listed in `BUILT_IN`; a plug-in package registers its
`AlgorithmDef` under the entry-point group `fedsaddle.algorithms` (or, for one process
only, `register(definition)` does):

    [project.entry-points."fedsaddle.algorithms"]
    my_method = "my_package:MY_METHOD"

The coordinator finds the algorithm by the config's `name`; a client process
finds the local computations by the name a task carries, in the same entry points
(common/computations.py). Both sides read the installed packages once per process
(`rescan()` reads them again).

This module does not import the config: the config validates its `algorithms:`
entries through `parse_algorithm`, and takes the built-in specs from `BUILT_IN`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from fedsaddle.common import computations
from fedsaddle.common.problems.registry import import_failure, import_plugin_module
from fedsaddle.server.algorithms.catalyst import SCAFFOLD_CATALYST_S
from fedsaddle.server.algorithms.fedavg_s import FEDAVG_S
from fedsaddle.server.algorithms.fedgda_gt import FEDGDA_GT
from fedsaddle.server.algorithms.local_extragradient import LOCAL_EXTRAGRADIENT
from fedsaddle.server.algorithms.local_sgda_plus import LOCAL_SGDA_PLUS
from fedsaddle.server.algorithms.minibatch_md import MINIBATCH_MD
from fedsaddle.server.algorithms.mirror_prox import MIRROR_PROX
from fedsaddle.server.algorithms.scaffold_s import SCAFFOLD_S
from fedsaddle.server.algorithms.spec import AlgorithmDef, AlgorithmSpecBase

ENTRY_POINT_GROUP = "fedsaddle.algorithms"

# The built-in algorithms by name, in the order `available()` lists them (the paper's five first).
BUILT_IN: dict[str, AlgorithmDef[Any]] = {
    algorithm.name: algorithm
    for algorithm in (
        MINIBATCH_MD,
        MIRROR_PROX,
        FEDAVG_S,
        SCAFFOLD_S,
        SCAFFOLD_CATALYST_S,
        FEDGDA_GT,
        LOCAL_EXTRAGRADIENT,
        LOCAL_SGDA_PLUS,
    )
}


class AlgorithmNotFound(ValueError):
    """No algorithm of that name is built in or installed; the message lists those that are."""


def _load(path: str, name: str) -> AlgorithmDef[Any]:
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


_REGISTERED: dict[str, AlgorithmDef[Any]] = {}  # register()ed in this process


def register(algorithm: AlgorithmDef[Any]) -> None:
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


def available() -> list[str]:
    """The names of every algorithm this process can run: the built-in ones, then the plug-ins, sorted."""
    plugins = sorted(name for name in {*_entry_points(), *_REGISTERED} if name not in BUILT_IN)
    return [*BUILT_IN, *plugins]


@functools.cache
def definition(name: str) -> AlgorithmDef[Any]:
    """The algorithm called `name`; AlgorithmNotFound (listing what is installed) if there is none."""
    if name in BUILT_IN:  # (built-in names win)
        return BUILT_IN[name]
    if name in _REGISTERED:
        return _REGISTERED[name]
    path = _entry_points().get(name)
    if path is None:
        close = difflib.get_close_matches(name, available(), n=1, cutoff=0.7)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise AlgorithmNotFound(
            f"unknown name {name[:64]!r}{guess}; expected one of {available()} "
            f"(plug-ins register under the entry-point group {ENTRY_POINT_GROUP!r})"
        )
    return _load(path, name)


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
    spec: type[AlgorithmSpecBase] = definition(name).spec
    return spec.model_validate(dict(data))
