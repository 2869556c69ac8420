"""Text a peer sent, made safe to show.

Anything the other side of a session sends (a client's name, a coordinator's run
id or reasons) can be huge or full of control characters; `printable` bounds and
escapes it before it reaches a log line, an error or a status message, so a peer
can neither flood the logs nor write escape sequences to an operator's terminal.
"""

from __future__ import annotations


def printable(text: str | bytes, limit: int = 256) -> str:
    """`text` with control characters escaped, cut to about `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    if len(text) > limit:
        escaped += f"... ({len(text) - limit} more characters)"
    return escaped
