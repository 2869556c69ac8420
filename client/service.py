"""The client runtime: dial the coordinator, open a Session stream, answer its tasks until goodbye.

The shell around the protocol object: each instruction goes to the `ClientSession`
(session.py) with the time, and its actions are carried out in order (`_carry_out`):
messages written, the work done by the `HostedClients` (hosted.py) and its result fed
back, and a `Close` turned into the process's end.

A coordinator that is not up yet, restarts, loses the link, or closes connections
(it is at its connection limit, or flooded) is waited for: the client reconnects
with exponential backoff and jitter, for up to `connect_timeout_s` after it last had
a session, and says at once, then every few seconds, that it is still trying and
what it sees. Faults that retrying cannot fix end the client within seconds, with
the cause in its own words: an unknown host, a TLS handshake that fails (a TLS
client on a plaintext port, an untrusted certificate, a wrong server name), a
plaintext client on a TLS port, and refused credentials or indices. A closed
connection alone never counts as a TLS mismatch: the client asks the port itself
what it speaks (probe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, NamedTuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from fedsaddle.client.hosted import HostedClients
from fedsaddle.client.probe import TlsFiles, probe
from fedsaddle.client.session import (
    AgreeKeys,
    ClientError,
    ClientSession,
    Close,
    Compute,
    Instruction,
    LoadRun,
    Refusal,
    RunFailed,
    Send,
    Unmask,
)
from fedsaddle.common import blas, eventloop, wire
from fedsaddle.common.attacks import Attack
from fedsaddle.common.memory import return_freed_memory, tune_malloc
from fedsaddle.common.stop import Stopped
from fedsaddle.common.text import printable
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.proto import fedsaddle_pb2 as pb

if TYPE_CHECKING:  # (a client without --monitor never loads the monitor's HTTP server)
    from fedsaddle.client.monitor import ClientStats

log = logging.getLogger("fedsaddle.client")
# A log record's flag: a client repeating the coordinator's failure (`fedsaddle local`, whose coordinator
# says it in the same terminal, leaves those out: see launch.fork_clients).
ECHOES_COORDINATOR = "echoes_coordinator"

GOODBYE_WAIT_S = 5.0  # after a goodbye, how long to wait for the coordinator to end the call
# A name that does not resolve is retried this long: container networks register a
# service's name a moment after it starts, and again after it restarts.
DNS_GRACE_S = 5.0
FIRST_SAY_S = 1.5  # a client that cannot reach its coordinator says so after this long
SAY_EVERY_S = 5.0  # and then this often, while it still tries
PROBE_AFTER = 3  # closed connections in a row before the client asks the port whether it speaks TLS

__all__ = ["ECHOES_COORDINATOR", "ClientError", "ClientOptions", "run_client", "serve"]


@dataclass
class ClientOptions:
    coordinator: str
    indices: tuple[int, ...]
    name: str = ""
    connect_timeout_s: float = 60.0
    credentials: grpc.ChannelCredentials | None = None  # TLS (and client certificate)
    metadata: tuple[tuple[str, str], ...] = ()  # e.g. the bearer token
    server_name: str | None = None  # expected name in the coordinator's certificate
    data: dict[int, str] = field(default_factory=dict)  # each hosted client's own data file
    trusted: tuple[str, ...] = ()  # plugin problems ('module:Class') this process agrees to load
    client_certificate: bool = False  # credentials include a client certificate (mutual TLS)
    check_statistics: bool = True  # warn when the spec's statistics contradict this process's data
    tls_files: TlsFiles | None = None  # the PEM files of `credentials`, for the probe (probe.py)
    # What gRPC takes in of the coordinator's stream before this process reads it (0: gRPC's own window,
    # which grows with the link and held much of a large task in its buffers). Two default chunks: one held
    # no less and made large rounds longer (figures: bench/README.md).
    receive_window_mib: float = 2.0
    attack: Attack | None = None  # research and tests: this process lies about its answers (common/attacks.py)
    flipped: tuple[int, ...] = ()  # research and tests: clients that train on swapped labels (label_flip)
    stats: ClientStats | None = None  # counted for this process's monitor (--monitor), when it has one


def _hung_up(options: ClientOptions) -> str | None:
    """Why the coordinator closes every connection of this client, when its port's answer to a TLS
    ClientHello shows it (probe.py); None when it does not: then the closes have another cause."""
    where = options.coordinator
    verdict = probe(where, options.tls_files)
    if options.credentials is None:
        if verdict.speaks_tls:
            return f"the coordinator at {where} closes every plaintext connection at once: it serves TLS (give --ca)"
        return None
    if not verdict.refused_the_client:
        return None
    if not options.client_certificate:
        return (
            f"the coordinator at {where} closes every connection at once: it requires a client certificate "
            "(mutual TLS: give --cert and --key)"
        )
    return (
        f"the coordinator at {where} closes every connection at once: it does not accept this client's "
        "certificate (is it signed by the coordinator's client CA?)"
    )


class Fatal(ClientError):
    """A fault that retrying cannot fix."""


class UnknownHost(Fatal):
    """The coordinator's host name does not resolve: fatal, unless it did before or may yet (see run_client)."""


