"""The session registry: which client process holds which client indices, and how each left.

A session is one client process's Session stream. The registry hands out indices
(each to at most one live session), remembers how a session ended until its
indices are taken again, and tells the pool which clients are connected. It lives
on the server's event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from dataclasses import dataclass, field

import grpc

from fedsaddle.common.indices import some
from fedsaddle.common.text import printable
from fedsaddle.server.config import Limits as Limits  # what one coordinator grants its peers: one model, the config's
from fedsaddle.server.pool import ClientLost
from fedsaddle.server.transport.auth import Identity
from fedsaddle.server.transport.refusal import Refusal


class Admission:
    """Counts streams per peer address and streams waiting for their Hello; refuses the ones over the limits.

    Streams waiting for a Hello are capped per address too (`max_pending_per_peer`): one address's flood of
    silent streams must not take all of `max_pending` and keep every other client from saying Hello."""

    def __init__(self, max_per_peer: int, max_pending: int, max_pending_per_peer: int | None = None) -> None:
        self.max_per_peer, self.max_pending = max_per_peer, max_pending
        self.max_pending_per_peer = max_pending if max_pending_per_peer is None else max_pending_per_peer
        self.per_peer: dict[str, int] = {}
        self.pending_per_peer: dict[str, int] = {}
        self.pending = 0

    def enter(self, host: str) -> None:
        if self.pending >= self.max_pending:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.pending} streams are waiting for a Hello already")
        if self.per_peer.get(host, 0) >= self.max_per_peer:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_per_peer} streams from {host} already")
        if self.pending_per_peer.get(host, 0) >= self.max_pending_per_peer:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_pending_per_peer} streams from {host} are waiting for a Hello already",
            )
        self.per_peer[host] = self.per_peer.get(host, 0) + 1
        self.pending_per_peer[host] = self.pending_per_peer.get(host, 0) + 1
        self.pending += 1

    def greeted(self, host: str) -> None:
        """The stream said Hello, or was refused: it no longer waits."""
        self.pending -= 1
        _take_one(self.pending_per_peer, host)

    def leave(self, host: str) -> None:
        _take_one(self.per_peer, host)


def _take_one(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class Outbox:
    """A session's instructions waiting for its stream's writer, in order.

    A deque and one waiting writer: an asyncio.Queue would make a future for
    every item and keep counts no one reads, and a round queues one item per
    session."""

    def __init__(self) -> None:
        self._items: deque[bytes | None] = deque()
        self._writer: asyncio.Future[None] | None = None

    def put(self, item: bytes | None) -> None:
        self._items.append(item)
        writer = self._writer
        if writer is not None and not writer.done():
            writer.set_result(None)

    async def get(self) -> bytes | None:
        while not self._items:
            self._writer = asyncio.get_running_loop().create_future()
            try:
                await self._writer
            finally:
                self._writer = None
        return self._items.popleft()


class Overflow(Exception):
    """A session's undelivered messages exceeded their bound: it stopped reading its stream."""


@dataclass(eq=False)
class Session:
    """One connected client process."""

    indices: tuple[int, ...]
    peer: str
    name: str
    identity: Identity | None = None
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    outbox: Outbox = field(default_factory=Outbox)
    queued_bytes: int = 0
    max_queued_bytes: int = 1 << 62
    alive: bool = True
    closing: bool = False  # told goodbye: its end is expected
    task: asyncio.Task[None] | None = None  # the stream's handler (to drop a session that stops reading)
    dropped: Refusal | None = None  # why the coordinator ended it
    ready_run: str | None = None  # the run this session's clients are loaded for (it said Ready)
    listed: tuple[int, ...] | None = None  # the indices in the Hello's order, when that is not index order
    refused: int = 0  # messages refused in round `refused_in` since its last accepted answer
    refused_in: str = ""  # that round ("" while none is open)
    first_refused: str = ""  # why the first of them was

    @property
    def hello_order(self) -> tuple[int, ...]:
        """The indices as the Hello listed them: the order of Ready.sample_counts."""
        return self.listed or self.indices

    def listed_for(self, taking_part: tuple[int, ...]) -> tuple[int, ...] | None:
        """The order other than index order an answer may list `taking_part` in: the Hello's, when the
        round takes all of this session's clients (a sampled round's task names them, in index order)."""
        return self.listed if taking_part == self.indices else None

    def describe(self) -> str:
        who = f"client {self.indices[0]}" if len(self.indices) == 1 else f"clients {some(self.indices)}"
        as_identity = f" as {printable(self.identity.name, 64)!r}" if self.identity else ""
        return f"{who} ({printable(self.name, 64) or 'unnamed'} at {self.peer}{as_identity})"

    def send(self, data: bytes) -> None:
        """Queue serialized Instructions for this session's stream; Overflow past the bound."""
        if self.queued_bytes + len(data) > self.max_queued_bytes:
            raise Overflow(f"{self.describe()} stopped reading its stream ({self.queued_bytes} bytes undelivered)")
        self.queued_bytes += len(data)
        self.outbox.put(data)

    def end(self) -> None:
        """Close the stream after what is queued."""
        self.outbox.put(None)


class Registry:
    """Live sessions by index, and how the clients that are gone went."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.owner: dict[int, Session] = {}
        self.lost: dict[int, str] = {}  # client index -> how its session ended, until it rejoins
        self.all_joined = asyncio.Event()
        self._live: list[Session] | None = None  # live(), until a session opens or closes

    def open(self, session: Session) -> Session:
        """Give the session its indices; Refusal(ALREADY_EXISTS) if another live session holds one."""
        taken = [i for i in session.indices if i in self.owner]
        if taken:
            holder = self.owner[taken[0]]
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"client indices {some(taken)} are already connected: {holder.describe()} holds "
                f"{'them' if len(taken) > 1 else 'it'}",
            )
        for i in session.indices:
            self.owner[i] = session
            self.lost.pop(i, None)
        self._live = None
        if len(self.owner) == self.num_clients:
            self.all_joined.set()
        return session

    def close(self, session: Session, reason: str) -> None:
        """The session's stream ended; its indices are free again."""
        if not session.alive:
            return
        session.alive = False
        for i in session.indices:
            if self.owner.get(i) is session:
                del self.owner[i]
                self.lost[i] = f"{session.describe()} {reason}"
        self._live = None
        self.all_joined.clear()

    def live(self) -> list[Session]:
        """The live sessions, in the order of their first client index."""
        if self._live is None:
            self._live = sorted({id(s): s for s in self.owner.values()}.values(), key=lambda s: s.indices[0])
        return list(self._live)

    def missing(self) -> list[int]:
        if len(self.owner) == self.num_clients:
            return []
        return [i for i in range(self.num_clients) if i not in self.owner]

    def require_all(self, when: str) -> list[Session]:
        """The live sessions; ClientLost naming how each missing client went, if any is missing."""
        missing = self.missing()
        if missing:
            known = sorted({self.lost[i] for i in missing if i in self.lost})
            unknown = [i for i in missing if i not in self.lost]
            parts = [*known[:3], *([f"clients {some(unknown)} are not connected"] if unknown else [])]
            if len(known) > 3:
                parts.append(f"and {len(known) - 3} more sessions")
            raise ClientLost(f"{'; '.join(parts)} {when}", tuple(missing))
        return self.live()
