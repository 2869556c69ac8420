"""The coordinator's sessions: what it grants its peers, each stream's state, and the registry of indices.

A session is one client process's Session stream. Its state is one value of
`State` (greeting, joined, closing, ended) with the data that state needs; the
registry hands out indices (each to at most one live session), remembers how a
session ended until its indices are taken again, and says which clients are
connected. Nothing here does I/O or knows about an event loop: the protocol
object (protocol.py) owns these, and the servicer only counts streams (Admission).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.text import printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.config import Limits as Limits  # what one coordinator grants its peers: one model, the config's
from fedsaddle.server.pool import ClientLost
from fedsaddle.server.transport.identity import Identity
from fedsaddle.server.transport.refusal import Refusal, Status

if TYPE_CHECKING:
    from fedsaddle.server.fold import OrderedFold
    from fedsaddle.server.secure import MaskedRound


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
            raise Refusal(Status.RESOURCE_EXHAUSTED, f"{self.pending} streams are waiting for a Hello already")
        if self.per_peer.get(host, 0) >= self.max_per_peer:
            raise Refusal(Status.RESOURCE_EXHAUSTED, f"{self.max_per_peer} streams from {host} already")
        if self.pending_per_peer.get(host, 0) >= self.max_pending_per_peer:
            raise Refusal(
                Status.RESOURCE_EXHAUSTED,
                f"{self.max_pending_per_peer} streams from {host} are waiting for a Hello already",
            )
        self.per_peer[host] = self.per_peer.get(host, 0) + 1
        self.pending_per_peer[host] = self.pending_per_peer.get(host, 0) + 1
        self.pending += 1

    def floods(self, host: str) -> bool:
        """Whether `host` holds as many streams waiting for their Hello as one address may."""
        return self.pending_per_peer.get(host, 0) >= self.max_pending_per_peer

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


class State(enum.Enum):
    """Where a session stands."""

    GREETING = "greeting"  # the stream is open; its Hello has not come yet
    JOINED = "joined"  # it holds its indices and takes part
    CLOSING = "closing"  # told goodbye: its end is expected
    ENDED = "ended"  # over (its indices are free again)


class Incoming(NamedTuple):
    """A chunked answer being read: its header, the chunks so far and its size on the wire. A refused
    answer's chunks are still read to its end, checked but not kept (`refused`), and not refused
    one by one. An answer whose clients are next in the round's sum is added to it chunk by chunk
    (`fold`): its chunks are checked by the assembler and not kept."""

    header: pb.Answer
    assembler: wire.Assembler
    size: int
    refused: bool = False
    fold: OrderedFold | MaskedRound | None = None  # the round's sum its chunks are added to as they come (not kept)


@dataclass
class Refusals:
    """Messages refused from one session in one round (since its last accepted answer)."""

    count: int = 0
    round: str = ""  # the round they were refused in ("" while none is open)
    first: str = ""  # why the first of them was


@dataclass(eq=False)
class Session:
    """One client process's stream, from its first byte to its end."""

    key: int  # the protocol's number for it: what actions name
    peer: str
    identity: Identity | Refusal | None = None  # the credentials it came with (a Refusal: refused ones)
    state: State = State.GREETING
    indices: tuple[int, ...] = ()
    name: str = ""
    listed: tuple[int, ...] | None = None  # the indices in the Hello's order, when that is not index order
    ready_run: str | None = None  # the run this session's clients are loaded for (it said Ready)
    refusals: Refusals = field(default_factory=Refusals)
    incoming: Incoming | None = None  # a chunked answer being read

    @property
    def hello_order(self) -> tuple[int, ...]:
        """The indices as the Hello listed them: the order of Ready.sample_counts."""
        return self.listed or self.indices

    def listed_for(self, taking_part: tuple[int, ...]) -> tuple[int, ...] | None:
        """The order other than index order an answer may list `taking_part` in: the Hello's, when the
        round takes all of this session's clients (a sampled round's task names them, in index order)."""
        return self.listed if taking_part == self.indices else None

    def describe(self) -> str:
        if not self.indices:
            return f"a stream from {self.peer}"
        who = f"client {self.indices[0]}" if len(self.indices) == 1 else f"clients {some(self.indices)}"
        identity = self.identity if isinstance(self.identity, Identity) else None
        as_identity = f" as {printable(identity.name, 64)!r}" if identity else ""
        return f"{who} ({printable(self.name, 64) or 'unnamed'} at {self.peer}{as_identity})"


class Registry:
    """Live sessions by index, and how the clients that are gone went."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.owner: dict[int, Session] = {}
        self.lost: dict[int, str] = {}  # client index -> how its session ended, until it rejoins
        self.refused: dict[int, str] = {}  # client index -> why a session that claimed it was refused, until one joins
        self._live: list[Session] | None = None  # live(), until a session opens or closes

    @property
    def complete(self) -> bool:
        """Every client index is held by a live session."""
        return len(self.owner) == self.num_clients

    def open(self, session: Session) -> None:
        """Give the session its indices; Refusal(ALREADY_EXISTS) if another live session holds one."""
        taken = [i for i in session.indices if i in self.owner]
        if taken:
            holder = self.owner[taken[0]]
            raise Refusal(
                Status.ALREADY_EXISTS,
                f"client indices {some(taken)} are already connected: {holder.describe()} holds "
                f"{'them' if len(taken) > 1 else 'it'}",
            )
        for i in session.indices:
            self.owner[i] = session
            self.lost.pop(i, None)
            self.refused.pop(i, None)
        self._live = None

    def refuse(self, peer: str, claimed: Sequence[int], details: str) -> None:
        """A session that claimed these indices was refused (`details`): the ones no live session holds may
        be missing because of it, which `why_missing` then says."""
        if len(claimed) > self.num_clients:  # no honest claim (a hostile Hello may list millions): not read
            return
        indices = sorted({i for i in claimed if 0 <= i < self.num_clients})
        claim = f"a session from {peer} claiming {some(indices)} was refused: {details}"
        for i in indices:
            if i not in self.owner:
                self.refused[i] = claim

    def close(self, session: Session, reason: str) -> None:
        """The session ended; its indices are free again."""
        for i in session.indices:
            if self.owner.get(i) is session:
                del self.owner[i]
                self.lost[i] = f"{session.describe()} {reason}"
        self._live = None

    def live(self) -> list[Session]:
        """The live sessions, in the order of their first client index."""
        if self._live is None:
            self._live = sorted({id(s): s for s in self.owner.values()}.values(), key=lambda s: s.indices[0])
        return list(self._live)

    def missing(self) -> list[int]:
        if self.complete:
            return []
        return [i for i in range(self.num_clients) if i not in self.owner]

    def why_missing(self) -> str:
        """Why missing clients may be missing, when the registry knows: a session that claimed them was refused."""
        reasons = sorted({self.refused[i] for i in self.missing() if i in self.refused})
        return "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more refused sessions" if len(reasons) > 3 else "")

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
