"""The event loop gRPC runs on, in the coordinator and in every client process.

uvloop's loop (libuv, in C) where it is installed, else asyncio's own. A small
round is mostly the event loop's and gRPC's work per message, not arithmetic: at
d = 10 with ten client processes on two cores, the clients' CPU per round (as a
multiple of the bare gRPC fan-out's in the same run) fell by 7-17% on uvloop's loop,
and the round's ratio to that fan-out from a median of 1.72 to 1.61 in seven
alternating pairs (bench/README.md, *uvloop*). Nothing else changes: the same
messages, the same bits.

`FEDSADDLE_EVENT_LOOP=asyncio` chooses asyncio's own loop (to compare, or for
asyncio's debug mode); `uvloop` insists on uvloop; unset or `auto` takes uvloop
when it imports. A process's children inherit the choice with its environment.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
VARIABLE = "FEDSADDLE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


class EventLoopChoiceError(ValueError):
    """FEDSADDLE_EVENT_LOOP names no loop this process can run."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new event loop, by the environment's choice (see the module's docstring)."""
    choice = os.environ.get(VARIABLE, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise EventLoopChoiceError(
            f"{VARIABLE}={os.environ[VARIABLE]!r} names no event loop: give uvloop, asyncio or auto (or leave it unset)"
        )
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopChoiceError(
                f"{VARIABLE}=uvloop, but uvloop is not installed here (pip install uvloop; it has no Windows build)"
            ) from None
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the chosen kind."""
    return loop_factory()()


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on a loop of the chosen kind."""
    try:
        factory = loop_factory()
    except EventLoopChoiceError:
        coroutine.close()  # (never awaited: no warning about it)
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coroutine)


def chosen() -> str:
    """'uvloop' or 'asyncio': what this process's loops are (for logs and benchmarks)."""
    return "asyncio" if loop_factory() is asyncio.new_event_loop else "uvloop"
