"""numpy <-> protobuf: tasks and answers, vectors as raw float64 bytes, chunking.

A payload is the concatenation of float64 vectors (little-endian). If it fits in
`chunk_bytes` it travels inline in the Task or Answer; otherwise the header goes
with an empty payload and Chunk messages carry it in order. Every decoder here
checks what it reads and raises WireError with a message that says what is wrong.

The coordinator serializes a round's Task once (`encode_task` returns the
serialized Instructions) and sends the same bytes to every session.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.tasks import Answer, Decay, EvaluateTask, GradientTask, LocalStepsTask, Task
from fedsaddle.proto import fedsaddle_pb2 as pb

FLOAT64 = np.dtype("<f8")
MESSAGE_OVERHEAD = 1 << 20  # room for headers beside a full chunk
_DECAY: dict[Decay, pb.StepDecay] = {"constant": pb.CONSTANT, "inverse_sqrt": pb.INVERSE_SQRT}
_DECAY_NAME: dict[pb.StepDecay, Decay] = {v: k for k, v in _DECAY.items()}


class WireError(ValueError):
    """A message that does not decode to a valid task or answer."""


def message_limit(chunk_bytes: int) -> int:
    """The gRPC send/receive limit both sides set: a chunk plus headroom.

    gRPC refuses messages over 4 MiB by default; payloads of any size still work
    because they are chunked, and the limit is raised only as far as one chunk needs.
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


def to_bytes(vectors: Sequence[Array]) -> bytes:
    return _contiguous(vectors).tobytes()


def _contiguous(vectors: Sequence[Array]) -> memoryview:
    """The vectors' float64 entries, one after the other, as bytes (a view when there is one vector)."""
    if len(vectors) == 1:
        values = np.ascontiguousarray(vectors[0], dtype=FLOAT64)
    else:
        values = np.concatenate([np.asarray(v, dtype=FLOAT64).ravel() for v in vectors])
    return memoryview(values.reshape(-1)).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def from_bytes(data: bytes | bytearray, length: int) -> Array:
    """A read-only float64 view of the bytes (no copy), of exactly `length` entries."""
    if len(data) != 8 * length:
        raise WireError(f"payload has {len(data)} bytes, expected {8 * length} ({length} float64 entries)")
    values = np.frombuffer(data, dtype=FLOAT64)
    values.flags.writeable = False  # also over an assembled bytearray
    return values


def chunks(data: bytes | memoryview, chunk_bytes: int) -> Iterator[pb.Chunk]:
    """The payload in Chunks of at most `chunk_bytes`, each made when it is asked for."""
    view = memoryview(data)
    for offset in range(0, len(data), chunk_bytes):
        yield pb.Chunk(offset=offset, data=view[offset : offset + chunk_bytes].tobytes())


