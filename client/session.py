"""A client process's side of the protocol, free of I/O: instructions in, actions out (the twin of Coordination).

`ClientSession.receive` takes each Instruction from the coordinator, with the time,
and returns the actions to carry out: `Send` messages back, `LoadRun` (load the run's
data and make its worker), `Compute` (answer a task), `AgreeKeys` and `Unmask`
(secure aggregation), or `Close` (the session is over: done, failed by the
coordinator, or refused by this client, with the Failure to tell the coordinator).
It never reads a clock, touches a socket or a file, or computes: whoever drives it
(service.py, or the in-memory federation of the tests) performs the work actions
with `HostedClients` (hosted.py) and feeds each result back (`loaded`, `computed`,
`agreed`, `unmasked`), which returns the next actions.

Its state is one value: `Connecting` (no Welcome yet), `Welcomed` (no run yet),
`Loading` (a RunSpec's data being loaded), `Unserved` (the last RunSpec could not be
served; its Ready said why), `Working` (a run being served) or `Closed`. Which
instruction each state accepts is decided in `receive`; a coordinator off the
protocol gets a `Close` naming what it did, never an exception, and what it sent
changes nothing (the driver then ends the stream). Only a driver's own mistake (an
instruction while a run loads, or after the goodbye) raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.computations import find_computation
from fedsaddle.common.indices import some
from fedsaddle.common.memory import lasting
from fedsaddle.common.secagg import SecAggError, messages
from fedsaddle.common.tasks import COMPUTE_PAYLOAD_LIMIT, ComputeTask, EvaluateTask, Task
from fedsaddle.common.text import RefusalLog, printable
from fedsaddle.common.worker import UnknownComputation
from fedsaddle.proto import fedsaddle_pb2 as pb

log = logging.getLogger("fedsaddle.client")


HEARTBEAT_S = 60.0
# The instructions that belong to a run, refused before the Welcome (and what the refusal calls them).
_AFTER_WELCOME = {
    "run": "a RunSpec",
    "task": "a Task",
    "chunk": "a Chunk",
    "keys": "a KeyDirectory",
    "unmask": "an UnmaskRequest",
}

# RunSpec.element_type -> the payloads' numbers.
ELEMENTS: dict[int, wire.Element] = {pb.FLOAT64: wire.FLOAT64, pb.FLOAT32: wire.FLOAT32}

Instruction = pb.Instruction | wire.RawChunk | wire.InlineTask


class ClientError(RuntimeError):
    """The session could not start, or ended abnormally (the message says why)."""


class RunFailed(ClientError):
    """The coordinator ended the run as failed (its Goodbye says why)."""


# -- actions --------------------------------------------------------------------------------


class Send(NamedTuple):
    """Write these messages on the stream, in order (protobuf messages, or already serialized)."""

    messages: Iterable[pb.ClientMessage | bytes]


class LoadRun(NamedTuple):
    """Load the hosted clients' data for `run` and make its worker (HostedClients.load); feed the result
    to `ClientSession.loaded`. `num_clients` and `chunk_bytes` are the Welcome's."""

    run: pb.RunSpec
    num_clients: int
    chunk_bytes: int


class Compute(NamedTuple):
    """Answer a task of the run (HostedClients.compute); feed the result to `ClientSession.computed`.

    `task` is the decoded task, for the answering `clients` (None: every hosted one); None for the run's
    usual small gradient at `payload` (the few-calls path, hosted.LoneGradient). `failure_round`: the
    round a Failure names if this task cannot be answered (0 when its last Chunk completed it: a Chunk
    names no round)."""

    message: pb.Task
    task: Task | None
    clients: tuple[int, ...] | None = None
    payload: bytes | None = None
    failure_round: int = 0


class AgreeKeys(NamedTuple):
    """Agree on pairwise keys with the other clients (HostedClients.agree); feed the result to `agreed`."""

    epoch: int
    keys: dict[int, bytes]


class Unmask(NamedTuple):
    """A hosted client's part of unmasking a round (HostedClients.unmask); feed the reply to `unmasked`."""

    request: pb.UnmaskRequest


