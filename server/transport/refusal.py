"""The one refusal type of the transport.

Anything a peer sends (its name, indices, metadata) goes through
`common.text.printable` before it reaches a log line or a status message, and
warnings about refused peers through `common.text.RefusalLog`.
"""

from __future__ import annotations

import grpc

DETAILS_LIMIT = 1024  # bytes of text in a status or Rejected message


class Refusal(Exception):
    """A request refused: the gRPC status code to answer with and a short reason (at most 1 KiB)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        details = details if len(details) <= DETAILS_LIMIT else details[: DETAILS_LIMIT - 3] + "..."
        super().__init__(details)
        self.code = code
        self.details = details
