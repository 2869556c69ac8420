"""The one refusal type of the transport, and how peer-supplied text is made safe to show.

Anything a peer sends (its name, indices, metadata) can be huge or full of
control characters; `printable` bounds and escapes it before it reaches a log
line or a status message, so a peer cannot flood the logs or break them.
"""

from __future__ import annotations

import grpc

DETAILS_LIMIT = 1024  # bytes of text in a status or Rejected message


def printable(text: str | bytes, limit: int = 256) -> str:
    """`text` with control characters escaped, cut to about `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    if len(text) > limit:
        escaped += f"... ({len(text) - limit} more characters)"
    return escaped


class Refusal(Exception):
    """A request refused: the gRPC status code to answer with and a short reason (at most 1 KiB)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        details = details if len(details) <= DETAILS_LIMIT else details[: DETAILS_LIMIT - 3] + "..."
        super().__init__(details)
        self.code = code
        self.details = details