class Ending(Enum):
    DONE = "done"  # the coordinator said goodbye: the run is over
    FAILED = "failed"  # the coordinator ended the run as failed (RunFailed)
    REFUSED = "refused"  # this client cannot go on (ClientError): the coordinator is told why first


class Close(NamedTuple):
    """End the session: send `failure` first (if any), then close the stream; `reason` is what the person
    running this client reads."""

    ending: Ending
    reason: str
    failure: pb.ClientMessage | None = None

    def error(self) -> ClientError | None:
        """What the client process ends with (None: a run that ended well)."""
        if self.ending is Ending.DONE:
            return None
        return RunFailed(self.reason) if self.ending is Ending.FAILED else ClientError(self.reason)


Action = Send | LoadRun | Compute | AgreeKeys | Unmask | Close


# -- results fed back ---------------------------------------------------------------------


class Loaded(NamedTuple):
    """A run's data loaded and its worker made: what its Ready says, and how its tasks are served."""

    dimension: int  # the data's, which bounds the run's tasks (whatever the RunSpec claimed)
    sample_counts: tuple[int, ...]
    public_keys: tuple[bytes, ...]
    metrics: tuple[str, ...]  # the problem's evaluation metrics: an EVALUATE's answer layout
    secure: bool  # one party per hosted client (secure aggregation)
    lone: bool  # the usual small gradient task takes the few-calls path
    numeric_stack: str


class Refusal(NamedTuple):
    """What the hosted clients cannot do, and why: a run they cannot serve (its Ready says so), or a task or
    key directory they refuse (the session closes naming it)."""

    reason: str


# -- states ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Joined:
    """What the Welcome said, for the rest of the session."""

    chunk_bytes: int  # answers are cut into chunks of at most this
    num_clients: int  # n, the federation's size (0 if it did not say)


@dataclass(frozen=True, slots=True)
class Connecting:
    """The Hello is sent; no Welcome yet, so nothing of a run can be served."""


@dataclass(frozen=True, slots=True)
class Welcomed:
    """Welcomed, and no RunSpec yet."""

    joined: Joined


@dataclass(frozen=True, slots=True)
class Loading:
    """A RunSpec came; its data is being loaded (LoadRun), and `loaded` is expected next."""

    joined: Joined
    run: pb.RunSpec
    answered: int  # tasks answered in the last run served (a goodbye's log line says it)


@dataclass(frozen=True, slots=True)
class Unserved:
    """The last RunSpec could not be served (its Ready said why): its tasks are refused."""

    joined: Joined
    run: pb.RunSpec
    element: wire.Element  # its payloads' numbers, by which an inline task is checked
    answered: int


@dataclass(slots=True)
class Assembly:
    """A task whose payload comes in Chunks, being put together."""

    message: pb.Task
    assembler: wire.Assembler


@dataclass(slots=True)
class Working:
    """A run being served: what its tasks are checked against, how many were answered, and a task being
    assembled (if one is)."""

    joined: Joined
    run: pb.RunSpec
    run_id: str  # (read once, not per task)
    name: str  # its id as logs show it: the coordinator's text, bounded and escaped
    element: wire.Element
    dimension: int  # the data's: each task's payload is bounded by it
    metrics: tuple[str, ...]
    secure: bool
    lone: bool
    said: float  # when the log last said how far the run is
    answered: int = 0
    assembly: Assembly | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Closed:
    """The session is over; nothing more is received."""

    ending: Ending
    reason: str


State = Connecting | Welcomed | Loading | Unserved | Working | Closed