class Assembler:
    """Collects a chunked payload of known size, refusing gaps, overlaps and overruns.

    Memory grows with the chunks that arrived, never ahead of them: a peer that
    announces a large payload and sends nothing costs nothing.
    """

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        self.filled = 0
        self._data = bytearray()  # grown in place: the payload is never held twice

    @property
    def done(self) -> bool:
        return self.filled == self.total

    @property
    def held_bytes(self) -> int:
        """Memory the payload holds so far."""
        return len(self._data)

    def add(self, chunk: pb.Chunk) -> None:
        if chunk.offset != self.filled:
            raise WireError(f"chunk at byte {chunk.offset}, expected byte {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.total:
            raise WireError(f"chunks overrun the payload: {end} bytes of {self.total}")
        if not chunk.data:
            raise WireError("empty chunk")
        self._data += chunk.data
        self.filled = end

    def payload(self) -> bytearray:
        """The whole payload (call when done)."""
        return self._data


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


def encode_task(
    run_id: str, round_id: int, task: Task, chunk_bytes: int, client_indices: Sequence[int] = ()
) -> list[bytes]:
    """The serialized Task instruction, followed by serialized Chunks if the payload is larger than one chunk."""
    payload = _contiguous(task.payload())
    message = task_message(run_id, round_id, task, len(payload) // 8)
    message.client_indices.extend(client_indices)
    if len(payload) <= chunk_bytes:
        message.payload = payload.tobytes()
        return [pb.Instruction(task=message).SerializeToString()]
    pieces = [pb.Instruction(task=message).SerializeToString()]
    pieces.extend(pb.Instruction(chunk=c).SerializeToString() for c in chunks(payload, chunk_bytes))
    return pieces


def decode_task(message: pb.Task, payload: bytes | bytearray, dimension: int) -> Task:
    """The task a Task message (with its assembled payload) describes."""
    if message.kind == pb.EVALUATE:
        return EvaluateTask(from_bytes(payload, dimension), tuple(message.metric_names))
    if message.kind == pb.GRADIENT:
        values = from_bytes(payload, dimension)
        params = message.gradient
        if params.batch < 1:
            raise WireError(f"gradient batch must be >= 1, got {params.batch}")
        return GradientTask(z=values, batch=params.batch, exact=params.exact, want_objective=params.want_objective)
    if message.kind == pb.LOCAL_STEPS:
        local = message.local
        scaffold = local.correction == pb.SCAFFOLD
        if local.correction not in (pb.NONE, pb.SCAFFOLD):
            raise WireError(f"unknown correction {local.correction}")
        if local.decay not in _DECAY_NAME:
            raise WireError(f"unknown step decay {local.decay}")
        values = from_bytes(payload, (2 if scaffold else 1) * dimension)
        return LocalStepsTask(
            z_start=values[:dimension],
            steps=local.steps,
            gamma_local=local.gamma_local,
            step_offset=local.step_offset,
            decay=_DECAY_NAME[local.decay],
            control=values[dimension:] if scaffold else None,
            theta=local.theta,
        )
    raise WireError(f"unknown task kind {message.kind}")


# -- answers: client -> coordinator ----------------------------------------------------


def encode_answer(run_id: str, round_id: int, answer: Answer, chunk_bytes: int) -> Iterator[pb.ClientMessage]:
    """The Answer message, followed by Chunks if the payload is larger than one chunk.

    The chunks are cut from the answer's vectors as they are sent: a large answer is
    never copied whole.
    """
    header = pb.Answer(run_id=run_id, round_id=round_id, client_indices=list(answer.indices), diverged=answer.diverged)
    if answer.diverged:
        return iter([pb.ClientMessage(answer=header)])
    payload = _contiguous([answer.vectors])
    header.payload_length = len(payload) // 8
    if answer.objective is not None:
        header.objective = to_bytes([answer.objective])
    if answer.counts is not None:
        header.sample_counts.extend(int(c) for c in answer.counts)
    if len(payload) <= chunk_bytes:
        header.payload = payload.tobytes()
        return iter([pb.ClientMessage(answer=header)])
    return itertools.chain(
        [pb.ClientMessage(answer=header)], (pb.ClientMessage(chunk=c) for c in chunks(payload, chunk_bytes))
    )


def decode_answer(
    header: pb.Answer, payload: bytes | bytearray, dimension: int, want_objective: bool, want_counts: bool = False
) -> Answer:
    """Check an answer's vectors (length, finiteness) and return them; WireError if bad.

    `dimension` is the entries per client (the metrics' count for an evaluation answer,
    which must also carry one held-out row count per client: `want_counts`).
    """
    indices = tuple(header.client_indices)
    if header.diverged:
        return Answer(indices, np.empty((len(indices), 0)), None, diverged=True)
    values = from_bytes(payload, len(indices) * dimension).reshape(len(indices), dimension)
    finite = np.isfinite(values)
    if not finite.all():
        row, col = (int(v) for v in np.argwhere(~finite)[0])
        raise WireError(f"client {indices[row]}: entry {col} is {values[row, col]} (non-finite values are refused)")
    objective = None
    if want_objective:
        if len(header.objective) != 8 * len(indices):
            raise WireError(f"objective has {len(header.objective)} bytes, expected {8 * len(indices)}")
        objective = from_bytes(header.objective, len(indices))
        if not np.isfinite(objective).all():
            raise WireError("objective values must be finite")
    elif header.objective:
        raise WireError("objective values sent but not asked for")
    counts = None
    if want_counts:
        if len(header.sample_counts) != len(indices):
            raise WireError(f"{len(header.sample_counts)} held-out row counts for {len(indices)} clients")
        counts = np.array(header.sample_counts, dtype=np.float64)
    elif header.sample_counts:
        raise WireError("row counts sent but not asked for")
    return Answer(indices, values, objective, counts=counts)
