"""Why protobuf refused a message, said by field and byte."""

from __future__ import annotations

from typing import cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from fedsaddle.common.wire.by_hand import read_varint

# Why protobuf refused a message. Its DecodeError says only that the bytes are not the message; a client
# written from the proto by hand (in any language) needs to know which of its bytes are wrong. The walk is
# bounded (a hostile peer's megabytes of one-byte fields cost it _FAULT_STEPS turns of Python at most), and it
# runs only on bytes protobuf has refused already.
_FAULT_STEPS = 4096
_NESTING = 100  # protobuf's limit on nested messages and groups
_WIRE_TYPE = ("varint", "64-bit", "length-delimited", "start-group", "end-group", "32-bit")


class _Fault(Exception):
    """The first fault the walk found, as the error message will say it."""


def wire_fault(data: bytes, kind: type[Message]) -> str:
    """Why protobuf refuses `data` as a `kind`: the first fault found in its fields, nested messages of the
    schema included, with its byte position and the field's name (`field answer.round_id at byte 3: a
    varint longer than 10 bytes`); a general reason when the walk finds none or gives up."""
    steps = [_FAULT_STEPS]
    try:
        _walk(memoryview(data), 0, cast(Descriptor, kind.DESCRIPTOR), "", 0, None, steps)
    except _Fault as fault:
        return str(fault)
    if steps[0] <= 0:
        return f"protobuf refuses it (its first {_FAULT_STEPS} fields are well-formed)"
    return "protobuf refuses it (every field is well-formed on its own)"


def _walk(
    data: memoryview,
    base: int,
    descriptor: Descriptor | None,
    path: str,
    depth: int,
    group: int | None,
    steps: list[int],
) -> int:
    """Walk the fields of `data` (at byte `base` of the whole message) up to its end, or up to the end-group
    of `group`, whose position after it is returned; _Fault on the first fault. Past the step budget it stops
    and returns the end, finding nothing more."""
    pos, end = 0, len(data)
    while pos < end:
        steps[0] -= 1
        if steps[0] <= 0:
            return end
        at = base + pos
        key, after = _varint_or_fault(data, pos, f"byte {at}", "a field's key", "a field's key")
        if after - pos > 5:
            raise _Fault(f"byte {at}: a field's key longer than 5 bytes")
        if key >> 32:
            raise _Fault(f"byte {at}: a field's key beyond 32 bits")
        pos, number, wire_type = after, key >> 3, key & 7
        known = descriptor.fields_by_number.get(number) if descriptor is not None else None
        where = f"field {path}{known.name if known is not None else number} at byte {at}"
        if number == 0:
            raise _Fault(f"byte {at}: field number 0, which no field has")
        if wire_type == 0:
            _, pos = _varint_or_fault(data, pos, where, "its varint", "a varint")
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if pos + size > end:
                raise _Fault(f"{where}: a {_WIRE_TYPE[wire_type]} value needs {size} bytes, {end - pos} remain")
            pos += size
        elif wire_type == 2:
            length, body = _varint_or_fault(data, pos, where, "its length", "a length")
            if body - pos > 5:
                raise _Fault(f"{where}: its length is written in {body - pos} bytes (protobuf reads at most 5)")
            if length > end - body:
                raise _Fault(f"{where}: its length says {length} bytes, {end - body} remain")
            pos = body + length
            if known is not None:
                _check_value(data[body:pos], base + body, known, f"{path}{known.name}.", where, depth, steps)
        elif wire_type == 3:
            if depth + 1 > _NESTING:
                raise _Fault(f"{where}: groups and messages nested more than {_NESTING} deep")
            inner = f"{path}{number}." if depth < 8 else path  # (a name, not a list of a hostile peer's 100 levels)
            pos += _walk(data[pos:], base + pos, None, inner, depth + 1, number, steps)
        elif wire_type == 4:
            if group != number:
                raise _Fault(f"{where}: an end-group with no group of field {number} open")
            return pos
        else:
            raise _Fault(f"{where}: wire type {wire_type}, which does not exist")
    if group is not None and steps[0] > 0:
        raise _Fault(f"byte {base + end}: the group of field {group} is not closed before its message ends")
    return end


def _varint_or_fault(data: memoryview, pos: int, where: str, inside: str, name: str) -> tuple[int, int]:
    """The varint at `pos` and the position after it, or _Fault: the message ends inside it, or it runs
    past 10 bytes (`where`: the field, or the byte, the fault is told at)."""
    try:
        return read_varint(data, pos)
    except IndexError:
        raise _Fault(f"{where}: the message ends inside {inside}") from None
    except ValueError:
        raise _Fault(f"{where}: {name} longer than 10 bytes") from None


def _check_value(
    value: memoryview, base: int, field: FieldDescriptor, path: str, where: str, depth: int, steps: list[int]
) -> None:
    """A length-delimited value of a field the schema knows: a nested message is walked, a string must be UTF-8."""
    if field.type == field.TYPE_MESSAGE:
        if depth + 1 > _NESTING:
            raise _Fault(f"{where}: groups and messages nested more than {_NESTING} deep")
        _walk(value, base, field.message_type, path, depth + 1, None, steps)
    elif field.type == field.TYPE_STRING:
        try:
            str(value, "utf-8")
        except UnicodeDecodeError as error:
            raise _Fault(f"{where}: not valid UTF-8 (byte {base + error.start})") from None
    elif field.type in _FIXED:  # packed fixed-size numbers (bytes fields hold anything)
        if len(value) % _FIXED[field.type]:
            raise _Fault(f"{where}: {len(value)} bytes of packed {_FIXED[field.type]}-byte numbers")
    elif field.type != field.TYPE_BYTES:  # packed varints
        pos = 0
        while pos < len(value):
            steps[0] -= 1
            if steps[0] <= 0:
                return
            try:
                _, pos = read_varint(value, pos)
            except IndexError:
                raise _Fault(f"{where}: its packed values end inside a varint") from None
            except ValueError:
                raise _Fault(f"{where}: a packed varint longer than 10 bytes (byte {base + pos})") from None


_FIXED = {
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}