class ClientSession:
    """One stream's session with the coordinator: its state, and the protocol's decisions on each instruction."""

    def __init__(self, indices: tuple[int, ...], heartbeat_s: float = HEARTBEAT_S) -> None:
        self.indices = indices
        self.state: State = Connecting()
        # A line in the log every `heartbeat_s` of a run, so that a site's operator sees it work.
        self.heartbeat_s = heartbeat_s
        self._refusals = RefusalLog(log)  # a coordinator's flood of Rejected costs the log a few lines
        # Chunked payloads are assembled here, task after task (a buffer of its own: common/memory.py).
        self._payload: bytearray | memoryview = bytearray()

    @property
    def chunk_bytes(self) -> int:
        """The Welcome's chunk size (0 before it), with which answers are cut."""
        state = self.state
        return 0 if isinstance(state, (Connecting, Closed)) else state.joined.chunk_bytes

    def hello(self, name: str) -> pb.ClientMessage:
        return pb.ClientMessage(
            hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=list(self.indices), client_name=name)
        )

    # -- instructions in --------------------------------------------------------------------

    def receive(self, instruction: Instruction, now: float) -> list[Action]:
        """The actions one instruction calls for (a Chunk, or a Task's inline payload, may come read by hand:
        wire.read_chunk, wire.read_inline_task). `now`: a monotonic clock's time, in seconds."""
        state = self.state
        if (
            type(state) is Working
            and state.lone
            and type(instruction) is pb.Instruction
            and instruction.HasField("task")
        ):
            # The run's usual small task, for the few-calls path (hosted.LoneGradient): a GRADIENT of the run
            # naming no clients, asking no objective, with a batch of at least 1 and exactly the run's entries
            # inline. Any other task goes the general way below, with the general way's errors.
            task = instruction.task
            if (
                task.kind == pb.GRADIENT
                and task.run_id == state.run_id
                and task.payload_length == state.dimension
                and not task.client_indices
            ):
                payload, params = task.payload, task.gradient  # (each read of a bytes field is a copy)
                if len(payload) == 8 * state.dimension and params.batch >= 1 and not params.want_objective:
                    return [Compute(task, None, None, payload)]
        if isinstance(state, (Loading, Closed)):
            raise RuntimeError(f"an instruction received while {type(state).__name__}")  # (the driver's mistake)
        try:
            return self._receive(state, instruction, now)
        except wire.WireError as exc:
            return self._close(instruction, f"malformed instruction from the coordinator: {exc}", str(exc))

    def _receive(self, state: State, instruction: Instruction, now: float) -> list[Action]:
        if isinstance(instruction, wire.RawChunk):
            return self._chunk(state, instruction, instruction)
        inline = None
        message = instruction
        if isinstance(message, wire.InlineTask):
            message, inline = message
        kind = message.WhichOneof("body")
        if isinstance(state, Connecting) and kind in _AFTER_WELCOME:
            # Nothing of a run can be served before the Welcome gives the chunk size: an answer cut into
            # chunks of no size would never end (a hostile or broken coordinator's first message).
            return self._refuse(instruction, self._before_welcome(message, kind))
        if kind == "task":
            return self._task(state, instruction, message.task, inline)
        if kind == "welcome":
            return self._welcome(state, instruction, message.welcome)
        if kind == "run":
            assert not isinstance(state, (Connecting, Loading, Closed))
            answered = state.answered if isinstance(state, (Unserved, Working)) else 0
            self.state = Loading(state.joined, message.run, answered)
            return [LoadRun(message.run, state.joined.num_clients, state.joined.chunk_bytes)]
        if kind == "chunk":
            return self._chunk(state, instruction, message.chunk)
        if kind == "keys":
            return self._key_directory(state, instruction, message.keys)
        if kind == "unmask":
            return self._unmask(state, instruction, message.unmask)
        if kind == "rejected":
            rejected = message.rejected
            code = pb.RejectCode.Name(rejected.code) if rejected.code in pb.RejectCode.values() else rejected.code
            self._refusals.warn(
                "round %d: answer refused: %s: %s",
                rejected.round_id,
                code,
                printable(rejected.details, 1024),
                now=now,
            )
            return []
        if kind == "goodbye":
            return self._goodbye(state, message.goodbye)
        # (None: an empty Instruction, or one of a kind a later protocol added, which protobuf keeps aside)
        return self._refuse(
            instruction,
            "unknown instruction: none of the kinds this client knows (an empty one, or a later protocol's)",
        )

    def _welcome(self, state: State, instruction: Instruction, welcome: pb.Welcome) -> list[Action]:
        if not isinstance(state, Connecting):  # one per session: a second would change the chunk size under a run
            during = (
                f" during run {printable(state.run.run_id, 64)!r}" if isinstance(state, (Unserved, Working)) else ""
            )
            return self._refuse(instruction, f"the coordinator sent a second Welcome{during}")
        try:
            chunk_bytes = wire.check_chunk_bytes(welcome.chunk_bytes)
        except ValueError as exc:
            return self._refuse(instruction, f"the coordinator's Welcome is malformed: {exc}")
        self.state = Welcomed(Joined(chunk_bytes, welcome.num_clients))
        log.info("joined federation %s as clients %s", printable(welcome.federation_id, 64), list(self.indices))
        return []

    def _goodbye(self, state: State, goodbye: pb.Goodbye) -> list[Action]:
        reason = printable(goodbye.reason, 1024)
        if goodbye.outcome == pb.FAILED:
            close = Close(Ending.FAILED, f"the coordinator ended the run as failed: {reason}")
        else:
            answered = state.answered if isinstance(state, (Unserved, Working)) else 0
            log.info("coordinator says goodbye (%d tasks answered in the last run): %s", answered, reason)
            close = Close(Ending.DONE, reason)
        self.state = Closed(close.ending, close.reason)
        return [close]

    @staticmethod
    def _before_welcome(instruction: pb.Instruction, kind: str) -> str:
        if kind == "task":  # (a task needs its RunSpec too, which cannot have come either)
            run_id = printable(instruction.task.run_id, 64)
            return f"task for run {run_id!r} before its RunSpec: the coordinator sent it before its Welcome"
        return f"the coordinator sent {_AFTER_WELCOME[kind]} before its Welcome"

    # -- tasks --------------------------------------------------------------------------------

    def _task(self, state: State, instruction: Instruction, task: pb.Task, inline: memoryview | None) -> list[Action]:
        """A task: answered at once when its payload came inline (`inline`, if read by hand), else its
        chunks are awaited."""
        payload = task.payload if inline is None else inline  # (each read of a bytes field is a copy)
        if payload or task.payload_length == 0:
            element = state.element if isinstance(state, (Unserved, Working)) else wire.FLOAT64
            wire.check_inline(task.payload_length, payload, element)  # refused before the task is kept
            return self._execute(state, instruction, task, payload, task.round_id)
        if not isinstance(state, Working):
            return self._refuse(instruction, self._not_running(state, task.run_id))
        if task.run_id != state.run_id:
            return self._refuse(instruction, self._not_running(state, task.run_id))
        # z and a control at most; a local computation's z and named arrays
        limit = (COMPUTE_PAYLOAD_LIMIT if task.kind == pb.COMPUTE else 2) * state.dimension
        if task.payload_length > limit:
            return self._refuse(
                instruction,
                f"the coordinator sent a task of {task.payload_length} {state.element.name} entries; "
                f"run {state.name!r} allows at most {limit}",
            )
        size = state.element.itemsize * task.payload_length
        if len(self._payload) < size:
            self._payload = memoryview(lasting((size,), np.uint8))  # type: ignore[arg-type]  # (a buffer)
        assembler = wire.Assembler(size, into=self._payload, min_piece=wire.min_piece(state.joined.chunk_bytes))
        state.assembly = Assembly(task, assembler)
        return []

    def _chunk(self, state: State, instruction: Instruction, chunk: pb.Chunk | wire.RawChunk) -> list[Action]:
        assembly = state.assembly if isinstance(state, Working) else None
        if assembly is None:
            return self._refuse(instruction, "the coordinator sent a chunk outside a task")
        assembly.assembler.add(chunk)
        if not assembly.assembler.done:
            return []
        assert isinstance(state, Working)
        state.assembly = None
        return self._execute(state, instruction, assembly.message, assembly.assembler.payload(), 0, own=True)

    def _execute(
        self,
        state: State,
        instruction: Instruction,
        message: pb.Task,
        payload: bytes | memoryview,
        failure_round: int,
        own: bool = False,
    ) -> list[Action]:
        """A task checked and decoded for the hosted clients to answer; `own`: its payload is this session's
        buffer, which the worker may write over."""
        if not isinstance(state, Working) or message.run_id != state.run_id:
            return self._refuse(instruction, self._not_running(state, message.run_id))
        task = wire.decode_task(message, payload, state.dimension, writable=own, dtype=state.element)
        if isinstance(task, ComputeTask) and find_computation(task.name) is None:
            return self._refuse(instruction, str(UnknownComputation(task.name)))
        if isinstance(task, EvaluateTask) and (not state.metrics or task.metric_names != state.metrics):
            return self._refuse(instruction, self._other_metrics(state, task.metric_names))
        # Only the clients the task names take part, when it names some (a sampled round).
        clients = tuple(message.client_indices) or None
        if clients is not None:
            named = set(clients)
            if not named <= set(self.indices):
                return self._refuse(instruction, f"the task names clients {some(clients)}, not all hosted here")
            if len(named) < len(clients):  # each would be computed and sent again: an answer of any size
                return self._refuse(instruction, f"the task names clients {some(clients)}, some more than once")
        return [Compute(message, task, clients, failure_round=failure_round)]

    @staticmethod
    def _other_metrics(state: Working, asked: tuple[str, ...]) -> str:
        """The refusal of an evaluation task whose metrics are not the run's problem's (the answer's layout)."""
        if not state.metrics:
            return (
                f"the coordinator sent an evaluation task for run {state.name!r}, "
                "whose problem has no evaluation metrics (no held-out data)"
            )
        return (
            f"the coordinator asked run {state.name!r} for the metrics {printable(repr(list(asked)), 200)}; "
            f"its problem computes {list(state.metrics)}"
        )

    @staticmethod
    def _not_running(state: State, run_id: str, what: str = "task") -> str:
        """Why a message (`what`: a task, a key directory, an unmask request) of run `run_id` is refused: it
        does not belong to the run this process announced itself Ready for, or that run could not start."""
        if isinstance(state, Unserved) and run_id == state.run.run_id:
            return f"{what} for run {printable(run_id, 64)!r}, which this process could not start"
        return f"{what} for run {printable(run_id, 64)!r} before its RunSpec"

    # -- secure aggregation ----------------------------------------------------------------

    def _key_directory(self, state: State, instruction: Instruction, directory: pb.KeyDirectory) -> list[Action]:
        """Pairwise keys to agree on with every other client; a replayed, stale or forged directory ends the
        session, as a coordinator that sends one is not following the protocol."""
        if not isinstance(state, Working) or directory.run_id != state.run_id:
            return self._refuse(instruction, self._not_running(state, directory.run_id, "key directory"))
        if not state.secure:
            return self._refuse(instruction, f"a key directory for run {state.name!r}, which has no secure aggregation")
        try:
            keys = messages.read_key_directory(directory)
        except (SecAggError, wire.WireError) as exc:
            return self._refuse(instruction, f"refused the coordinator's key directory: {exc}")
        return [AgreeKeys(int(directory.epoch), keys)]

    def _unmask(self, state: State, instruction: Instruction, request: pb.UnmaskRequest) -> list[Action]:
        if not isinstance(state, Working) or request.run_id != state.run_id:
            return self._refuse(instruction, self._not_running(state, request.run_id, "unmask request"))
        if not state.secure or request.client not in self.indices:
            return self._refuse(instruction, f"an unmask request for client {request.client}, not hosted here")
        return [Unmask(request)]

    # -- results in ---------------------------------------------------------------------------

    def loaded(self, result: Loaded | Refusal, now: float) -> list[Action]:
        """The RunSpec's data loaded (or why not): the Ready to send."""
        state = self.state
        assert isinstance(state, Loading), f"a run loaded while {type(state).__name__}"
        run = state.run
        name = printable(run.run_id, 64)
        if isinstance(result, Refusal):
            self.state = Unserved(state.joined, run, ELEMENTS.get(run.element_type, wire.FLOAT64), state.answered)
            log.error("cannot serve run %s: %s", name, printable(result.reason, 1024))
            return [Send([pb.ClientMessage(ready=pb.Ready(run_id=run.run_id, error=result.reason))])]
        element = ELEMENTS[run.element_type]
        self.state = Working(
            state.joined,
            run,
            run.run_id,
            name,
            element,
            result.dimension,
            result.metrics,
            result.secure,
            result.lone,
            now,
        )
        log.info(
            "run %s: clients %s ready (dimension %d; %s)",
            name,
            list(self.indices),
            result.dimension,
            result.numeric_stack,
        )
        ready = pb.Ready(
            run_id=run.run_id,
            dimension=result.dimension,
            sample_counts=result.sample_counts,
            numeric_stack=result.numeric_stack,
            public_keys=result.public_keys,
            element_type=run.element_type,
        )
        return [Send([pb.ClientMessage(ready=ready)])]

    def computed(self, action: Compute, result: Iterable[bytes] | Refusal, now: float) -> list[Action]:
        """A task's answer made (or refused): send it; a line in the log every `heartbeat_s` of the run."""
        state = self.state
        assert isinstance(state, Working), f"a task answered while {type(state).__name__}"
        if isinstance(result, Refusal):
            return self._refuse_round(action.failure_round, result.reason)
        state.answered += 1
        if now - state.said >= self.heartbeat_s:
            state.said = now
            log.info("run %s: %d tasks answered, now at round %d", state.name, state.answered, action.message.round_id)
        return [Send(result)]

    def agreed(self, action: AgreeKeys, result: Refusal | None) -> list[Action]:
        """Pairwise keys agreed (or the directory refused: the session ends)."""
        state = self.state
        assert isinstance(state, Working), f"keys agreed while {type(state).__name__}"
        if result is not None:
            return self._refuse_round(0, result.reason)
        log.info(
            "run %s: agreed pairwise keys with %d clients (epoch %d)", state.name, len(action.keys) - 1, action.epoch
        )
        return []

    @staticmethod
    def unmasked(reply: bytes) -> list[Action]:
        """A hosted client's unmasking reply (or its refusal, which names the round): send it."""
        return [Send([reply])]

    # -- the end --------------------------------------------------------------------------------

    def failure(self, instruction: Instruction, error: Exception) -> pb.ClientMessage:
        """What to tell the coordinator when carrying out this instruction's actions raised `error`: this
        client cannot go on, and why (Failure: the coordinator fails the round at once, naming it)."""
        # The project's own errors name the fault in their text; any other is named by its type too.
        reason = str(error) if isinstance(error, ClientError | ValueError) else f"{type(error).__name__}: {error}"
        return self._failure(_round_of(instruction), reason)

    def _failure(self, round_id: int, reason: str) -> pb.ClientMessage:
        state = self.state
        run_id = state.run.run_id if isinstance(state, (Loading, Unserved, Working)) else ""
        return pb.ClientMessage(failure=pb.Failure(run_id=run_id, round_id=round_id, reason=reason))

    def _refuse(self, instruction: Instruction, reason: str) -> list[Action]:
        """This client cannot go on with what the coordinator sent: the coordinator is told why, and the
        session ends with it."""
        return self._close(instruction, reason, reason)

    def _close(self, instruction: Instruction, reason: str, told: str) -> list[Action]:
        return self._ended(self._failure(_round_of(instruction), told), reason)

    def _refuse_round(self, round_id: int, reason: str) -> list[Action]:
        return self._ended(self._failure(round_id, reason), reason)

    @staticmethod
    def _ended(failure: pb.ClientMessage, reason: str) -> list[Action]:
        # (The state stays as it was: what was refused changed nothing. The driver ends the stream.)
        return [Close(Ending.REFUSED, reason, failure)]


def _round_of(instruction: Instruction) -> int:
    """The round a Failure names for an instruction: its task's, or 0 (a Chunk, or no task)."""
    if isinstance(instruction, wire.InlineTask):
        instruction = instruction.instruction
    return instruction.task.round_id if isinstance(instruction, pb.Instruction) and instruction.HasField("task") else 0