def diagnose(error: grpc.aio.AioRpcError, options: ClientOptions) -> tuple[type[Fatal] | None, str]:
    """(the Fatal kind it is, or None if retrying may help; the cause in words a person can act on)
    for a failed session attempt."""
    code, details = error.code(), printable(error.details() or "", 1024)  # the coordinator's words, bounded
    where = options.coordinator
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Fatal, f"the coordinator at {where} refused this client's credentials: {code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Fatal, f"the coordinator at {where} refused this client: {details}"
    if code == grpc.StatusCode.ALREADY_EXISTS:  # the old session may not be gone yet after a restart
        return None, f"the coordinator at {where} still holds these indices: {details}"
    text = details.lower()
    if "resolv" in text or "domain name not found" in text or "dns" in text:
        return UnknownHost, f"cannot find the host of {where}: {details}"
    if "hostname verification" in text or "peer name" in text or "no match found for server name" in text:
        return Fatal, (
            f"the certificate of the coordinator at {where} is not for this name (give --server-name "
            f"with a name in its certificate): {details}"
        )
    if "handshake failed" in text or "certificate_verify_failed" in text or "ssl_error" in text:
        plain = "wrong_version_number" in text
        hint = "the coordinator does not serve TLS (drop --ca)" if plain else "is --ca the CA that signed it?"
        return Fatal, f"TLS handshake with the coordinator at {where} failed: {hint}: {details}"
    return None, f"{code.name}: {details}"


def _channel(options: ClientOptions) -> grpc.aio.Channel:
    # Receive what the largest chunk a coordinator may set needs.
    channel_options: list[tuple[str, int | str]] = [*wire.grpc_options(wire.MAX_CHUNK_BYTES)]
    channel_options += wire.window_options(int(options.receive_window_mib * (1 << 20)))
    if options.server_name:
        channel_options.append(("grpc.ssl_target_name_override", options.server_name))
    if options.credentials is not None:
        return grpc.aio.secure_channel(options.coordinator, options.credentials, options=channel_options)
    return grpc.aio.insecure_channel(options.coordinator, options=channel_options)


# The frames a SIGTERM finds when it comes while the loop's thread computes: a task, or a run's data
# being loaded or generated (a coordinator's synthetic problem may take hours to generate).
_COMPUTING = frozenset({Worker.execute.__code__, HostedClients.load.__code__})


class _Lost(Exception):
    """The session ended without a goodbye (the coordinator went away); `joined` if it had started."""

    def __init__(self, cause: str, joined: bool, kind: str = "") -> None:
        super().__init__(cause)
        self.joined = joined
        self.kind = kind  # the gRPC status code's name, when a status ended it


class _Garbled(NamedTuple):
    """A message that is not an Instruction (its size): the session ends on it. (gRPC would log an
    exception raised while parsing with its traceback, and hand the loop None.)"""

    size: int


def _parse(data: bytes) -> pb.Instruction | wire.RawChunk | wire.InlineTask | _Garbled:
    """A Chunk, and a Task's large inline payload, are read by hand, as views into the message (no
    copy); anything else by protobuf."""
    chunk = wire.read_chunk(data)
    if chunk is not None:
        return chunk
    try:
        return wire.read_inline_task(data) or pb.Instruction.FromString(data)
    except DecodeError:
        return _Garbled(len(data))


async def _session(channel: grpc.aio.Channel, options: ClientOptions, shards: ShardCache, waiting: _Waiting) -> None:
    """One session, until a DONE goodbye (return), a FAILED one (RunFailed) or a lost stream (_Lost)."""
    stats = options.stats
    session = ClientSession(options.indices)
    hosted = HostedClients(options.indices, shards, options.attack)
    open_session = channel.stream_stream(
        wire.SESSION_METHOD,
        request_serializer=wire.serialized,
        response_deserializer=_parse if stats is None else stats.counting(_parse),
    )
    call = open_session(None, metadata=options.metadata or None)
    joined = False
    try:
        hello = session.hello(options.name or f"{socket.gethostname()}:{os.getpid()}")
        if stats is not None:
            stats.sessions += 1
            stats.sent(hello)
        await call.write(hello)
        async for instruction in call:
            if not joined:
                joined = True
                waiting.reached()
            if isinstance(instruction, _Garbled):
                raise Fatal(
                    f"malformed instruction from the coordinator: {instruction.size} bytes that are not an Instruction"
                )
            try:
                close = await _carry_out(call, session, hosted, instruction, stats)
                if close is None:
                    hosted.prepare_next()  # secure aggregation: the next round's masks, while the coordinator works
            except grpc.aio.AioRpcError:  # the link: nothing to tell
                raise
            except Exception as exc:  # this client cannot go on: the coordinator is told why before it goes
                await _tell(call, session.failure(instruction, exc))
                raise
            if close is not None:
                if close.failure is not None:  # this client refuses to go on: the coordinator is told why first
                    await _tell(call, close.failure)
                error = close.error()
                if error is not None:
                    raise error
                await _close_writing(call)
                return
    except grpc.aio.AioRpcError as exc:
        fatal, cause = diagnose(exc, options)
        if fatal is not None:
            raise fatal(cause) from None
        raise _Lost(cause, joined, exc.code().name) from None
    except wire.WireError as exc:
        raise Fatal(f"malformed instruction from the coordinator: {exc}") from None
    finally:
        call.cancel()
    raise _Lost(f"the coordinator at {options.coordinator} closed the session without a goodbye", joined)


