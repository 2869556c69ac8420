"""A client process's side of the protocol, free of I/O: instructions in, messages out.

`ClientSession.handle` takes each Instruction from the coordinator and returns
the ClientMessages to send back (a Ready after a RunSpec, an Answer and its
Chunks after a Task). It never touches a socket, so the runtime (service.py)
and the tests drive it the same way.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from fedsaddle.common import blas, wire
from fedsaddle.common.attacks import Attack, corrupt_answer
from fedsaddle.common.computations import find_computation
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.indices import some
from fedsaddle.common.memory import lasting, trim
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import DataError, ProblemNotFound, parse_spec, problem_class
from fedsaddle.common.secagg import SecAggError, messages
from fedsaddle.common.secagg.party import Party
from fedsaddle.common.secagg.rows import mask_answer, row_length
from fedsaddle.common.secagg.settings import check_bound
from fedsaddle.common.tasks import COMPUTE_PAYLOAD_LIMIT, Answer, ComputeTask, EvaluateTask, Task
from fedsaddle.common.text import RefusalLog, printable
from fedsaddle.common.worker import ShardCache, UnknownComputation, Worker
from fedsaddle.proto import fedsaddle_pb2 as pb

if TYPE_CHECKING:
    from fedsaddle.client.monitor import ClientStats

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
_ELEMENTS: dict[int, wire.Element] = {pb.FLOAT64: wire.FLOAT64, pb.FLOAT32: wire.FLOAT32}


class ClientError(RuntimeError):
    """The session could not start, or ended abnormally (the message says why)."""


class RunFailed(ClientError):
    """The coordinator ended the run as failed (its Goodbye says why)."""


class ClientSession:
    """The state of one session: the welcome, the current run and its worker, a task being assembled."""

    def __init__(
        self,
        indices: tuple[int, ...],
        shards: ShardCache | None = None,
        attack: Attack | None = None,
        stats: ClientStats | None = None,
    ) -> None:
        self.indices = indices
        self.attack = attack  # research and tests: lie about every algorithm answer (common/attacks.py)
        self.stats = stats  # what this process's monitor counts (client/monitor.py), when it has one
        self._began = 0.0  # when the instruction being handled came (counted when there are stats)
        self._answers: wire.AnswerWriter | None = None  # made by the Welcome, with its chunk size
        self.run: pb.RunSpec | None = None
        self._run_id, self._dimension = "", 0  # the run's, read once (not per task)
        self._element: wire.Element = wire.FLOAT64  # the run's element type (RunSpec.element_type)
        self._run_name = ""  # its id as logs show it: the coordinator's text, bounded and escaped
        self._metrics: tuple[str, ...] = ()  # its problem's evaluation metrics: an EVALUATE's answer layout
        self._refusals = RefusalLog(log)  # a coordinator's flood of Rejected costs the log a few lines
        self.worker: Worker | None = None
        self.shards = shards or ShardCache(size=2)  # holds the clients' data files and the trusted plugins
        self.goodbye: pb.Goodbye | None = None
        self._task: pb.Task | None = None
        self._assembler: wire.Assembler | None = None
        # Chunked payloads are assembled here, task after task (a buffer of its own: common/memory.py).
        self._payload: bytearray | memoryview = bytearray()
        self._federation_size = 0  # n, from the Welcome
        # A line in the log every `heartbeat_s` of a run, so that a site's operator sees it work.
        self.heartbeat_s = HEARTBEAT_S
        self._tasks, self._said = 0, time.monotonic()
        # Secure aggregation (docs/privacy.md): one party per hosted client, and each one's own weight.
        self._parties: dict[int, Party] = {}
        # (round, its clients, row length) of the last masked round, and the round expected after its unmasking:
        # its masks are made while the coordinator unmasks and computes (prepare_next).
        self._last_masked: tuple[int, tuple[int, ...], int] | None = None
        self._upcoming: tuple[int, tuple[int, ...], int] | None = None
        self._weights: dict[int, float] | None = None
        self._dp: DpSettings | None = None  # differential privacy's clipping and this process's noise
        self._lone: LoneGradient | None = None  # the usual small round's task, in a few calls (see the class)

    @property
    def chunk_bytes(self) -> int:
        """The Welcome's chunk size (0 before it), with which answers are cut."""
        return 0 if self._answers is None else self._answers.chunk_bytes

    @property
    def over(self) -> bool:
        return self.goodbye is not None

    def hello(self, name: str) -> pb.ClientMessage:
        return pb.ClientMessage(
            hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=list(self.indices), client_name=name)
        )

    def handle(
        self, instruction: pb.Instruction | wire.RawChunk | wire.InlineTask
    ) -> Iterable[pb.ClientMessage | bytes]:
        """Act on one instruction (a Chunk, or a Task's inline payload, may come read by hand:
        wire.read_chunk, wire.read_inline_task); the messages to send in reply, as protobuf messages or
        already serialized."""
        if self.stats is not None:
            self._began = time.perf_counter()
        lone = self._lone
        if lone is not None and type(instruction) is pb.Instruction and instruction.HasField("task"):
            task = instruction.task
            answer = lone.answer(task)
            if answer is not None:
                self._answered(task.round_id)
                return answer
        if isinstance(instruction, wire.RawChunk):
            return self._chunk(instruction)
        inline = None
        if isinstance(instruction, wire.InlineTask):
            instruction, inline = instruction
        kind = instruction.WhichOneof("body")
        if self._answers is None and kind in _AFTER_WELCOME:
            # Nothing of a run can be served before the Welcome gives the chunk size: an answer cut into
            # chunks of no size would never end (a hostile or broken coordinator's first message).
            raise ClientError(self._before_welcome(instruction, kind))
        if kind == "task":
            return self._task_header(instruction.task, inline)
        if kind == "welcome":
            if self._answers is not None:  # one per session: a second would change the chunk size under a run
                during = f" during run {self._run_name!r}" if self.run is not None else ""
                raise ClientError(f"the coordinator sent a second Welcome{during}")
            try:
                self._answers = wire.AnswerWriter(wire.check_chunk_bytes(instruction.welcome.chunk_bytes))
            except ValueError as exc:
                raise ClientError(f"the coordinator's Welcome is malformed: {exc}") from None
            self._federation_size = instruction.welcome.num_clients
            federation = printable(instruction.welcome.federation_id, 64)
            log.info("joined federation %s as clients %s", federation, list(self.indices))
            return []
        if kind == "run":
            return [pb.ClientMessage(ready=self._start_run(instruction.run))]
        if kind == "chunk":
            return self._chunk(instruction.chunk)
        if kind == "keys":
            self._key_directory(instruction.keys)
            return []
        if kind == "unmask":
            return [self._unmask(instruction.unmask)]
        if kind == "rejected":
            rejected = instruction.rejected
            code = pb.RejectCode.Name(rejected.code) if rejected.code in pb.RejectCode.values() else rejected.code
            self._refusals.warn(
                "round %d: answer refused: %s: %s", rejected.round_id, code, printable(rejected.details, 1024)
            )
            return []
        if kind == "goodbye":
            self.goodbye = instruction.goodbye
            reason = printable(instruction.goodbye.reason, 1024)
            if instruction.goodbye.outcome == pb.FAILED:
                raise RunFailed(f"the coordinator ended the run as failed: {reason}")
            log.info("coordinator says goodbye (%d tasks answered in the last run): %s", self._tasks, reason)
            return []
        # (None: an empty Instruction, or one of a kind a later protocol added, which protobuf keeps aside)
        raise ClientError(
            "unknown instruction: none of the kinds this client knows (an empty one, or a later protocol's)"
        )

    def failure(
        self, instruction: pb.Instruction | wire.RawChunk | wire.InlineTask, error: Exception
    ) -> pb.ClientMessage:
        """What to tell the coordinator when `handle` raised `error` on `instruction`: this client cannot go
        on, and why (Failure: the coordinator fails the round at once, naming it)."""
        if isinstance(instruction, wire.InlineTask):
            instruction = instruction.instruction
        task = instruction.task if isinstance(instruction, pb.Instruction) and instruction.HasField("task") else None
        # The project's own errors name the fault in their text; any other is named by its type too.
        reason = str(error) if isinstance(error, ClientError | ValueError) else f"{type(error).__name__}: {error}"
        failure = pb.Failure(run_id=self._run_id, round_id=task.round_id if task is not None else 0, reason=reason)
        return pb.ClientMessage(failure=failure)

    @staticmethod
    def _before_welcome(instruction: pb.Instruction, kind: str) -> str:
        if kind == "task":  # (a task needs its RunSpec too, which cannot have come either)
            run_id = printable(instruction.task.run_id, 64)
            return f"task for run {run_id!r} before its RunSpec: the coordinator sent it before its Welcome"
        return f"the coordinator sent {_AFTER_WELCOME[kind]} before its Welcome"

    def _task_header(self, task: pb.Task, inline: memoryview | None = None) -> Iterable[pb.ClientMessage | bytes]:
        """A task: executed at once when its payload came inline (`inline`, if read by hand), else its
        chunks are awaited."""
        payload = task.payload if inline is None else inline  # (each read of a bytes field is a copy)
        if payload or task.payload_length == 0:
            wire.check_inline(task.payload_length, payload, self._element)  # refused before the task is kept
            return self._execute(task, payload)
        self._check_run(task.run_id)
        assert self.run is not None
        # z and a control at most; a local computation's z and named arrays
        limit = (COMPUTE_PAYLOAD_LIMIT if task.kind == pb.COMPUTE else 2) * self._dimension
        if task.payload_length > limit:
            raise ClientError(
                f"the coordinator sent a task of {task.payload_length} {self._element.name} entries; "
                f"run {self._run_name!r} allows at most {limit}"
            )
        size = self._element.itemsize * task.payload_length
        if len(self._payload) < size:
            self._payload = memoryview(lasting((size,), np.uint8))  # type: ignore[arg-type]  # (a buffer)
        self._task, self._assembler = (
            task,
            wire.Assembler(size, into=self._payload, min_piece=wire.min_piece(self.chunk_bytes)),
        )
        return []

    def _chunk(self, chunk: pb.Chunk | wire.RawChunk) -> Iterable[pb.ClientMessage | bytes]:
        if self._task is None or self._assembler is None:
            raise ClientError("the coordinator sent a chunk outside a task")
        self._assembler.add(chunk)
        if not self._assembler.done:
            return []
        task, payload = self._task, self._assembler.payload()
        self._task = self._assembler = None
        return self._execute(task, payload, own=True)

    def _start_run(self, run: pb.RunSpec) -> pb.Ready:
        """Load this process's clients' data for the run; Ready says what it gives, or why it cannot."""
        self.run, self.worker, self._lone = run, None, None
        gc.unfreeze()  # the last run's objects (frozen below) go back to the collector with the run
        self._run_id, self._dimension = run.run_id, int(run.dimension)
        self._run_name = printable(run.run_id, 64)
        self._element = wire.FLOAT64
        try:
            if run.element_type not in _ELEMENTS:
                raise ValueError(
                    f"the coordinator's RunSpec.element_type is {run.element_type}, which this client does not know "
                    "(it reads FLOAT64 and FLOAT32)"
                )
            self._element = _ELEMENTS[run.element_type]
            try:
                problem = json.loads(run.problem_json)
            except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deeply to parse)
                raise ValueError(f"the coordinator's problem is not JSON: {exc}") from None
            spec = parse_spec(problem, self.shards.trusted)
            missing = [name for name in run.computations if find_computation(name) is None]
            if missing:
                raise ValueError(str(UnknownComputation(missing[0])))
            n = self._federation_size
            if n and spec.num_clients != n:  # a synthetic problem's data generation scales with it
                raise ValueError(f"the run's problem has {spec.num_clients} clients; the federation has {n}")
            seed = run.synthetic_seed if run.HasField("synthetic_seed") else None
            shards = self.shards.get(spec, seed, self.indices, "samples" if run.want_sample_counts else "uniform")
            self._metrics = tuple(problem_class(spec.name, spec.plugin, self.shards.trusted).metric_names)
            counts: list[int] = []
            if run.want_sample_counts:
                sample_counts = getattr(shards, "sample_counts", None)
                if sample_counts is None:
                    raise ValueError(f"problem {spec.name} has no per-client sample counts to weight by")
                counts = sample_counts()
            worker = Worker(
                shards,
                run.noise_seed,
                run.gradient_noise,
                reuse_answers=True,
                scratch_tasks=True,
                element=self._element,
            )
            self._parties, self._weights, self._dp, keys = {}, None, None, []
            if run.HasField("dp"):
                clip, multiplier = run.dp.clip, run.dp.noise_multiplier
                if not (math.isfinite(clip) and clip > 0 and math.isfinite(multiplier) and multiplier > 0):
                    raise ValueError(f"differential privacy needs a finite clip and noise multiplier > 0, got {run.dp}")
                if not run.HasField("secure_aggregation"):
                    raise ValueError("the coordinator asks for differential privacy's noise without secure aggregation")
                self._dp = DpSettings(clip, multiplier)
            if run.HasField("secure_aggregation") and self._element != wire.FLOAT64:
                raise ValueError("the coordinator asks for secure aggregation in a FLOAT32 run; its rows are float64's")
            if run.HasField("secure_aggregation"):
                secure = run.secure_aggregation
                settings = messages.read_settings(secure)
                check_bound(max(n, len(self.indices), 2), settings.bound, settings.scale_bits)
                self._parties = {i: Party(i, run.run_id, settings) for i in self.indices}
                keys = [self._parties[i].public_key for i in self.indices]
                if secure.weigh_by_samples:  # each client weighs its own row; the counts never leave
                    sample_counts = getattr(shards, "sample_counts", None)
                    if sample_counts is None:
                        raise ValueError(f"problem {spec.name} has no per-client sample counts to weight by")
                    self._weights = dict(zip(self.indices, (float(c) for c in sample_counts()), strict=True))
        except ValidationError as exc:
            return self._cannot(run, f"the coordinator's problem does not validate here: {exc.errors()[0]['msg']}")
        except (ProblemNotFound, DataError, ValueError) as exc:
            return self._cannot(run, str(exc))
        except MemoryError as exc:  # the problem's size is the coordinator's to choose, this machine's memory is not
            return self._cannot(run, f"not enough memory for this process's clients' data: {exc}")
        self.worker = worker
        # Making the data left its temporaries' pages in the heaps (tens of MiB at d = 1e6): hand them back
        # before the first task, whose buffers are not placed there (common/memory.py, `lasting`).
        trim()
        # What lives as long as the run (modules, the worker, its data, the parties) is set aside from the
        # collector, so that the full collection of the periodic trim (every 15 s) does not walk it again and
        # again: its cost then stays small whatever the run's size (figures: docs/privacy.md, "Cost").
        # Unreferenced objects are still freed; only reference cycles among them wait for the next run's unfreeze.
        gc.freeze()
        # Tasks are bounded by what the data gives, not by what the RunSpec claims: a coordinator that
        # said a trillion and went on despite this Ready would have this process allocate terabytes.
        self._dimension = shards.dimension
        # Its answer goes inline as protobuf writes it: within the Welcome's chunk size (a longer one goes in
        # Chunks) and below BY_HAND_ABOVE (a larger one is written by hand). (Asked last: the worker sets its
        # answer buffer aside for it.)
        inline = 8 * self._dimension <= self.chunk_bytes and 8 * self._dimension < wire.BY_HAND_ABOVE
        inline = inline and self._element == wire.FLOAT64  # (its bytes are float64's)
        assert self._answers is not None  # (the Welcome came before the run)
        self._answers.dtype = self._element
        gradient = worker.lone_gradient() if inline and not self._parties and self.attack is None else None
        if gradient is not None:
            self._lone = LoneGradient(
                run.run_id, worker.indices[0], self._dimension, gradient, worker.answer, self._answers
            )
        self._tasks, self._said = 0, time.monotonic()
        stack = blas.numeric_stack()
        log.info(
            "run %s: clients %s ready (dimension %d; %s)", self._run_name, list(self.indices), shards.dimension, stack
        )
        return pb.Ready(
            run_id=run.run_id,
            dimension=shards.dimension,
            sample_counts=counts,
            numeric_stack=stack,
            public_keys=keys,
            element_type=run.element_type,
        )

    def _other_metrics(self, asked: tuple[str, ...]) -> str:
        """The error for an evaluation task whose metrics are not the run's problem's (the answer's layout)."""
        if not self._metrics:
            return (
                f"the coordinator sent an evaluation task for run {self._run_name!r}, "
                "whose problem has no evaluation metrics (no held-out data)"
            )
        return (
            f"the coordinator asked run {self._run_name!r} for the metrics {printable(repr(list(asked)), 200)}; "
            f"its problem computes {list(self._metrics)}"
        )

    def _cannot(self, run: pb.RunSpec, reason: str) -> pb.Ready:
        log.error("cannot serve run %s: %s", self._run_name, printable(reason, 1024))
        return pb.Ready(run_id=run.run_id, error=reason)

    def _check_run(self, run_id: str, what: str = "task") -> None:
        """ClientError unless a message (`what`: a task, a key directory, an unmask request) of run `run_id`
        belongs to the run this process announced itself Ready for."""
        if self.run is None or run_id != self._run_id:
            raise ClientError(f"{what} for run {printable(run_id, 64)!r} before its RunSpec")
        if self.worker is None:
            raise ClientError(f"{what} for run {self._run_name!r}, which this process could not start")

    def _execute(self, message: pb.Task, payload: bytes | memoryview, own: bool = False) -> Iterable[bytes]:
        """Run a task; `own`: its payload is this session's buffer, which the worker may write over."""
        run_id = message.run_id
        if run_id != self._run_id or self.worker is None:  # (_check_run's test, without a call per task)
            self._check_run(run_id)
        assert self.worker is not None
        task = wire.decode_task(message, payload, self._dimension, writable=own, dtype=self._element)
        if isinstance(task, ComputeTask) and find_computation(task.name) is None:
            raise ClientError(str(UnknownComputation(task.name)))
        if isinstance(task, EvaluateTask) and (not self._metrics or task.metric_names != self._metrics):
            raise ClientError(self._other_metrics(task.metric_names))
        # Only the clients the task names take part, when it names some (a sampled round).
        clients = tuple(message.client_indices) or None
        if clients is not None:
            named = set(clients)
            if not named <= set(self.indices):
                raise ClientError(f"the task names clients {some(clients)}, not all hosted here")
            if len(named) < len(clients):  # each would be computed and sent again: an answer of any size
                raise ClientError(f"the task names clients {some(clients)}, some more than once")
        round_id = message.round_id
        if self._parties:
            answer = self._masked(message, task, clients)
        else:
            assert self._answers is not None  # (a run has begun: the Welcome came before it)
            answer = self._answers.encode(
                run_id, round_id, self._lie(task, self.worker.execute(task, round_id, clients), round_id)
            )
        self._answered(round_id)
        return answer

    def _lie(self, task: Task, answer: Answer, round_id: int) -> Answer:
        """The answer as this process sends it: its own, unless it simulates a Byzantine client (never on
        held-out evaluation)."""
        if self.attack is None or isinstance(task, EvaluateTask):
            return answer
        assert self.run is not None
        return corrupt_answer(self.attack, answer, self.run.noise_seed, round_id)

    def _answered(self, round_id: int) -> None:
        """Count a task answered; a line in the log every `heartbeat_s`."""
        self._tasks += 1
        if self.stats is not None:  # (from the instruction that completed the task to its answer made)
            self.stats.answered(time.perf_counter() - self._began)
        now = time.monotonic()
        if now - self._said >= self.heartbeat_s:
            self._said = now
            log.info("run %s: %d tasks answered, now at round %d", self._run_name, self._tasks, round_id)

    # -- secure aggregation ----------------------------------------------------------------

    def _key_directory(self, directory: pb.KeyDirectory) -> None:
        """Agree on pairwise keys with every other client; a replayed, stale or forged directory ends
        the session (ClientError), as a coordinator that sends one is not following the protocol."""
        self._check_run(directory.run_id, "key directory")
        if not self._parties:
            raise ClientError(f"a key directory for run {self._run_name!r}, which has no secure aggregation")
        try:
            keys = messages.read_key_directory(directory)
            for party in self._parties.values():
                party.agree(int(directory.epoch), keys)
        except (SecAggError, wire.WireError) as exc:
            raise ClientError(f"refused the coordinator's key directory: {exc}") from None
        log.info(
            "run %s: agreed pairwise keys with %d clients (epoch %d)", self._run_name, len(keys) - 1, directory.epoch
        )

    def _masked(self, message: pb.Task, task: Task, clients: tuple[int, ...] | None) -> Iterable[bytes]:
        """The task's answer as masked rows, one per answering client, each masked by its own party."""
        assert self.worker is not None
        round_clients = tuple(int(i) for i in message.round_clients) or tuple(range(self._federation_size))
        answer = self._lie(task, self.worker.execute(task, message.round_id, clients), message.round_id)
        self._last_masked = (message.round_id, round_clients, row_length(task, self._dimension))
        self._upcoming = None
        try:
            masked = mask_answer(
                self._parties, answer, task, message.round_id, 0, round_clients, self._weights, self._dp
            )
        except SecAggError as exc:  # the coordinator asked for a round that cannot be summed safely
            raise ClientError(f"refused to answer: {exc}") from None
        if masked.diverged:
            log.error("run %s: %s", self._run_name, masked.reason)
        return messages.masked_answer(self._run_id, message.round_id, masked, self.chunk_bytes)

    def _unmask(self, request: pb.UnmaskRequest) -> bytes:
        """A client's part of unmasking a round, or its refusal (sent back, naming the round)."""
        self._check_run(request.run_id, "unmask request")
        party = self._parties.get(request.client)
        if party is None:
            raise ClientError(f"an unmask request for client {request.client}, not hosted here")
        try:
            reply = party.unmask(messages.read_unmask_request(request))
        except SecAggError as exc:
            log.error("run %s: client %d refuses to unmask: %s", self._run_name, request.client, exc)
            return messages.unmask_reply(self._run_id, request.round_id, request.client, None, str(exc))
        last = self._last_masked
        if last is not None and last[0] == request.round_id:  # the same clients and length are the likely next
            self._upcoming = (request.round_id + 1, last[1], last[2])
        return messages.unmask_reply(self._run_id, request.round_id, request.client, reply)

    def prepare_next(self) -> None:
        """Make the expected next round's masks now, after the unmasking replies are sent and before the
        task comes (the coordinator is unmasking and computing): the task then only adds them. A round that
        comes otherwise is masked as usual, and the masks made here are dropped."""
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None:
            return
        round_id, clients, length = upcoming
        for index, party in self._parties.items():
            if index in clients:
                party.prepare(round_id, 0, clients, length)


