"""The servicer of `Coordinator.Session`: thin. It decodes, checks, and hands over.

Each client process's stream runs two coroutines: the handler below, which
writes the session's queued Instructions (serialized once per round by the
pool, passed through as bytes), and a reader that takes the process's messages:
Ready goes to the run-start barrier, an Answer (with its Chunks) is checked
(checks.py) and offered to the open round (rounds.py). A refused answer gets a
Rejected instruction and changes nothing. A message that breaks the protocol
ends the stream with INVALID_ARGUMENT, as do too many refused ones in one round
(every message costs the coordinator work, a refused one buys nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple, NoReturn

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from fedsaddle.common import wire
from fedsaddle.common.text import RefusalLog, printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.transport import checks
from fedsaddle.server.transport.auth import Authenticator, Identity
from fedsaddle.server.transport.gate import ConnectionGate
from fedsaddle.server.transport.refusal import Refusal
from fedsaddle.server.transport.rounds import Barriers, OpenRound
from fedsaddle.server.transport.sessions import Admission, Limits, Overflow, Registry, Session

log = logging.getLogger("fedsaddle.coordinator")

SERVICE = wire.SERVICE
GOODBYE_GRACE_S = 2.0  # how long a told-goodbye session may take to close its side


class Received(NamedTuple):
    """A message as it came off the wire: parsed (None if the bytes are not a ClientMessage) and its size.

    A message that is only a Chunk is read by hand (wire.read_chunk): then `chunk` holds it
    and `message` is None."""

    message: pb.ClientMessage | None
    size: int
    chunk: wire.RawChunk | None = None


class Incoming(NamedTuple):
    """A chunked answer being read: its header, the chunks so far and its size on the wire. A refused
    answer's chunks are still read to its end, checked but not kept (`refused`), and not refused
    one by one."""

    header: pb.Answer
    assembler: wire.Assembler
    size: int
    refused: bool = False


# A session refused this many times in one round (since its last accepted answer) is ended. An honest
# one is refused once or twice in a round at most: a straggler's answer that comes after the round closed.
MAX_REFUSED_IN_A_ROUND = 32


def parse(data: bytes) -> Received:
    chunk = wire.read_chunk(data)
    if chunk is not None:
        return Received(None, len(data), chunk)
    try:
        return Received(pb.ClientMessage.FromString(data), len(data))
    except DecodeError:
        return Received(None, len(data))


async def _end(context: grpc.aio.ServicerContext[Any, Any], refusal: Refusal) -> NoReturn:
    """End the stream with the refusal's status.

    Only its code and text go on: gRPC keeps the exception that abort raises, and
    that exception must not drag along (through a traceback) the frames that held
    what the peer sent, or every refused message would stay in memory.
    """
    code, details = refusal.code, refusal.details
    refusal.__traceback__ = refusal.__context__ = refusal.__cause__ = None
    del refusal
    await context.abort(code, details)


class SessionService:
    """Serves every Session stream of one coordinator."""

    def __init__(
        self,
        registry: Registry,
        barriers: Barriers,
        welcome: pb.Welcome,
        authenticator: Authenticator | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.registry = registry
        self.barriers = barriers
        self.welcome = pb.Instruction(welcome=welcome).SerializeToString()
        self.chunk_bytes = welcome.chunk_bytes
        self.min_piece = wire.min_piece(welcome.chunk_bytes)
        # The run's dimension (set by the pool): a refused answer's chunks are read and dropped up to
        # what a session's clients could send, no further.
        self.entries_per_client = 0
        self.authenticator = authenticator
        self.limits = limits or Limits()
        self.shutting_down = False  # set by the pool when it says goodbye and stops the server
        self.hello_timeout_s = self.limits.hello_timeout_s
        self.admission = Admission(
            self.limits.max_streams_per_peer, self.limits.max_pending_hellos, self.limits.max_quiet_per_peer
        )
        self.refusals = RefusalLog(log)
        self.gate: ConnectionGate | None = None  # told which connections carry a session (gate.py)
        self.on_join: Callable[[Session], None] | None = None  # e.g. send a rejoining session the current run
        # A Ready outside a run's start (a rejoining session's): whether it was for the run under way.
        self.on_ready: Callable[[Session, pb.Ready], bool] | None = None

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        session = grpc.stream_stream_rpc_method_handler(
            self.session, request_deserializer=parse, response_serializer=wire.serialized
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Session": session})

    # -- one stream -----------------------------------------------------------------------

    async def session(
        self, requests: AsyncIterator[Received], context: grpc.aio.ServicerContext[Received, bytes]
    ) -> None:
        # Answers are checked for non-finite entries and refused by name (checks.py); numpy need
        # not warn about them as well. Set for this stream's tasks alone (numpy's error state is a
        # context variable, and each task runs in a copy of the context it was created in).
        np.seterr(over="ignore", invalid="ignore")
        peer = context.peer()
        host = peer.rsplit(":", 1)[0]
        try:
            self.admission.enter(host)
        except Refusal as refusal:
            self.refusals.warn("refused a stream from %s: %s", peer, refusal.details)
            await _end(context, refusal)
        # Admitted: the connection carries a call now, which the gate leaves alone (a stream waiting for its
        # Hello ends at hello_timeout_s, and an address has at most max_quiet_per_peer of those).
        if self.gate is not None:
            self.gate.enter(peer)
        try:
            await self._serve(requests, context, peer, host)
        finally:
            self.admission.leave(host)
            if self.gate is not None:
                self.gate.leave(peer)

    async def _serve(
        self,
        requests: AsyncIterator[Received],
        context: grpc.aio.ServicerContext[Received, bytes],
        peer: str,
        host: str,
    ) -> None:
        incoming = requests.__aiter__()
        refused: Refusal | None = None
        try:
            session = await self._open(incoming, context, peer)
        except Refusal as refusal:
            self.refusals.warn("refused a session from %s: %s", peer, refusal.details)
            refused = refusal
        finally:
            self.admission.greeted(host)
        if refused is not None:
            await _end(context, refused)
        log.info("%s joined", session.describe())
        session.task = asyncio.current_task()
        reader = asyncio.create_task(self._read(session, incoming))
        failure: Refusal | None = None
        try:
            # In the same step as the registry took the session, before any await: a run the pool starts
            # once this session completes the federation is sent to it by the pool, not again by on_join.
            # What on_join queues goes out after the Welcome, which is written first.
            if self.on_join is not None:
                self.on_join(session)
            await context.write(self.welcome)
            while (item := await session.outbox.get()) is not None:
                session.queued_bytes -= len(item)
                await context.write(item)
            if session.closing and not reader.done():
                # After a goodbye, let the client close its side first: ending the call now would fail an
                # answer it is writing, and it would never read the goodbye queued before that answer.
                await asyncio.wait({reader}, timeout=GOODBYE_GRACE_S)
            failure = reader.result() if reader.done() else None
        except asyncio.CancelledError:  # dropped (see drop), the server stopping, or the client gone
            if session.dropped is not None:
                failure = session.dropped
            elif self.shutting_down and not session.closing:
                failure = Refusal(grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down")
        finally:
            reader.cancel()
            if session.closing:
                why = "ended its session"
            elif failure is not None:  # the run that fails for it says why, not just that it left
                why = f"was ended by the coordinator ({failure.details})"
            else:
                why = "disconnected"
            self._close(session, why)
        if failure is not None:
            log.warning("ended the session of %s: %s", session.describe(), failure.details)
            await _end(context, failure)

    def drop(self, session: Session, reason: str) -> None:
        """End a session from the coordinator's side (it stopped reading its stream): it is lost, by name."""
        if not session.alive:
            return
        session.dropped = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        self._close(session, f"was dropped: {reason}")
        if session.task is not None:
            session.task.cancel()

    async def _open(
        self, incoming: AsyncIterator[Received], context: grpc.aio.ServicerContext[Received, bytes], peer: str
    ) -> Session:
        try:
            first = await asyncio.wait_for(incoming.__anext__(), self.hello_timeout_s)
        except TimeoutError:
            raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"no Hello within {self.hello_timeout_s:g} s") from None
        except StopAsyncIteration:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before a Hello") from None
        if first.message is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{first.size} bytes that are not a ClientMessage")
        if first.message.WhichOneof("body") != "hello":
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with a Hello")
        hello = first.message.hello
        identity = self._authenticate(context)
        indices = checks.hello_indices(hello, self.registry.num_clients)
        if identity is not None:
            Authenticator.check_indices(identity, indices)
        ordered = tuple(sorted(indices))
        listed = indices if indices != ordered else None
        session = Session(ordered, peer, printable(hello.client_name, 256), identity, listed=listed)
        session.max_queued_bytes = self.limits.max_undelivered_bytes
        return self.registry.open(session)

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
        if self.authenticator is None:
            return None
        common_names = context.auth_context().get("x509_common_name", [])
        return self.authenticator.identify(context.invocation_metadata() or (), common_names)

    def _close(self, session: Session, reason: str) -> None:
        if session.alive:
            self.registry.close(session, reason)
            self.barriers.lose(session, reason)
            log.info("%s %s", session.describe(), reason)

    # -- what a client process sends --------------------------------------------------------

    async def _read(self, session: Session, incoming: AsyncIterator[Received]) -> Refusal | None:
        """Take the session's messages until its stream ends; a Refusal if it broke the protocol."""
        pending: Incoming | None = None
        try:
            async for received in incoming:
                if received.chunk is not None:  # the usual large message, read by hand
                    pending = self._piece(session, pending, received.chunk, received.size)
                    del received  # not kept until the next message comes: it may be megabytes
                    continue
                message = received.message
                kind = message.WhichOneof("body") if message is not None else None
                if message is None or kind is None or kind == "hello":
                    what = "bytes that are not a ClientMessage" if message is None else f"an unexpected {kind}"
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what} ({received.size} bytes)")
                if kind == "ready":
                    run_id = message.ready.run_id
                    if run_id and run_id == session.ready_run:  # a Ready answers a RunSpec, once
                        raise Refusal(
                            grpc.StatusCode.INVALID_ARGUMENT, f"a second Ready for run {printable(run_id, 64)!r}"
                        )
                    starting = self.barriers.starting
                    taken = starting is not None and starting.accept(session, message.ready)
                    if not taken and self.on_ready is not None:
                        taken = self.on_ready(session, message.ready)
                    if not taken:  # (a late one is possible: a RunSpec resent as a run ended)
                        self._count_refusal(session, f"a Ready for run {printable(run_id, 64)!r}, not under way")
                elif kind == "unmasked":
                    unmasking = self.barriers.unmask
                    if unmasking is None or not unmasking.accept(session, message.unmasked, received.size):
                        self._count_refusal(session, f"an unmasking for round {message.unmasked.round_id}, not asked")
                elif kind == "answer":
                    if pending is not None and not pending.refused:
                        self._reject(session, pending.header.round_id, checks.INVALID, "a new Answer before the chunks")
                    pending = self._answer(session, message.answer, received.size)
                else:
                    pending = self._piece(session, pending, message.chunk, received.size)
                del received, message
        except Refusal as refusal:
            session.end()
            return refusal
        except Overflow as overflow:
            session.end()
            return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(overflow))
        session.end()  # the process closed its side: its session is over
        return None

    def _answer(self, session: Session, header: pb.Answer, size: int) -> Incoming | None:
        round_ = self.barriers.round
        expected = round_.expectation(session) if round_ is not None else None
        try:
            length = checks.answer_header(
                header, session.indices, expected, round_ is not None and session.id in round_.answers
            )
        except Refusal as refusal:
            self._reject(session, header.round_id, refusal.code, refusal.details)
            most = len(session.indices) * self.entries_per_client
            if header.payload or not 0 < header.payload_length <= most:
                return None  # (chunks that follow are refused one by one)
            # Its chunks may be on their way (a late answer, say): read them, but refuse only once.
            skipped = wire.Assembler(8 * header.payload_length, min_piece=self.min_piece, keep=False)
            return Incoming(header, skipped, size, refused=True)
        payload = header.payload  # (each read of a bytes field is a copy)
        if length and not payload:
            return Incoming(header, wire.Assembler(length, min_piece=self.min_piece), size)  # chunks follow
        assert round_ is not None and expected is not None
        self._accept(session, round_, expected, header, payload, size)
        return None

    def _piece(
        self, session: Session, pending: Incoming | None, chunk: pb.Chunk | wire.RawChunk, size: int
    ) -> Incoming | None:
        """A Chunk of the answer being assembled (`pending`); the answer is offered when complete."""
        if pending is None:
            self._reject(session, 0, checks.INVALID, "a Chunk without an Answer before it")
            return None
        header, assembler, total, refused = pending
        try:
            assembler.add(chunk)
        except wire.WireError as exc:
            self._reject(session, header.round_id, checks.INVALID, str(exc))
            return None
        if not assembler.done:
            return Incoming(header, assembler, total + size, refused)
        if not refused:
            self._offer(session, header, assembler.payload(), total + size)
        return None

    def _offer(self, session: Session, header: pb.Answer, payload: bytes | memoryview, size: int) -> None:
        """A chunked answer is complete: checked again, as the round may have moved on while the chunks came."""
        round_ = self.barriers.round
        expected = round_.expectation(session) if round_ is not None else None
        try:
            checks.answer_header(header, session.indices, expected, round_ is not None and session.id in round_.answers)
        except Refusal as refusal:
            self._reject(session, header.round_id, refusal.code, refusal.details)
            return
        assert round_ is not None and expected is not None
        self._accept(session, round_, expected, header, payload, size)

    def _accept(
        self,
        session: Session,
        round_: OpenRound,
        expected: checks.Expectation,
        header: pb.Answer,
        payload: bytes | memoryview,
        size: int,
    ) -> None:
        """Offer an answer whose header was checked against the open round: its vectors are checked here."""
        try:
            answer = checks.answer(header, payload, expected)
        except Refusal as refusal:
            self._reject(session, header.round_id, refusal.code, refusal.details)
            return
        session.refused = 0
        round_.accept(session, answer, size)

    def _reject(self, session: Session, round_id: int, code: grpc.StatusCode, details: str) -> None:
        """Tell the session its answer was refused; end it (Refusal) after too many refusals in one round:
        each message costs the coordinator work, and a refused one buys nothing."""
        self._count_refusal(session, details)
        if self.shutting_down:  # an answer that crossed the goodbye (Ctrl-C, SIGTERM): expected, not news
            log.debug("refused an answer from %s as the coordinator stops: %s", session.describe(), details)
            return  # (nor for the client: its goodbye comes)
        self.refusals.warn("refused an answer from %s: %s", session.describe(), details)
        rejected = pb.Rejected(round_id=round_id, code=code.value[0], details=details)
        session.send(pb.Instruction(rejected=rejected).SerializeToString())

    def _count_refusal(self, session: Session, details: str) -> None:
        """Count a message refused or ignored; Refusal once the session has had too many in this round."""
        round_ = self.barriers.round
        in_round = round_.what if round_ is not None else ""
        if session.refused_in != in_round:
            session.refused, session.refused_in = 0, in_round
        session.refused += 1
        if session.refused == 1:
            session.first_refused = details
        if session.refused >= MAX_REFUSED_IN_A_ROUND:
            where = f"in {in_round}" if in_round else "while no round was open"
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{session.refused} messages refused {where}; the first: {session.first_refused}",
            )
