"""numpy <-> protobuf: tasks and answers, vectors as raw float64 bytes, chunking.

A payload is the concatenation of float64 vectors (little-endian; float32 in a run
whose RunSpec says so: every codec here takes the run's element type). If it fits in
`chunk_bytes` it travels inline in the Task or Answer; otherwise the header goes
with an empty payload and Chunk messages carry it in order. Every decoder here
checks what it reads and raises WireError with a message that says what is wrong.

The coordinator serializes a round's Task once (`encode_task` returns the
serialized Instructions) and sends the same bytes to every session.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, TypeVar, cast

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from fedsaddle.common.numeric import Array, all_finite
from fedsaddle.common.tasks import (
    COMPUTE_PAYLOAD_LIMIT,
    Answer,
    ComputeTask,
    Decay,
    EvaluateTask,
    GradientTask,
    LocalStepsTask,
    Task,
)
from fedsaddle.proto import fedsaddle_pb2 as pb

# The gRPC names both sides use, as the generated descriptor spells them.
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # fedsaddle.v2.Coordinator
SESSION_METHOD = f"/{SERVICE}/Session"
FLOAT64 = np.dtype("<f8")
FLOAT32 = np.dtype("<f4")
Element = np.dtype[np.floating]  # a run's element type on the wire: FLOAT64, or FLOAT32
MESSAGE_OVERHEAD = 1 << 20  # room for headers beside a full chunk
_DECAY: dict[Decay, pb.StepDecay] = {"constant": pb.CONSTANT, "inverse_sqrt": pb.INVERSE_SQRT}
_DECAY_NAME: dict[pb.StepDecay, Decay] = {v: k for k, v in _DECAY.items()}


class WireError(ValueError):
    """A message that does not decode to a valid task or answer."""


def serialized(message: Message | bytes) -> bytes:
    """gRPC's serializer on both sides: messages queued already serialized (tasks, answers,
    chunks: see below) pass through; any other is serialized by protobuf."""
    return message if isinstance(message, bytes) else message.SerializeToString()


# The chunk sizes a coordinator may set (transport.chunk_bytes) and a client accepts in a Welcome.
DEFAULT_CHUNK_BYTES = 2 << 20
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 64 << 20


def check_chunk_bytes(chunk_bytes: int) -> int:
    """`chunk_bytes` if it is an allowed chunk size; ValueError naming the range if not."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"chunk_bytes must be between {MIN_CHUNK_BYTES} (1 KiB) and {MAX_CHUNK_BYTES} (64 MiB), got {chunk_bytes}"
        )
    return chunk_bytes


MIN_PIECE_BYTES = 4 << 10


def chunk_entries(carry: bytes, offset: int, data: bytes | memoryview, dtype: str) -> tuple[np.ndarray, int, bytes]:
    """A payload chunk's whole entries (8 bytes each, 4 for float32), for a sum that adds them as they come: a
    chunk may end inside an entry, whose first bytes (`carry`, from the chunk before) wait for the next. (The
    entries as an array of `dtype`, the index of the first in the payload, the bytes to carry to the next chunk.)"""
    size = np.dtype(dtype).itemsize
    if carry:
        data = carry + bytes(data)
        offset -= len(carry)
    whole = len(data) - len(data) % size
    return np.frombuffer(data, dtype=dtype, count=whole // size), offset // size, bytes(data[whole:])


def min_piece(chunk_bytes: int) -> int:
    """The least data a Chunk other than a payload's last may carry: 4 KiB, or the session's
    chunk size if that is smaller. Every message costs its receiver a fixed amount of work, so a
    payload cut into tiny chunks would cost it many times what the bytes do (at one byte per
    chunk, a d = 1e4 answer cost the coordinator 13.7 s a round: bench/chunk_flood.py)."""
    return min(chunk_bytes, MIN_PIECE_BYTES)


def message_limit(chunk_bytes: int) -> int:
    """The gRPC send/receive limit both sides set: a chunk plus headroom.

    Payloads of any size travel in chunks, so no message needs more: with the default
    2 MiB chunks the limit is 3 MiB, below gRPC's own 4 MiB, and larger chunks raise it.
    """
    return chunk_bytes + MESSAGE_OVERHEAD


def grpc_options(chunk_bytes: int, server: bool = False) -> list[tuple[str, int]]:
    """The channel or server options both sides use: message limits and keepalive.

    Keepalive pings notice a dead peer on a quiet link within seconds (a cut
    cable sends no reset); the server lets clients ping while idle.
    """
    limit = message_limit(chunk_bytes)
    options = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if server:
        options += [
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # A second coordinator on the same port must fail, not silently share it.
            ("grpc.so_reuseport", 0),
        ]
    return options


def window_options(window_bytes: int) -> list[tuple[str, int]]:
    """A fixed HTTP/2 receive window per stream, or none (0: gRPC's own).

    gRPC grows its window with the link's bandwidth-delay product, so that on loopback it takes in
    whole messages of a million entries (answers on the coordinator, a task's chunks on a client)
    before the event loop reads them, and holds them in its buffers; a fixed window keeps that to one
    window per stream, and caps the peer's sending at one window per round trip."""
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)] if window_bytes else []


