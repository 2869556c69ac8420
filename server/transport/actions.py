"""The actions the coordinator's protocol object (protocol.py) answers with, and the other plain values
that go in and out of it.

Out: the actions the shell carries out (`Send`, `End`, `Greeted`, `Settled`, `Failed`) and the results
an operation settles with (`RoundResult`, `UnmaskResult`, `Resent`, or `MissingClients`). In: a
stream's message as it came off the wire (`Received`, made by `parse`), and the pool's requests: a
run's RunSpec (`run_spec`) and a round serialized once (`round_request`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from google.protobuf.message import DecodeError

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.numeric import Array
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply
from fedsaddle.common.secagg.rows import row_length
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, Task
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import PoolError, RunInfo
from fedsaddle.server.secure import MaskedRound
from fedsaddle.server.settlement import round_traffic
from fedsaddle.server.transport.refusal import Status


class MissingClients(PoolError):
    """Not every client joined in time; the message lists the missing indices."""

    def __init__(self, missing: list[int], timeout: float, why: str = "") -> None:
        super().__init__(f"clients {some(missing)} did not join within {timeout:g} s" + (f": {why}" if why else ""))
        self.missing, self.why = tuple(missing), why


class Received(NamedTuple):
    """A message as it came off the wire: parsed (None if the bytes are not a ClientMessage) and its size.

    A message that is only a Chunk is read by hand (wire.read_chunk): then `chunk` holds it
    and `message` is None. An Answer with a large inline payload is read by hand too
    (wire.read_inline_answer): `message` holds it without the payload, and `payload` the payload."""

    message: pb.ClientMessage | None
    size: int
    chunk: wire.RawChunk | None = None
    payload: memoryview | None = None
    fault: str = ""  # when message is None and chunk too: what is wrong with the bytes (wire.wire_fault)


def parse(data: bytes) -> Received:
    chunk = wire.read_chunk(data)
    if chunk is not None:
        return Received(None, len(data), chunk)
    try:
        inline = wire.read_inline_answer(data)
        if inline is not None:
            return Received(inline[0], len(data), None, inline[1])
        return Received(pb.ClientMessage.FromString(data), len(data))
    except DecodeError:
        return Received(None, len(data), fault=wire.wire_fault(data, pb.ClientMessage))


# -- actions ------------------------------------------------------------------------------


class Send(NamedTuple):
    """Queue serialized Instructions on a session's stream. `bound` (if not 0): the stream's
    undelivered bytes may grow to this from now on (more means it stopped reading)."""

    session: int
    data: bytes
    bound: int = 0


class End(NamedTuple):
    """End a session's stream after what is queued: with `code` and `details`, or (code None) in order.
    `at_once`: drop what is queued (it stopped reading); `linger_s`: let the client close its side first."""

    session: int
    code: Status | None
    details: str = ""
    at_once: bool = False
    linger_s: float = 0.0


class Greeted(NamedTuple):
    """The stream's Hello came (or it was refused, or it ended): it no longer waits for one. `joined`:
    it holds a session now."""

    session: int
    joined: bool = False


class Settled(NamedTuple):
    """The pool's operation is over: its result (None, the sample counts, or a RoundResult)."""

    result: object


class Failed(NamedTuple):
    """The pool's operation failed with this error."""

    error: BaseException


Action = Send | End | Greeted | Settled | Failed


class RoundRequest(NamedTuple):
    """One round as the pool asks for it: the task serialized, and what an answer must hold."""

    round_id: int
    pieces: list[bytes]  # the serialized task, for sessions whose clients all take part
    entries: int  # float64 entries per client in an answer
    want_objective: bool
    counts: int  # an evaluation's row counts per client in an answer: 1, or one per metric; 0: none
    floats: int  # float64 entries the task carries per client
    subset: frozenset[int] | None  # the clients taking part (None: all)
    pieces_for: Callable[[tuple[int, ...]], list[bytes]]  # the task for a session with only some of them
    masked: bool = False  # secure aggregation: answers are masked rows of `entries` ring elements
    fold: bool = False  # add the answers' vectors up as they come (server/fold.py), not keep them
    weights: Array | None = None  # the run's weight per client, by index (None: uniform), for the fold
    # Secure aggregation: the round's sum, to which each masked answer's rows are added as they are read (in
    # any order; the round keeps only their shares); None: the rows are kept whole.
    masked_sum: MaskedRound | None = None


