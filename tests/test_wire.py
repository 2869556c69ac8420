"""The wire format: generated modules match the proto; encoding is exact; chunks are checked."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from fedsaddle.common import wire
from fedsaddle.common.numeric import all_finite
from fedsaddle.common.tasks import Answer, ComputeTask, EvaluateTask, GradientTask, LocalStepsTask, Task
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.transport import actions

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"


def test_committed_modules_match_the_proto(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", PROTO_DIR / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        assert (tmp_path / name).read_text() == (PROTO_DIR / name).read_text(), f"{name} is stale: run `make proto`"


def test_a_task_round_trips_bit_for_bit_inline_and_chunked() -> None:
    rng = np.random.default_rng(0)
    z, control = rng.standard_normal(1000), rng.standard_normal(1000)
    task = LocalStepsTask(
        z, steps=7, gamma_local=0.01, step_offset=40, decay="inverse_sqrt", control=control, theta=2.0
    )
    for chunk_bytes in (1 << 20, 1024):  # 16 kB payload: inline, then 16 chunks
        pieces = [pb.Instruction.FromString(p) for p in wire.encode_task("run", 9, task, chunk_bytes)]
        assert len(pieces) == (1 if chunk_bytes > 16000 else 1 + 16)
        header = pieces[0].task
        payload = header.payload
        if len(pieces) > 1:  # full chunks, one of them across the end of z and the start of the control
            assert [len(p.chunk.data) for p in pieces[1:]] == [1024] * 15 + [16000 - 15 * 1024]
            assembler = wire.Assembler(8 * header.payload_length)
            for piece in pieces[1:]:
                assembler.add(piece.chunk)
            assert assembler.done
            payload = assembler.payload()
        decoded = wire.decode_task(header, payload, 1000)
        assert isinstance(decoded, LocalStepsTask)
        assert decoded.z_start.tobytes() == z.tobytes()
        assert decoded.control is not None and decoded.control.tobytes() == control.tobytes()
        assert (decoded.steps, decoded.step_offset, decoded.decay, decoded.theta) == (7, 40, "inverse_sqrt", 2.0)


def test_a_compute_task_carries_its_name_arrays_and_parameters_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    z, anchor, short = rng.standard_normal(500), rng.standard_normal(500), rng.standard_normal(7)
    task = ComputeTask(
        "local_sgda_plus", z, (("anchor", anchor), ("x_snapshot", short)), (("steps", 5.0), ("gamma", 0.125))
    )
    for chunk_bytes in (1 << 20, 1024):
        pieces = [pb.Instruction.FromString(p) for p in wire.encode_task("run", 4, task, chunk_bytes)]
        header = pieces[0].task
        payload = header.payload
        if len(pieces) > 1:
            assembler = wire.Assembler(8 * header.payload_length)
            for piece in pieces[1:]:
                assembler.add(piece.chunk)
            payload = assembler.payload()
        assert header.payload_length == 1007
        decoded = wire.decode_task(header, payload, 500)
        assert isinstance(decoded, ComputeTask)
        assert decoded.name == "local_sgda_plus" and decoded.params == (("steps", 5.0), ("gamma", 0.125))
        assert [name for name, _ in decoded.arrays] == ["anchor", "x_snapshot"]
        assert decoded.z.tobytes() == z.tobytes()
        assert decoded.arrays[0][1].tobytes() == anchor.tobytes() and decoded.arrays[1][1].tobytes() == short.tobytes()


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda c: setattr(c, "name", ""), "needs a computation name"),
        (lambda c: setattr(c, "name", "x" * 65), "needs a computation name"),
        (lambda c: c.array_names.append("other"), "2 array names, 1 lengths"),
        (lambda c: c.array_names.__setitem__(0, "z"), "compute array name 'z' is not a distinct identifier"),
        (lambda c: c.array_names.__setitem__(0, "not an identifier"), "is not a distinct identifier"),
        (lambda c: c.params.add(name="gamma", value=1.0), "compute parameter name 'gamma' is not a distinct"),
        (lambda c: setattr(c.params[0], "value", float("nan")), "parameter 'gamma' is not finite"),
        (lambda c: c.array_lengths.__setitem__(0, 5), "payload has 64 bytes, expected 72"),
        (lambda c: c.array_lengths.__setitem__(0, 10**12), "at most 4 x 4"),
    ],
)
def test_a_malformed_compute_task_is_refused_naming_the_fault(mutate: Any, reason: str) -> None:
    task = ComputeTask("mine", np.ones(4), (("anchor", np.ones(4)),), (("gamma", 0.5),))
    (piece,) = wire.encode_task("r", 1, task, 1 << 20)
    message = pb.Instruction.FromString(piece).task
    mutate(message.compute)
    with pytest.raises(wire.WireError, match=re.escape(reason)):
        wire.decode_task(message, message.payload, 4)


def test_a_compute_task_with_a_parameter_that_is_no_number_is_not_sent() -> None:
    with pytest.raises(wire.WireError, match="parameter 'gamma' must be finite, got inf"):
        wire.encode_task("r", 1, ComputeTask("mine", np.ones(4), params=(("gamma", float("inf")),)), 1 << 20)


def test_gradient_task_and_answer_round_trip() -> None:
    z = np.array([1.5, -2.0, 3.25, np.pi])
    (piece,) = wire.encode_task("r", 1, GradientTask(z, batch=3, exact=False, want_objective=True), 1 << 20)
    message = pb.Instruction.FromString(piece).task
    decoded = wire.decode_task(message, message.payload, 4)
    assert isinstance(decoded, GradientTask)
    assert decoded.z.tobytes() == z.tobytes() and decoded.batch == 3 and decoded.want_objective
    answer = Answer((2, 5), np.arange(8.0).reshape(2, 4), np.array([0.5, -1.0]))
    (part,) = (pb.ClientMessage.FromString(m) for m in wire.encode_answer("r", 1, answer, 1 << 20))
    back = wire.decode_answer(part.answer, part.answer.payload, 4, want_objective=True)
    assert back.indices == (2, 5)
    assert np.array_equal(back.vectors, answer.vectors)
    assert back.objective is not None and np.array_equal(back.objective, answer.objective)


def _built_anew(run_id: str, round_id: int, answer: Answer, chunk_bytes: int = 1024) -> bytes:
    """The answer's header as protobuf writes it from scratch: the reference for AnswerWriter."""
    header = pb.Answer(run_id=run_id, round_id=round_id, client_indices=answer.indices, diverged=answer.diverged)
    if not answer.diverged:
        header.payload_length = answer.vectors.size
        if answer.objective is not None:
            header.objective = answer.objective.tobytes()
        if answer.counts is not None:
            header.sample_counts.extend(int(c) for c in answer.counts)
        if 8 * answer.vectors.size <= chunk_bytes:
            header.payload = answer.vectors.tobytes()
    return pb.ClientMessage(answer=header).SerializeToString()


