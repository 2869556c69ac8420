"""Messages written and read by hand, byte for byte as protobuf writes and reads them, for the large ones:
a Chunk, and a Task or an Answer whose inline payload is nearly all of it. Through protobuf a payload is
copied two or three times on the way out and twice on the way in; here once out and never in (a view).
tests/test_wire.py checks that every reader here reads what protobuf reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from google.protobuf.message import Message

from fedsaddle.proto import fedsaddle_pb2 as pb

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


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
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


def read_length(data: bytes, pos: int) -> tuple[int, int]:
    """A length (of a submessage, of bytes) at `pos`, as `read_varint` reads it; ValueError past 5 bytes,
    which protobuf refuses however small the value."""
    length, end = read_varint(data, pos)
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
        size, pos = read_length(message, 1)
        if pos + size != len(message):
            return None
        offset = 0
        if message[pos] == _OFFSET_TAG:
            offset, pos = read_varint(message, pos + 1)
        if message[pos] != _DATA_TAG:
            return None
        length, pos = read_length(message, pos + 1)
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


INSTRUCTION_TASK, TASK_PAYLOAD = _tag(pb.Instruction, "task"), _tag(pb.Task, "payload")
MESSAGE_ANSWER, ANSWER_PAYLOAD = _tag(pb.ClientMessage, "answer"), _tag(pb.Answer, "payload")
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
    read = _read_inline(message, pb.Instruction, "task", INSTRUCTION_TASK, TASK_PAYLOAD)
    return None if read is None else InlineTask(*read)


def read_inline_answer(message: bytes) -> tuple[pb.ClientMessage, memoryview] | None:
    """An Answer of at least BY_HAND_ABOVE bytes, nearly all of them its inline payload: the ClientMessage
    without its payload, and the payload as a view into `message`; None for any other message (see above)."""
    return _read_inline(message, pb.ClientMessage, "answer", MESSAGE_ANSWER, ANSWER_PAYLOAD)


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
        size, start = read_length(message, 1)
        if start + size != end:
            return None
        pos, span, fields = start, None, 0
        while pos < end:
            fields += 1
            if fields > _INLINE_FIELDS:  # (a peer's message of many small fields: protobuf reads them in C)
                return None
            field_start, key = pos, message[pos]
            key, pos = (key, pos + 1) if key < 0x80 else read_varint(message, pos)  # (one byte: the usual key)
            if pos - field_start > 5:  # protobuf refuses a key longer than a 32-bit varint, however small its value
                return None
            wire_type = key & 7
            if wire_type == 0:
                _, pos = read_varint(message, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, body = read_length(message, pos)
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
