"""The coordinator's event loop, run by the thread that needs it.

The driver calls into the pool once per round and waits for the answers. Had the
loop a thread of its own, each round would cross between threads twice (the task
handed to the loop, the answers handed back), each time with a wake-up and the
GIL passed over: on a small problem about as much CPU as the round's own Python.
So the thread that calls runs the loop itself, for as long as its call lasts.

Between calls a keeper thread takes the loop over, once the caller has been away
`idle_s`: joins, health checks, hostile streams and a lost client's return are
served while the driver computes, and a round that follows the last one at once
never waits for a hand-over. A caller whose thread runs an event loop of its own
(a notebook's cell does) cannot run a second one: its calls go to the keeper.

A signal handler that raises (SIGTERM's Stopped, Ctrl-C's KeyboardInterrupt) must
not raise inside the loop, where asyncio would catch it in a callback or pin it on
whichever task was running. While the main thread runs the loop, SIGTERM and
SIGINT are held: the loop stops at once, and the handler runs outside it, in the
caller's frame, as it would have had the loop been elsewhere. They are held too
while it takes the loop, so that a handler that raises cannot leave it taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fedsaddle.common import eventloop

T = TypeVar("T")
log = logging.getLogger("fedsaddle.coordinator")
HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_UNGUARDED = contextlib.nullcontext()
# signal.getsignal turns the handler into a member of the Handlers enum when it can, which for a callable
# handler costs a ValueError raised and caught (6 us, twice a round): the C module's own returns it as is.
_getsignal: Callable[[int], object] = getattr(signal, "_signal", signal).getsignal


class LoopRunner:
    """An event loop run by whichever thread calls `run`, and by a keeper thread in between."""

    def __init__(self, idle_s: float = 0.02) -> None:
        self.loop = eventloop.new_event_loop()
        log.debug("event loop: %s", eventloop.chosen())
        self.idle_s = idle_s
        self._owner = threading.Lock()  # held by the thread that runs the loop
        self._state = threading.Lock()  # guards the two fields below
        self._callers = 0  # threads in run(): they come before the keeper
        self._left_at = time.monotonic()  # when the last caller left
        self._wanted = asyncio.Event()  # set on the loop: a caller wants it back from the keeper
        self._closed = False
        self._guard = _SignalGuard(self.loop)
        self.loop.set_exception_handler(_report)
        self._keeper = threading.Thread(target=self._keep, name="fedsaddle-loop-keeper", daemon=True)
        self._keeper.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run the coroutine to its end on the loop, in this thread: its result, or its exception raised here."""
        if _has_running_loop():  # e.g. a notebook's cell: this thread runs a loop of its own
            return self._run_elsewhere(coroutine, timeout)
        counted = owned = False
        task: asyncio.Task[T] | None = None
        guard = self._guard if threading.current_thread() is threading.main_thread() else None
        try:
            # A signal's handler that raises must not come between taking the loop and noting it:
            # the loop would stay taken, and the next call (the goodbye) would wait for it forever.
            with guard if guard is not None else _UNGUARDED:
                with self._state:
                    self._callers += 1
                counted = True
                if not self._owner.acquire(blocking=False):  # the keeper has it: ask for it back
                    self.loop.call_soon_threadsafe(self._wanted.set)
                    self._owner.acquire()
                owned = True
            task = self.loop.create_task(coroutine if timeout is None else asyncio.wait_for(coroutine, timeout))
            if guard is None:
                return self.loop.run_until_complete(task)
            while True:
                self._run_until_done_or_held(task, guard)  # the held signals' handlers may raise here
                if task.done():
                    return task.result()
                # (else a handler ran and did not raise: go on waiting)
        finally:
            if task is None:
                coroutine.close()
            elif not task.done():  # a signal's handler raised: the call is abandoned
                task.cancel()  # (it unwinds when the loop next runs)
            if owned:
                self._owner.release()
            if counted:
                self._leave()

    def _run_until_done_or_held(self, task: asyncio.Task[Any], guard: _SignalGuard) -> None:
        """Run the loop until the task is done or a held signal comes, then run the held handlers.

        A held signal wakes a future of this call's own, never `loop.stop()`: a stop that came in the
        turn the task ended would leave asyncio's own stop for the task queued, to stop whoever ran the
        loop next (the keeper, or the goodbye's call) before its future was done."""
        woken = self.loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(wake)
        guard.enter(wake)
        try:
            self.loop.run_until_complete(woken)
        finally:
            task.remove_done_callback(wake)
            guard.leave()

    def _run_elsewhere(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Hand the coroutine to the keeper, which runs the loop while no thread calls `run` itself."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def _leave(self) -> None:
        with self._state:
            self._callers -= 1
            self._left_at = time.monotonic()

    def _keep(self) -> None:
        """The keeper thread: run the loop while no caller has for `idle_s`, until one wants it back."""
        while not self._closed:
            time.sleep(self.idle_s)
            with self._state:
                idle = not self._callers and time.monotonic() - self._left_at >= self.idle_s
            if not idle or not self._owner.acquire(blocking=False):
                continue
            try:
                with self._state:
                    if self._callers or self._closed:  # one came in meanwhile: it is waiting for the lock
                        continue
                self._wanted.clear()  # a request made while no one ran the loop is stale
                self.loop.run_until_complete(self._wanted.wait())
            except Exception:  # the keeper must outlive anything that goes wrong in one turn
                log.exception("the event loop's keeper thread")
            finally:
                self._owner.release()

    def close(self) -> None:
        """Stop the keeper and close the loop (call after the last `run`)."""
        self._closed = True
        if threading.current_thread() is threading.main_thread():
            self._guard.restore()
        if self._keeper.is_alive():
            with contextlib.suppress(RuntimeError):  # (the loop is closed already)
                self.loop.call_soon_threadsafe(self._wanted.set)  # if the keeper runs the loop now
            self._keeper.join(timeout=5)
        if not self.loop.is_closed() and self._owner.acquire(timeout=5):
            try:
                self.loop.close()
            finally:
                self._owner.release()


def _report(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's report of an exception in a callback, but for gRPC's late event of a loop closed earlier.

    gRPC's completion queue serves every event loop of the process: an event of a pool
    closed before this one (a second run in a notebook, a test session) can come while
    this loop serves the queue, and handing it to its own, closed loop fails. Nothing
    waits for it; asyncio would log the failure as an error, with a traceback."""
    exception = context.get("exception")
    if (
        isinstance(exception, RuntimeError)
        and str(exception) == "Event loop is closed"
        and "PollerCompletionQueue" in repr(context.get("handle"))
    ):
        log.debug("dropped a gRPC event of an event loop closed earlier")
        return
    loop.default_exception_handler(context)


def _has_running_loop() -> bool:
    # (get_running_loop raises when there is none, which is the usual case here, once a round)
    return asyncio._get_running_loop() is not None


class _SignalGuard:
    """Holds SIGTERM and SIGINT while the main thread takes the loop and while it runs it (see the
    module's docstring).

    Held at Python's level, not by a signal mask: a signal the main thread masks goes
    to another thread, and Python still runs its handler in the main thread, wherever
    that is. It wraps the handlers once and re-wraps only a handler installed since: a
    round costs two getsignal calls, not four system calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.deferring = False  # the main thread takes the loop now
        self.held: list[int] = []
        self._wake: Callable[[], None] | None = None  # while the main thread runs the loop: ends that run
        self._original: dict[int, Callable[[int, Any], Any]] = {}
        self._handler = self._handle  # one bound method, so that `is` recognizes it

    def __enter__(self) -> None:
        """The signals that come in the `with` block are held; their handlers run after it, and may raise there."""
        for number in HELD_SIGNALS:
            current = _getsignal(number)
            if current is not self._handler and callable(current):
                self._original[number] = current
                signal.signal(number, self._handler)
        self.deferring = True

    def __exit__(self, *exc: object) -> None:
        self.deferring = False
        self._deliver()

    def enter(self, wake: Callable[[], None]) -> None:
        """The main thread runs the loop until `wake` is called (on the loop)."""
        self._wake = wake

    def leave(self) -> None:
        """Out of the loop: run the handlers of the signals held, which may raise here."""
        self._wake = None
        self._deliver()

    def _deliver(self) -> None:
        held, self.held = self.held, []
        for number in held:
            self._original[number](number, None)

    def _handle(self, number: int, frame: Any) -> None:
        wake = self._wake
        if wake is None and not self.deferring:
            self._original[number](number, frame)
            return
        self.held.append(number)
        if wake is not None:
            self.loop.call_soon_threadsafe(wake)  # (wakes the loop if it waits in select)

    def restore(self) -> None:
        """Put back the handlers it wrapped (main thread only)."""
        for number, handler in self._original.items():
            if signal.getsignal(number) is self._handler:
                signal.signal(number, handler)
