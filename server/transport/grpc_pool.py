"""The gRPC transport: client processes dial in; each round is a real exchange.

The coordinator is the gRPC server (grpc.aio). Its event loop runs in the
driver's thread for as long as an exchange lasts, and in a keeper thread between
exchanges (loop.py): a round crosses no thread. Each round's Task is serialized
once and the same bytes go to every session; answers come back in client-index
order whatever order they arrived in.

This module is the pool's adapter alone: ports, the health service, the loop and
the `ClientPool` interface. Every protocol decision is made by the object in
protocol.py (sessions.py, rounds.py and checks.py are its parts); servicer.py
carries its actions out on the streams; auth.py holds TLS and client identities.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_aio  # public as grpc_health.v1.health.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.memory import return_freed_memory, tune_malloc
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import Category, ClientPool, ClientView, PoolError, RunInfo
from fedsaddle.server.secure import MaskedRound
from fedsaddle.server.settlement import RoundTally
from fedsaddle.server.transport.actions import (
    Action,
    MissingClients,
    RoundResult,
    UnmaskResult,
    round_request,
    run_spec,
)
from fedsaddle.server.transport.auth import Authenticator
from fedsaddle.server.transport.gate import ConnectionGate, GatedHealth
from fedsaddle.server.transport.loop import LoopRunner
from fedsaddle.server.transport.protocol import (
    Coordination,
)
from fedsaddle.server.transport.servicer import SERVICE, SessionService
from fedsaddle.server.transport.sessions import Limits

log = logging.getLogger("fedsaddle.coordinator")
T = TypeVar("T")
WAIT_SAY_S = 5.0  # while clients are missing, the log names them this often
DESCRIPTOR_RESERVE = 256  # descriptors kept for files, the event loop and gRPC's own

__all__ = ["GrpcPool", "MissingClients"]


def _within_descriptors(connections: int) -> int:
    """`connections`, or fewer if the process may not open that many descriptors. The soft limit is raised
    towards the hard one first: a connection over the limit would fail gRPC's accept(2), again and again,
    rather than be refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + DESCRIPTOR_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        allowed = max(1, soft - DESCRIPTOR_RESERVE)
        log.warning(
            "transport.limits.max_connections is %d, but this process may open only %d files "
            "(ulimit -n): at most %d connections are accepted",
            connections,
            soft,
            allowed,
        )
        return allowed
    return connections