async def _carry_out(
    call: _Call, session: ClientSession, hosted: HostedClients, instruction: Instruction, stats: ClientStats | None
) -> Close | None:
    """Carry out what an instruction calls for: write what the session sends, have the hosted clients do
    the work it asks for and feed each result back. The Close that ends the session, if one does."""
    began = time.perf_counter() if stats is not None else 0.0  # (an answer's time, from the instruction on)
    actions = session.receive(instruction, time.monotonic())
    for action in actions:  # (what a result calls for is appended, and carried out in turn)
        if isinstance(action, Send):
            for message in action.messages:
                if stats is not None:
                    stats.sent(message)
                await call.write(message)
        elif isinstance(action, Compute):
            answer = hosted.compute(action)
            if stats is not None and not isinstance(answer, Refusal):
                stats.answered(time.perf_counter() - began)
            actions += session.computed(action, answer, time.monotonic())
        elif isinstance(action, LoadRun):
            actions += session.loaded(hosted.load(action), time.monotonic())
        elif isinstance(action, AgreeKeys):
            actions += session.agreed(action, hosted.agree(action))
        elif isinstance(action, Unmask):
            actions += session.unmasked(hosted.unmask(action))
        else:
            return action
    return None


_Call = grpc.aio.StreamStreamCall[pb.ClientMessage | bytes, object]


