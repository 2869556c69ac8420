"""The gRPC transport: client processes dial in; each round is a real exchange.

The coordinator is the gRPC server (grpc.aio, on its own event-loop thread). A
client process calls Join and keeps the instruction stream open; the coordinator
pushes RunSpecs and Tasks down it, and the client answers each Task with one
Submit call. An answer is checked completely before it is stored, so a bad one
is refused with a precise status and changes nothing; the round completes only
when every session has answered, and the answers are returned in client-index
order whatever order they arrived in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio  # public as grpc_health.v1.health.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedsaddle.common import wire
from fedsaddle.common.tasks import Answer, GradientTask, Task
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc
from fedsaddle.server.pool import Category, ClientLost, ClientPool, PoolError, RunInfo
from fedsaddle.server.transport.auth import Authenticator, Identity, Refusal

log = logging.getLogger("fedsaddle.coordinator")


class MissingClients(PoolError):
    """Not every client joined in time; the message lists the missing indices."""

    def __init__(self, missing: Sequence[int], timeout: float) -> None:
        super().__init__(f"clients {list(missing)} did not join within {timeout:g} s")
        self.missing = tuple(missing)


@dataclass(eq=False)
class Session:
    """One connected client process."""

    id: str
    indices: tuple[int, ...]
    peer: str
    name: str
    identity: Identity | None = None
    outbox: asyncio.Queue[pb.Instruction | None] = field(default_factory=asyncio.Queue)
    alive: bool = True
    closing: bool = False

    def describe(self) -> str:
        who = f"client {self.indices[0]}" if len(self.indices) == 1 else f"clients {list(self.indices)}"
        as_identity = f" as {self.identity.name!r}" if self.identity else ""
        return f"{who} ({self.name or 'unnamed'} at {self.peer}{as_identity})"


@dataclass(eq=False)
class PendingRound:
    run_id: str
    round_id: int
    want_objective: bool
    sessions: tuple[Session, ...]
    future: asyncio.Future[None]
    answers: dict[str, Answer] = field(default_factory=dict)
    bytes_up: int = 0


class Federation(pb_grpc.CoordinatorServicer):
    """The coordinator's side of every session. Lives on the server's event loop."""

    def __init__(self, num_clients: int, chunk_bytes: int, authenticator: Authenticator | None = None) -> None:
        self.num_clients = num_clients
        self.authenticator = authenticator
        self.chunk_bytes = chunk_bytes
        self.federation_id = secrets.token_hex(8)
        self.sessions: dict[str, Session] = {}
        self.owner: dict[int, Session] = {}
        self.all_joined = asyncio.Event()
        self.run: RunInfo | None = None
        self.pending: PendingRound | None = None
        self.lost: dict[int, str] = {}  # client index -> how its session ended, until it rejoins

    # -- sessions --------------------------------------------------------------------

    def live_sessions(self) -> list[Session]:
        return sorted({s for s in self.owner.values()}, key=lambda s: s.indices[0])

    def missing(self) -> list[int]:
        return [i for i in range(self.num_clients) if i not in self.owner]

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[pb.JoinRequest, pb.Instruction]
    ) -> AsyncIterator[pb.Instruction]:
        peer = context.peer()
        indices = tuple(int(i) for i in request.client_indices)
        identity: Identity | None = None
        try:
            identity = self._authenticate(context)
            if identity is not None:
                Authenticator.check_indices(identity, indices)
        except Refusal as refusal:
            log.warning("refused join from %s (%s): %s", peer, request.client_name or "unnamed", refusal.details)
            await context.abort(refusal.code, refusal.details)
        problem = self._join_problem(request, indices)
        if problem is not None:
            code, details = problem
            log.warning("refused join from %s (%s): %s", peer, request.client_name or "unnamed", details)
            await context.abort(code, details)
        session = Session(secrets.token_hex(16), tuple(sorted(indices)), peer, request.client_name, identity)
        self.sessions[session.id] = session
        for i in session.indices:
            self.owner[i] = session
            self.lost.pop(i, None)
        log.info("%s joined", session.describe())
        if not self.missing():
            self.all_joined.set()
        yield pb.Instruction(
            welcome=pb.Welcome(
                session_id=session.id,
                federation_id=self.federation_id,
                num_clients=self.num_clients,
                chunk_bytes=self.chunk_bytes,
            )
        )
        try:
            while (item := await session.outbox.get()) is not None:
                yield item
        finally:
            self._drop(session, "ended its session" if session.closing else "disconnected")

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
        if self.authenticator is None:
            return None
        common_names = context.auth_context().get("x509_common_name", [])
        return self.authenticator.identify(context.invocation_metadata() or (), common_names)

    def _join_problem(self, request: pb.JoinRequest, indices: tuple[int, ...]) -> tuple[grpc.StatusCode, str] | None:
        if request.protocol_version != pb.PROTOCOL_VERSION_1:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"protocol version {request.protocol_version} is not supported (this coordinator speaks 1)",
            )
        if not indices:
            return grpc.StatusCode.INVALID_ARGUMENT, "no client indices given"
        if len(set(indices)) != len(indices):
            return grpc.StatusCode.INVALID_ARGUMENT, f"client indices repeat: {list(indices)}"
        outside = [i for i in indices if i >= self.num_clients]
        if outside:
            return grpc.StatusCode.INVALID_ARGUMENT, f"client indices {outside} are outside [0, {self.num_clients})"
        taken = [i for i in indices if i in self.owner]
        if taken:
            return grpc.StatusCode.ALREADY_EXISTS, f"client indices {taken} are already connected"
        if self.run is not None:
            return grpc.StatusCode.FAILED_PRECONDITION, "a run is in progress; clients join before it starts"
        return None

    def _drop(self, session: Session, reason: str) -> None:
        if not session.alive:
            return
        session.alive = False
        self.sessions.pop(session.id, None)
        for i in session.indices:
            if self.owner.get(i) is session:
                del self.owner[i]
        if session.closing:
            log.debug("%s %s", session.describe(), reason)
            return
        self.all_joined.clear()
        log.error("%s %s", session.describe(), reason)
        for i in session.indices:
            self.lost[i] = f"{session.describe()} {reason}"
        pending = self.pending
        if (
            pending is not None
            and session in pending.sessions
            and session.id not in pending.answers
            and not pending.future.done()
        ):
            pending.future.set_exception(
                ClientLost(f"{session.describe()} {reason} during round {pending.round_id}", session.indices)
            )

    # -- answers ---------------------------------------------------------------------

    async def Submit(
        self,
        request_iterator: AsyncIterator[pb.AnswerPart],
        context: grpc.aio.ServicerContext[pb.AnswerPart, pb.SubmitReceipt],
    ) -> pb.SubmitReceipt:
        iterator = request_iterator.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty submission")
        if first.WhichOneof("body") != "answer":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a submission must start with an Answer")
        return await self._accept(first.answer, first.ByteSize(), iterator, context)

    async def SubmitOne(  # named as the RPC
        self, request: pb.Answer, context: grpc.aio.ServicerContext[pb.Answer, pb.SubmitReceipt]
    ) -> pb.SubmitReceipt:
        return await self._accept(request, request.ByteSize(), None, context)

    async def _accept(
        self,
        header: pb.Answer,
        size: int,
        chunks: AsyncIterator[pb.AnswerPart] | None,
        context: grpc.aio.ServicerContext[Any, pb.SubmitReceipt],
    ) -> pb.SubmitReceipt:
        try:
            identity = self._authenticate(context)
            received = await self._receive(header, size, chunks, identity)
        except (_Refused, Refusal) as refusal:
            log.warning("refused an answer from %s: %s", context.peer(), refusal.details)
            await context.abort(refusal.code, refusal.details)
        session, pending, answer, size = received
        # Re-check after the awaits above: the round may have moved on meanwhile.
        if self.pending is not pending or session.id in pending.answers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"round {pending.round_id} is no longer open")
        pending.answers[session.id] = answer
        pending.bytes_up += size
        if len(pending.answers) == len(pending.sessions) and not pending.future.done():
            pending.future.set_result(None)
        return pb.SubmitReceipt()

    async def _receive(
        self, header: pb.Answer, size: int, chunks: AsyncIterator[pb.AnswerPart] | None, identity: Identity | None
    ) -> tuple[Session, PendingRound, Answer, int]:
        """Check an answer completely; _Refused with the status to return if it is bad."""
        session = self.sessions.get(header.session_id)
        if session is None or not session.alive:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "unknown session id")
        if session.identity is not None and identity != session.identity:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "the session belongs to another identity")
        claimed = tuple(int(i) for i in header.client_indices)
        foreign = sorted(set(claimed) - set(session.indices))
        if foreign:
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED, f"{session.describe()} may not answer for clients {foreign}"
            )
        if claimed != session.indices:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an answer must list the session's clients {list(session.indices)} in order, got {list(claimed)}",
            )
        pending = self.pending
        if pending is None or header.run_id != pending.run_id:
            current = pending.run_id if pending else "none open"
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"answer for run {header.run_id!r}, but the open round belongs to run {current!r}",
            )
        if header.round_id != pending.round_id:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale answer for round {header.round_id}; the coordinator is waiting on round {pending.round_id}",
            )
        if session.id in pending.answers:
            raise _Refused(
                grpc.StatusCode.ALREADY_EXISTS, f"{session.describe()} already answered round {pending.round_id}"
            )
        if session not in pending.sessions:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"{session.describe()} is not part of round {pending.round_id}"
            )
        assert self.run is not None
        expected = 0 if header.diverged else len(claimed) * self.run.dimension
        if header.payload_length != expected:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"answer has {header.payload_length} float64 entries, expected {expected} "
                f"({len(claimed)} client(s) x {self.run.dimension})",
            )
        payload: bytes | bytearray = header.payload
        if not header.payload and expected:
            if chunks is None:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "a chunked answer must use Submit, not SubmitOne")
            assembler = wire.Assembler(8 * expected)
            try:
                async for part in chunks:
                    if part.WhichOneof("body") != "chunk":
                        raise wire.WireError("only chunks may follow the Answer")
                    assembler.add(part.chunk)
                    size += part.ByteSize()
            except wire.WireError as exc:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if not assembler.done:
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"payload incomplete: {assembler.filled} of {8 * expected} bytes"
                )
            payload = assembler.buffer
        try:
            answer = wire.decode_answer(header, payload, self.run.dimension, pending.want_objective)
        except wire.WireError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return session, pending, answer, size

    # -- rounds (called from the pool through the loop) ------------------------------

    async def announce(self, run: RunInfo) -> None:
        self._check_alive(f"before run {run.run_id}")
        self.run = run
        for session in self.live_sessions():
            session.outbox.put_nowait(_run_instruction(run))

    async def exchange(
        self, messages: list[pb.Instruction], round_id: int, want_objective: bool, timeout: float
    ) -> tuple[list[Answer], int, int]:
        """Send one round's task to every session and wait for all answers."""
        assert self.run is not None
        sessions = tuple(self._check_alive(f"before round {round_id}"))
        loop = asyncio.get_running_loop()
        pending = PendingRound(self.run.run_id, round_id, want_objective, sessions, loop.create_future())
        self.pending = pending
        size = sum(m.ByteSize() for m in messages)
        for session in sessions:
            for message in messages:
                session.outbox.put_nowait(message)
        try:
            await asyncio.wait_for(asyncio.shield(pending.future), timeout)
        except TimeoutError:
            silent = [s for s in sessions if s.id not in pending.answers]
            names = "; ".join(s.describe() for s in silent)
            raise ClientLost(
                f"round {round_id}: no answer within {timeout:g} s from {names}",
                tuple(i for s in silent for i in s.indices),
            ) from None
        finally:
            self.pending = None
        return [pending.answers[s.id] for s in sessions], size * len(sessions), pending.bytes_up

    def _check_alive(self, when: str) -> list[Session]:
        """The live sessions; ClientLost naming how each missing client went, if any is missing."""
        missing = self.missing()
        if missing:
            known = sorted({self.lost[i] for i in missing if i in self.lost})
            unknown = [i for i in missing if i not in self.lost]
            parts = [*known, *([f"clients {unknown} are not connected"] if unknown else [])]
            raise ClientLost(f"{'; '.join(parts)} {when}", tuple(missing))
        return self.live_sessions()

    async def goodbye(self, reason: str) -> None:
        for session in self.live_sessions():
            session.closing = True
            session.outbox.put_nowait(pb.Instruction(goodbye=pb.Goodbye(reason=reason)))
            session.outbox.put_nowait(None)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _run_instruction(run: RunInfo) -> pb.Instruction:
    return pb.Instruction(
        run=pb.RunSpec(
            run_id=run.run_id,
            problem_json=run.problem.model_dump_json(),
            seed=run.seed,
            gradient_noise=run.gradient_noise,
            dimension=run.dimension,
        )
    )


