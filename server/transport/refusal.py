"""The one refusal type of the transport, and the statuses it refuses with.

Anything a peer sends (its name, indices, metadata) goes through
`common.text.printable` before it reaches a log line or a status message, and
warnings about refused peers through `common.text.RefusalLog`.
"""

from __future__ import annotations

import enum

DETAILS_LIMIT = 1024  # bytes of text in a status or Rejected message


class Status(enum.Enum):
    """Why the coordinator refuses a stream or a message: the statuses it uses, by gRPC's names and numbers.

    The protocol object and its parts speak in these; only the servicer turns them into `grpc.StatusCode`
    (by name). A Rejected instruction carries the number (`RejectCode` in proto/fedsaddle.proto)."""

    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class Refusal(Exception):
    """A request refused: the status to answer with and a short reason (at most 1 KiB)."""

    def __init__(self, code: Status, details: str) -> None:
        details = details if len(details) <= DETAILS_LIMIT else details[: DETAILS_LIMIT - 3] + "..."
        super().__init__(details)
        self.code = code
        self.details = details
