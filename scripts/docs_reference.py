"""The reference pages' generated parts: every config field from the pydantic models, every command's help.

`python scripts/docs_reference.py config|cli` prints one of them; the documentation site's hook
(scripts/docs_hooks.py) puts them into docs/reference/ at build time, so they cannot go stale.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fedsaddle.cli import build_parser
from fedsaddle.common.problems import problem_class
from fedsaddle.common.problems.registry import BUILT_IN
from fedsaddle.server import config as run_config


def _type(annotation: Any) -> str:
    """A field's type as a reader wants it: `int`, `'fixed' | 'random'`, `list of algorithm`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return f"list of {_type(args[0])}" if args else "list"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation.__name__ == "ProblemSpec":
            return "[a problem's spec](#problems)"
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "its fields' defaults" if isinstance(value, BaseModel) else f"`{value}`"
    if field.default is PydanticUndefined:
        return "**required**"
    return f"`{field.default}`" if field.default is not None else "`null`"


def _bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for name, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(item, name, None) is not None:
                found.append(f"{sign} {getattr(item, name)}")
    return ", ".join(found)


def _models(model: type[BaseModel], seen: dict[str, type[BaseModel]]) -> None:
    """Every model reachable from `model`'s fields, in the order they are met."""
    if model.__name__ in seen:
        return
    seen[model.__name__] = model
    for field in model.model_fields.values():
        for nested in _nested(field.annotation):
            _models(nested, seen)


def _nested(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested(a)]


def _table(model: type[BaseModel]) -> list[str]:
    lines = [f"### {model.__name__}", ""]
    doc = " ".join((model.__doc__ or "").split())
    if doc and not doc.startswith("Usage docs"):
        lines += [doc, ""]
    lines += ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {_bounds(field)} | {meaning} |")
    return [*lines, ""]


def config_reference() -> str:
    """Markdown: one table per model of a run config, then each built-in problem's spec."""
    seen: dict[str, type[BaseModel]] = {}
    _models(run_config.RunConfig, seen)
    for name in run_config.BUILT_IN_SPECS:
        _models(name, seen)
    lines = ["## Run config", ""]
    for model in seen.values():
        if model.__name__ != "ProblemSpec":
            lines += _table(model)
    lines += ["## Problems", "", "The `problem` field is validated by the named problem's own spec:", ""]
    for problem_name in BUILT_IN:
        spec = problem_class(problem_name).Spec
        kind = "synthetic" if problem_class(problem_name).synthetic else "real data"
        table = _table(spec)
        lines += [table[0], "", f"`{problem_name}` ({kind})", *table[1:]]
    return "\n".join(lines)


def cli_reference() -> str:
    """Markdown: `fedsaddle --help`, then every command's (and `data`'s actions')."""
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: the page is the same everywhere
    parser = build_parser()
    parser.prog = "fedsaddle"
    blocks = [("fedsaddle", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                blocks.append((f"fedsaddle {name}", sub))
                for inner in sub._actions:
                    if isinstance(inner, argparse._SubParsersAction):
                        blocks += [(f"fedsaddle {name} {n}", s) for n, s in inner.choices.items()]
    lines = []
    for title, sub in blocks:
        sub.prog = title
        text = sub.format_help().replace("```", "'''")
        lines += [f"## `{title}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("config", "cli"):
        sys.exit("usage: docs_reference.py config|cli")
    print(config_reference() if which == "config" else cli_reference())