def _why_not_bound(listen: str) -> str:
    """Why `listen` (HOST:PORT) cannot be bound, as the operating system says it ('Address already in
    use'); gRPC itself does not say."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return "the port may be taken, or the address not this host's"


class GrpcPool(ClientPool):
    """A ClientPool whose clients are processes connected over gRPC."""

    def __init__(
        self,
        num_clients: int,
        listen: str = "127.0.0.1:0",
        *,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        round_timeout_s: float = 60.0,
        server_credentials: grpc.ServerCredentials | None = None,
        authenticator: Authenticator | None = None,
        limits: Limits | None = None,
        rejoin_timeout_s: float = 0.0,
        straggler_deadline_s: float | None = None,
        min_clients: int | None = None,
        token_listen: str | None = None,
        token_credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.chunk_bytes = wire.check_chunk_bytes(chunk_bytes)
        self.last_fold: OrderedFold | None = None  # the last round's running sum (its counters: bench, tests)
        # Add the answers up as they come (server/fold.py); False keeps every client's vector until the round
        # closes, as a coordinator that inspects them would (tests/test_privacy_grpc.py's curious one).
        self.fold_answers = True
        super().__init__()
        tune_malloc()
        self.federation_size = num_clients
        self.round_timeout_s = round_timeout_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self.limits = limits or Limits()
        self.straggler_deadline_s, self.min_clients = straggler_deadline_s, min_clients
        self.federation_id = secrets.token_hex(8)
        self._runner = LoopRunner()  # the loop runs in the thread that calls (see loop.py)
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._closed = False
        self._say_missing_at = time.monotonic() + WAIT_SAY_S  # when wait_for_clients next names the missing
        self.token_port: int | None = None  # the second port, for token identities under mutual TLS
        self._latency: dict[int, float] = {}  # client index -> its last answer's latency (kept when observed)
        try:
            self.protocol, self.service = self._call(self._make_state(authenticator))
            self.port = self._call(self._start_server(listen, server_credentials, token_listen, token_credentials))
        except BaseException:
            self._runner.close()
            raise
        host = listen.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the server's loop, in this thread, to its result."""
        return self._runner.run(coroutine, timeout)

    async def _make_state(self, authenticator: Authenticator | None) -> tuple[Coordination, SessionService]:
        welcome = pb.Welcome(
            federation_id=self.federation_id, num_clients=self.federation_size, chunk_bytes=self.chunk_bytes
        )
        protocol = Coordination(
            self.federation_size,
            welcome,
            limits=self.limits,
            round_timeout_s=self.round_timeout_s,
            rejoin_timeout_s=self.rejoin_timeout_s,
            straggler_deadline_s=self.straggler_deadline_s,
            min_clients=self.min_clients,
        )
        return protocol, SessionService(protocol, authenticator, self.limits)

    async def _start_server(
        self,
        listen: str,
        credentials: grpc.ServerCredentials | None,
        token_listen: str | None,
        token_credentials: grpc.ServerCredentials | None,
    ) -> int:
        limits = self.limits
        options = [
            *wire.grpc_options(self.chunk_bytes, server=True),
            ("grpc.max_allowed_incoming_connections", _within_descriptors(limits.max_connections)),
            ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
            ("grpc.max_connection_idle_ms", int(1000 * limits.idle_connection_s)),
            # A connection that does not complete its TLS and HTTP/2 handshakes (silent, or not HTTP/2) in
            # this long is closed by gRPC; one that completes them and then carries nothing, by the gate.
            ("grpc.server_handshake_timeout_ms", int(1000 * limits.handshake_timeout_s)),
            ("grpc.max_metadata_size", 16 << 10),
            *wire.window_options(limits.receive_window_bytes),
        ]
        # Calls beyond this many in all are refused with RESOURCE_EXHAUSTED by gRPC itself: a session per
        # client at most, the streams waiting for a Hello, and room for health checks. (Not connections times
        # streams: calls gRPC queues for a busy event loop hold memory until it serves them.)
        calls = max(4096, 2 * self.federation_size + limits.max_pending_hellos)
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=calls)
        server.add_generic_rpc_handlers((self.service.handler(),))
        # The standard health service (grpc.health.v1), for orchestrators and `fedsaddle health`.
        gate = ConnectionGate(set(), limits.handshake_timeout_s, limits.max_quiet_per_peer)
        self._health = GatedHealth(gate)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = self._bind(server, listen, credentials)
        gate.ports.add(port)
        if token_listen is not None:
            self.token_port = self._bind(server, token_listen, token_credentials)
            gate.ports.add(self.token_port)
        await server.start()
        self.gate, self.service.gate = gate, gate
        self._gatekeeper = asyncio.ensure_future(self._keep_gate(gate))
        for service in ("", SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._trimmer = asyncio.ensure_future(return_freed_memory())
        return port

    async def _keep_gate(self, gate: ConnectionGate) -> None:
        """The gate's sweeps, and the refusal counts a flood that ended inside their window held back."""
        sweeps = asyncio.ensure_future(gate.run())
        try:
            while True:
                await asyncio.sleep(1.0)
                self.service.refusals.flush()
                gate.refusals.flush()
        finally:
            sweeps.cancel()

    @staticmethod
    def _bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
        try:
            port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
        except RuntimeError:
            port = 0  # gRPC says only 'Failed to bind to address', and to set GRPC_VERBOSITY for why
        if port == 0:
            raise PoolError(f"cannot listen on {listen}: {_why_not_bound(listen)}")
        return port

    # -- the pool ---------------------------------------------------------------------------

    def _operate(self, begin: Callable[[float], list[Action]], timeout: float | None = None) -> object:
        """Begin one of the protocol's operations (given the time) and wait on the loop until it settles."""

        async def operate() -> object:
            return await self.service.operate(begin(self._runner.loop.time()))

        return self._call(operate(), timeout)

    def wait_for_clients(self, timeout: float) -> None:
        """Block until every client index is connected; MissingClients on timeout. Every WAIT_SAY_S of
        waiting (across calls), the log says which clients are still missing."""
        deadline = time.monotonic() + timeout
        while True:
            step = max(0.0, min(deadline, self._say_missing_at) - time.monotonic())
            try:
                self._operate(functools.partial(self.protocol.await_federation, step))
                return
            except MissingClients as short:
                self._say_missing()
                if time.monotonic() >= deadline:
                    raise MissingClients(self.missing(), timeout, short.why) from None

    def _say_missing(self) -> None:
        now = time.monotonic()
        if now < self._say_missing_at:
            return
        self._say_missing_at = now + WAIT_SAY_S
        missing = self.missing()
        if missing:
            joined = self.federation_size - len(missing)
            log.info("waiting for clients %s (%d of %d joined)", some(missing, 20), joined, self.federation_size)

    def missing(self) -> list[int]:
        """The client indices no live session holds now."""

        async def missing() -> list[int]:
            return self.protocol.missing()

        return self._call(missing())

    def _announce(self, run: RunInfo) -> list[int] | None:
        if run.num_clients != self.federation_size:
            raise PoolError(f"the run has {run.num_clients} clients but the federation has {self.federation_size}")
        message = run_spec(run)
        counts = self._operate(lambda now: self.protocol.start_run(run, message, now))
        return counts if isinstance(counts, list) else None

    def numeric_stacks(self) -> dict[str, list[int]]:
        """What the clients reported computing with (numpy, BLAS kernel): the client indices of each."""
        return self.protocol.numeric_stacks()

    def connections_closed(self) -> dict[str, int]:
        """Connections the gate closed (gate.py): quiet past the handshake deadline, or over an address's cap;
        and how many times an address's new connections were dropped in the kernel (synfilter.py)."""
        gate = self.gate
        return {"silent": gate.closed_silent, "over_peer_cap": gate.closed_over_cap, "held_off": gate.held_off}

    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        return self._collect(task, round_id, category, participants, False)

    def _collect(
        self,
        task: Task,
        round_id: int,
        category: Category,
        participants: tuple[int, ...] | None,
        masked: bool,
        masked_sum: MaskedRound | None = None,
    ) -> list[Answer]:
        run = self.run
        assert run is not None
        # Central differential privacy clips each client's row: those rounds keep the rows, not their sum.
        fold = not masked and run.dp is None and self.fold_answers and not run.keeps_rows
        request = round_request(
            run, round_id, task, self.chunk_bytes, participants, masked, fold, self.weights, masked_sum
        )
        opened = time.perf_counter()
        try:
            result = self._operate(lambda now: self.protocol.open_round(request, now))
        finally:
            self._count_resent()
        assert isinstance(result, RoundResult)
        if self.observer is not None:
            self._note_latencies(opened)
        counts = self.traffic[category]
        counts.bytes_down += result.bytes_down
        counts.bytes_up += result.bytes_up
        self.last_fold = result.fold
        return result.answers

    def _folded(self) -> OrderedFold | None:
        return self.last_fold

    def _note_latencies(self, opened: float) -> None:
        """Each session that answered the round just collected: its clients' latency, task out to answer in."""
        sessions = self.protocol.sessions
        for key, stream in list(self.service.streams.items()):
            if stream.last_at >= opened and (session := sessions.get(key)) is not None:
                for index in session.indices:
                    self._latency[index] = stream.last_at - opened

    def client_view(self) -> list[ClientView]:
        registry = self.protocol.registry
        owners, lost, refused = dict(registry.owner), dict(registry.lost), dict(registry.refused)
        latency = dict(self._latency)
        view = []
        for index in range(self.federation_size):
            session = owners.get(index)
            state = "joined" if session else "lost" if index in lost else "refused" if index in refused else "waiting"
            if self._closed and state == "lost":  # told goodbye: gone as it should be
                state = "left"
            view.append(ClientView(index, session.peer if session else "", state, latency.get(index)))
        return view

    def refusals(self) -> dict[str, int]:
        return dict(self.service.ended_with)

    # -- secure aggregation --------------------------------------------------------------------

    def _public_keys(self) -> dict[int, bytes]:
        return dict(self.protocol.keys.public_keys)

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        assert self.run is not None
        directory = messages.key_directory(self.run.run_id, epoch, keys)

        async def send() -> int:
            actions, size = self.protocol.broadcast(directory)
            self.service.act(actions)
            return size

        self.traffic["privacy"].bytes_down += self._call(send())

    def _exchange_masked(
        self,
        task: Task,
        round_id: int,
        category: Category,
        participants: tuple[int, ...] | None,
        rows: MaskedRound,
    ) -> list[MaskedAnswer]:
        """Each masked row is added to `rows` as it is read (chunk by chunk, or whole when it is accepted), and
        its payload let go: the coordinator holds the round's sum and the answers being read, not every row
        (unless `fold_answers` is off)."""
        try:
            answers = self._collect(task, round_id, category, participants, True, rows if self.fold_answers else None)
        finally:
            self._count_rekeys()
        return [messages.as_masked(answer) for answer in answers]

    def _count_rekeys(self) -> None:
        """Each key agreement anew (clients that rejoined with new keys) is a round of the privacy category:
        their keys up (in their Ready), the directory down to every client."""
        privacy = self.traffic.get("privacy")
        if privacy is None or self.run is None:
            return
        for clients, size in self.protocol.keys.take_rekeys():
            privacy.add(RoundTally(self.run.num_clients, 0, 0, None, clients))
            privacy.bytes_down += size

    def _unmask(self, requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskReply]:
        assert self.run is not None
        replies, refusals, bytes_down, bytes_up = self._call(self._unmasking(self.run.run_id, requests))
        privacy = self.traffic["privacy"]
        privacy.bytes_down += bytes_down
        privacy.bytes_up += bytes_up
        if refusals:
            client, reason = min(refusals.items())
            raise PoolError(f"client {client} refused to unmask: {reason}")
        return replies

    async def _unmasking(
        self, run_id: str, requests: dict[int, UnmaskRequest]
    ) -> tuple[dict[int, UnmaskReply], dict[int, str], int, int]:
        """Send each request to the session hosting its client; the replies, the refusals, the bytes both ways."""
        result = await self.service.operate(self.protocol.unmask(requests, self._runner.loop.time()))
        assert isinstance(result, UnmaskResult)
        return result.replies, result.refusals, result.bytes_down, result.bytes_up

    def _count_resent(self) -> None:
        """Fold what was sent again to rejoining sessions into the retransmission counts."""
        messages, floats, size = self.protocol.take_resent()
        counts = self.traffic.get("retransmission")
        if counts is not None:
            counts.messages_down += messages
            counts.floats_down += floats
            counts.bytes_down += size

    def close(self) -> None:
        """Say goodbye to every client (the run finished, or failed: `failure`), then stop the server."""
        if self._closed:
            return
        self._closed = True
        reason, outcome = (self.farewell, pb.DONE) if self.failure is None else (self.failure, pb.FAILED)
        # Each step on its own: the clients' goodbye must not depend on the health service's last word.
        if self._health is not None:
            with contextlib.suppress(Exception):
                self._call(self._health.enter_graceful_shutdown(), timeout=5)
        with contextlib.suppress(Exception):
            self._call(self._goodbye(reason, outcome), timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._call(self._stop_server(), timeout=10)
        self._runner.close()

    async def _stop_server(self) -> None:
        assert self._server is not None
        self._trimmer.cancel()
        self._gatekeeper.cancel()
        self.service.refusals.flush(at_exit=True)
        self.gate.refusals.flush(at_exit=True)
        await self._server.stop(grace=2.0)
        self.service.stop()

    async def _goodbye(self, reason: str, outcome: pb.Outcome) -> None:
        self.service.act(self.protocol.goodbye(reason, outcome))

    def __enter__(self) -> GrpcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
