"""Ctrl-C and SIGTERM while a command runs: an interrupt exits 130 with one line, never lost in a finalizer;
SIGTERM stops a run with its outputs written."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

_INTERRUPTED: list[bool] = []  # one entry per interrupt the command stopped for


def say_interrupted(what: str = "") -> None:
    _INTERRUPTED.append(True)
    # The command stops for this interrupt: one more (a lost one sent again, a second Ctrl-C) must not
    # end the process by the signal while it says so and exits 130.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"fedsaddle: interrupted{what}", file=sys.stderr)


def wraps_an_interrupt(exc: BaseException) -> bool:
    """A Ctrl-C that a library turned into an error of its own (pydantic's serializer, which runs the
    signal's handler inside its Rust code, reports 'Error serializing to JSON: KeyboardInterrupt')."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt) or str(seen).rstrip(": ").endswith("KeyboardInterrupt"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def interrupts_not_lost(
    hook: Callable[[sys.UnraisableHookArgs], object],
) -> Callable[[sys.UnraisableHookArgs], object]:
    """sys.unraisablehook that delivers a lost Ctrl-C again. Python runs a signal's handler wherever the
    main thread is, a finalizer or a weak reference's callback included (the garbage collector's); there
    the handler's KeyboardInterrupt is 'ignored', with a traceback, and the interrupt is lost. So it is
    sent again, from another thread, to be handled where it can stop the command."""

    def unraisable(what: sys.UnraisableHookArgs) -> None:
        if what.exc_type is not None and issubclass(what.exc_type, KeyboardInterrupt):
            said = len(_INTERRUPTED)
            if said:  # the command has stopped for an interrupt already
                return

            def again() -> None:
                if len(_INTERRUPTED) == said:  # (not if the command has stopped for one meanwhile)
                    os.kill(os.getpid(), signal.SIGINT)

            resend = threading.Timer(0.01, again)
            resend.daemon = True
            resend.start()
            return
        hook(what)

    return unraisable


_TERMINATED: list[bool] = []  # an entry once SIGTERM has come (`--hold` then does not hold)


def stop_on_sigterm() -> None:
    from fedsaddle.common.stop import Stopped

    def stop(signum: int, frame: object) -> None:
        _TERMINATED.append(True)
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


def terminated() -> bool:
    """Whether SIGTERM has come since stop_on_sigterm()."""
    return bool(_TERMINATED)
