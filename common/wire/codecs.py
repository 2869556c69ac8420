"""Tasks (coordinator -> client) and answers (client -> coordinator) as messages, and back, each decoder
checking what it reads: a payload travels inline when it fits in one chunk, in Chunks after its header
when not. The coordinator serializes a round's Task once (`encode_task` returns the serialized
Instructions) and sends the same bytes to every session."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from fedsaddle.common.numeric import all_finite
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
from fedsaddle.common.wire.by_hand import (
    ANSWER_PAYLOAD,
    BY_HAND_ABOVE,
    INSTRUCTION_TASK,
    MESSAGE_ANSWER,
    TASK_PAYLOAD,
    with_payload,
)
from fedsaddle.common.wire.chunking import chunks
from fedsaddle.common.wire.payload import (
    FLOAT64,
    Element,
    WireError,
    from_bytes,
    payload_parts,
    payload_pieces,
    to_bytes,
)
from fedsaddle.proto import fedsaddle_pb2 as pb

_DECAY: dict[Decay, pb.StepDecay] = {"constant": pb.CONSTANT, "inverse_sqrt": pb.INVERSE_SQRT}
_DECAY_NAME: dict[pb.StepDecay, Decay] = {v: k for k, v in _DECAY.items()}


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
    parts = payload_parts(task.payload(), dtype)
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
    return [with_payload(INSTRUCTION_TASK, message.SerializeToString(), TASK_PAYLOAD, parts, back.SerializeToString())]


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
            header.sample_counts.extend(int(c) for c in answer.counts.ravel())  # (per metric: client by client)
        size = dtype.itemsize * vectors.size
        if size > self.chunk_bytes:
            pieces = payload_pieces(vectors, self.chunk_bytes, dtype)
            return itertools.chain([self._message.SerializeToString()], chunks(pieces, self.chunk_bytes))
        if size < BY_HAND_ABOVE:
            header.payload = vectors.astype(dtype, copy=False).tobytes()  # C order, contiguous or not
            return iter([self._message.SerializeToString()])
        # Then objective (6) and sample_counts (8); diverged (7) has none.
        back = pb.Answer(objective=header.objective, sample_counts=header.sample_counts)
        return iter([answer_with_payload(header, payload_parts([vectors], dtype), back)])


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
    return with_payload(MESSAGE_ANSWER, front.SerializeToString(), ANSWER_PAYLOAD, parts, back.SerializeToString())


def decode_answer(
    header: pb.Answer,
    payload: bytes | memoryview,
    dimension: int,
    want_objective: bool,
    want_counts: int = 0,
    indices: tuple[int, ...] | None = None,
    dtype: Element = FLOAT64,
) -> Answer:
    """Check an answer's vectors (length, finiteness) and return them; WireError if bad.

    `dimension` is the entries per client (the metrics' count for an evaluation answer,
    which must also carry `want_counts` row counts per client: 1, or one per metric for a
    problem whose metrics are on different rows; counts (k,) or (k, metrics)). `indices`:
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
        if len(header.sample_counts) != clients * want_counts:
            each = "" if want_counts == 1 else f" x {want_counts} metrics"
            raise WireError(
                f"{len(header.sample_counts)} row counts for {clients} clients{each}; expected {clients * want_counts}"
            )
        counts = np.array(header.sample_counts, dtype=np.float64)
        if want_counts > 1:
            counts = counts.reshape(clients, want_counts)
    elif header.sample_counts:
        raise WireError("row counts sent but not asked for")
    return Answer(indices, flat.reshape(clients, dimension), objective, False, counts)
