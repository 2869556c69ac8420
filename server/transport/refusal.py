"""The one refusal type of the transport, and the rate-limited log of refusals.

Anything a peer sends (its name, indices, metadata) goes through
`common.text.printable` before it reaches a log line or a status message.
"""

from __future__ import annotations

import logging
import time

import grpc

DETAILS_LIMIT = 1024  # bytes of text in a status or Rejected message


class Refusal(Exception):
    """A request refused: the gRPC status code to answer with and a short reason (at most 1 KiB)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        details = details if len(details) <= DETAILS_LIMIT else details[: DETAILS_LIMIT - 3] + "..."
        super().__init__(details)
        self.code = code
        self.details = details


class RefusalLog:
    """Warnings for refused peers, at most `burst` per `window_s` seconds; the rest are counted and summed up.

    A flood of hostile streams then costs the log a few lines, not one each.
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, window_s: float = 10.0) -> None:
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self.window_start = 0.0
        self.logged = 0
        self.suppressed = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.window_start >= self.window_s:
            if self.suppressed:
                self.logger.warning("... and %d more refusals in the last %g s", self.suppressed, self.window_s)
            self.window_start, self.logged, self.suppressed = now, 0, 0
        if self.logged < self.burst:
            self.logged += 1
            self.logger.warning(message, *args)
        else:
            self.suppressed += 1