async def _close_writing(call: _Call) -> None:
    """Close this side of the stream, then give the coordinator GOODBYE_WAIT_S to end the call."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(call.done_writing(), GOODBYE_WAIT_S)
        await asyncio.wait_for(call.code(), GOODBYE_WAIT_S)  # the coordinator ends the call


async def _tell(call: _Call, failure: pb.ClientMessage) -> None:
    """Send a Failure and close this side of the stream, as best it can (the link may be gone already:
    the client exits with the error either way)."""
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
        await asyncio.wait_for(call.write(failure), GOODBYE_WAIT_S)
        await _close_writing(call)


class _Waiting:
    """What the client says while it cannot reach its coordinator: after FIRST_SAY_S (a coordinator that
    comes up a moment later is not news), then every SAY_EVERY_S, each time with what it last saw; and at
    once when the cause becomes another (a refusal of its indices, say). Timed by `speak`, not by the
    attempts: one attempt at an address that drops packets lasts gRPC's connect timeout (20 s)."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.since: float | None = time.monotonic()  # trying since then; None while it has a session
        self.deadline = self.since + options.connect_timeout_s
        self.said_at: float | None = None
        self.cause, self.kind, self.said = "no answer yet", "", ""

    def failed(self, cause: str, kind: str) -> None:
        self.cause, self.kind = cause, kind
        if kind != self.said and (self.said or kind == grpc.StatusCode.ALREADY_EXISTS.name):
            self._say()

    def tick(self) -> None:
        if self.since is None:
            return
        now = time.monotonic()
        if (self.said_at is None and now - self.since >= FIRST_SAY_S) or (
            self.said_at is not None and now - self.said_at >= SAY_EVERY_S
        ):
            self._say()

    def _say(self) -> None:
        self.said_at, self.said = time.monotonic(), self.kind
        log.warning(
            "cannot reach the coordinator at %s yet (%s); still trying for %.0f s",
            self.options.coordinator,
            self.cause,
            max(0.0, self.deadline - self.said_at),
        )

    def reached(self) -> None:
        """A session started."""
        self.since = self.said_at = None
        self.cause, self.kind, self.said = "no answer yet", "", ""

    def lost(self) -> None:
        """The session was lost: trying again from now."""
        self.since = time.monotonic()
        self.deadline = self.since + self.options.connect_timeout_s

    async def speak(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.tick()


def _closed(cause: str) -> bool:
    """A connection the coordinator's side closed or reset (not one nobody listens for)."""
    text = cause.lower()
    return any(word in text for word in ("socket closed", "connection reset", "end of tcp stream", "broken pipe"))


async def run_client(options: ClientOptions) -> None:
    """Serve sessions until the run is over: returns after a DONE goodbye, raises ClientError otherwise."""
    waiting = _Waiting(options)
    speaker = asyncio.ensure_future(waiting.speak())
    try:
        await _serve_sessions(options, waiting)
    finally:
        speaker.cancel()


async def _serve_sessions(options: ClientOptions, waiting: _Waiting) -> None:
    shards = ShardCache(
        size=2,
        data=options.data,
        trusted=options.trusted,
        check_statistics=options.check_statistics,
        flipped=options.flipped,
    )
    delay, closed_in_a_row = 0.1, 0
    joined_once, unresolved_since = False, 0.0
    async with _channel(options) as channel:
        while True:
            try:
                await _session(channel, options, shards, waiting)
                return
            except RunFailed:
                raise
            except UnknownHost as unknown:
                now = time.monotonic()
                unresolved_since = unresolved_since or now
                if not joined_once and now - unresolved_since >= DNS_GRACE_S:
                    raise
                if now >= waiting.deadline:
                    raise ClientError(
                        f"cannot reach the coordinator at {options.coordinator} within "
                        f"{options.connect_timeout_s:g} s: {unknown}"
                    ) from None
                waiting.failed(str(unknown), "unresolved")
                await asyncio.sleep(min(0.5, max(0.0, waiting.deadline - now)))
                continue
            except _Lost as lost:
                if lost.joined:  # a session was up: the link dropped or the coordinator went away
                    joined_once, unresolved_since = True, 0.0
                    delay, closed_in_a_row = 0.1, 0
                    waiting.lost()
                    log.warning(
                        "lost the coordinator (%s); reconnecting for up to %g s", lost, options.connect_timeout_s
                    )
                else:
                    closed_in_a_row = closed_in_a_row + 1 if _closed(str(lost)) else 0
                    # Closed connections alone do not tell a TLS port from a full or flooded one: ask the port.
                    if closed_in_a_row and closed_in_a_row % PROBE_AFTER == 0:
                        mismatch = await asyncio.to_thread(_hung_up, options)
                        if mismatch is not None:
                            raise Fatal(mismatch) from None
                    if time.monotonic() >= waiting.deadline:
                        raise ClientError(
                            f"cannot reach the coordinator at {options.coordinator} within "
                            f"{options.connect_timeout_s:g} s: {lost}"
                        ) from None
                    waiting.failed(str(lost), lost.kind)
                log.debug("coordinator not reachable (%s); retrying in %.2f s", lost, delay)
                await asyncio.sleep(min(delay, max(0.0, waiting.deadline - time.monotonic())))
                delay = min(5.0, delay * 2) * random.uniform(0.8, 1.2)  # exponential backoff with jitter


def serve(options: ClientOptions) -> str:
    """Run the client; SIGTERM ends it cleanly (the stream closes, the coordinator is told). Returns the
    name of the signal that stopped it, or '' when the run ended."""

    tune_malloc()
    log.debug("event loop: %s", eventloop.chosen())  # (an unknown choice is refused here, before anything starts)
    blas.apply()  # the count every process of the run uses, whatever the environment held (common/blas.py)
    # A diverging run overflows; its answers say so (Answer.diverged), so numpy need not warn.
    np.seterr(over="ignore", invalid="ignore")

    async def session() -> str:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        stopped_by = ""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            nonlocal stopped_by
            if stopped_by and signum == signal.SIGINT:  # a second Ctrl-C: the user will not wait
                raise KeyboardInterrupt
            stopped_by = signal.Signals(signum).name
            # A task computes in the loop's thread, and the loop takes no callback until it ends: a
            # task of many local steps (or a hostile coordinator's billions) would outlast the signal,
            # as would the data of a synthetic problem of a billion clients.
            while frame is not None:
                if frame.f_code in _COMPUTING:
                    raise Stopped
                frame = frame.f_back
            with contextlib.suppress(RuntimeError):  # (the loop is closed: the session is over already)
                loop.call_soon_threadsafe(task.cancel)

        signal.signal(signal.SIGTERM, on_signal)
        # (Ctrl-C stays ignored where it was: `fedsaddle local`'s clients leave it to their coordinator.)
        sigint = signal.getsignal(signal.SIGINT)
        if sigint is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, on_signal)
        trimmer = asyncio.ensure_future(return_freed_memory())
        try:
            await run_client(options)
        except asyncio.CancelledError:
            log.info("stopped by %s; session closed", stopped_by or "cancellation")
        except Stopped:
            log.info("stopped by %s while computing; session closed", stopped_by)
        finally:
            trimmer.cancel()
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
        return stopped_by

    return eventloop.run(session())