class RoundResult(NamedTuple):
    """A collected round: the answers in client-index order, the bytes sent and the bytes received.
    `fold`: the answers' vectors added up (the answers then carry none), when the round asked for it."""

    answers: list[Answer]
    bytes_down: int
    bytes_up: int
    fold: OrderedFold | None = None


def run_spec(run: RunInfo) -> bytes:
    """The RunSpec instruction that announces a run, serialized."""
    spec = pb.RunSpec(
        run_id=run.run_id,
        problem_name=run.problem.name,
        problem_json=run.problem.model_dump_json(),
        noise_seed=run.seed,
        gradient_noise=run.gradient_noise,
        dimension=run.dimension,
        want_sample_counts=run.weighting == "samples" and run.secure is None,
        computations=run.computations,
    )
    if run.precision == "float32":  # (float64 is the field's default: such a RunSpec's bytes are as before)
        spec.element_type = pb.FLOAT32
    if run.secure is not None:  # (clients weigh their own rows: the counts stay with them)
        spec.secure_aggregation.CopyFrom(messages.settings_message(run.secure, run.weighting == "samples"))
        if run.dp is not None:  # the clients add the noise (without secure aggregation, the coordinator does)
            spec.dp.CopyFrom(pb.DifferentialPrivacy(clip=run.dp.clip, noise_multiplier=run.dp.noise_multiplier))
    if run.problem_object.synthetic:
        spec.synthetic_seed = run.seed  # a benchmark source: clients generate their data from it
    return pb.Instruction(run=spec).SerializeToString()


def round_request(
    run: RunInfo,
    round_id: int,
    task: Task,
    chunk_bytes: int,
    participants: tuple[int, ...] | None,
    masked: bool = False,
    fold: bool = False,
    weights: Array | None = None,
    masked_sum: MaskedRound | None = None,
) -> RoundRequest:
    """A round's task serialized once (and for a session with only some of its clients sampled, on demand).
    `masked`: secure aggregation's round, whose answers are masked rows naming every client of the round
    (added to `masked_sum` as they come, if given); `fold`: the answers' vectors are added up as they come
    (weighted by `weights`), except an evaluation's."""
    clients = (participants or ()) if masked else ()

    def pieces_for(indices: tuple[int, ...]) -> list[bytes]:
        return wire.encode_task(run.run_id, round_id, task, chunk_bytes, indices, clients, run.element)

    if masked:
        entries, want_objective, counts = row_length(task, run.dimension), False, 0
    else:
        entries = len(task.metric_names) if isinstance(task, EvaluateTask) else run.dimension
        want_objective = isinstance(task, GradientTask) and task.want_objective
        counts = 0 if not isinstance(task, EvaluateTask) else len(task.metric_names) if task.counts_per_metric else 1
    return RoundRequest(
        round_id,
        wire.encode_task(run.run_id, round_id, task, chunk_bytes, round_clients=clients, dtype=run.element),
        entries=entries,
        want_objective=want_objective,
        counts=counts,
        floats=round_traffic(task, run.num_clients, run.dimension).floats_down,
        subset=None if participants is None else frozenset(participants),
        pieces_for=pieces_for,
        masked=masked,
        fold=fold and not masked and not isinstance(task, EvaluateTask),
        weights=weights,
        masked_sum=masked_sum if masked else None,
    )


class UnmaskResult(NamedTuple):
    """An unmask sub-exchange: the replies and refusals by client, the bytes sent and received."""

    replies: dict[int, UnmaskReply]
    refusals: dict[int, str]
    bytes_down: int
    bytes_up: int


class Resent(NamedTuple):
    """What was sent again to rejoining sessions since it was last taken."""

    messages: int
    floats: int
    size: int
