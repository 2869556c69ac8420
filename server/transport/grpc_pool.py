"""The gRPC transport: client processes dial in; each round is a real exchange.

The coordinator is the gRPC server (grpc.aio). Its event loop runs in the
driver's thread for as long as an exchange lasts, and in a keeper thread between
exchanges (loop.py): a round crosses no thread. Each round's Task is serialized
once and the same bytes go to every session; answers come back in client-index
order whatever order they arrived in.

The parts: checks.py (pure checks of what clients send), sessions.py (the
registry of sessions), rounds.py (the barriers a run's start and a round wait
on), servicer.py (the Session stream), auth.py (TLS and client identities),
loop.py (who runs the event loop when).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_aio  # public as grpc_health.v1.health.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.memory import return_freed_memory, tune_malloc
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer, row_length
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, Task
from fedsaddle.common.text import printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import Category, ClientLost, ClientPool, PoolError, RunInfo
from fedsaddle.server.settlement import round_traffic
from fedsaddle.server.transport.auth import Authenticator
from fedsaddle.server.transport.checks import Expectation
from fedsaddle.server.transport.gate import ConnectionGate, GatedHealth
from fedsaddle.server.transport.loop import LoopRunner
from fedsaddle.server.transport.rounds import Barriers, OpenRound, RunStart, Unmasking
from fedsaddle.server.transport.servicer import SERVICE, SessionService
from fedsaddle.server.transport.sessions import Limits, Overflow, Registry, Session

log = logging.getLogger("fedsaddle.coordinator")
T = TypeVar("T")
WAIT_SAY_S = 5.0  # while clients are missing, the log names them this often
DESCRIPTOR_RESERVE = 256  # descriptors kept for files, the event loop and gRPC's own
NOT_REPORTED = "not reported"  # a client whose Ready leaves numeric_stack empty (an outside implementation)


class MissingClients(PoolError):
    """Not every client joined in time; the message lists the missing indices."""

    def __init__(self, missing: list[int], timeout: float) -> None:
        super().__init__(f"clients {some(missing)} did not join within {timeout:g} s")
        self.missing = tuple(missing)


@dataclass
class Round:
    """One round's task as the pool hands it to the loop."""

    pieces: list[bytes]  # the serialized task, for sessions whose clients all take part
    round_id: int
    entries: int  # float64 entries per client in an answer
    want_objective: bool
    evaluation: bool
    floats: int  # float64 entries the task carries per client
    subset: set[int] | None  # the clients taking part (None: all)
    pieces_for: Callable[[tuple[int, ...]], list[bytes]]  # the task for a session with only some of them
    masked: bool = False  # secure aggregation: answers are masked rows of `entries` ring elements


RoundOutcome = tuple[list[Answer], int, int]  # the answers in client order, bytes sent, bytes received


