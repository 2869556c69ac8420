"""What a peer makes a process log, made safe.

Anything the other side of a session sends (a client's name, a coordinator's run
id or reasons) can be huge or full of control characters; `printable` bounds and
escapes it before it reaches a log line, an error or a status message, and
`RefusalLog` bounds how many lines a flood of refusals writes. So a peer can
neither flood the logs nor write escape sequences to an operator's terminal.
"""

from __future__ import annotations

import logging
import time


def printable(text: str | bytes, limit: int = 256) -> str:
    """`text` with control characters escaped, cut to about `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    if len(text) > limit:
        escaped += f"... ({len(text) - limit} more characters)"
    return escaped


class RefusalLog:
    """Warnings for refused peers, at most `burst` per `window_s` seconds; the rest are counted and summed up.

    A flood of hostile streams (or refused answers) then costs the log a few lines, not one each.
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, window_s: float = 10.0) -> None:
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self.window_start = 0.0
        self.logged = 0
        self.suppressed = 0

    def warn(self, message: str, *args: object, now: float | None = None) -> None:
        """Log the warning unless this window's burst is spent. `now`: a monotonic time in seconds, for a
        caller that keeps the time itself (a protocol object free of I/O); read from the clock if None."""
        if now is None:
            now = time.monotonic()
        if now - self.window_start >= self.window_s:
            self.flush(now=now)
            self.window_start, self.logged = now, 0
        if self.logged < self.burst:
            self.logged += 1
            self.logger.warning(message, *args)
        else:
            self.suppressed += 1

    def flush(self, at_exit: bool = False, now: float | None = None) -> None:
        """Write how many warnings were held back: once their window has ended (call it now and then:
        a flood that stops inside a window sends no further warning to do it), or `at_exit`, at once."""
        if self.suppressed and (
            at_exit or (time.monotonic() if now is None else now) - self.window_start >= self.window_s
        ):
            self.logger.warning("... and %d more refusals in the last %g s", self.suppressed, self.window_s)
            self.suppressed = 0
