"""Barriers on the coordinator's event loop: a run's start (every session Ready) and an open round.

A round completes when every participating session has answered; answers are
kept per session and handed back in client-index order, whatever order they
arrived in. A session lost while a barrier waits on it fails the barrier with an
error naming it, unless rejoins are allowed: then the barrier waits up to the
rejoin timeout for a new session with the same indices to take its place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from fedsaddle.common import wire
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply
from fedsaddle.common.tasks import Answer
from fedsaddle.common.text import printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import ClientLost
from fedsaddle.server.transport.checks import Expectation
from fedsaddle.server.transport.sessions import Session


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False)
class Barrier:
    """Waits for one message from each of some sessions.

    Completion is counted, not searched for: each accepted message takes its
    session off `pending`, so a round costs O(1) per answer whatever the number
    of sessions. The waiter sleeps on one future that anything that matters
    (done, failed, a session lost or replaced) resolves.
    """

    sessions: list[Session]
    what: str  # for errors: "round 7", "the start of run r"
    rejoin_timeout_s: float = 0.0
    lost: dict[tuple[int, ...], tuple[float, str]] = field(default_factory=dict)  # indices -> (deadline, how)
    renewed: float = 0.0  # when a session last rejoined: it gets a full timeout from then
    pending: set[str] = field(init=False)  # ids of the sessions not heard from yet
    done: bool = field(default=False, init=False)
    error: BaseException | None = field(default=None, init=False)
    _wake: asyncio.Future[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.pending = {s.id for s in self.sessions}

    def finished(self) -> bool:
        return self.done

    def waiting_on(self) -> list[Session]:
        return [s for s in self.sessions if s.id in self.pending]

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _heard(self, session: Session) -> None:
        """A session's message was accepted."""
        self.pending.discard(session.id)
        if not self.pending and not self.done:
            self.done = True
            self._poke()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done, self.error = True, error
            self._poke()

    def lose(self, session: Session, reason: str) -> None:
        """A session's stream ended: fail the barrier if it was still waited on, or wait for a rejoin."""
        if session.id not in self.pending or self.done:
            return
        how = f"{session.describe()} {reason} during {self.what}"
        if self.rejoin_timeout_s > 0:
            self.lost[session.indices] = (asyncio.get_running_loop().time() + self.rejoin_timeout_s, how)
            self._poke()
        else:
            self.fail(ClientLost(how, session.indices))

    def replace(self, new: Session) -> Session | None:
        """A rejoining session takes the place of the lost one with its indices; the old one, if it did."""
        if new.indices not in self.lost:
            return None
        old = next(s for s in self.sessions if s.indices == new.indices)
        self.sessions[self.sessions.index(old)] = new
        self.pending.discard(old.id)
        self.pending.add(new.id)
        del self.lost[new.indices]
        self.renewed = asyncio.get_running_loop().time()
        self._poke()
        return old

    async def wait(self, timeout: float) -> None:
        """Until complete; ClientLost naming the silent sessions after `timeout` seconds, or naming a
        lost client that did not rejoin in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.done:
            rejoins = [d for d, _ in self.lost.values()]
            # A rejoin in progress may outlast the round's timeout; a rejoined session gets a full one.
            until = max([deadline, self.renewed + timeout if self.renewed else 0.0, *rejoins])
            nearest = min([until, *rejoins])
            self._wake = wake = loop.create_future()
            timer = loop.call_at(nearest, _resolve, wake)
            try:
                await wake
            finally:
                timer.cancel()
                self._wake = None
            if self.finished():  # (a method: the await above may have changed it)
                break
            now = loop.time()
            gone = [(indices, how) for indices, (d, how) in self.lost.items() if d <= now]
            if gone:
                indices, how = gone[0]
                raise ClientLost(f"{how}, and did not rejoin within {self.rejoin_timeout_s:g} s", indices)
            if now >= until:
                silent = [s for s in self.waiting_on() if s.indices not in self.lost]
                names = "; ".join(s.describe() for s in silent[:5])
                more = f" and {len(silent) - 5} more sessions" if len(silent) > 5 else ""
                raise ClientLost(
                    f"{self.what}: no answer within {timeout:g} s from {names}{more}",
                    tuple(i for s in silent for i in s.indices),
                )
        if self.error is not None:
            raise self.error


@dataclass(eq=False)
class RunStart(Barrier):
    """The start of a run: every session says Ready (or why it cannot serve the run)."""

    run_id: str = ""
    ready: dict[str, pb.Ready] = field(default_factory=dict)

    def accept(self, session: Session, ready: pb.Ready) -> bool:
        """Take a session's Ready; False if this barrier does not wait on it."""
        if session.id in self.pending and ready.run_id == self.run_id:
            self.ready[session.id] = ready
            self._heard(session)
            return True
        return False