def to_bytes(vectors: Sequence[Array], dtype: Element = FLOAT64) -> bytes:
    return b"".join(_parts(vectors, dtype))


def _parts(vectors: Sequence[Array], dtype: Element = FLOAT64) -> list[memoryview]:
    """The vectors' entries as bytes of `dtype`, one view per vector (a copy only of a vector that is
    not contiguous of that type): the payload is their concatenation, never built as one buffer."""
    views = []
    for vector in vectors:
        values = np.ascontiguousarray(vector, dtype=dtype).reshape(-1)
        views.append(memoryview(values).cast("B"))  # type: ignore[arg-type]  # numpy arrays are buffers
    return views


def _pieces(vectors: Array, most: int, dtype: Element = FLOAT64) -> Iterator[memoryview]:
    """The entries of `vectors` (in C order) as bytes of `dtype`, in pieces of at most `most` bytes (whole,
    when contiguous), each made when asked for: the rows of a client process's answer are columns of its
    worker's buffer, and a contiguous copy of all of them (a vector per hosted client) is never made."""
    if vectors.dtype == dtype and vectors.flags.c_contiguous:
        yield memoryview(vectors.reshape(-1)).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        return
    rows = np.reshape(vectors, (-1, vectors.shape[-1])) if vectors.ndim > 1 else vectors[None]
    step = max(1, most // dtype.itemsize)
    for row in rows:
        for start in range(0, len(row), step):
            piece = np.ascontiguousarray(row[start : start + step], dtype=dtype)
            yield memoryview(piece).cast("B")  # type: ignore[arg-type]


def from_bytes(
    data: bytes | bytearray | memoryview, length: int, writable: bool = False, dtype: Element = FLOAT64
) -> Array:
    """A view of the bytes as `dtype` (no copy), of exactly `length` entries: read-only, unless
    `writable` and the bytes are."""
    size = dtype.itemsize
    if len(data) != size * length:
        raise WireError(f"payload has {len(data)} bytes, expected {size * length} ({length} {dtype.name} entries)")
    values = cast(Array, np.frombuffer(data, dtype=dtype))  # (Array: float64's, or a float32 run's)
    if not writable and not isinstance(data, bytes):  # over bytes it is read-only already
        values.flags.writeable = False
    return values


# -- Chunks, by hand ----------------------------------------------------------------------
#
# A Chunk is field 4 of both Instruction and ClientMessage, and carries nearly all the
# bytes of a large payload. Through protobuf, a chunk's data is copied three times on the
# way out (numpy to bytes, bytes into the message, the message to its serialized form)
# and twice on the way in. The two functions below write and read exactly the bytes
# protobuf does (tests/test_wire.py compares them) with one copy out and none in.

CHUNK_TAG = 0x22  # field 4, length-delimited (Instruction.chunk and ClientMessage.chunk)
_OFFSET_TAG, _DATA_TAG = 0x08, 0x12  # Chunk.offset (varint), Chunk.data (length-delimited)


class RawChunk(NamedTuple):
    """A Chunk read by hand: `data` is a view into the received message, not a copy."""

    offset: int
    data: memoryview


def varint(value: int) -> bytes:
    """`value` (>= 0) as protobuf's varint (also for the messages common/secagg/messages.py writes by hand)."""
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


_UINT64 = (1 << 64) - 1


def _read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; IndexError or ValueError if malformed."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _UINT64, pos  # (protobuf too keeps a 10-byte varint's low 64 bits)
        shift += 7
        if shift >= 64:
            raise ValueError("varint too long")


def _read_length(data: bytes, pos: int) -> tuple[int, int]:
    """A length (of a submessage, of bytes) at `pos`, as `_read_varint` reads it; ValueError past 5 bytes,
    which protobuf refuses however small the value."""
    length, end = _read_varint(data, pos)
    if end - pos > 5:
        raise ValueError("length longer than 5 bytes")
    return length, end


def with_payload(outer: bytes, front: bytes, payload_tag: bytes, parts: Sequence[memoryview], back: bytes) -> bytes:
    """A serialized message holding one submessage (key `outer`) made of `front`, the payload as a
    bytes field, then `back`: each part serialized, in field-number order, so the bytes are
    protobuf's own. The payload is copied once."""
    size = sum(len(part) for part in parts)
    field = payload_tag + varint(size)
    inner = len(front) + len(field) + size + len(back)
    return b"".join((outer, varint(inner), front, field, *parts, back))


def chunk_message(offset: int, data: memoryview | Sequence[memoryview]) -> bytes:
    """A serialized Instruction (or ClientMessage) holding one Chunk whose data is `data` (or its
    pieces, one after the other): what protobuf writes, with one copy."""
    pieces = [data] if isinstance(data, memoryview) else data
    front = bytes((_OFFSET_TAG,)) + varint(offset) if offset else b""  # proto3 leaves a 0 offset out
    return with_payload(bytes((CHUNK_TAG,)), front, bytes((_DATA_TAG,)), pieces, b"")


def read_chunk(message: bytes) -> RawChunk | None:
    """The Chunk of a serialized Instruction or ClientMessage that is only a Chunk, as written by
    protobuf (offset, then data); None for any other message, which protobuf then parses."""
    try:
        if not message or message[0] != CHUNK_TAG:
            return None
        size, pos = _read_length(message, 1)
        if pos + size != len(message):
            return None
        offset = 0
        if message[pos] == _OFFSET_TAG:
            offset, pos = _read_varint(message, pos + 1)
        if message[pos] != _DATA_TAG:
            return None
        length, pos = _read_length(message, pos + 1)
        if pos + length != len(message):
            return None
        return RawChunk(offset, memoryview(message)[pos:])
    except (IndexError, ValueError):
        return None


# A payload that travels inline is written by hand too once it is large: protobuf copies it into
# the message and again into the serialized bytes, and at 1.6 MB that took a client longer than
# its gradient. Below this size protobuf's own writer costs less than the Python around a join.
BY_HAND_ABOVE = 64 << 10


def _tag(message: type[Message], field: str) -> bytes:
    """The key byte of a length-delimited field (message, bytes) numbered below 16."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    assert number < 16
    return bytes(((number << 3) | 2,))


_INSTRUCTION_TASK, _TASK_PAYLOAD = _tag(pb.Instruction, "task"), _tag(pb.Task, "payload")
_MESSAGE_ANSWER, _ANSWER_PAYLOAD = _tag(pb.ClientMessage, "answer"), _tag(pb.Answer, "payload")
M = TypeVar("M", bound=Message)
# The fields the inline reader walks at most: a Task or an Answer holds a dozen (and an Answer one more for
# each hosted client's sealed shares, a Task one for each metric's name); past that protobuf reads it.
_INLINE_FIELDS = 64


# A large inline payload is read by hand too: protobuf copies it out of the received bytes into
# its message, and again into a bytes object when the field is read; by hand it is a view, and only
# the other fields (a few dozen bytes) go through protobuf, which checks them as it always does.


class InlineTask(NamedTuple):
    """A Task instruction whose inline payload was read by hand: `instruction` holds the Task without
    its payload (the field is empty), and `payload` is a view into the received message, not a copy."""

    instruction: pb.Instruction
    payload: memoryview


def read_inline_task(message: bytes) -> InlineTask | None:
    """A Task instruction of at least BY_HAND_ABOVE bytes, nearly all of them its inline payload, read as
    protobuf reads it but for the payload's copies; None for any other message, which protobuf then parses."""
    read = _read_inline(message, pb.Instruction, "task", _INSTRUCTION_TASK, _TASK_PAYLOAD)
    return None if read is None else InlineTask(*read)


def read_inline_answer(message: bytes) -> tuple[pb.ClientMessage, memoryview] | None:
    """An Answer of at least BY_HAND_ABOVE bytes, nearly all of them its inline payload: the ClientMessage
    without its payload, and the payload as a view into `message`; None for any other message (see above)."""
    return _read_inline(message, pb.ClientMessage, "answer", _MESSAGE_ANSWER, _ANSWER_PAYLOAD)


def _read_inline(
    message: bytes, kind: type[M], field: str, outer_tag: bytes, payload_tag: bytes
) -> tuple[M, memoryview] | None:
    """`message` if it is only the submessage `field` (key `outer_tag`), holding the payload (key
    `payload_tag`) once and BY_HAND_ABOVE bytes at least, nearly all of them the payload's: the message
    parsed by protobuf without the payload's field, and the payload's view. None when the bytes are
    anything else (a field twice, a group, a length past the end, other fields past a sixteenth of the
    payload or more than _INLINE_FIELDS fields): protobuf then reads them, or refuses them, as before.

    DecodeError as protobuf raises it, if the other fields are not valid."""
    if len(message) < BY_HAND_ABOVE or message[0] != outer_tag[0]:
        return None
    end, key_wanted = len(message), payload_tag[0]
    try:
        size, start = _read_length(message, 1)
        if start + size != end:
            return None
        pos, span, fields = start, None, 0
        while pos < end:
            fields += 1
            if fields > _INLINE_FIELDS:  # (a peer's message of many small fields: protobuf reads them in C)
                return None
            field_start, key = pos, message[pos]
            key, pos = (key, pos + 1) if key < 0x80 else _read_varint(message, pos)  # (one byte: the usual key)
            if pos - field_start > 5:  # protobuf refuses a key longer than a 32-bit varint, however small its value
                return None
            wire_type = key & 7
            if wire_type == 0:
                _, pos = _read_varint(message, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, body = _read_length(message, pos)
                pos = body + length
                if key == key_wanted:
                    if span is not None:  # (protobuf keeps the last: left to it)
                        return None
                    span = (field_start, body, pos)
            else:  # groups, and wire types that do not exist
                return None
            if pos > end:
                return None
    except (IndexError, ValueError):
        return None
    if span is None:
        return None
    field_start, body, field_end = span
    payload_size = field_end - body
    # The view keeps the whole message alive, for as long as an answer waits for its turn in the sum, or a
    # round keeps its answers: by hand only when the payload is nearly all of it (the rest at most a sixteenth
    # of it). A message padded with other fields, or with an empty payload (none, to protobuf), is left to
    # protobuf, whose copy keeps the payload alone.
    if 16 * (end - payload_size) > payload_size:
        return None
    # The whole message again without the payload's field, not the submessage alone: protobuf's limit on
    # nesting counts the outer message, and its errors name it. (Set even when the payload was its only field.)
    rest = message[start:field_start] + message[field_end:]
    return kind.FromString(outer_tag + varint(len(rest)) + rest), memoryview(message)[body:field_end]


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
        return _read_varint(data, pos)
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
                _, pos = _read_varint(value, pos)
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


def chunks(parts: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """The payload (the concatenation of `parts`) as serialized Chunk messages of `chunk_bytes` data
    (the last may be shorter), each made when asked for; a chunk may span two parts.

    ValueError, raised here and not at the first chunk, if `chunk_bytes` is not positive: a chunk of
    no data would never get through the payload, and the chunks would never end."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return _chunks(parts, chunk_bytes)


def _chunks(parts: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    offset, pending, room = 0, [], chunk_bytes
    for part in parts:
        start = 0
        while start < len(part):
            take = part[start : start + room]
            pending.append(take)
            start, room = start + len(take), room - len(take)
            if room == 0:
                yield chunk_message(offset, pending)
                offset, pending, room = offset + chunk_bytes, [], chunk_bytes
    if pending:
        yield chunk_message(offset, pending)


class Assembler:
    """Collects a chunked payload of known size, refusing gaps, overlaps and overruns.

    The payload's buffer is taken at the first chunk, at its full size but untouched:
    memory pages are committed as chunks fill them, so a peer that announces a large
    payload and sends little costs little. One buffer of the final size, instead of one
    grown chunk by chunk, leaves no holes of every intermediate size in the heap. A client
    process may pass its own buffer (`into`) and reuse it from task to task.

    Every chunk but the last must carry at least `min_piece` bytes (see min_piece). With
    `keep=False` the chunks are checked and counted, but not kept: the chunks of a refused
    answer, read to their end.
    """

    def __init__(
        self, total_bytes: int, into: bytearray | memoryview | None = None, min_piece: int = 0, keep: bool = True
    ) -> None:
        if into is not None and len(into) < total_bytes:
            raise ValueError(f"a buffer of {len(into)} bytes cannot hold {total_bytes}")
        self.total = total_bytes
        self.filled = 0
        self.min_piece = min_piece
        self.keep = keep
        self._into = None if into is None else memoryview(into)[:total_bytes]

    @property
    def done(self) -> bool:
        return self.filled == self.total

    def add(self, chunk: pb.Chunk | RawChunk) -> None:
        if chunk.offset != self.filled:
            raise WireError(f"chunk at byte {chunk.offset}, expected byte {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.total:
            raise WireError(f"chunks overrun the payload: {end} bytes of {self.total}")
        if not chunk.data:
            raise WireError("empty chunk")
        size = len(chunk.data)
        if end < self.total and size < self.min_piece:
            raise WireError(
                f"a chunk of {size} byte{'s' * (size != 1)} before the payload's last: "
                f"every chunk but the last carries at least {self.min_piece} bytes"
            )
        if not self.keep:
            self.filled = end
            return
        if self._into is None:
            try:
                self._into = memoryview(np.empty(self.total, dtype=np.uint8))  # type: ignore[arg-type]
            except MemoryError:
                raise WireError(f"no memory for a payload of {self.total} bytes") from None
        self._into[self.filled : end] = chunk.data
        self.filled = end

    def payload(self) -> memoryview:
        """The whole payload (call when done)."""
        assert self._into is not None  # a payload of 0 bytes travels inline, never in chunks
        return self._into


# -- tasks: coordinator -> client ------------------------------------------------------


def task_message(run_id: str, round_id: int, task: Task, payload_length: int) -> pb.Task:
    """The Task header (without its payload)."""
    message = pb.Task(run_id=run_id, round_id=round_id, payload_length=payload_length)
    if isinstance(task, EvaluateTask):
        message.kind = pb.EVALUATE
        message.metric_names.extend(task.metric_names)
        return message
    if isinstance(task, GradientTask):
        message.kind = pb.GRADIENT
        message.gradient.CopyFrom(
            pb.GradientParams(batch=task.batch, exact=task.exact, want_objective=task.want_objective)
        )
        return message
    if isinstance(task, ComputeTask):
        message.kind = pb.COMPUTE
        message.compute.CopyFrom(compute_message(task))
        return message
    if np.size(task.gamma_local) > 1 or np.size(task.theta) > 1:
        raise WireError("a batch of runs (array step sizes) runs in-process only; one run travels over gRPC")
    message.kind = pb.LOCAL_STEPS
    message.local.CopyFrom(
        pb.LocalSteps(
            steps=task.steps,
            gamma_local=float(np.ravel(task.gamma_local)[0]),
            step_offset=task.step_offset,
            decay=_DECAY[task.decay],
            correction=pb.NONE if task.control is None else pb.SCAFFOLD,
            theta=float(np.ravel(task.theta)[0]),
        )
    )
    return message


def check_inline(payload_length: int, payload: bytes | memoryview, dtype: Element = FLOAT64) -> None:
    """WireError unless a Task's inline payload carries exactly the payload_length entries its header
    declares (a payload in Chunks is assembled to that length, and refused if the chunks disagree)."""
    size = dtype.itemsize
    if len(payload) != size * payload_length:
        entries = f" ({len(payload) // size} {dtype.name} entries)" if len(payload) % size == 0 else ""
        raise WireError(
            f"a task declares payload_length {payload_length} ({size * payload_length} bytes) but carries an inline "
            f"payload of {len(payload)} bytes{entries}"
        )


# A compute task's payload: z, then its named arrays, at most COMPUTE_PAYLOAD_LIMIT z-lengths in all.
_NAME_LIMIT = 64


def compute_message(task: ComputeTask) -> pb.Compute:
    """A ComputeTask's name, array names and lengths, and parameters."""
    for name, value in task.params:
        if not math.isfinite(value):
            raise WireError(f"local computation {task.name!r}: parameter {name!r} must be finite, got {value}")
    return pb.Compute(
        name=task.name,
        array_names=[name for name, _ in task.arrays],
        array_lengths=[int(array.shape[-1]) for _, array in task.arrays],
        params=[pb.ComputeParam(name=name, value=float(value)) for name, value in task.params],
    )


def _identifier(kind: str, name: str, taken: set[str]) -> str:
    if not (name.isidentifier() and len(name) <= _NAME_LIMIT) or name in taken:
        shown = name[:_NAME_LIMIT]
        raise WireError(
            f"compute {kind} name {shown!r} is not a distinct identifier of at most {_NAME_LIMIT} characters"
        )
    taken.add(name)
    return name


def decode_compute(
    message: pb.Compute, payload: bytes | bytearray | memoryview, dimension: int, dtype: Element = FLOAT64
) -> ComputeTask:
    """A COMPUTE task; WireError naming what is malformed."""
    name = message.name
    if not name or len(name) > _NAME_LIMIT:
        raise WireError(f"a compute task needs a computation name of 1 to {_NAME_LIMIT} characters")
    if len(message.array_names) != len(message.array_lengths):
        raise WireError(
            f"compute task {name!r}: {len(message.array_names)} array names, {len(message.array_lengths)} lengths"
        )
    taken = {"oracle", "z"}
    lengths = [int(n) for n in message.array_lengths]
    total = dimension + sum(lengths)
    if total > COMPUTE_PAYLOAD_LIMIT * dimension:
        raise WireError(
            f"compute task {name!r}: {total} payload entries, at most {COMPUTE_PAYLOAD_LIMIT} x {dimension}"
        )
    values = from_bytes(payload, total, dtype=dtype)
    arrays = []
    start = dimension
    for array_name, length in zip(message.array_names, lengths, strict=True):
        arrays.append((_identifier("array", array_name, taken), values[start : start + length]))
        start += length
    params = []
    for param in message.params:
        if not math.isfinite(param.value):
            raise WireError(f"compute task {name!r}: parameter {param.name[:_NAME_LIMIT]!r} is not finite")
        params.append((_identifier("parameter", param.name, taken), float(param.value)))
    return ComputeTask(name, values[:dimension], tuple(arrays), tuple(params))


def encode_task(
    run_id: str,
    round_id: int,
    task: Task,
    chunk_bytes: int,
    client_indices: Sequence[int] = (),
    round_clients: Sequence[int] = (),
    dtype: Element = FLOAT64,
) -> list[bytes]:
    """The serialized Task instruction, followed by serialized Chunks if the payload is larger than one chunk.

    `round_clients`: under secure aggregation, every client of a sampled round (empty: all, or no masks);
    `dtype`: the run's element type."""
    parts = _parts(task.payload(), dtype)
    size = sum(len(part) for part in parts)
    message = task_message(run_id, round_id, task, size // dtype.itemsize)
    message.round_clients.extend(round_clients)
    if size > chunk_bytes:
        message.client_indices.extend(client_indices)
        return [pb.Instruction(task=message).SerializeToString(), *chunks(parts, chunk_bytes)]
    if size < BY_HAND_ABOVE:
        message.client_indices.extend(client_indices)
        message.payload = b"".join(parts)
        return [pb.Instruction(task=message).SerializeToString()]
    # Fields 1-6, the payload (7), then client_indices (8), metric_names (9) and round_clients (10).
    back = pb.Task(
        client_indices=client_indices,
        metric_names=message.metric_names,
        round_clients=round_clients,
        compute=message.compute if message.HasField("compute") else None,
    )
    message.ClearField("metric_names")
    message.ClearField("round_clients")
    message.ClearField("compute")
    return [
        with_payload(_INSTRUCTION_TASK, message.SerializeToString(), _TASK_PAYLOAD, parts, back.SerializeToString())
    ]


def decode_task(
    message: pb.Task,
    payload: bytes | bytearray | memoryview,
    dimension: int,
    writable: bool = False,
    dtype: Element = FLOAT64,
) -> Task:
    """The task a Task message (with its assembled payload of `dtype` entries) describes; its vectors are
    views of the payload, writable if `writable` (the caller's own buffer, which the task may use up)."""
    kind = message.kind
    if kind == pb.GRADIENT:
        values = from_bytes(payload, dimension, dtype=dtype)
        params = message.gradient
        batch = params.batch
        if batch < 1:
            raise WireError(f"gradient batch must be >= 1, got {batch}")
        return GradientTask(values, batch, params.exact, params.want_objective)
    if kind == pb.COMPUTE:
        return decode_compute(message.compute, payload, dimension, dtype)
    if kind == pb.EVALUATE:
        return EvaluateTask(from_bytes(payload, dimension, dtype=dtype), tuple(message.metric_names))
    if kind == pb.LOCAL_STEPS:
        local = message.local
        scaffold = local.correction == pb.SCAFFOLD
        if local.correction not in (pb.NONE, pb.SCAFFOLD):
            raise WireError(f"unknown correction {local.correction}")
        if local.decay not in _DECAY_NAME:
            raise WireError(f"unknown step decay {local.decay}")
        for name, value in (("gamma_local", local.gamma_local), ("theta", local.theta)):
            if not (math.isfinite(value) and value >= 0):
                raise WireError(f"{name} must be finite and >= 0, got {value}")
        values = from_bytes(payload, (2 if scaffold else 1) * dimension, writable, dtype)
        return LocalStepsTask(
            z_start=values[:dimension],
            steps=local.steps,
            gamma_local=local.gamma_local,
            step_offset=local.step_offset,
            decay=_DECAY_NAME[local.decay],
            control=values[dimension:] if scaffold else None,
            theta=local.theta,
        )
    raise WireError(f"unknown task kind {kind}")


# -- answers: client -> coordinator ----------------------------------------------------


def encode_answer(
    run_id: str, round_id: int, answer: Answer, chunk_bytes: int, dtype: Element = FLOAT64
) -> Iterator[bytes]:
    """The serialized Answer message, followed by serialized Chunks if the payload is larger than one chunk.

    The chunks are cut from the answer's vectors as they are sent: a large answer is
    never copied whole.
    """
    return AnswerWriter(chunk_bytes, dtype).encode(run_id, round_id, answer)


class AnswerWriter:
    """Serializes answers as `encode_answer` does, from a header kept while its fixed fields stay
    the same: a client process answers every round of a run with the same run id, clients and
    length, and building the protobuf message anew cost more than the rest of a small answer."""

    def __init__(self, chunk_bytes: int, dtype: Element = FLOAT64) -> None:
        self.chunk_bytes = chunk_bytes
        self.dtype = dtype  # the run's element type (a client process sets it with each run)
        self._fixed: tuple[object, ...] | None = None
        self._message = pb.ClientMessage()

    def encode(self, run_id: str, round_id: int, answer: Answer) -> Iterator[bytes]:
        vectors = answer.vectors
        fixed = (run_id, answer.indices, answer.diverged, vectors.size, answer.objective is None, answer.counts is None)
        if fixed != self._fixed:
            self._message = pb.ClientMessage()
            header = self._message.answer  # filled in place: pb.ClientMessage(answer=header) would copy it
            header.SetInParent()  # an Answer even if every field is at its default
            header.run_id = run_id
            header.client_indices.extend(answer.indices)
            if answer.diverged:
                header.diverged = True
            else:
                header.payload_length = vectors.size
            self._fixed = fixed
        header = self._message.answer
        header.round_id = round_id
        if answer.diverged:
            return iter([self._message.SerializeToString()])
        dtype = self.dtype
        if answer.objective is not None:
            header.objective = to_bytes([answer.objective], dtype)
        if answer.counts is not None:
            del header.sample_counts[:]
            header.sample_counts.extend(int(c) for c in answer.counts)
        size = dtype.itemsize * vectors.size
        if size > self.chunk_bytes:
            pieces = _pieces(vectors, self.chunk_bytes, dtype)
            return itertools.chain([self._message.SerializeToString()], chunks(pieces, self.chunk_bytes))
        if size < BY_HAND_ABOVE:
            header.payload = vectors.astype(dtype, copy=False).tobytes()  # C order, contiguous or not
            return iter([self._message.SerializeToString()])
        # Then objective (6) and sample_counts (8); diverged (7) has none.
        back = pb.Answer(objective=header.objective, sample_counts=header.sample_counts)
        return iter([answer_with_payload(header, _parts([vectors], dtype), back)])


def answer_with_payload(header: pb.Answer, parts: Sequence[memoryview], back: pb.Answer) -> bytes:
    """The serialized ClientMessage of an Answer: `header`'s fields 1-4 (run id, round, clients, payload
    length), the payload (the concatenation of `parts`, copied once), then `back`'s fields, which must
    all be numbered above the payload's: the bytes protobuf writes for that Answer."""
    front = pb.Answer(
        run_id=header.run_id,
        round_id=header.round_id,
        client_indices=header.client_indices,
        payload_length=header.payload_length,
    )
    return with_payload(_MESSAGE_ANSWER, front.SerializeToString(), _ANSWER_PAYLOAD, parts, back.SerializeToString())


def decode_answer(
    header: pb.Answer,
    payload: bytes | memoryview,
    dimension: int,
    want_objective: bool,
    want_counts: bool = False,
    indices: tuple[int, ...] | None = None,
    dtype: Element = FLOAT64,
) -> Answer:
    """Check an answer's vectors (length, finiteness) and return them; WireError if bad.

    `dimension` is the entries per client (the metrics' count for an evaluation answer,
    which must also carry one held-out row count per client: `want_counts`). `indices`:
    the header's client indices, when the caller has read and checked them already.
    """
    if indices is None:
        indices = tuple(header.client_indices)
    if header.diverged:
        return Answer(indices, np.empty((len(indices), 0)), None, diverged=True)
    clients = len(indices)
    flat = from_bytes(payload, clients * dimension, dtype=dtype)
    if not all_finite(flat):  # (tested flat: one row of a d = 10 answer is the usual case)
        values = flat.reshape(clients, dimension)
        row, col = (int(v) for v in np.argwhere(~np.isfinite(values))[0])
        raise WireError(f"client {indices[row]}: entry {col} is {values[row, col]} (non-finite values are refused)")
    objective = None
    if want_objective:
        if len(header.objective) != dtype.itemsize * clients:
            raise WireError(f"objective has {len(header.objective)} bytes, expected {dtype.itemsize * clients}")
        objective = from_bytes(header.objective, clients, dtype=dtype)
        if not all_finite(objective):
            raise WireError("objective values must be finite")
    elif header.objective:
        raise WireError("objective values sent but not asked for")
    counts = None
    if want_counts:
        if len(header.sample_counts) != clients:
            raise WireError(f"{len(header.sample_counts)} held-out row counts for {clients} clients")
        counts = np.array(header.sample_counts, dtype=np.float64)
    elif header.sample_counts:
        raise WireError("row counts sent but not asked for")
    return Answer(indices, flat.reshape(clients, dimension), objective, False, counts)
