"""The servicer of `Coordinator.Session`: a shell that only moves bytes and keeps time.

Each client process's stream is admitted (Admission: streams per address, streams
waiting for a Hello), handed to the protocol object (protocol.py) with its
credentials, and then runs two coroutines: a reader that feeds every message to
the protocol, and the handler itself, which writes the stream's queued
Instructions (serialized once per round, passed through as bytes). Whatever the
protocol answers is carried out here (`act`): bytes queued, a stream ended with a
status, the pool's waiting operation settled. One timer wakes the protocol at its
next deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import numpy as np

from fedsaddle.common import wire
from fedsaddle.server.transport.actions import (
    Action,
    End,
    Failed,
    Greeted,
    Received,
    Send,
    Settled,
    parse,
)
from fedsaddle.server.transport.auth import Authenticator, Identity
from fedsaddle.server.transport.gate import ConnectionGate
from fedsaddle.server.transport.protocol import Coordination
from fedsaddle.server.transport.refusal import Refusal, Status
from fedsaddle.server.transport.sessions import Admission, Limits

log = logging.getLogger("fedsaddle.coordinator")

SERVICE = wire.SERVICE
# The protocol's statuses as gRPC's (the same names and numbers): the one place the two meet.
GRPC_STATUS = {status: grpc.StatusCode[status.name] for status in Status}


class Outbox:
    """A stream's instructions waiting for its writer, in order (None: end the stream).

    A deque and one waiting writer: an asyncio.Queue would make a future for
    every item and keep counts no one reads, and a round queues one item per
    session."""

    def __init__(self) -> None:
        self._items: deque[bytes | None] = deque()
        self._writer: asyncio.Future[None] | None = None

    def put(self, item: bytes | None) -> None:
        self._items.append(item)
        writer = self._writer
        if writer is not None and not writer.done():
            writer.set_result(None)

    async def get(self) -> bytes | None:
        while not self._items:
            self._writer = asyncio.get_running_loop().create_future()
            try:
                await self._writer
            finally:
                self._writer = None
        return self._items.popleft()


@dataclass(eq=False)
class Stream:
    """The I/O side of one stream: what waits to be written, and how it is to end."""

    key: int
    peer: str
    writer: asyncio.Task[Any] | None
    bound: int  # undelivered bytes past which it stopped reading (set per round by the protocol)
    outbox: Outbox
    queued_bytes: int = 0
    ending: End | None = None
    greeted: bool = False  # past its Hello (admission no longer counts it as waiting)
    joined: bool = False  # it holds a session (the gate counts its connection as carrying one)
    last_at: float = 0.0  # when its last message came in (perf_counter): a round's latency, for the monitor


async def _end(context: grpc.aio.ServicerContext[Any, Any], refusal: Refusal) -> NoReturn:
    """End the stream with the refusal's status.

    Only its code and text go on: gRPC keeps the exception that abort raises, and
    that exception must not drag along (through a traceback) the frames that held
    what the peer sent, or every refused message would stay in memory.
    """
    code, details = GRPC_STATUS[refusal.code], refusal.details
    refusal.__traceback__ = refusal.__context__ = refusal.__cause__ = None
    del refusal
    await context.abort(code, details)


class SessionService:
    """Serves every Session stream of one coordinator (created on the server's event loop)."""

    def __init__(
        self, protocol: Coordination, authenticator: Authenticator | None = None, limits: Limits | None = None
    ) -> None:
        self.protocol = protocol
        self.authenticator = authenticator
        self.limits = limits or Limits()
        self.admission = Admission(
            self.limits.max_streams_per_peer, self.limits.max_pending_hellos, self.limits.max_quiet_per_peer
        )
        self.refusals = protocol.refusals  # (flushed by the pool now and then: gate.py)
        self.gate: ConnectionGate | None = None  # told which connections carry a session (gate.py)
        self.loop = asyncio.get_running_loop()
        self.streams: dict[int, Stream] = {}
        self._waiter: asyncio.Future[object] | None = None  # the pool's operation under way
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._paused: dict[int, asyncio.Event] = {}  # streams not read until the protocol says they may be
        self.ended_with: dict[str, int] = {}  # streams ended with an error status, by its name (the monitor's)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        session = grpc.stream_stream_rpc_method_handler(
            self.session, request_deserializer=parse, response_serializer=wire.serialized
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Session": session})

    # -- the pool's operations --------------------------------------------------------------

    async def operate(self, actions: list[Action]) -> object:
        """Carry out the actions that began an operation, and wait until the protocol settles it."""
        waiter: asyncio.Future[object] = self.loop.create_future()
        self._waiter = waiter
        try:
            self.act(actions)
            return await waiter
        finally:
            self._waiter = None
            if not waiter.done():  # interrupted (a signal, loop.py): the protocol is not to settle it any more
                self.protocol.abandon()
                self._rearm()

    # -- carrying out the protocol's actions ------------------------------------------------

    def act(self, actions: Iterable[Action]) -> None:
        todo = deque(actions) if actions else None  # (most messages, a round's answers, call for none)
        while todo:
            action = todo.popleft()
            if isinstance(action, Send):
                stream = self.streams.get(action.session)
                if stream is None or stream.ending is not None:
                    continue
                if action.bound:
                    stream.bound = action.bound
                if stream.queued_bytes + len(action.data) > stream.bound:
                    todo.extend(self.protocol.drop(stream.key, stream.queued_bytes, self.loop.time()))
                    continue
                stream.queued_bytes += len(action.data)
                stream.outbox.put(action.data)
            elif isinstance(action, End):
                self._finish(action)
            elif isinstance(action, Greeted):
                stream = self.streams.get(action.session)
                if stream is not None and not stream.greeted:
                    self._greeted(stream, action.joined)
            else:
                self._settle(action)
        self._rearm()
        if self._paused:
            self._resume()

    def _resume(self) -> None:
        """Read on the paused streams the protocol now lets be read (a round's reorder buffer has room)."""
        for key, event in list(self._paused.items()):
            if self.protocol.may_read(key):
                del self._paused[key]
                event.set()

    def _greeted(self, stream: Stream, joined: bool) -> None:
        stream.greeted = True
        stream.joined = joined
        self.admission.greeted(stream.peer.rsplit(":", 1)[0])

    def _finish(self, end: End) -> None:
        stream = self.streams.get(end.session)
        if stream is None:
            return
        ending = stream.ending
        if ending is not None and (ending.code is not None or end.code is None):
            return  # the first status given is the one the stream ends with
        stream.ending = end
        if end.code is not None:
            self.ended_with[end.code.name] = self.ended_with.get(end.code.name, 0) + 1
        stream.outbox.put(None)
        if end.at_once and stream.writer is not None:
            stream.writer.cancel()

    def _settle(self, outcome: Settled | Failed) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if isinstance(outcome, Failed):
            waiter.set_exception(outcome.error)
        else:
            waiter.set_result(outcome.result)

    def _rearm(self) -> None:
        """Wake the protocol at its next deadline (one timer, moved only when the deadline moves)."""
        deadline = self.protocol.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = None if deadline is None else self.loop.call_at(deadline, self._tick)

    def _tick(self) -> None:
        due = self._timer_at
        self._timer = self._timer_at = None
        # (the loop may call a moment before the deadline, by its clock's resolution)
        now = self.loop.time() if due is None else max(self.loop.time(), due)
        try:
            actions = self.protocol.tick(now)
        except Exception as exc:  # the coordinator's own fault while a deadline settles something: the
            # operation waiting on it fails by name at once, instead of waiting for a timer no one re-arms
            log.exception("internal error at a deadline")
            fault = RuntimeError(f"internal error in the coordinator at a deadline ({exc!r}); see its log")
            self._settle(Failed(fault))
            self._rearm()
            return
        self.act(actions)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    # -- one stream -------------------------------------------------------------------------

    async def session(
        self, requests: AsyncIterator[Received], context: grpc.aio.ServicerContext[Received, bytes]
    ) -> None:
        peer = context.peer()
        host = peer.rsplit(":", 1)[0]
        try:
            self.admission.enter(host)
        except Refusal as refusal:
            # A flood's streams come here by the thousand (docs/operations.md): refused with the status
            # set and no exception raised, as cheaply as a call served in Python can be.
            self.protocol.refusals.warn("refused a stream from %s: %s", peer, refusal.details)
            context.set_code(GRPC_STATUS[refusal.code])
            context.set_details(refusal.details)
            if self.gate is not None:
                self.gate.refused()
                if self.admission.floods(host):
                    self.gate.hold_off(peer)
            return
        # Answers are checked for non-finite entries and refused by name (checks.py); numpy need
        # not warn about them as well. Set for this stream's tasks alone (numpy's error state is a
        # context variable, and each task runs in a copy of the context it was created in).
        np.seterr(over="ignore", invalid="ignore")
        # Admitted: the connection carries a call now, which the gate leaves alone (a stream waiting for its
        # Hello ends at hello_timeout_s, and an address has at most max_quiet_per_peer of those).
        if self.gate is not None:
            self.gate.enter(peer)
        try:
            await self._serve(requests, context, peer)
        finally:
            self.admission.leave(host)
            if self.gate is not None:
                self.gate.leave(peer)

    async def _serve(
        self, requests: AsyncIterator[Received], context: grpc.aio.ServicerContext[Received, bytes], peer: str
    ) -> None:
        identity: Identity | Refusal | None
        try:
            identity = self._authenticate(context)
        except Refusal as refusal:  # told once the Hello comes, as that is checked first
            identity = refusal
        key = self.protocol.connect(peer, identity, self.loop.time())
        stream = Stream(key, peer, asyncio.current_task(), self.limits.max_undelivered_bytes, Outbox())
        self.streams[key] = stream
        self._rearm()
        reader = asyncio.create_task(self._read(stream, requests))
        try:
            while (item := await stream.outbox.get()) is not None:
                stream.queued_bytes -= len(item)
                await context.write(item)
            if stream.ending is not None and stream.ending.linger_s and not reader.done():
                # After a goodbye, let the client close its side first: ending the call now would fail an
                # answer it is writing, and it would never read the goodbye queued before that answer.
                await asyncio.wait({reader}, timeout=stream.ending.linger_s)
        except asyncio.CancelledError:  # dropped (its End says why), the server stopping, or the client gone
            pass
        finally:
            reader.cancel()
            self.act(self.protocol.stream_ended(key, self.loop.time(), gone=True))
            self.protocol.forget(key)
            del self.streams[key]
            if not stream.greeted:
                self.admission.greeted(peer.rsplit(":", 1)[0])
        ending = stream.ending
        if ending is not None and ending.code is not None:
            await _end(context, Refusal(ending.code, ending.details))

    async def _read(self, stream: Stream, requests: AsyncIterator[Received]) -> None:
        """Feed the stream's messages to the protocol until it ends, or the protocol ends it. While the
        protocol says the stream may not be read (its answer's turn has not come), the next message is
        not asked for: gRPC then stops granting the client flow-control window, and the client waits."""
        try:
            async for received in requests:
                stream.last_at = time.perf_counter()
                self.act(self.protocol.receive(stream.key, received, self.loop.time()))
                del received  # not kept until the next message comes: it may be megabytes
                if stream.ending is not None and stream.ending.code is not None:
                    return
                if not self.protocol.may_read(stream.key):
                    event = self._paused[stream.key] = asyncio.Event()
                    await event.wait()
            self.act(self.protocol.stream_ended(stream.key, self.loop.time()))
        except Exception as exc:  # the coordinator's own fault, on a message of this stream: said, and the
            # stream ended (the session lost, as if the client had gone), not a reader gone silent that a round
            # would later blame on its client as a timeout
            log.exception("internal error on a message from %s; ending its stream", stream.peer)
            details = f"internal error in the coordinator ({type(exc).__name__}); see its log"
            self.act([End(stream.key, Status.INTERNAL, details, at_once=True)])
        finally:
            self._paused.pop(stream.key, None)

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
        if self.authenticator is None:
            return None
        common_names = context.auth_context().get("x509_common_name", [])
        return self.authenticator.identify(context.invocation_metadata() or (), common_names)
