"""The client runtime: dial the coordinator, then answer its tasks until it says goodbye."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass

import grpc

from fedsaddle.common import wire
from fedsaddle.common.problems import PaperRegressionSpec, QuadraticGameSpec, make_shards
from fedsaddle.common.tasks import Answer
from fedsaddle.common.worker import Worker
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc

log = logging.getLogger("fedsaddle.client")

# The most a coordinator may ask one chunk to be; the receive limit follows from it.
MAX_CHUNK_BYTES = 64 << 20


@dataclass
class ClientOptions:
    coordinator: str
    indices: tuple[int, ...]
    name: str = ""
    connect_timeout_s: float = 60.0
    credentials: grpc.ChannelCredentials | None = None  # TLS (and client certificate)
    metadata: tuple[tuple[str, str], ...] = ()  # e.g. the bearer token
    server_name: str | None = None  # expected name in the coordinator's certificate


class ClientError(RuntimeError):
    """The session could not start or ended abnormally."""


class _Session:
    """State of one session: the welcome, the current run's worker, a task being assembled."""

    def __init__(self, options: ClientOptions, stub: pb_grpc.CoordinatorStub) -> None:
        self.options = options
        self.stub = stub
        self.session_id = ""
        self.chunk_bytes = 0
        self.run: pb.RunSpec | None = None
        self.worker: Worker | None = None
        self._worker_key: tuple[str, int, float] | None = None
        self._task: pb.Task | None = None
        self._assembler: wire.Assembler | None = None

    async def handle(self, instruction: pb.Instruction) -> bool:
        """Act on one instruction; False when the session is over."""
        kind = instruction.WhichOneof("body")
        if kind == "welcome":
            self.session_id = instruction.welcome.session_id
            self.chunk_bytes = instruction.welcome.chunk_bytes
            log.info(
                "joined federation %s as clients %s", instruction.welcome.federation_id, list(self.options.indices)
            )
        elif kind == "run":
            self._start_run(instruction.run)
        elif kind == "task":
            task = instruction.task
            if task.payload or task.payload_length == 0:
                await self._execute(task, task.payload)
            else:
                self._task, self._assembler = task, wire.Assembler(8 * task.payload_length)
        elif kind == "chunk":
            if self._task is None or self._assembler is None:
                raise ClientError("the coordinator sent a chunk outside a task")
            self._assembler.add(instruction.chunk)
            if self._assembler.done:
                task, payload = self._task, self._assembler.buffer
                self._task = self._assembler = None
                await self._execute(task, payload)
        elif kind == "goodbye":
            log.info("coordinator says goodbye: %s", instruction.goodbye.reason)
            return False
        return True

    def _start_run(self, run: pb.RunSpec) -> None:
        self.run = run
        key = (run.problem_json, run.seed, run.gradient_noise)
        if key == self._worker_key:
            return
        spec = _parse_problem(run.problem_json)
        shards = make_shards(spec, run.seed, self.options.indices)
        if shards.dimension != run.dimension:
            raise ClientError(f"problem has dimension {shards.dimension}, coordinator says {run.dimension}")
        self.worker = Worker(shards, run.seed, run.gradient_noise)
        self._worker_key = key
        log.info("run %s: built shards %s (dimension %d)", run.run_id, list(self.options.indices), run.dimension)

    async def _execute(self, message: pb.Task, payload: bytes | bytearray) -> None:
        if self.run is None or self.worker is None or message.run_id != self.run.run_id:
            raise ClientError(f"task for run {message.run_id!r} before its RunSpec")
        task = wire.decode_task(message, payload, int(self.run.dimension))
        answer: Answer = self.worker.execute(task, message.round_id)
        parts = wire.encode_answer(self.session_id, message.run_id, message.round_id, answer, self.chunk_bytes)
        metadata = self.options.metadata or None
        try:
            if len(parts) == 1:
                await self.stub.SubmitOne(parts[0].answer, metadata=metadata)
            else:
                await self.stub.Submit(iter(parts), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            # The coordinator refused this answer (e.g. the round timed out meanwhile);
            # it decides what happens next, so say so and keep the session.
            log.warning("round %d: answer refused: %s: %s", message.round_id, exc.code().name, exc.details())


def _parse_problem(text: str) -> PaperRegressionSpec | QuadraticGameSpec:
    from pydantic import TypeAdapter

    from fedsaddle.common.problems import ProblemSpec

    adapter: TypeAdapter[PaperRegressionSpec | QuadraticGameSpec] = TypeAdapter(ProblemSpec)
    return adapter.validate_json(text)


async def run_client(options: ClientOptions) -> None:
    """Serve one session; returns when the coordinator says goodbye, raises ClientError otherwise."""
    channel_options = [
        *wire.grpc_options(MAX_CHUNK_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if options.server_name:
        channel_options.append(("grpc.ssl_target_name_override", options.server_name))  # type: ignore[arg-type]
    if options.credentials is not None:
        channel = grpc.aio.secure_channel(options.coordinator, options.credentials, options=channel_options)
    else:
        channel = grpc.aio.insecure_channel(options.coordinator, options=channel_options)
    async with channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), options.connect_timeout_s)
        except TimeoutError:
            raise ClientError(
                f"cannot reach the coordinator at {options.coordinator} within {options.connect_timeout_s:g} s"
            ) from None
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        session = _Session(options, stub)
        request = pb.JoinRequest(
            protocol_version=pb.PROTOCOL_VERSION_1,
            client_indices=list(options.indices),
            client_name=options.name or f"{socket.gethostname()}:{os.getpid()}",
        )
        call = stub.Join(request, metadata=options.metadata or None)
        try:
            async for instruction in call:
                if not await session.handle(instruction):
                    return
        except grpc.aio.AioRpcError as exc:
            raise ClientError(f"session with {options.coordinator} ended: {exc.code().name}: {exc.details()}") from None
        except wire.WireError as exc:
            raise ClientError(f"malformed instruction from the coordinator: {exc}") from None
        raise ClientError(f"the coordinator at {options.coordinator} closed the session without a goodbye")


def serve(options: ClientOptions) -> None:
    """Run the session; SIGTERM ends it cleanly (the channel closes, the coordinator is told)."""

    async def session() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await run_client(options)
        except asyncio.CancelledError:
            log.info("stopped by SIGTERM; session closed")

    asyncio.run(session())