@pytest.mark.parametrize("hosted", [1, 3])
def test_an_answer_of_a_workers_columns_is_chunked_as_its_contiguous_copy(hosted: int) -> None:
    # A client process's answer is the transpose of its worker's (dimension, clients) buffer: for several
    # hosted clients its rows are strided, and they are cut into chunks piece by piece, not copied whole.
    columns = np.random.default_rng(8).standard_normal((2500, hosted))
    rows = columns.T
    assert rows.flags.c_contiguous == (hosted == 1)
    strided = list(wire.AnswerWriter(1024).encode("r", 3, Answer(tuple(range(hosted)), rows)))
    copied = list(wire.AnswerWriter(1024).encode("r", 3, Answer(tuple(range(hosted)), np.ascontiguousarray(rows))))
    assert strided == copied and len(strided) == 1 + -(-2500 * 8 * hosted // 1024)
    data = b"".join(bytes(wire.read_chunk(piece).data) for piece in strided[1:])  # type: ignore[union-attr]
    assert data == rows.tobytes()


def test_an_answer_writer_keeps_nothing_of_one_answer_in_the_next() -> None:
    # One writer, as in a client process: the header it keeps must not carry a field over.
    rng = np.random.default_rng(3)
    small, large = rng.standard_normal((1, 20)), rng.standard_normal((2, 100))  # 160 B inline; 1600 B in chunks
    answers = [
        ("r", 1, Answer((4,), small)),
        ("r", 2, Answer((4,), small + 1)),
        ("r", 3, Answer((4,), small, np.array([2.5]))),
        ("r", 4, Answer((4,), small)),  # the objective of round 3 is gone
        ("r", 5, Answer((4,), np.empty((1, 0)), diverged=True)),
        ("r", 6, Answer((4,), small)),
        ("s", 1, Answer((4, 7), large)),  # another run, chunked
        ("s", 2, Answer((7,), small)),  # a sampled round: one client of two
        ("s", 3, Answer((4, 7), np.ones((2, 3)), counts=np.array([5.0, 9.0]))),
        ("s", 4, Answer((4, 7), np.ones((2, 3)), counts=np.array([6.0, 2.0]))),
        ("s", 5, Answer((4, 7), large)),
    ]
    writer = wire.AnswerWriter(1024)
    for run_id, round_id, answer in answers:
        pieces = list(writer.encode(run_id, round_id, answer))
        assert pieces[0] == _built_anew(run_id, round_id, answer), (run_id, round_id)
        assert pieces == list(wire.encode_answer(run_id, round_id, answer, 1024))
        if len(pieces) > 1:  # the chunks carry the vectors
            assert b"".join(bytes(wire.read_chunk(p).data) for p in pieces[1:]) == answer.vectors.tobytes()  # type: ignore[union-attr]


def _every_kind_of_task(rng: np.random.Generator, entries: int) -> list[Task]:
    """A task of each kind whose payload has `entries` float64 entries."""
    z, control = rng.standard_normal(entries // 2), rng.standard_normal(entries - entries // 2)
    return [
        GradientTask(np.concatenate([z, control]), batch=2, want_objective=True),
        LocalStepsTask(z, 3, 0.1, 7, "inverse_sqrt", control=control, theta=0.5),
        EvaluateTask(np.concatenate([z, control]), ("test_auc", "test_mse")),
        ComputeTask("mine", z, (("anchor", control),), (("steps", 3.0), ("mu", 0.25))),
    ]


def test_large_inline_payloads_written_by_hand_are_protobufs_bytes() -> None:
    # From 64 KiB up, a payload that fits in one message is joined by hand, not copied twice by protobuf.
    rng = np.random.default_rng(5)
    chunk_bytes = 4 << 20
    for entries in (wire.BY_HAND_ABOVE // 8 - 1, wire.BY_HAND_ABOVE // 8, 200_000):
        for task in _every_kind_of_task(rng, entries):
            for indices in ((), (2, 5)):
                (piece,) = wire.encode_task("run", 11, task, chunk_bytes, indices)
                message = wire.task_message("run", 11, task, entries)
                message.client_indices.extend(indices)
                message.payload = np.concatenate([v.ravel() for v in task.payload()]).tobytes()
                assert piece == pb.Instruction(task=message).SerializeToString(), (type(task).__name__, entries)
        vectors = rng.standard_normal((2, entries // 2))
        for answer in (
            Answer((1, 4), vectors),
            Answer((1, 4), vectors, np.array([0.5, -2.0])),
            Answer((1, 4), vectors, counts=np.array([3.0, 9.0])),
            Answer((1, 4), vectors[:, ::2]),  # not contiguous: rows in C order all the same
        ):
            (piece,) = wire.AnswerWriter(chunk_bytes).encode("run", 12, answer)
            assert piece == _built_anew("run", 12, answer, chunk_bytes)


def _without_payload(message: Any, field: str) -> Any:
    copy = type(message)()
    copy.CopyFrom(message)
    getattr(copy, field).payload = b""
    return copy


def test_large_inline_payloads_read_by_hand_are_what_protobuf_reads() -> None:
    # From 64 KiB up, an inline payload is read as a view into the message, and the other fields by protobuf.
    rng = np.random.default_rng(6)
    for entries in (wire.BY_HAND_ABOVE // 8 - 2, wire.BY_HAND_ABOVE // 8, 200_000):
        for task in _every_kind_of_task(rng, entries):
            (piece,) = wire.encode_task("run", 11, task, 4 << 20, (2, 5), (1, 2, 5))
            read = wire.read_inline_task(piece)
            if len(piece) < wire.BY_HAND_ABOVE:
                assert read is None  # (protobuf is cheaper on a small one)
                continue
            assert read is not None, (type(task).__name__, entries)
            parsed = pb.Instruction.FromString(piece)
            assert read.instruction == _without_payload(parsed, "task")
            assert bytes(read.payload) == parsed.task.payload and read.payload.obj is piece  # a view, not a copy
        for answer in (Answer((1, 4), rng.standard_normal((2, entries // 2)), np.array([0.5, -2.0])),):
            (piece,) = wire.AnswerWriter(4 << 20).encode("run", 12, answer)
            inline = wire.read_inline_answer(piece)
            if len(piece) < wire.BY_HAND_ABOVE:
                assert inline is None
                continue
            assert inline is not None
            message, payload = inline
            parsed = pb.ClientMessage.FromString(piece)
            assert message == _without_payload(parsed, "answer") and message.WhichOneof("body") == "answer"
            assert bytes(payload) == parsed.answer.payload and payload.obj is piece


def test_an_inline_payload_is_left_to_protobuf_unless_it_is_there_once_in_a_plain_message() -> None:
    big = b"\x01" * wire.BY_HAND_ABOVE
    answer = pb.Answer(run_id="r", round_id=3, payload_length=len(big) // 8).SerializeToString()
    payload = pb.Answer(payload=big).SerializeToString()  # the payload's field alone
    tag = bytes(((pb.ClientMessage.DESCRIPTOR.fields_by_name["answer"].number << 3) | 2,))  # length-delimited

    def outer(inner: bytes, after: bytes = b"") -> bytes:
        return tag + wire.varint(len(inner)) + inner + after

    assert wire.read_inline_answer(outer(answer + payload)) is not None
    left = [
        outer(answer + payload + payload),  # twice: protobuf keeps the last
        outer(answer + payload, after=b"\x08\x01"),  # a field outside the answer
        outer(answer + bytes([0x1B]) + payload),  # a group's start inside
        outer(answer + payload)[:-1],  # cut short
        outer(answer + payload + bytes([0x3A, 0xFF, 0xFF, 0x7F])),  # a length past the end
        outer(pb.Answer(run_id="r" * len(big)).SerializeToString()),  # as large, but no payload
        outer(answer + payload + bytes([0xFA, 0x06]) + wire.varint(len(big) // 8) + big[: len(big) // 8]),  # padded
        outer(answer + bytes([0x2A, 0x00]) + bytes([0xFA, 0x06]) + wire.varint(len(big)) + big),  # empty, padded
        pb.ClientMessage(chunk=pb.Chunk(data=big)).SerializeToString(),
        b"",
    ]
    for message in left:
        assert wire.read_inline_answer(message) is None, message[:16]
    assert pb.ClientMessage.FromString(left[0]).answer.payload == big  # (and protobuf reads that one)
    # Other fields still go through protobuf, which refuses what it always refused: a run id not UTF-8.
    bad_text = pb.Answer(run_id="r").SerializeToString().replace(b"r", b"\xff")
    with pytest.raises(DecodeError):
        wire.read_inline_answer(outer(bad_text + payload))
    with pytest.raises(DecodeError):
        pb.ClientMessage.FromString(outer(bad_text + payload))


def _read_as_protobuf_reads(message: bytes, read: Any, kind: Any, field: str) -> bool:
    """The reader takes the message as protobuf does, leaves it to protobuf, or refuses it where protobuf does;
    whether it took it."""
    try:
        parsed = kind.FromString(message)
    except DecodeError:
        with pytest.raises(DecodeError):
            if read(message) is None:
                kind.FromString(message)
        return False
    inline = read(message)
    if inline is not None:
        assert inline[0] == _without_payload(parsed, field)
        assert bytes(inline[1]) == getattr(parsed, field).payload
    return inline is not None


@pytest.mark.parametrize("size", [2, 5, 6, 10])
def test_a_payload_key_written_in_more_bytes_than_it_needs_is_read_as_protobuf_reads_it(size: int) -> None:
    # Protobuf takes a key of up to 5 bytes, however long its varint need be (0x3A as BA 80 .. 00), and
    # refuses a longer one: the message is then corrupt, not a Task with a payload.
    key = bytes([0xBA] + [0x80] * (size - 2) + [0x00])
    payload = b"\x01" * wire.BY_HAND_ABOVE
    inner = pb.Task(run_id="r", round_id=2).SerializeToString() + key + wire.varint(len(payload)) + payload
    message = bytes([0x1A]) + wire.varint(len(inner)) + inner
    assert _read_as_protobuf_reads(message, wire.read_inline_task, pb.Instruction, "task") == (size <= 5)
    answer = pb.Answer(run_id="r", round_id=2).SerializeToString() + bytes([0xAA]) + key[1:]
    inner = answer + wire.varint(len(payload)) + payload
    message = bytes([0x1A]) + wire.varint(len(inner)) + inner
    assert _read_as_protobuf_reads(message, wire.read_inline_answer, pb.ClientMessage, "answer") == (size <= 5)


def _padded(value: int, size: int) -> bytes:
    """`value` as a varint of at least `size` bytes: its shortest form, padded with 0x80 bytes and a 0x00."""
    shortest = wire.varint(value)
    if len(shortest) >= size:
        return shortest
    return shortest[:-1] + bytes([0x80 | shortest[-1]] + [0x80] * (size - len(shortest) - 1) + [0x00])


@pytest.mark.parametrize("size", [1, 5, 6, 10])
def test_lengths_written_in_more_bytes_than_they_need_are_read_as_protobuf_reads_them(size: int) -> None:
    # Protobuf takes the length of a submessage or of bytes in up to 5 bytes, and refuses a longer one.
    payload = b"\x01" * wire.BY_HAND_ABOVE
    head = pb.Task(run_id="r", round_id=2).SerializeToString()
    for inner, outer_size in (
        (head + b"\x3a" + _padded(len(payload), size) + payload, 1),  # the payload's length
        (b"\x0a" + _padded(1, size) + b"r" + b"\x3a" + wire.varint(len(payload)) + payload, 1),  # the run id's
        (head + b"\x3a" + wire.varint(len(payload)) + payload, size),  # the Task's
    ):
        message = b"\x1a" + _padded(len(inner), outer_size) + inner
        assert _read_as_protobuf_reads(message, wire.read_inline_task, pb.Instruction, "task") == (size <= 5)
    data = b"\x02" * 300
    data_field = b"\x12" + _padded(len(data), size) + data
    for chunk in (
        b"\x22" + _padded(2 + len(data_field), 1) + b"\x08\x07" + data_field,  # the data's length
        b"\x22" + _padded(2 + 3 + len(data), size) + b"\x08\x07\x12" + wire.varint(len(data)) + data,  # the Chunk's
    ):
        try:
            parsed = pb.ClientMessage.FromString(chunk)
        except DecodeError:
            assert wire.read_chunk(chunk) is None
            continue
        read = wire.read_chunk(chunk)
        assert read is not None and (read.offset, bytes(read.data)) == (parsed.chunk.offset, parsed.chunk.data)


def test_fields_nested_as_deep_as_protobuf_allows_and_one_deeper_are_read_as_protobuf_reads_them() -> None:
    # Unknown groups nested in the Task's GradientParams (field 4): protobuf counts the Instruction and the Task
    # in its depth limit; the reader must leave them counted when protobuf reads the fields beside the payload.
    payload = b"\x01" * wire.BY_HAND_ABOVE
    taken = []
    for depth in range(90, 110):
        groups = bytes([0xA3, 0x06]) * depth + bytes([0xA4, 0x06]) * depth  # field 100: start, then end
        inner = b"\x22" + wire.varint(len(groups)) + groups + b"\x3a" + wire.varint(len(payload)) + payload
        message = bytes([0x1A]) + wire.varint(len(inner)) + inner
        taken.append(_read_as_protobuf_reads(message, wire.read_inline_task, pb.Instruction, "task"))
    assert taken[0] and not taken[-1]  # (read by hand below the limit, and refused past it)


def _field(rng: np.random.Generator, numbers: list[int], payload: bytes, payload_number: int) -> bytes:
    """A field as a hostile peer may write it: any number (0 and unknown ones too), any wire type (groups and
    the two that do not exist), keys and lengths in more bytes than they need, submessages holding fields."""
    number = int(rng.choice([*numbers, payload_number, payload_number, 0, 99, (1 << 29) - 1]))
    wire_type = int(rng.choice([0, 0, 1, 2, 2, 2, 2, 5, 3, 4, 6, 7]))
    key = _padded((number << 3) | wire_type, int(rng.choice([1, 1, 1, 2, 5, 6, 10])))
    if wire_type == 0:
        return key + _padded(int(rng.choice([0, 1, 300, (1 << 63), (1 << 64) - 1])), int(rng.choice([1, 1, 10])))
    if wire_type in (1, 5):
        return key + bytes(8 if wire_type == 1 else 4)
    if wire_type != 2:
        return key
    if number == payload_number and rng.random() < 0.7:
        data = payload
    elif rng.random() < 0.3:  # a submessage (or bytes that look like one) holding a field of its own
        data = _field(rng, [1, 2, 3], b"", 7)
    else:
        data = bytes(int(rng.choice([0, 1, 3, 10])))
    return key + _padded(len(data), int(rng.choice([1, 1, 1, 5, 6]))) + data


@pytest.mark.parametrize("kind", [pb.Instruction, pb.ClientMessage], ids=["task", "answer"])
def test_an_inline_payload_read_by_hand_is_what_protobuf_reads_in_any_message_a_hostile_peer_writes(
    kind: Any,
) -> None:
    # Messages built field by field, with the encodings protobuf takes and those it refuses: whatever the
    # reader takes, protobuf reads the same; what protobuf refuses, the reader refuses or leaves to it.
    read, field = (wire.read_inline_task, "task") if kind is pb.Instruction else (wire.read_inline_answer, "answer")
    inner_kind = getattr(kind(), field)
    payload_number = inner_kind.DESCRIPTOR.fields_by_name["payload"].number
    numbers = [f.number for f in inner_kind.DESCRIPTOR.fields if f.number != payload_number]
    rng = np.random.default_rng(8)
    taken = 0
    for _ in range(3000):
        payload = bytes([int(rng.integers(256))]) * int(rng.choice([0, 8, wire.BY_HAND_ABOVE + 1]))
        inner = b"".join(_field(rng, numbers, payload, payload_number) for _ in range(int(rng.integers(6))))
        if rng.random() < 0.8:
            inner += bytes([(payload_number << 3) | 2]) + wire.varint(len(payload)) + payload
        message = b"\x1a" + _padded(len(inner), int(rng.choice([1, 1, 1, 5, 6]))) + inner
        if rng.random() < 0.1:  # another field of the outer message after it (the oneof set twice, say)
            message += _field(rng, [1, 2, 4], b"", 3)
        taken += _read_as_protobuf_reads(message, read, kind, field)
    assert taken > 100


def test_a_message_of_many_small_fields_costs_the_inline_reader_no_more_than_it_costs_protobuf() -> None:
    # 3 MiB (the coordinator's message limit) of two-byte fields: protobuf reads them in C in milliseconds; a
    # walk over each of them in Python took 600 ms of the coordinator's thread, for each such message a peer sent.
    payload = b"\x01" * wire.BY_HAND_ABOVE
    for many in (b"\x10\x01" * (3 << 19), b"\x10\x01" * 100):  # round_id, again and again
        inner = many + b"\x2a" + wire.varint(len(payload)) + payload
        message = b"\x1a" + wire.varint(len(inner)) + inner
        assert wire.read_inline_answer(message) is None  # (left to protobuf)
    times = []
    for read in (wire.read_inline_answer, pb.ClientMessage.FromString) * 3:
        began = time.process_time()
        read(message)
        times.append(time.process_time() - began)
    by_hand, protobuf = min(times[0::2]), min(times[1::2])
    assert by_hand < protobuf + 0.005, (by_hand, protobuf)


def _inline_answer() -> tuple[bytes, Any, Any, str]:
    vectors = np.random.default_rng(2).standard_normal((1, wire.BY_HAND_ABOVE // 8 + 1))
    (made,) = wire.AnswerWriter(1 << 20).encode("run-7", 3, Answer((5,), vectors, np.array([1.5])))
    return made, wire.read_inline_answer, pb.ClientMessage, "answer"


def _inline_task() -> tuple[bytes, Any, Any, str]:
    z, control = np.random.default_rng(3).standard_normal((2, wire.BY_HAND_ABOVE // 16 + 1))
    task = LocalStepsTask(z, 3, 0.1, 7, "inverse_sqrt", control=control, theta=0.5)
    (made,) = wire.encode_task("run-7", 3, task, 1 << 20, (5, 6), (1, 5, 6))  # fields after the payload too
    return made, wire.read_inline_task, pb.Instruction, "task"


@pytest.mark.parametrize("make", [_inline_answer, _inline_task], ids=["answer", "task"])
def test_an_inline_payload_read_by_hand_is_what_protobuf_reads_in_any_mutation_of_one(make: Any) -> None:
    # Whatever the reader takes, protobuf reads the same; what protobuf refuses, the reader refuses or leaves.
    base, read, kind, field = make()
    rng = np.random.default_rng(1)
    read_by_hand = 0
    for _ in range(3000):
        made = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):  # near the front (the header) or the back (the fields after it)
            at = int(rng.integers(24)) if rng.random() < 0.5 else len(made) - int(rng.integers(1, 24))
            byte = int(rng.integers(256))
            if rng.random() < 0.4:
                made[at] = byte
            elif rng.random() < 0.5:
                del made[at]
            else:
                made.insert(at, byte)
        message = bytes(made)
        try:
            inline = read(message)
        except DecodeError:
            with pytest.raises(DecodeError):
                kind.FromString(message)
            continue
        if inline is None:
            continue
        read_by_hand += 1
        parsed = kind.FromString(message)
        assert inline[0] == _without_payload(parsed, field), message[:24]
        assert bytes(inline[1]) == getattr(parsed, field).payload, message[:24]
    assert read_by_hand > 250  # (most mutations break the framing: those are left to protobuf)


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 300, 4 << 20, 1 << 40])
@pytest.mark.parametrize("size", [1, 127, 128, 20_000])
def test_chunks_written_and_read_by_hand_are_protobufs_bytes(offset: int, size: int) -> None:
    data = np.random.default_rng(size).bytes(size)
    made = wire.chunk_message(offset, memoryview(data))
    assert wire.chunk_message(offset, [memoryview(data)[: size // 3], memoryview(data)[size // 3 :]]) == made
    for kind in (pb.Instruction, pb.ClientMessage):
        assert made == kind(chunk=pb.Chunk(offset=offset, data=data)).SerializeToString()
        parsed = kind.FromString(made).chunk
        assert (parsed.offset, parsed.data) == (offset, data)
    read = wire.read_chunk(made)
    assert read is not None and read.offset == offset and bytes(read.data) == data


def test_anything_but_a_plain_chunk_is_left_to_protobuf() -> None:
    chunk = pb.Chunk(offset=8, data=b"abc").SerializeToString()
    reordered = bytes([0x12, 3]) + b"abc" + bytes([0x08, 8])  # valid protobuf, fields in another order
    others = [
        pb.ClientMessage(answer=pb.Answer(run_id="r", payload=b"x" * 64)).SerializeToString(),
        pb.Instruction(task=pb.Task(run_id="r")).SerializeToString(),
        bytes([wire.CHUNK_TAG, len(reordered)]) + reordered,
        bytes([wire.CHUNK_TAG, len(chunk) + 2]) + chunk + bytes([0x18, 1]),  # an unknown field inside
        bytes([wire.CHUNK_TAG, len(chunk)]) + chunk + bytes([0x0A, 0]),  # another field after the chunk
        pb.Instruction(chunk=pb.Chunk(offset=8)).SerializeToString(),  # empty data: no data field at all
        bytes([wire.CHUNK_TAG, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]),
        bytes([wire.CHUNK_TAG]),
        b"",
    ]
    for message in others:
        assert wire.read_chunk(message) is None, message[:16]
    # Protobuf reads the reordered one as the same chunk: nothing is lost by leaving it to it.
    assert pb.Instruction.FromString(others[2]).chunk == pb.Chunk(offset=8, data=b"abc")


def test_a_chunk_read_by_hand_is_what_protobuf_reads_in_any_mutation_of_one() -> None:
    # A peer's bytes need not be protobuf's own: whatever read_chunk takes, protobuf must read the same
    # (and what it leaves, protobuf reads). 20 000 chunks with bytes changed, dropped or inserted.
    rng = np.random.default_rng(0)
    read_by_hand = 0
    for _ in range(20_000):
        offset = (0, 1, 127, 128, 2**63, 2**64 - 1)[int(rng.integers(6))]
        made = bytearray(
            pb.Instruction(chunk=pb.Chunk(offset=offset, data=bytes(int(rng.integers(300))))).SerializeToString()
        )
        for _ in range(int(rng.integers(3))):
            at, byte = int(rng.integers(len(made) + 1)), int(rng.integers(256))
            if rng.random() < 0.4 and at < len(made):
                made[at] = byte
            elif rng.random() < 0.5 and at < len(made):
                del made[at]
            else:
                made.insert(at, byte)
        message = bytes(made)
        read = wire.read_chunk(message)
        if read is None:
            continue
        read_by_hand += 1
        parsed = pb.Instruction.FromString(message)
        assert parsed.WhichOneof("body") == "chunk", message[:24]
        assert (parsed.chunk.offset, parsed.chunk.data) == (read.offset, bytes(read.data)), message[:24]
    assert read_by_hand > 10_000  # most mutations leave a chunk (in the data)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gamma_local", float("nan")),
        ("gamma_local", float("inf")),
        ("gamma_local", -0.1),
        ("theta", float("nan")),
        ("theta", -1.0),
    ],
)
def test_local_steps_with_a_step_or_weight_that_is_no_number_are_refused(field: str, value: float) -> None:
    # (A NaN step made every answer "diverged", as if the step were too large.)
    local = pb.LocalSteps(steps=2, gamma_local=0.1, decay=pb.CONSTANT, correction=pb.NONE)
    setattr(local, field, value)
    task = pb.Task(run_id="r", round_id=1, kind=pb.LOCAL_STEPS, local=local, payload_length=4)
    with pytest.raises(wire.WireError, match=f"^{field} must be finite and >= 0, got {value}$"):
        wire.decode_task(task, np.ones(4).tobytes(), 4)
    setattr(local, field, 0.0)  # both may be 0: the minibatch regime, and no Catalyst regularizer
    task.local.CopyFrom(local)
    assert isinstance(wire.decode_task(task, np.ones(4).tobytes(), 4), LocalStepsTask)


def test_answers_with_bad_vectors_are_refused_with_the_reason() -> None:
    header = pb.Answer(client_indices=[3, 4], payload_length=8)
    values = np.ones(8)
    values[6] = np.nan
    with pytest.raises(wire.WireError, match="client 4: entry 2 is nan"):
        wire.decode_answer(header, values.tobytes(), 4, want_objective=False)
    with pytest.raises(wire.WireError, match="payload has 56 bytes, expected 64"):
        wire.decode_answer(header, np.ones(7).tobytes(), 4, want_objective=False)
    with pytest.raises(wire.WireError, match="objective has 0 bytes, expected 16"):
        wire.decode_answer(header, np.ones(8).tobytes(), 4, want_objective=True)


def test_the_assembler_refuses_gaps_and_overruns() -> None:
    assembler = wire.Assembler(16)
    assembler.add(pb.Chunk(offset=0, data=b"x" * 8))
    with pytest.raises(wire.WireError, match="chunk at byte 12, expected byte 8"):
        assembler.add(pb.Chunk(offset=12, data=b"x" * 4))
    with pytest.raises(wire.WireError, match="overrun"):
        assembler.add(pb.Chunk(offset=8, data=b"x" * 9))
    with pytest.raises(wire.WireError, match="empty chunk"):
        assembler.add(pb.Chunk(offset=8, data=b""))
    assert not assembler.done
    assembler.add(pb.Chunk(offset=8, data=b"y" * 8))
    assert assembler.done and assembler.payload() == b"x" * 8 + b"y" * 8


def test_every_chunk_but_the_last_carries_at_least_the_minimum_piece() -> None:
    assert wire.min_piece(2 << 20) == 4096 and wire.min_piece(1024) == 1024
    assembler = wire.Assembler(2500, min_piece=1024)
    with pytest.raises(wire.WireError, match="a chunk of 1023 bytes before the payload's last: every chunk but"):
        assembler.add(pb.Chunk(offset=0, data=b"x" * 1023))
    assert assembler.filled == 0  # the refused chunk left nothing behind
    assembler.add(pb.Chunk(offset=0, data=b"x" * 1024))
    assembler.add(pb.Chunk(offset=1024, data=b"y" * 1200))
    assembler.add(pb.Chunk(offset=2224, data=b"z" * 276))  # the last may be short
    assert assembler.done and bytes(assembler.payload()[1020:1030]) == b"xxxxyyyyyy"
    # The chunks of a refused answer are checked and counted, not kept.
    skipped = wire.Assembler(1 << 40, min_piece=1024, keep=False)
    skipped.add(pb.Chunk(offset=0, data=b"s" * 4096))
    with pytest.raises(wire.WireError, match="a chunk of 10 bytes before the payload's last"):
        skipped.add(pb.Chunk(offset=4096, data=b"s" * 10))
    assert skipped.filled == 4096 and not skipped.done


@pytest.mark.parametrize("chunk_bytes", [0, -1])
def test_chunks_of_no_data_are_refused_when_asked_for_not_cut_forever(chunk_bytes: int) -> None:
    payload = [memoryview(np.arange(4.0).tobytes())]
    with pytest.raises(ValueError, match=f"chunk_bytes must be > 0, got {chunk_bytes}"):
        wire.chunks(payload, chunk_bytes)  # raised by the call itself, before any chunk is asked for
    with pytest.raises(ValueError, match="chunk_bytes must be > 0, got 0"):
        wire.AnswerWriter(0).encode("r", 1, Answer((0,), np.arange(4.0).reshape(1, 4)))
    cut = [wire.read_chunk(piece) for piece in wire.chunks(payload, 12)]  # a positive size cuts as before
    assert [(c.offset, bytes(c.data)) for c in cut if c is not None] == [
        (0, payload[0][:12].tobytes()),
        (12, payload[0][12:24].tobytes()),
        (24, payload[0][24:].tobytes()),
    ]


def test_the_assembler_holds_only_what_arrived() -> None:
    # A peer announcing a large payload and sending little costs the process little:
    # the buffer's pages are committed only as chunks fill them.
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    before = rss()
    assembler = wire.Assembler(1 << 30)
    assembler.add(pb.Chunk(offset=0, data=b"z" * 4096))
    assembler.add(wire.RawChunk(4096, memoryview(b"y" * 4096)))
    assert assembler.filled == 8192 and not assembler.done
    assert rss() - before < 64 << 20  # far from the announced GiB
    assert bytes(assembler.payload()[4090:4100]) == b"zzzzzzyyyy"


def test_message_limit_is_raised_only_as_far_as_one_chunk_needs() -> None:
    options = dict(wire.grpc_options(4 << 20))
    assert options["grpc.max_receive_message_length"] == (4 << 20) + (1 << 20)


@pytest.mark.parametrize("rows", [7, 2001])  # short vectors take the sum of squares first, long ones not
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_all_finite_finds_any_non_finite_entry_in_any_layout(layout: str, rows: int) -> None:
    base = np.random.default_rng(0).standard_normal((rows, 5))
    views = {"C": lambda a: a, "F": lambda a: np.asfortranarray(a), "strided": lambda a: a[::2, ::2]}
    view = views[layout]
    assert all_finite(view(base))
    with np.errstate(over="ignore"):  # as the callers have it
        assert all_finite(view(base * 1e200))  # squares overflow: the entries are looked at one by one
    for bad in (np.inf, -np.inf, np.nan):
        for row, col in ((0, 0), (rows - 1, 4), (2, 3)):
            values = base.copy()
            values[row, col] = bad
            seen = layout != "strided" or (row % 2 == 0 and col % 2 == 0)  # the view holds the entry
            assert all_finite(view(values)) is not seen, (bad, row, col)


# -- bytes protobuf refuses -------------------------------------------------------------------


def _as_written(number: int, wire_type: int, body: bytes = b"") -> bytes:
    """A field as a hand-written client may write it: key, then `body` (with its length, if length-delimited)."""
    key = wire.varint(number << 3 | wire_type)
    return key + (wire.varint(len(body)) + body if wire_type == 2 else body)


_RUN = _as_written(1, 2, b"r-1")  # Answer.run_id
_PAYLOAD = bytes(8 * 10_000)  # over BY_HAND_ABOVE: the inline reader's path too


@pytest.mark.parametrize(
    ("message", "fault"),
    [
        (_as_written(3, 2, _RUN + b"\x10\x80"), "field answer.round_id at byte 7: the message ends inside its varint"),
        (_as_written(3, 2, _RUN + b"\x10" + b"\x80" * 10 + b"\x01"),
         "field answer.round_id at byte 7: a varint longer than 10 bytes"),
        (_as_written(3, 2, _RUN + _as_written(5, 2, _PAYLOAD))[:-5],
         "field answer at byte 0: its length says 80009 bytes, 80004 remain"),
        (_as_written(3, 2, _RUN + b"\x2a" + wire.varint(80_001) + _PAYLOAD),
         "field answer.payload at byte 9: its length says 80001 bytes, 80000 remain"),
        (_as_written(3, 2, _RUN + b"\x2a\x80\xf1\x84\x80\x80\x00" + _PAYLOAD),
         "field answer.payload at byte 9: its length is written in 6 bytes (protobuf reads at most 5)"),
        (_as_written(3, 2, _as_written(1, 2, b"\xff\xfe") + _as_written(5, 2, _PAYLOAD)),
         "field answer.run_id at byte 4: not valid UTF-8 (byte 6)"),
        (_as_written(3, 2, _RUN + b"\x1a\x02\x01\x80"),
         "field answer.client_indices at byte 7: its packed values end inside a varint"),
        (_as_written(3, 2, _RUN + _as_written(5, 2, _PAYLOAD) + b"\x00\x00"),
         "byte 80013: field number 0, which no field has"),
        (_as_written(3, 2, _RUN + _as_written(5, 2, _PAYLOAD) + _as_written(99, 4)),
         "field answer.99 at byte 80013: an end-group with no group of field 99 open"),
        (_as_written(3, 2, _RUN + _as_written(99, 3) + _as_written(5, 2, _PAYLOAD)),
         "byte 80015: the group of field 99 is not closed before its message ends"),
        (_as_written(3, 2, _RUN + _as_written(99, 3) * 101),
         "field answer.99.99.99.99.99.99.99.99 at byte 206: groups and messages nested more than 100 deep"),
        (_as_written(3, 2, _RUN + b"\x0e"), "field answer.run_id at byte 7: wire type 6, which does not exist"),
        (_as_written(3, 2, _RUN + b"\x39\x00\x00"),
         "field answer.diverged at byte 7: a 64-bit value needs 8 bytes, 2 remain"),
        (_as_written(4, 2, _as_written(1, 0, b"\x05") + _as_written(2, 2, _PAYLOAD))[:-1],
         "field chunk at byte 0: its length says 80006 bytes, 80005 remain"),
        (_as_written(4, 2, b"\x08" + b"\xff" * 10 + b"\x01" + _as_written(2, 2, _PAYLOAD)),
         "field chunk.offset at byte 4: a varint longer than 10 bytes"),
        (b"\x1a", "field answer at byte 0: the message ends inside its length"),
        (b"\x80", "byte 0: the message ends inside a field's key"),
        (b"\x80\x80\x80\x80\x80\x01", "byte 0: a field's key longer than 5 bytes"),
        (b"\xff\xff\xff\xff not a protobuf", "byte 0: a field's key beyond 32 bits"),
    ],
)  # fmt: skip
def test_bytes_protobuf_refuses_are_refused_naming_the_first_fault(message: bytes, fault: str) -> None:
    # A client written from the proto by hand needs to know what is wrong with its bytes: protobuf says only
    # that they are not a ClientMessage. The coordinator's error names the field, its byte and the fault.
    with pytest.raises(DecodeError):
        pb.ClientMessage.FromString(message)
    assert wire.wire_fault(message, pb.ClientMessage) == fault
    received = actions.parse(message)
    assert (received.message, received.chunk, received.fault) == (None, None, fault)


def test_the_fault_finder_gives_up_on_a_hostile_peers_megabytes_of_tiny_fields_in_bounded_time() -> None:
    # 1.5 million one-varint fields, then one that protobuf refuses: the walk stops after _FAULT_STEPS fields.
    message = _as_written(3, 2, b"\x10\x01" * 750_000 + b"\x10")
    with pytest.raises(DecodeError):
        pb.ClientMessage.FromString(message)
    started = time.process_time()
    fault = wire.wire_fault(message, pb.ClientMessage)
    assert time.process_time() - started < 0.5
    assert fault == "protobuf refuses it (its first 4096 fields are well-formed)"
