"""A config's validation errors as the user reads them: one line per bad field, where the user wrote it.

`describe_error` turns one of pydantic's errors into `where: what (got value)`: the location
without the tags pydantic adds for a discriminated union (`algorithms.0.fedavg_s.gamma` reads
`algorithms[0].gamma`; a tag is recognised by the models' own `Literal` fields, not by a list of
names), a misspelt field with the one it was likely meant to be, a union entry that names no
member with the members it may name. server/config.py renders every config error through it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

FIELDS_DISAGREE = "fields_disagree"  # the type of the error a check across fields raises (config_checks.py)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's annotation may hold, through lists, unions and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _tagged(model: type[BaseModel], tag: str) -> bool:
    """Whether `tag` names this member of a discriminated union: one of its fields is Literal[tag]."""
    return any(
        get_origin(info.annotation) is Literal and tag in get_args(info.annotation)
        for info in model.model_fields.values()
    )


def _walk(model: type[BaseModel] | None, loc: Sequence[Any]) -> tuple[list[str | int], list[type[BaseModel]]]:
    """An error's location as the user wrote it, and the models that may stand at its end.

    pydantic puts a discriminated union's tag into the location (algorithms.0.fedavg_s.gamma);
    the user wrote algorithms[0].gamma. A tag is told from a field by the models themselves:
    it is no field of the models at that point, and one of them declares it as its Literal.
    """
    candidates = [] if model is None else [model]
    path: list[str | int] = []
    for item in loc:
        if isinstance(item, int):  # a list's element: the same models
            path.append(item)
            continue
        having = [m for m in candidates if item in m.model_fields]
        members = [m for m in candidates if _tagged(m, str(item))]
        if having or not members:
            path.append(item)
            candidates = [sub for m in having for sub in _models_in(m.model_fields[item].annotation)]
        else:  # the union's tag: the member it names stands here
            candidates = members
    return path, candidates


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> set[str]:
    """The field names a config may give at `loc`, an error's location without its last part."""
    return {name for m in _walk(model, loc)[1] for name in m.model_fields}


def _suggestion(error: Any, model: type[BaseModel] | None) -> str:
    """' (did you mean 'gamma_local'?)' for a misspelt field; with no close one, the fields that place
    takes, when they are few enough to read (' (its fields: 'kind', 'tau')'); else ''."""
    loc = tuple(error["loc"])
    if model is None or error["type"] != "extra_forbidden" or not loc or not isinstance(loc[-1], str):
        return ""
    fields = {name.lower(): name for name in _fields_at(model, loc[:-1])}
    close = difflib.get_close_matches(loc[-1].lower(), sorted(fields), n=1, cutoff=0.7)
    if close:
        return f" (did you mean {fields[close[0]]!r}?)"
    if 0 < len(fields) <= FIELDS_LISTED:
        return f" (its fields: {', '.join(repr(fields[name]) for name in sorted(fields))})"
    return ""


FIELDS_LISTED = 12  # an unknown field's place lists its fields when it has at most this many


def describe_error(error: Any, model: type[BaseModel] | None = None) -> str:
    parts: list[str] = []
    for item in _walk(model, error["loc"])[0]:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{item}]"]
        else:
            parts.append(str(item))
    where = ".".join(parts) or "config"
    message = "unknown field" if error["type"] == "extra_forbidden" else str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "union_tag_invalid":
        ctx = error["ctx"]
        field_name = str(ctx["discriminator"]).strip("'")
        tags = re.findall(r"'([^']*)'", str(ctx["expected_tags"]))
        close = difflib.get_close_matches(str(ctx["tag"]), tags, n=1, cutoff=0.7)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        message = f"unknown {field_name} {ctx['tag']!r}{guess}; expected one of {ctx['expected_tags']}"
    elif error["type"] == "union_tag_not_found":
        message = _tag_needed(str(error["ctx"]["discriminator"]).strip("'"), _walk(model, error["loc"])[1])
    elif error["type"] == "model_attributes_type" and (tag := _union_tag(members := _walk(model, error["loc"])[1])):
        # (`sync: fixed`: a choice named where its mapping belongs)
        message = f"needs a mapping, not {error['input']!r}: it {_tag_needed(tag, members)}"
    elif (
        "input" in error
        and error["type"] not in ("missing", "extra_forbidden", FIELDS_DISAGREE)
        and not isinstance(error["input"], dict)
        and f"got {error['input']!r}" not in message  # (a validator's own message may name it already)
        and f"got {error['input']}" not in message
    ):
        message += f" (got {error['input']!r})"
    return f"{where}: {message}{_suggestion(error, model)}"


def _union_tag(members: list[type[BaseModel]]) -> str:
    """The field that tells apart the members of a discriminated union standing at a place ('kind' for
    `sync`), or '' if the place holds one model, or no such field."""
    if len(members) < 2:
        return ""
    for name in members[0].model_fields:
        if all(name in m.model_fields and get_origin(m.model_fields[name].annotation) is Literal for m in members):
            return name
    return ""


def _tag_needed(tag: str, members: list[type[BaseModel]]) -> str:
    """What an entry of a discriminated union that names no member lacks: 'needs kind: fixed (takes tau) or
    kind: random (takes p)', from the members themselves (pydantic says only that it found no tag)."""
    choices = []
    for member in members:
        field = member.model_fields.get(tag)
        if field is None or get_origin(field.annotation) is not Literal:
            continue
        takes = [name for name in member.model_fields if name != tag]
        choices.append(f"{tag}: {get_args(field.annotation)[0]}" + (f" (takes {', '.join(takes)})" if takes else ""))
    if not choices:
        return f"needs a {tag}"
    return "needs " + (f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0])


def describe_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per bad field: `where: what (got value)`; a misspelt field of `model` gets a suggestion."""
    return "\n".join(f"  {describe_error(e, model)}" for e in exc.errors())