@dataclass(eq=False)
class OpenRound(Barrier):
    """A round in flight: what each participating session must answer, and what it did."""

    expected: dict[str, Expectation] = field(default_factory=dict)  # by session id
    answers: dict[str, Answer] = field(default_factory=dict)
    bytes_up: int = 0
    pieces: list[bytes] = field(default_factory=list)  # the serialized task, for sessions whose clients all take part
    # The task for a session with only some of its clients in the round (sampled participation).
    pieces_for: Callable[[tuple[int, ...]], list[bytes]] | None = None
    floats_per_client: int = 0  # float64 entries the task carries (for counting what is sent again)
    straggler_deadline_s: float | None = None  # close the round after this long ...
    min_clients: int | None = None  # ... once this many clients have answered

    def answered_clients(self) -> int:
        return sum(len(self.expected[s.id].indices) for s in self.sessions if s.id in self.answers)

    def expectation(self, session: Session) -> Expectation | None:
        return self.expected.get(session.id)

    def task_for(self, session: Session) -> list[bytes]:
        """The task as this session is sent it: naming only its clients in the round when some of
        its clients sit the round out, so its answer (and a rejoining session's) lists exactly those."""
        mine = self.expected[session.id].indices
        if mine == session.indices or self.pieces_for is None:
            return self.pieces
        return self.pieces_for(mine)

    def replace(self, new: Session) -> Session | None:
        old = super().replace(new)
        if old is not None:
            expected = self.expected.pop(old.id)
            # The new stream's Hello may list its clients in another order than the lost one's.
            self.expected[new.id] = expected._replace(listed=new.listed_for(expected.indices))
        return old

    def accept(self, session: Session, answer: Answer, size: int) -> None:
        self.answers[session.id] = answer
        self.bytes_up += size
        self._heard(session)

    def in_order(self) -> list[Answer]:
        """The answers in client-index order (only those in hand, if a straggler deadline closed the round)."""
        return [self.answers[s.id] for s in self.sessions if s.id in self.answers]

    async def wait(self, timeout: float) -> None:
        if self.straggler_deadline_s is None or self.min_clients is None:
            return await super().wait(timeout)
        try:
            await super().wait(min(timeout, self.straggler_deadline_s))
            return
        except ClientLost:
            if self.answered_clients() >= self.min_clients:
                return  # close with the answers in hand; later ones are stale
            if self.straggler_deadline_s >= timeout:
                raise
        await super().wait(timeout - self.straggler_deadline_s)


@dataclass(eq=False)
class Unmasking(Barrier):
    """Secure aggregation's unmask sub-exchange: each asked client's reply, or its refusal.

    A session lost here does not fail the barrier: the unmasking goes on with the replies
    that came (the aggregator decides whether they are enough), and so does a timeout."""

    run_id: str = ""
    round_id: int = 0
    expected: dict[str, set[int]] = field(default_factory=dict)  # session id -> clients asked
    replies: dict[int, UnmaskReply] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # client -> why it refused (or sent garbage)
    bytes_up: int = 0

    def accept(self, session: Session, reply: pb.UnmaskReply, size: int) -> bool:
        """Take a client's reply; False if this barrier does not wait on it."""
        asked = self.expected.get(session.id)
        client = int(reply.client)
        if asked is None or client not in asked or reply.run_id != self.run_id or reply.round_id != self.round_id:
            return False
        asked.discard(client)
        self.bytes_up += size
        if reply.error:
            self.refusals[client] = printable(reply.error, 1024)
        else:
            try:
                self.replies[client] = messages.read_unmask_reply(reply)
            except wire.WireError as exc:
                self.refusals[client] = f"a malformed unmasking: {exc}"
        if not asked:
            self._heard(session)
        return True

    def lose(self, session: Session, reason: str) -> None:
        if session.id in self.pending and not self.done:
            self._heard(session)  # its clients give no unmasking

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(ClientLost):  # silent clients give no unmasking either
            await super().wait(timeout)


@dataclass
class Barriers:
    """The barrier the coordinator waits on now, if any (one at a time)."""

    starting: RunStart | None = None
    round: OpenRound | None = None
    unmask: Unmasking | None = None

    def lose(self, session: Session, reason: str) -> None:
        for barrier in (self.starting, self.round, self.unmask):
            if barrier is not None:
                barrier.lose(session, reason)