class GrpcPool(ClientPool):
    """A ClientPool whose clients are processes connected over gRPC.

    The server runs on a private event loop in a background thread; the
    algorithm's thread hands it each exchange and blocks until the answers are in.
    """

    def __init__(
        self,
        num_clients: int,
        listen: str = "127.0.0.1:0",
        *,
        chunk_bytes: int = 4 << 20,
        round_timeout_s: float = 60.0,
        server_credentials: grpc.ServerCredentials | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        super().__init__()
        self.chunk_bytes = chunk_bytes
        self.round_timeout_s = round_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fedsaddle-grpc", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.federation: Federation = self._call(self._make_federation(num_clients, authenticator))
        self._health: health_aio.HealthServicer | None = None
        try:
            self.port = self._call(self._start_server(listen, server_credentials))
        except BaseException:
            self._stop_loop()
            raise
        host = listen.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"
        self._closed = False

    # -- plumbing --------------------------------------------------------------------

    def _call(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _make_federation(self, num_clients: int, authenticator: Authenticator | None) -> Federation:
        return Federation(num_clients, self.chunk_bytes, authenticator)

    async def _start_server(self, listen: str, credentials: grpc.ServerCredentials | None) -> int:
        options = [
            *wire.grpc_options(self.chunk_bytes),
            # Notice dead peers on quiet links, and let clients ping while idle.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_CoordinatorServicer_to_server(self.federation, server)  # type: ignore[no-untyped-call]
        # The standard health service (grpc.health.v1), for orchestrators and `fedsaddle health`.
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise PoolError(f"cannot listen on {listen}: {exc}") from None
        if port == 0:
            raise PoolError(f"cannot listen on {listen}")
        await server.start()
        for service in ("", "fedsaddle.v1.Coordinator"):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return port

    # -- the pool --------------------------------------------------------------------

    def wait_for_clients(self, timeout: float) -> None:
        """Block until every client index is connected; MissingClients on timeout."""
        try:
            self._call(asyncio.wait_for(self.federation.all_joined.wait(), timeout))
        except TimeoutError:
            raise MissingClients(self._call(self._missing()), timeout) from None
        log.info("all %d clients connected", self.federation.num_clients)

    async def _missing(self) -> list[int]:
        return self.federation.missing()

    def _announce(self, run: RunInfo) -> None:
        if run.num_clients != self.federation.num_clients:
            raise PoolError(
                f"the run has {run.num_clients} clients but the federation has {self.federation.num_clients}"
            )
        self._call(self.federation.announce(run))

    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        assert self.run is not None
        messages = wire.encode_task(self.run.run_id, round_id, task, self.chunk_bytes)
        want_objective = isinstance(task, GradientTask) and task.want_objective
        exchange = self.federation.exchange(messages, round_id, want_objective, self.round_timeout_s)
        answers, bytes_down, bytes_up = self._call(exchange)
        counts = self.traffic[category]
        counts.bytes_down += bytes_down
        counts.bytes_up += bytes_up
        return list(answers)

    def close(self, reason: str = "the run is over") -> None:
        """Say goodbye to every client, then stop the server and its loop."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if self._health is not None:
                self._call(self._health.enter_graceful_shutdown(), timeout=5)
            self._call(self.federation.goodbye(reason), timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._call(self._server.stop(grace=2.0), timeout=10)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> GrpcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
