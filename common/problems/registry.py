"""Where problems come from, and which ones a process is willing to load.

A problem is found by its name among the built-in ones, then among the installed
packages' entry points in the group `fedsaddle.problems`, or by the config's
`plugin: "module:Class"`.

Where plug-in modules are found: where Python finds them (an installed package,
PYTHONPATH), else in the folder of the config file that names them and in the
folder the process was started in (each also with its `src/`, the usual layout
of a package), so that a package next to its config needs no PYTHONPATH.

Trust: the coordinator's operator writes the config, so the coordinator imports
what it names. A client process never imports a module just because a
coordinator asked: it loads built-in problems, registered entry points, and the
`module:Class` paths its own operator allowed (`fedsaddle client --problem ...`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import DataProblem, Problem, ProblemSpec, SyntheticProblem

ENTRY_POINT_GROUP = "fedsaddle.problems"

BUILT_IN = {
    "paper_regression": "fedsaddle.common.problems.synthetic:PaperRegression",
    "quadratic_game": "fedsaddle.common.problems.synthetic:QuadraticGame",
    "linear_regression": "fedsaddle.common.problems.regression:LinearRegression",
    "auc": "fedsaddle.common.problems.auc:AucMaximization",
    "fair_logistic": "fedsaddle.common.problems.fairness:FairLogistic",
    "agnostic": "fedsaddle.common.problems.agnostic:AgnosticLogistic",
    # A PyTorch problem (the torch extra): imported only when a config names it.
    "deep_auc": "fedsaddle.common.problems.deep_auc:DeepAuc",
}


class ProblemNotFound(ValueError):
    """No problem of that name (or plugin path) can be loaded here; the message says why.

    `field`: the config field at fault, `name` or `plugin`."""

    def __init__(self, message: str, field: str = "name") -> None:
        super().__init__(message)
        self.field = field


_PLUGIN_FOLDERS: list[Path] = []  # the folders of the configs this process read


def add_plugin_folder(folder: str | Path) -> None:
    """Look for plug-in modules in `folder` (a config file's) too, when Python does not find them."""
    resolved = Path(folder).resolve()
    if resolved not in _PLUGIN_FOLDERS:
        _PLUGIN_FOLDERS.append(resolved)


def import_plugin_module(module_name: str) -> ModuleType:
    """import_module, falling back on the config's folder and the working folder (and their src/): how every
    kind of plug-in (problem, algorithm, aggregation rule) is found."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        if exc.name != top:
            raise  # the plug-in was found, and lacks something it imports itself
        for folder in (*_PLUGIN_FOLDERS, Path.cwd()):
            for base in (folder, folder / "src"):
                if (base / top / "__init__.py").is_file() or (base / f"{top}.py").is_file():
                    sys.path.insert(0, str(base))
                    # Client processes this one starts afresh (not forked) find it the same way.
                    paths = (str(base), os.environ.get("PYTHONPATH"))
                    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
                    importlib.invalidate_caches()
                    return importlib.import_module(module_name)
        raise


def _not_importable(path: str, module_name: str, exc: ImportError, field: str = "name") -> ProblemNotFound:
    """What to do about a plug-in module that cannot be imported, and in which processes."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
        return ProblemNotFound(
            f"problem {path!r} is written in PyTorch, which is not installed here: pip install 'fedsaddle[torch]' "
            "(about 5 GB with CUDA) in every process that loads it, the coordinator's and the clients'",
            field,
        )
    if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
        looked = ", ".join(str(f) for f in (*_PLUGIN_FOLDERS, Path.cwd()))
        return ProblemNotFound(
            f"plugin {path!r}: cannot import {module_name!r}: {exc} (looked on sys.path and in {looked}, "
            "each with its src/). Every process that loads this problem must find it: the coordinator, which "
            f"reads the config, and every client process (started with --problem {path}). Install its package "
            "in each (pip install -e PACKAGE_FOLDER, which also registers an entry point if it declares one), "
            "or start the command in the folder that holds the module (or its src/), "
            "or put that folder on PYTHONPATH",
            field,
        )
    return ProblemNotFound(f"plugin {path!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}", field)


def import_failure(exc: BaseException) -> str:
    """What went wrong while a plug-in module ran, naming the file and line of a SyntaxError."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


def load_path(path: str, field: str = "name") -> type[Problem]:
    """The Problem class at 'module:Class'; `field`: the config field it came from (for errors)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ProblemNotFound(f"plugin {path!r} must look like 'package.module:ClassName'", field)
    try:
        module = import_plugin_module(module_name)
    except ImportError as exc:
        raise _not_importable(path, module_name, exc, field) from None
    except Exception as exc:  # the module was found, and failed while it ran: a SyntaxError, a NameError, ...
        raise ProblemNotFound(
            f"plugin {path!r}: importing {module_name!r} failed: {import_failure(exc)}", field
        ) from None
    found = getattr(module, attribute, None)
    if not (isinstance(found, type) and issubclass(found, Problem)):
        raise ProblemNotFound(f"plugin {path!r}: {attribute!r} is not a fedsaddle Problem class", field)
    if not issubclass(found, DataProblem | SyntheticProblem):
        raise ProblemNotFound(f"plugin {path!r}: subclass DataProblem (or SyntheticProblem)", field)
    return found


def registered() -> dict[str, str]:
    """name -> 'module:Class' of every problem this process can find without a plugin path."""
    return {**_entry_points(), **BUILT_IN}


@functools.cache
def _entry_points() -> dict[str, str]:
    """The installed packages' problems, read once per process (scanning every package's metadata
    on each call cost more than the paper sweep's arithmetic)."""
    found: dict[str, str] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


def rescan() -> None:
    """Read the installed packages' problems again (after installing a plug-in in a running process)."""
    _entry_points.cache_clear()


def problem_class(name: str, plugin: str | None = None, trusted: Collection[str] | None = None) -> type[Problem]:
    """The class of problem `name`. `trusted`: the plugin paths this process may import (None: any)."""
    if name in BUILT_IN and plugin in (None, BUILT_IN[name]):
        return load_path(BUILT_IN[name])
    known = registered()
    if name in known and plugin in (None, known[name]):
        return load_path(known[name])
    if plugin is None:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ProblemNotFound(
            f"unknown problem {name[:64]!r}{guess}: built in or registered are {sorted(known)}; "
            "name your own with `plugin: module:Class`"
        )
    if trusted is not None and plugin not in trusted:
        raise ProblemNotFound(
            f"problem {name[:64]!r} comes from plugin {plugin[:128]!r}, which this process does not trust "
            f"(start it with --problem {plugin[:128]})",
            "plugin",
        )
    cls = load_path(plugin, "plugin")
    spec_name = cls.Spec.model_fields["name"].default
    if spec_name not in (None, name):
        raise ProblemNotFound(f"plugin {plugin!r} defines problem {spec_name!r}, not {name!r}", "plugin")
    return cls


def parse_spec(data: Mapping[str, Any], trusted: Collection[str] | None = None) -> ProblemSpec:
    """Validate a problem entry (config or RunSpec) with its problem's own Spec; ValidationError if bad."""
    if not isinstance(data, Mapping):
        raise ProblemNotFound(f"the problem must be a mapping of fields, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str):
        raise ProblemNotFound("the problem needs a `name`")
    plugin = data.get("plugin")
    cls = problem_class(name, plugin if isinstance(plugin, str) else None, trusted)
    return cls.Spec.model_validate(dict(data))


def make_problem(spec: ProblemSpec, trusted: Collection[str] | None = None) -> Problem:
    """The problem a validated spec describes."""
    return problem_class(spec.name, spec.plugin, trusted)(spec)


# -- synthetic sources (tests and experiments) --------------------------------------------


def make_shards(spec: ProblemSpec, seed: int, indices: Sequence[int]) -> Any:
    """The generated shards of some clients of a synthetic problem."""
    problem = make_problem(spec)
    if not isinstance(problem, SyntheticProblem):
        raise ValueError(f"problem {spec.name} has no synthetic data: its clients load their own files")
    return problem.shards(seed, indices)


def solution(spec: ProblemSpec, seed: int) -> Array | None:
    """z*, when the spec and seed determine it without the clients' data (synthetic problems)."""
    problem = make_problem(spec)
    return problem.solution(seed) if isinstance(problem, SyntheticProblem) else None
