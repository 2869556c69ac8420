"""The coordinator's event loop runs in the thread that calls the pool, and in a keeper thread between
calls (server/transport/loop.py): streams are served while the driver computes, and a signal that
arrives while the main thread runs the loop is raised after it, not inside it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_bad_answers import HandClient

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.loop import LoopRunner


class Terminated(Exception):
    """What this test's SIGTERM handler raises (as the CLI's raises Stopped)."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_streams_are_served_while_the_driver_calls_nothing() -> None:
    # The main thread holds the pool and does not call it: the keeper thread must run the loop.
    with GrpcPool(1, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address) as channel:
        time.sleep(0.5)
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        hand = HandClient(channel, [0])
        assert hand.welcome().num_clients == 1  # a Hello answered with no call under way
        time.sleep(0.2)
        assert pool.missing() == []
        hand.close()


def test_a_sigterm_during_a_round_is_raised_in_the_callers_frame_at_once() -> None:
    with sigterm_raises():
        handler = signal.getsignal(signal.SIGTERM)
        pool = GrpcPool(1, "127.0.0.1:0", round_timeout_s=60)
        channel = grpc.insecure_channel(pool.address)
        try:
            hand = HandClient(channel, [0])  # says Ready, and never answers a task
            hand.welcome()
            pool.wait_for_clients(10)
            pool.start_run(RunInfo("r", PaperRegressionSpec(num_clients=1, dim=5, s=1.0), 0, 0.0))
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
            started = time.monotonic()
            timer.start()
            with pytest.raises(Terminated):
                pool.gradients(np.ones(10))  # the main thread runs the loop, waiting for the answer
            assert time.monotonic() - started < 10  # at once, not at the round's 60 s timeout
            assert hand.next_task().round_id == 1  # the round had started
            # The loop is intact: the pool still says goodbye and closes.
            pool.close()
            goodbye = hand.next()
            assert goodbye.HasField("goodbye"), goodbye
        finally:
            pool.close()
            channel.close()
        assert signal.getsignal(signal.SIGTERM) is handler  # the pool's hold on SIGTERM is gone


def test_a_signal_that_lands_inside_another_task_reaches_the_caller_and_spares_the_task() -> None:
    runner = LoopRunner()
    bystanders: list[asyncio.Task[str]] = []

    async def bystander() -> str:  # e.g. a session's handler, running when the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            await asyncio.sleep(0)
        return "intact"

    async def call() -> str:
        bystanders.append(asyncio.get_running_loop().create_task(bystander()))
        await asyncio.sleep(60)
        return "waited it out"

    async def outcome() -> str:
        return await bystanders[0]

    try:
        with sigterm_raises():
            started = time.monotonic()
            with pytest.raises(Terminated):
                runner.run(call())
            assert time.monotonic() - started < 30  # at once, not after the call's 60 s
            assert runner.run(outcome()) == "intact"  # the handler did not raise inside it
    finally:
        runner.close()


def test_a_pool_is_usable_from_a_thread_that_runs_an_event_loop_of_its_own() -> None:
    # A notebook runs its cells inside an event loop: the pool's loop cannot run in that thread too.
    with GrpcPool(1, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address) as channel:

        async def cell() -> list[int]:
            hand = HandClient(channel, [0])
            await asyncio.get_running_loop().run_in_executor(None, hand.welcome)
            pool.wait_for_clients(10)  # synchronous calls, as a notebook makes them
            missing = pool.missing()
            hand.close()
            return missing

        assert asyncio.run(cell()) == []


class TrippingLock:
    """The loop's lock, with a SIGTERM sent as the main thread takes it: its handler runs in the main
    thread while it takes the loop, whichever thread the kernel handed the signal to."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.tripped = lock, False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.lock.acquire(blocking, timeout)
        if got and not self.tripped and threading.current_thread() is threading.main_thread():
            self.tripped = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # (a handler that raises does so here, or once the loop is taken)
        return got

    def release(self) -> None:
        self.lock.release()


def test_a_sigterm_that_lands_as_the_caller_takes_the_loop_leaves_it_free() -> None:
    # A handler that raised between taking the loop's lock and noting it left the lock taken: the next
    # call (the goodbye, after SIGTERM) waited for it forever.
    runner = LoopRunner()
    runner._owner = TrippingLock(runner._owner)  # type: ignore[assignment]

    async def answer() -> str:
        return "answered"

    try:
        with sigterm_raises():
            with pytest.raises(Terminated):
                runner.run(answer())
            assert runner._owner.tripped  # type: ignore[attr-defined]
            after: list[str] = []
            caller = threading.Thread(target=lambda: after.append(runner.run(answer())), daemon=True)
            caller.start()
            caller.join(timeout=10)
            assert after == ["answered"]
    finally:
        runner.close()


def test_a_signal_that_lands_as_the_call_ends_leaves_no_stop_behind_for_the_next_run() -> None:
    # The held signal's wake-up ran, then the call's task ended in the same turn of the loop: asyncio's
    # own "stop when done" callback was left queued, and stopped whoever ran the loop next (the
    # keeper thread, which logged "Event loop stopped before Future completed", or the goodbye).
    runner = LoopRunner(idle_s=60)  # the keeper never takes the loop here: the main thread runs it next

    async def call() -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler queues its wake-up behind this step
        await asyncio.sleep(0)  # the step that ends the call is queued behind the wake-up
        return "answered"

    async def after() -> str:
        await asyncio.sleep(0.05)
        return "answered after"

    try:
        with sigterm_raises():
            with pytest.raises(Terminated):
                runner.run(call())
            assert runner.run(after()) == "answered after"
    finally:
        runner.close()


class PollerCompletionQueue:
    """Named as gRPC's completion queue is, whose callback asyncio names by its qualified name."""

    def _handle_events(self) -> None:
        raise RuntimeError("Event loop is closed")  # its event belonged to a loop closed earlier


def another_callback() -> None:
    raise RuntimeError("Event loop is closed")


def test_grpcs_late_event_for_a_closed_loop_is_no_error_and_other_callbacks_errors_still_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A process that opened pools one after another: gRPC's completion queue, shared by their loops,
    # can hand this loop an event of an earlier pool, whose loop is closed. asyncio logged it as an error.
    caplog.set_level(logging.DEBUG)
    runner = LoopRunner()

    async def callbacks() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(PollerCompletionQueue()._handle_events)
        loop.call_soon(another_callback)
        await asyncio.sleep(0.01)

    try:
        runner.run(callbacks())
    finally:
        runner.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "another_callback" in errors[0].getMessage(), caplog.text
    said = [r.getMessage() for r in caplog.records if r.name == "fedsaddle.coordinator"]
    assert [m for m in said if not m.startswith("event loop: ")] == [
        "dropped a gRPC event of an event loop closed earlier"
    ]