def _window_options(window: int) -> list[tuple[str, int]]:
    """A fixed HTTP/2 receive window per stream, or none (0). gRPC grows its window with the link's
    bandwidth-delay product, so that on loopback it takes in whole answers of a million entries from
    every client before the loop reads them; a fixed one keeps that to one window per client."""
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)] if window else []


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
        super().__init__()
        tune_malloc()
        self.federation_size = num_clients
        self.round_timeout_s = round_timeout_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self.limits = limits or Limits()
        self.straggler_deadline_s, self.min_clients = straggler_deadline_s, min_clients
        self._spec: bytes | None = None  # the current run's RunSpec, for sessions that rejoin
        self._counts: list[int] | None = None  # the clients' sample counts in this run (weighting: samples)
        self._public_keys_of: dict[int, bytes] = {}  # secure aggregation: each client's key in this run
        self._resent = [0, 0, 0]  # messages, float64 entries and bytes sent again to rejoining sessions
        self._stacks: dict[int, str] = {}  # client index -> the numeric stack its process reported in Ready
        self._warned_stacks: dict[str, list[int]] = {}  # the differing stacks last warned about
        self.federation_id = secrets.token_hex(8)
        self._runner = LoopRunner()  # the loop runs in the thread that calls (see loop.py)
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._closed = False
        self._say_missing_at = time.monotonic() + WAIT_SAY_S  # when wait_for_clients next names the missing
        self.token_port: int | None = None  # the second port, for token identities under mutual TLS
        try:
            self.registry, self.barriers, self.service = self._call(self._make_state(authenticator))
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

    async def _make_state(self, authenticator: Authenticator | None) -> tuple[Registry, Barriers, SessionService]:
        registry, barriers = Registry(self.federation_size), Barriers()
        welcome = pb.Welcome(
            federation_id=self.federation_id, num_clients=self.federation_size, chunk_bytes=self.chunk_bytes
        )
        service = SessionService(registry, barriers, welcome, authenticator, self.limits)
        service.on_join, service.on_ready = self._on_join, self._on_ready
        return registry, barriers, service

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
            *_window_options(limits.receive_window_bytes),
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
        except RuntimeError as exc:
            raise PoolError(f"cannot listen on {listen}: {exc}") from None
        if port == 0:
            raise PoolError(f"cannot listen on {listen} (is the port taken, or the address not this host's?)")
        return port

    def _deliver(self, session: Session, pieces: list[bytes]) -> int:
        """Queue instructions for a session; a session that stopped reading is dropped (and named). Bytes queued."""
        size = 0
        try:
            for piece in pieces:
                session.send(piece)
                size += len(piece)
        except Overflow as overflow:
            self.service.drop(session, str(overflow))
        return size

    # -- the pool ---------------------------------------------------------------------------

    def wait_for_clients(self, timeout: float) -> None:
        """Block until every client index is connected; MissingClients on timeout. Every WAIT_SAY_S of
        waiting (across calls), the log says which clients are still missing."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            step = max(0.0, min(deadline, self._say_missing_at) - now)
            try:
                self._call(asyncio.wait_for(self.registry.all_joined.wait(), step))
                break
            except TimeoutError:
                self._say_missing()
                if time.monotonic() >= deadline:
                    raise MissingClients(self.missing(), timeout) from None
        log.info("all %d clients connected", self.federation_size)

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
            return self.registry.missing()

        return self._call(missing())

    def _announce(self, run: RunInfo) -> list[int] | None:
        if run.num_clients != self.federation_size:
            raise PoolError(f"the run has {run.num_clients} clients but the federation has {self.federation_size}")
        spec = pb.RunSpec(
            run_id=run.run_id,
            problem_name=run.problem.name,
            problem_json=run.problem.model_dump_json(),
            noise_seed=run.seed,
            gradient_noise=run.gradient_noise,
            dimension=run.dimension,
            want_sample_counts=run.weighting == "samples" and run.secure is None,
        )
        if run.secure is not None:  # (clients weigh their own rows: the counts stay with them)
            spec.secure_aggregation.CopyFrom(messages.settings_message(run.secure, run.weighting == "samples"))
            if run.dp is not None:  # the clients add the noise (without secure aggregation, the coordinator does)
                spec.dp.CopyFrom(pb.DifferentialPrivacy(clip=run.dp.clip, noise_multiplier=run.dp.noise_multiplier))
        if run.problem_object.synthetic:
            spec.synthetic_seed = run.seed  # a benchmark source: clients generate their data from it
        return self._call(self._start_run(run, pb.Instruction(run=spec).SerializeToString()))

    async def _start_run(self, run: RunInfo, spec: bytes) -> list[int] | None:
        """Send the RunSpec to every session and wait until all are Ready; PoolError naming any that is not.

        Returns the clients' sample counts by index, when the run asked for them."""
        self._spec, self._counts, self._public_keys_of = spec, None, {}
        self.service.entries_per_client = run.dimension + (2 if run.secure is not None else 0)  # (masked rows)
        sessions = await self._present(f"before run {run.run_id}", None)
        barrier = RunStart(list(sessions), f"the start of run {run.run_id}", self.rejoin_timeout_s, run_id=run.run_id)
        self.barriers.starting = barrier
        try:
            for session in sessions:
                self._deliver(session, [spec])
            await barrier.wait(self.round_timeout_s)
        finally:
            self.barriers.starting = None
        counts = [0] * run.num_clients
        for session in barrier.sessions:
            problem = self._problem_with(session, barrier.ready[session.id], run)
            if problem is not None:
                raise PoolError(problem)
            session.ready_run = run.run_id
            for index, count in zip(session.hello_order, barrier.ready[session.id].sample_counts, strict=False):
                counts[index] = count
            for index, key in zip(session.hello_order, barrier.ready[session.id].public_keys, strict=False):
                self._public_keys_of[index] = key
            self._note_stack(session, barrier.ready[session.id])
        self._counts = counts if run.weighting == "samples" and run.secure is None else None
        self._warn_if_stacks_differ(run.run_id)
        return self._counts

    def _note_stack(self, session: Session, ready: pb.Ready) -> None:
        for index in session.indices:
            self._stacks[index] = printable(ready.numeric_stack, 256) or NOT_REPORTED

    def _warn_if_stacks_differ(self, run_id: str) -> None:
        """Warn when the clients' reported stacks differ, once for each grouping (not once per run)."""
        stacks = {k: v for k, v in self.numeric_stacks().items() if k != NOT_REPORTED}  # (the field is optional)
        if len(stacks) > 1 and stacks != self._warned_stacks:
            self._warned_stacks = stacks
            told = "; ".join(f"{stack} (clients {some(indices)})" for stack, indices in stacks.items())
            log.warning(
                "run %s: the client processes compute with different numeric stacks: %s. Matrix products may "
                "then differ in their last bits between clients and from simulate (set OPENBLAS_CORETYPE alike "
                "on every host)",
                run_id,
                told,
            )

    def numeric_stacks(self) -> dict[str, list[int]]:
        """What the clients reported computing with (numpy, BLAS kernel): the client indices of each."""
        grouped: dict[str, list[int]] = {}
        for index in sorted(self._stacks):
            grouped.setdefault(self._stacks[index], []).append(index)
        return grouped

    def connections_closed(self) -> dict[str, int]:
        """Connections the gate closed (gate.py): quiet past the handshake deadline, or over an address's cap."""
        return {"silent": self.gate.closed_silent, "over_peer_cap": self.gate.closed_over_cap}

    def _problem_with(self, session: Session, ready: pb.Ready, run: RunInfo) -> str | None:
        """Why a session's Ready does not let the run go on, or None."""
        if ready.error:
            return f"{session.describe()} cannot serve run {run.run_id}: {printable(ready.error, 512)}"
        if ready.dimension != run.dimension:
            return (
                f"{session.describe()} has data of dimension {ready.dimension}, "
                f"but run {run.run_id} expects {run.dimension}"
            )
        if run.secure is not None:
            if len(ready.public_keys) != len(session.indices):
                return (
                    f"{session.describe()} sent {len(ready.public_keys)} public keys for {len(session.indices)} "
                    f"clients; run {run.run_id} uses secure aggregation"
                )
            if self._public_keys_of and any(self._public_keys_of.get(i) for i in session.indices):
                # A process that restarted has new keys; the run would need every client to agree anew.
                return (
                    f"{session.describe()} rejoined run {run.run_id} with new keys: secure aggregation does not "
                    "take a client back into a run yet (resume the run instead)"
                )
            return None
        reported = list(ready.sample_counts)
        if run.weighting == "samples" and len(reported) != len(session.indices):
            return f"{session.describe()} reported {len(reported)} sample counts for {len(session.indices)} clients"
        if run.weighting == "samples" and 0 in reported:
            empty = session.hello_order[reported.index(0)]
            return (
                f"{session.describe()} reported 0 training samples for client {empty}: weighted by samples, "
                "every client must bring some"
            )
        if self._counts is not None:  # a rejoining session must bring the same data
            before = [self._counts[i] for i in session.hello_order]
            if reported != before:
                return f"{session.describe()} rejoined with sample counts {reported[:8]}, had {before[:8]}"
        return None

    async def _present(self, when: str, run_id: str | None) -> list[Session]:
        """The live sessions, all loaded for run `run_id` (if given). With rejoins allowed, first waits
        up to the rejoin timeout for missing clients to come back; ClientLost naming them if they do not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rejoin_timeout_s
        while self.rejoin_timeout_s > 0 and loop.time() < deadline:
            loading = run_id is not None and any(s.ready_run != run_id for s in self.registry.live())
            if not self.registry.missing() and not loading:
                break
            await asyncio.sleep(0.05)
        try:
            sessions = self.registry.require_all(when)
        except ClientLost as lost:
            if self.rejoin_timeout_s <= 0:
                raise
            # As a round's barrier says it of a client lost during the round (rounds.py).
            waited = f"{lost}, and did not rejoin within {self.rejoin_timeout_s:g} s"
            raise ClientLost(waited, lost.client_indices) from None
        unready = [s for s in sessions if run_id is not None and s.ready_run != run_id]
        if unready:
            raise ClientLost(f"{unready[0].describe()} rejoined {when} but did not say Ready", unready[0].indices)
        return sessions

    # -- rejoining sessions (on the loop) ----------------------------------------------------

    def _resend(self, session: Session, pieces: list[bytes], clients: int = 0, floats: int = 0) -> None:
        self._resent[2] += self._deliver(session, pieces)
        self._resent[0] += clients
        self._resent[1] += floats

    def _on_join(self, session: Session) -> None:
        """A session joined while a run is under way: it can only be a client coming back."""
        if self._spec is None:
            return
        starting = self.barriers.starting
        # The run's start now waits on it, or (rejoins allowed) its Ready comes to _on_ready.
        if (starting is not None and starting.replace(session) is not None) or self.rejoin_timeout_s > 0:
            self._resend(session, [self._spec])
            log.info("%s rejoined; sent it run %s", session.describe(), self.run.run_id if self.run else "?")

    def _on_ready(self, session: Session, ready: pb.Ready) -> bool:
        """A rejoining session is loaded: let it take its place in the open round, and resend the task.
        False if the Ready is not for the run under way."""
        run = self.run
        if run is None or ready.run_id != run.run_id:
            return False
        problem = self._problem_with(session, ready, run)
        round_ = self.barriers.round
        if problem is not None:
            if round_ is not None:
                round_.fail(PoolError(problem))
            log.error("%s", problem)
            return True
        session.ready_run = run.run_id
        self._note_stack(session, ready)  # it may have come back on another machine, or another build
        self._warn_if_stacks_differ(run.run_id)
        if round_ is not None and round_.replace(session) is not None:
            clients = len(round_.expected[session.id].indices)
            self._resend(session, round_.task_for(session), clients, round_.floats_per_client * clients)
        return True

    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        assert self.run is not None
        pieces = wire.encode_task(self.run.run_id, round_id, task, self.chunk_bytes)
        want_objective = isinstance(task, GradientTask) and task.want_objective
        evaluation = isinstance(task, EvaluateTask)
        entries = len(task.metric_names) if isinstance(task, EvaluateTask) else self.run.dimension
        traffic = round_traffic(task, self.run.num_clients, self.run.dimension)
        subset = None if participants is None else set(participants)

        def pieces_for(indices: tuple[int, ...]) -> list[bytes]:  # a session with some of its clients sampled
            return wire.encode_task(self.run.run_id, round_id, task, self.chunk_bytes, indices)  # type: ignore[union-attr]

        round_ = Round(pieces, round_id, entries, want_objective, evaluation, traffic.floats_down, subset, pieces_for)
        try:
            answers, bytes_down, bytes_up = self._call(self._round(round_))
        finally:
            self._count_resent()
        counts = self.traffic[category]
        counts.bytes_down += bytes_down
        counts.bytes_up += bytes_up
        return answers

    # -- secure aggregation --------------------------------------------------------------------

    def _public_keys(self) -> dict[int, bytes]:
        return dict(self._public_keys_of)

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        assert self.run is not None
        directory = messages.key_directory(self.run.run_id, epoch, keys)

        async def send() -> int:
            return sum(self._deliver(session, [directory]) for session in self.registry.live())

        self.traffic["privacy"].bytes_down += self._call(send())

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[MaskedAnswer]:
        run = self.run
        assert run is not None
        clients = () if participants is None else participants
        pieces = wire.encode_task(run.run_id, round_id, task, self.chunk_bytes, round_clients=clients)
        traffic = round_traffic(task, run.num_clients, run.dimension)
        subset = None if participants is None else set(participants)

        def pieces_for(indices: tuple[int, ...]) -> list[bytes]:
            return wire.encode_task(run.run_id, round_id, task, self.chunk_bytes, indices, clients)

        entries = row_length(task, run.dimension)
        round_ = Round(pieces, round_id, entries, False, False, traffic.floats_down, subset, pieces_for, masked=True)
        try:
            answers, bytes_down, bytes_up = self._call(self._round(round_))
        finally:
            self._count_resent()
        counts = self.traffic[category]
        counts.bytes_down += bytes_down
        counts.bytes_up += bytes_up
        return [messages.as_masked(answer) for answer in answers]

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
        round_id = next(iter(requests.values())).round_id
        asked = [(s, sorted(set(s.indices) & set(requests))) for s in self.registry.live()]
        asked = [(s, clients) for s, clients in asked if clients]
        barrier = Unmasking(
            [s for s, _ in asked],
            f"the unmasking of round {round_id}",
            run_id=run_id,
            round_id=round_id,
            expected={s.id: set(clients) for s, clients in asked},
        )
        self.barriers.unmask = barrier
        sent = 0
        try:
            for session, clients in asked:
                sent += self._deliver(session, [messages.unmask_request(run_id, j, requests[j]) for j in clients])
            await barrier.wait(self.round_timeout_s)
        finally:
            self.barriers.unmask = None
        return barrier.replies, barrier.refusals, sent, barrier.bytes_up

    def _count_resent(self) -> None:
        """Fold what was sent again to rejoining sessions into the retransmission counts."""
        messages, floats, size = self._resent
        self._resent[:] = [0, 0, 0]
        counts = self.traffic.get("retransmission")
        if counts is not None:
            counts.messages_down += messages
            counts.floats_down += floats
            counts.bytes_down += size

    async def _round(self, round_: Round) -> RoundOutcome:
        """Send one round's task to the participating sessions: their answers in client order, the bytes
        sent and the bytes received."""
        assert self.run is not None
        run_id, round_id = self.run.run_id, round_.round_id
        everyone = await self._present(f"before round {round_id}", run_id)
        taking_part: list[tuple[Session, tuple[int, ...]]] = []
        for session in everyone:
            mine = session.indices if round_.subset is None else tuple(i for i in session.indices if i in round_.subset)
            if mine:
                taking_part.append((session, mine))
        # Secure aggregation: every client of the round, whose shares each masked row must carry.
        round_clients = (
            tuple(sorted(round_.subset)) if round_.subset is not None else tuple(range(self.run.num_clients))
        )
        barrier = OpenRound(
            [s for s, _ in taking_part],
            f"round {round_id}",
            self.rejoin_timeout_s,
            expected={
                s.id: Expectation(
                    run_id,
                    round_id,
                    mine,
                    round_.entries,
                    round_.want_objective,
                    round_.evaluation,
                    s.listed_for(mine),
                    round_.masked,
                    round_clients,
                )
                for s, mine in taking_part
            },
            pieces=round_.pieces,
            pieces_for=round_.pieces_for,
            floats_per_client=round_.floats,
            straggler_deadline_s=self.straggler_deadline_s,
            min_clients=self.min_clients,
        )
        self.barriers.round = barrier
        sent = 0
        bound = max(self.limits.max_undelivered_bytes, 3 * sum(len(p) for p in round_.pieces))
        try:
            for session, _ in taking_part:
                pieces = barrier.task_for(session)
                session.max_queued_bytes = bound  # max(64 MiB by default, 3 rounds' tasks): more, it stopped reading
                sent += self._deliver(session, pieces)
            await barrier.wait(self.round_timeout_s)
            return barrier.in_order(), sent, barrier.bytes_up
        except asyncio.CancelledError:
            # Abandoned by a signal (loop.py): the coordinator stops. The answers already on their way cross
            # the goodbye; they are refused quietly, as after it.
            self.service.shutting_down = True
            raise
        finally:
            if self.barriers.round is barrier:  # the next round may be open already
                self.barriers.round = None

    def close(self) -> None:
        """Say goodbye to every client (the run finished, or failed: `failure`), then stop the server."""
        if self._closed:
            return
        self._closed = True
        service = getattr(self, "service", None)  # None if the pool failed while starting
        if service is not None:
            service.shutting_down = True
        reason, outcome = (self.farewell, pb.DONE) if self.failure is None else (self.failure, pb.FAILED)
        with contextlib.suppress(Exception):
            if self._health is not None:
                self._call(self._health.enter_graceful_shutdown(), timeout=5)
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

    async def _goodbye(self, reason: str, outcome: pb.Outcome) -> None:
        goodbye = pb.Instruction(goodbye=pb.Goodbye(reason=reason, outcome=outcome)).SerializeToString()
        for session in self.registry.live():
            session.closing = True
            with contextlib.suppress(Exception):
                session.send(goodbye)
            session.end()

    def __enter__(self) -> GrpcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
