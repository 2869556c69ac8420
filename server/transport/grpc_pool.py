"""The gRPC transport: client processes dial in; each round is a real exchange.

The coordinator is the gRPC server (grpc.aio, on its own event-loop thread). The
driver's thread hands each exchange to the loop and waits for its answers. Each
round's Task is serialized once and the same bytes go to every session; answers
come back in client-index order whatever order they arrived in.

The parts: checks.py (pure checks of what clients send), sessions.py (the
registry of sessions), rounds.py (the barriers a run's start and a round wait
on), servicer.py (the Session stream), auth.py (TLS and client identities).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_aio  # public as grpc_health.v1.health.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, Task
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import Category, ClientPool, PoolError, RunInfo
from fedsaddle.server.transport.auth import Authenticator
from fedsaddle.server.transport.checks import Expectation
from fedsaddle.server.transport.refusal import printable
from fedsaddle.server.transport.rounds import Barriers, OpenRound, RunStart
from fedsaddle.server.transport.servicer import SERVICE, SessionService
from fedsaddle.server.transport.sessions import Registry

log = logging.getLogger("fedsaddle.coordinator")
T = TypeVar("T")


class MissingClients(PoolError):
    """Not every client joined in time; the message lists the missing indices."""

    def __init__(self, missing: list[int], timeout: float) -> None:
        super().__init__(f"clients {some(missing)} did not join within {timeout:g} s")
        self.missing = tuple(missing)


class GrpcPool(ClientPool):
    """A ClientPool whose clients are processes connected over gRPC."""

    def __init__(
        self,
        num_clients: int,
        listen: str = "127.0.0.1:0",
        *,
        chunk_bytes: int = 4 << 20,
        round_timeout_s: float = 60.0,
        server_credentials: grpc.ServerCredentials | None = None,
        authenticator: Authenticator | None = None,
        hello_timeout_s: float = 10.0,
    ) -> None:
        super().__init__()
        self.federation_size = num_clients
        self.chunk_bytes = chunk_bytes
        self.round_timeout_s = round_timeout_s
        self.federation_id = secrets.token_hex(8)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fedsaddle-grpc", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._closed = False
        try:
            self.registry, self.barriers, self.service = self._call(self._make_state(authenticator, hello_timeout_s))
            self.port = self._call(self._start_server(listen, server_credentials))
        except BaseException:
            self._stop_loop()
            raise
        host = listen.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the server's loop and wait for its result in this thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _make_state(
        self, authenticator: Authenticator | None, hello_timeout_s: float
    ) -> tuple[Registry, Barriers, SessionService]:
        registry, barriers = Registry(self.federation_size), Barriers()
        welcome = pb.Welcome(
            federation_id=self.federation_id, num_clients=self.federation_size, chunk_bytes=self.chunk_bytes
        )
        return registry, barriers, SessionService(registry, barriers, welcome, authenticator, hello_timeout_s)

    async def _start_server(self, listen: str, credentials: grpc.ServerCredentials | None) -> int:
        server = grpc.aio.server(options=wire.grpc_options(self.chunk_bytes, server=True))
        server.add_generic_rpc_handlers((self.service.handler(),))
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
        for service in ("", SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return port

    # -- the pool ---------------------------------------------------------------------------

    def wait_for_clients(self, timeout: float) -> None:
        """Block until every client index is connected; MissingClients on timeout."""
        try:
            self._call(asyncio.wait_for(self.registry.all_joined.wait(), timeout))
        except TimeoutError:
            raise MissingClients(self.missing(), timeout) from None
        log.info("all %d clients connected", self.federation_size)

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
            want_sample_counts=run.weighting == "samples",
        )
        if run.kind.synthetic:
            spec.synthetic_seed = run.seed  # a benchmark source: clients generate their data from it
        return self._call(self._start_run(run, pb.Instruction(run=spec).SerializeToString()))

    async def _start_run(self, run: RunInfo, spec: bytes) -> list[int] | None:
        """Send the RunSpec to every session and wait until all are Ready; PoolError naming any that is not.

        Returns the clients' sample counts by index, when the run asked for them."""
        sessions = self.registry.require_all(f"before run {run.run_id}")
        barrier = RunStart(tuple(sessions), f"the start of run {run.run_id}", run_id=run.run_id)
        self.barriers.starting = barrier
        try:
            for session in sessions:
                session.send(spec)
            await barrier.wait(self.round_timeout_s)
        finally:
            self.barriers.starting = None
        for session in sessions:
            ready = barrier.ready[session.id]
            if ready.error:
                raise PoolError(f"{session.describe()} cannot serve run {run.run_id}: {printable(ready.error, 512)}")
            if ready.dimension != run.dimension:
                raise PoolError(
                    f"{session.describe()} has data of dimension {ready.dimension}, "
                    f"but run {run.run_id} expects {run.dimension}"
                )
        if run.weighting != "samples":
            return None
        counts = [0] * run.num_clients
        for session in sessions:
            reported = list(barrier.ready[session.id].sample_counts)
            if len(reported) != len(session.indices):
                raise PoolError(
                    f"{session.describe()} reported {len(reported)} sample counts for {len(session.indices)} clients"
                )
            for index, count in zip(session.indices, reported, strict=True):
                counts[index] = count
        return counts

    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        assert self.run is not None
        pieces = wire.encode_task(self.run.run_id, round_id, task, self.chunk_bytes)
        want_objective = isinstance(task, GradientTask) and task.want_objective
        evaluation = isinstance(task, EvaluateTask)
        entries = len(task.metric_names) if isinstance(task, EvaluateTask) else self.run.dimension
        answers, bytes_down, bytes_up = self._call(self._round(pieces, round_id, entries, want_objective, evaluation))
        counts = self.traffic[category]
        counts.bytes_down += bytes_down
        counts.bytes_up += bytes_up
        return answers

    async def _round(
        self, pieces: list[bytes], round_id: int, entries: int, want_objective: bool, evaluation: bool
    ) -> tuple[list[Answer], int, int]:
        """Send one round's task to every session and wait for all answers."""
        assert self.run is not None
        sessions = self.registry.require_all(f"before round {round_id}")
        run_id = self.run.run_id
        barrier = OpenRound(
            tuple(sessions),
            f"round {round_id}",
            expected={
                s.id: Expectation(run_id, round_id, s.indices, entries, want_objective, evaluation) for s in sessions
            },
        )
        self.barriers.round = barrier
        size = sum(len(p) for p in pieces)
        try:
            for session in sessions:
                for piece in pieces:
                    session.send(piece)
            await barrier.wait(self.round_timeout_s)
        finally:
            self.barriers.round = None
        return barrier.in_order(), size * len(sessions), barrier.bytes_up

    def close(self) -> None:
        """Say goodbye to every client (the run finished, or failed: `failure`), then stop the server."""
        if self._closed:
            return
        self._closed = True
        reason, outcome = ("the run is over", pb.DONE) if self.failure is None else (self.failure, pb.FAILED)
        with contextlib.suppress(Exception):
            if self._health is not None:
                self._call(self._health.enter_graceful_shutdown(), timeout=5)
            self._call(self._goodbye(reason, outcome), timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._call(self._server.stop(grace=2.0), timeout=10)
        self._stop_loop()

    async def _goodbye(self, reason: str, outcome: pb.Outcome) -> None:
        goodbye = pb.Instruction(goodbye=pb.Goodbye(reason=reason, outcome=outcome)).SerializeToString()
        for session in self.registry.live():
            session.closing = True
            with contextlib.suppress(Exception):
                session.send(goodbye)
            session.end()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> GrpcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
