"""A client process's side of the protocol, free of I/O: instructions in, messages out.

`ClientSession.handle` takes each Instruction from the coordinator and returns
the ClientMessages to send back (a Ready after a RunSpec, an Answer and its
Chunks after a Task). It never touches a socket, so the runtime (service.py)
and the tests drive it the same way.
"""

from __future__ import annotations

import logging

from fedsaddle.common import wire
from fedsaddle.common.problems import PaperRegressionSpec, QuadraticGameSpec
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.proto import fedsaddle_pb2 as pb

log = logging.getLogger("fedsaddle.client")


class ClientError(RuntimeError):
    """The session could not start, or ended abnormally (the message says why)."""


class RunFailed(ClientError):
    """The coordinator ended the run as failed (its Goodbye says why)."""


def parse_problem(text: str) -> PaperRegressionSpec | QuadraticGameSpec:
    from pydantic import TypeAdapter, ValidationError

    from fedsaddle.common.problems import ProblemSpec

    adapter: TypeAdapter[PaperRegressionSpec | QuadraticGameSpec] = TypeAdapter(ProblemSpec)
    try:
        return adapter.validate_json(text)
    except ValidationError as exc:
        raise ClientError(f"the coordinator's problem is not one this client knows: {exc}") from None


class ClientSession:
    """The state of one session: the welcome, the current run and its worker, a task being assembled."""

    def __init__(self, indices: tuple[int, ...]) -> None:
        self.indices = indices
        self.chunk_bytes = 0
        self.run: pb.RunSpec | None = None
        self.worker: Worker | None = None
        self.shards = ShardCache(size=2)
        self.goodbye: pb.Goodbye | None = None
        self._task: pb.Task | None = None
        self._assembler: wire.Assembler | None = None

    @property
    def over(self) -> bool:
        return self.goodbye is not None

    def hello(self, name: str) -> pb.ClientMessage:
        return pb.ClientMessage(
            hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=list(self.indices), client_name=name)
        )

    def handle(self, instruction: pb.Instruction) -> list[pb.ClientMessage]:
        """Act on one instruction; the messages to send in reply."""
        kind = instruction.WhichOneof("body")
        if kind == "welcome":
            self.chunk_bytes = instruction.welcome.chunk_bytes
            log.info("joined federation %s as clients %s", instruction.welcome.federation_id, list(self.indices))
            return []
        if kind == "run":
            return [pb.ClientMessage(ready=self._start_run(instruction.run))]
        if kind == "task":
            task = instruction.task
            if task.payload or task.payload_length == 0:
                return self._execute(task, task.payload)
            self._task, self._assembler = task, wire.Assembler(8 * task.payload_length)
            return []
        if kind == "chunk":
            if self._task is None or self._assembler is None:
                raise ClientError("the coordinator sent a chunk outside a task")
            self._assembler.add(instruction.chunk)
            if not self._assembler.done:
                return []
            task, payload = self._task, self._assembler.payload()
            self._task = self._assembler = None
            return self._execute(task, payload)
        if kind == "rejected":
            rejected = instruction.rejected
            code = pb.RejectCode.Name(rejected.code) if rejected.code in pb.RejectCode.values() else rejected.code
            log.warning("round %d: answer refused: %s: %s", rejected.round_id, code, rejected.details)
            return []
        if kind == "goodbye":
            self.goodbye = instruction.goodbye
            if instruction.goodbye.outcome == pb.FAILED:
                raise RunFailed(f"the coordinator ended the run as failed: {instruction.goodbye.reason}")
            log.info("coordinator says goodbye: %s", instruction.goodbye.reason)
            return []
        raise ClientError(f"unknown instruction {kind!r}")

    def _start_run(self, run: pb.RunSpec) -> pb.Ready:
        self.run, self.worker = run, None
        try:
            spec = parse_problem(run.problem_json)
            if not run.HasField("synthetic_seed"):
                raise ClientError(f"problem {spec.name} needs data files, and this process was given none")
            shards = self.shards.get(spec, run.synthetic_seed, self.indices)
        except (ClientError, ValueError) as exc:
            log.error("run %s: %s", run.run_id, exc)
            return pb.Ready(run_id=run.run_id, error=str(exc))
        self.worker = Worker(shards, run.noise_seed, run.gradient_noise)
        log.info("run %s: shards %s ready (dimension %d)", run.run_id, list(self.indices), shards.dimension)
        return pb.Ready(run_id=run.run_id, dimension=shards.dimension)

    def _execute(self, message: pb.Task, payload: bytes) -> list[pb.ClientMessage]:
        if self.run is None or message.run_id != self.run.run_id:
            raise ClientError(f"task for run {message.run_id!r} before its RunSpec")
        if self.worker is None:
            raise ClientError(f"task for run {message.run_id!r}, which this process could not start")
        task = wire.decode_task(message, payload, int(self.run.dimension))
        answer = self.worker.execute(task, message.round_id)
        return wire.encode_answer(message.run_id, message.round_id, answer, self.chunk_bytes)