class LoneGradient:
    """The usual task of a small round, answered in a few calls: a gradient at z, for the one client a
    process hosts. The general path (`ClientSession._execute`: decoding, the worker's dispatch, the
    finiteness test, the answer's encoding) makes some thirty Python and numpy calls for it, and in
    place each costs several times what it costs in a loop, as the other processes take the caches
    between rounds: at d = 10 a task took 27-48 us less CPU this way (bench/README.md, *One task, few
    calls*).

    A run takes it only where the general path would do just this: one client hosted, no secure
    aggregation (nor its differential privacy), no gradient noise (Worker.lone_gradient), and answers
    small enough to go inline as protobuf writes them (within the Welcome's chunk size and below
    wire.BY_HAND_ABOVE). A task takes it only when it is a GRADIENT of the run naming no clients,
    asking no objective, with a batch of at least 1 and exactly the run's entries inline; any other
    task goes the general way, with the general path's errors. A gradient that is not a finite float64
    column of the run's length (a diverged one; a plug-in's of another shape or type) is not computed
    again: it is answered as the general path answers it (Worker.answer, then the session's
    AnswerWriter), so that shards with a state of their own see one call per task. The bytes are the
    same (tests/test_client_session.py compares them)."""

    def __init__(
        self,
        run_id: str,
        index: int,
        dimension: int,
        gradient: Callable[[Array], Array],
        general: Callable[[Array], Answer],
        writer: wire.AnswerWriter,
    ) -> None:
        self.run_id, self.dimension, self.size, self.shape = run_id, dimension, 8 * dimension, (dimension, 1)
        self.gradient, self.general, self.writer = gradient, general, writer
        self.message = pb.ClientMessage()
        header = self.message.answer  # the fields every answer of the run shares, set once
        header.run_id = run_id
        header.client_indices.append(index)
        header.payload_length = dimension

    def answer(self, task: pb.Task) -> Iterable[bytes] | None:
        """The serialized answer, or None if the task is not one this path takes (nothing computed)."""
        if (
            task.kind != pb.GRADIENT
            or task.run_id != self.run_id
            or task.payload_length != self.dimension
            or task.client_indices
        ):
            return None
        payload, params = task.payload, task.gradient
        if len(payload) != self.size or params.batch < 1 or params.want_objective:
            return None
        g = self.gradient(np.frombuffer(payload, np.float64)[:, None])
        if type(g) is np.ndarray and g.shape == self.shape and g.dtype == np.float64:
            flat = g.ravel()
            if math.isfinite(flat.dot(flat)):  # (as numeric.all_finite tests a short vector)
                header = self.message.answer
                header.round_id = task.round_id
                header.payload = g.tobytes()
                return (self.message.SerializeToString(),)
        return self.writer.encode(self.run_id, task.round_id, self.general(g))
