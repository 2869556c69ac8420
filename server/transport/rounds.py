"""Barriers, without I/O: a run's start (every session Ready) and a round being collected.

A barrier waits for one message from each of some sessions. It is told the time
with every event and asked for its verdict (`verdict(now)`) and its next deadline
(`deadline()`); whoever drives it wakes it then. Answers are kept per session and
handed back in client-index order, whatever order they arrived in. A session lost
while a barrier waits on it fails the barrier with an error naming it, unless
rejoins are allowed: then the barrier waits up to the rejoin timeout for a new
session with the same indices to take its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply
from fedsaddle.common.secagg.settings import SecAggError
from fedsaddle.common.tasks import Answer
from fedsaddle.common.text import printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import ClientLost, PoolError
from fedsaddle.server.secure import MaskedRound
from fedsaddle.server.transport.checks import Expectation
from fedsaddle.server.transport.sessions import Session

_NO_VECTORS = np.empty((0, 0))  # what a folded answer keeps of its vectors


@dataclass(eq=False)
class Barrier:
    """Waits for one message from each of `sessions`, from `opened` for `timeout_s` seconds.

    Completion is counted, not searched for: each accepted message takes its
    session off `pending`, so a round costs O(1) per answer whatever the number
    of sessions.
    """

    sessions: list[Session]
    what: str  # for errors: "round 7", "the start of run r"
    opened: float  # the time it was opened at
    timeout_s: float
    rejoin_timeout_s: float = 0.0
    lost: dict[tuple[int, ...], tuple[float, str]] = field(default_factory=dict)  # indices -> (deadline, how)
    renewed: float = 0.0  # when a session last rejoined: it gets a full timeout from then
    pending: set[int] = field(init=False)  # keys of the sessions not heard from yet
    done: bool = field(default=False, init=False)
    error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.pending = {s.key for s in self.sessions}
        self.done = not self.pending  # (a barrier on no one is over at once)

    def waits_on(self, session: Session) -> bool:
        return session.key in self.pending

    def _heard(self, session: Session) -> None:
        """A session's message was accepted."""
        self.pending.discard(session.key)
        if not self.pending:
            self.done = True

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done, self.error = True, error

    def lose(self, session: Session, reason: str, now: float, final: bool = False) -> None:
        """A session ended: fail the barrier if it was still waited on, or wait for a rejoin (not when
        `final`: the client said it cannot go on)."""
        if session.key not in self.pending or self.done:
            return
        how = f"{session.describe()} {reason} during {self.what}"
        if self.rejoin_timeout_s > 0 and not final:
            self.lost[session.indices] = (now + self.rejoin_timeout_s, how)
        else:
            self.fail(ClientLost(how, session.indices))

    def replace(self, new: Session, now: float) -> Session | None:
        """A rejoining session takes the place of the lost one with its indices; the old one, if it did."""
        if new.indices not in self.lost or self.done:
            return None
        old = next(s for s in self.sessions if s.indices == new.indices)
        self.sessions[self.sessions.index(old)] = new
        self.pending.discard(old.key)
        self.pending.add(new.key)
        del self.lost[new.indices]
        self.renewed = now
        return old

    def _until(self) -> float:
        until = self.opened + self.timeout_s
        if self.renewed or self.lost:  # (asked after every message: the usual round has neither)
            # A rejoin in progress may outlast the timeout; a rejoined session gets a full one.
            renewed = self.renewed + self.timeout_s if self.renewed else 0.0
            until = max(until, renewed, *(d for d, _ in self.lost.values()))
        return until

    def deadline(self) -> float | None:
        """When the verdict may change with no event: a lost session's rejoin deadline, or the timeout."""
        if self.done:
            return None
        if not self.lost:
            return self._until()
        return min([self._until(), *(d for d, _ in self.lost.values())])

    def verdict(self, now: float) -> tuple[bool, BaseException | None]:
        """(settled, the error if it failed): complete, failed, or out of time at `now`."""
        if self.done:
            return True, self.error
        if self.lost:
            gone = [(indices, how) for indices, (d, how) in self.lost.items() if d <= now]
            if gone:
                indices, how = gone[0]
                return True, ClientLost(f"{how}, and did not rejoin within {self.rejoin_timeout_s:g} s", indices)
        if now >= self._until():
            owing = [s for s in self.sessions if s.key in self.pending and s.indices not in self.lost]
            held = [s for s in owing if self.held_back(s)]
            silent = [s for s in owing if not self.held_back(s)] or held
            names = "; ".join(s.describe() for s in silent[:5])
            more = f" and {len(silent) - 5} more sessions" if len(silent) > 5 else ""
            waiting = (
                f"; {len(held)} more sessions were not being read while the sum waited on these"
                if held and silent is not held
                else ""
            )
            return True, ClientLost(
                f"{self.what}: no answer within {self.timeout_s:g} s from {names}{more}{waiting}",
                tuple(i for s in silent for i in s.indices),
            )
        return False, None

    def held_back(self, session: Session) -> bool:
        """Whether the session's stream is not read on for now (its answer then waits on others)."""
        return False


@dataclass(eq=False)
class RunStart(Barrier):
    """The start of a run: every session says Ready (or why it cannot serve the run)."""

    run_id: str = ""
    ready: dict[int, pb.Ready] = field(default_factory=dict)

    def accept(self, session: Session, ready: pb.Ready) -> bool:
        """Take a session's Ready; False if this barrier does not wait on it."""
        if session.key in self.pending and ready.run_id == self.run_id and not self.done:
            self.ready[session.key] = ready
            self._heard(session)
            return True
        return False


@dataclass(eq=False)
class Collecting(Barrier):
    """A round in flight: what each participating session must answer, and what it did.

    With a straggler deadline the round closes after `straggler_deadline_s` once
    `min_clients` clients have answered (later answers are stale): at the deadline
    if they have, else as soon as they have, within the rest of the round's timeout.
    """

    expected: dict[int, Expectation] = field(default_factory=dict)  # by session key
    answers: dict[int, Answer] = field(default_factory=dict)
    bytes_down: int = 0
    bytes_up: int = 0
    pieces: list[bytes] = field(default_factory=list)  # the serialized task, for sessions whose clients all take part
    # The task for a session with only some of its clients in the round (sampled participation).
    pieces_for: Callable[[tuple[int, ...]], list[bytes]] | None = None
    floats_per_client: int = 0  # float64 entries the task carries (for counting what is sent again)
    straggler_deadline_s: float | None = None
    min_clients: int | None = None
    round_timeout_s: float = 0.0  # the whole round's (timeout_s is the current stretch's)
    stragglers_waited: bool = False  # the straggler deadline passed short of min_clients
    # The answers' vectors added up as they come (server/fold.py), or None: every answer kept whole.
    fold: OrderedFold | None = None
    # Secure aggregation: the round's sum, to which masked rows are added as they come, in any order (the
    # answers are kept without them); None: masked rows are kept whole.
    masked_sum: MaskedRound | None = None
    # The reorder buffer's bound: bytes of answers the sessions whose turn has not come may be reading or
    # have sent (None: no bound). The session that holds the fold's next client is always read.
    hold_bytes: int | None = None
    inline_bytes: int = 0  # answers up to this size travel in one message (the federation's chunk size)
    admitted: dict[int, int] = field(default_factory=dict)  # session key -> bytes of its answer, while held
    admitted_bytes: int = 0
    peak_admitted_bytes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.round_timeout_s = self.timeout_s
        if self.straggler_deadline_s is not None and self.min_clients is not None:
            self.timeout_s = min(self.timeout_s, self.straggler_deadline_s)

    def may_read(self, session: Session) -> bool:
        """Whether the session's stream may be read on: always, unless the reorder buffer is bounded, the
        session owes this round an answer, and the buffer has no room for it while its turn has not come.
        A session admitted once keeps being read until its answer is added up."""
        held, size = self._room_for(session)
        if held:
            return False  # (HTTP/2 flow control holds the rest of its answer back on the client)
        if size:
            self.admitted[session.key] = size
            self.admitted_bytes += size
            self.peak_admitted_bytes = max(self.peak_admitted_bytes, self.admitted_bytes)
        return True

    def held_back(self, session: Session) -> bool:
        """Whether may_read would refuse the session now (without admitting it, as may_read does)."""
        return self._room_for(session)[0]

    def _room_for(self, session: Session) -> tuple[bool, int]:
        """(whether the session is held back, the bytes to admit it with if not: 0 when it is read whatever
        the buffer holds: no bound, admitted or answered already, owing nothing, or an answer of one
        message, read before this is asked)."""
        fold, bound = self.fold, self.hold_bytes
        if bound is None or session.key in self.admitted or session.key in self.answers:
            return False, 0
        expected = self.expected.get(session.key)
        if expected is None:
            return False, 0
        size = expected.entry_bytes * len(expected.indices) * expected.entries
        if size <= self.inline_bytes:
            return False, 0
        # The sum's next clients are always read; masked rows (no order) when no other answer is being read.
        turn = fold.next_client in expected.indices if fold is not None else not self.admitted
        if not turn and self.admitted_bytes + size > bound:
            return True, 0
        return False, size

    def _release_added(self) -> None:
        """Free the room of the admitted sessions whose answers are added up."""
        fold = self.fold
        for key in [k for k in self.admitted if k in self.answers]:
            if fold is None or not fold.waits_on(self.expected[key].indices):
                self.admitted_bytes -= self.admitted.pop(key)

    def lose(self, session: Session, reason: str, now: float, final: bool = False) -> None:
        if session.key in self.admitted and session.key not in self.answers:
            self.admitted_bytes -= self.admitted.pop(session.key)  # (what it was sending is dropped)
        super().lose(session, reason, now, final)

    def streams_into(self) -> OrderedFold | MaskedRound | None:
        """The sum an answer in chunks may be added to as they are read: the fold, or the masked rows' sum."""
        return self.fold if self.fold is not None else self.masked_sum

    def answered_clients(self) -> int:
        return sum(len(self.expected[key].indices) for key in self.answers)

    def expectation(self, session: Session) -> Expectation | None:
        return self.expected.get(session.key)

    def task_for(self, session: Session) -> list[bytes]:
        """The task as this session is sent it: naming only its clients in the round when some of
        its clients sit the round out, so its answer (and a rejoining session's) lists exactly those."""
        mine = self.expected[session.key].indices
        if mine == session.indices or self.pieces_for is None:
            return self.pieces
        return self.pieces_for(mine)

    def replace(self, new: Session, now: float) -> Session | None:
        old = super().replace(new, now)
        if old is not None:
            expected = self.expected.pop(old.key)
            # The new stream's Hello may list its clients in another order than the lost one's.
            self.expected[new.key] = expected._replace(listed=new.listed_for(expected.indices))
        return old

    def sit_out(self, new: Session) -> None:
        """A lost session's clients came back (on `new`) but will not answer this round: it stops waiting
        for them, and closes with the others' answers (secure aggregation: they count as dropped)."""
        if new.indices not in self.lost or self.done:
            return
        old = next(s for s in self.sessions if s.indices == new.indices)
        self.sessions.remove(old)
        self.pending.discard(old.key)
        expected = self.expected.pop(old.key, None)
        if self.fold is not None and expected is not None:  # the sum goes on past its clients
            self.admitted_bytes -= self.admitted.pop(old.key, 0)
            self.fold.skip(expected.indices)
        del self.lost[new.indices]
        if not self.pending:
            self.done = True

    def accept(self, session: Session, answer: Answer, size: int, added: bool = False) -> None:
        """Take a checked answer. `added`: its vectors went into the sum as they came (it carries none)."""
        fold = self.fold
        if fold is not None and not added:  # the vectors go into the sum (now, or in their turn); the rest stays
            fold.offer(answer)
            answer = answer._replace(vectors=_NO_VECTORS)
        elif self.masked_sum is not None and not added and answer.shares is not None:
            try:
                for row in messages.as_masked(answer).rows:  # into the round's sum; the shares stay with it
                    self.masked_sum.add(row)
            except SecAggError as exc:  # (checks.answer passed it: the round's own view of it disagrees)
                self.fail(PoolError(str(exc)))
                return
            answer = answer._replace(vectors=_NO_VECTORS)
        self.answers[session.key] = answer
        self.bytes_up += size
        self._heard(session)
        if self.admitted:
            self._release_added()

    def in_order(self) -> list[Answer]:
        """The answers in client-index order (only those in hand, if a straggler deadline closed the round)."""
        return [self.answers[s.key] for s in self.sessions if s.key in self.answers]

    def verdict(self, now: float) -> tuple[bool, BaseException | None]:
        settled, error = super().verdict(now)
        if self.straggler_deadline_s is None or self.min_clients is None:
            return settled, error
        if self.stragglers_waited:  # past the straggler deadline: it closes as soon as min_clients have answered
            if (error is None or isinstance(error, ClientLost)) and self.answered_clients() >= self.min_clients:
                return True, None
            return settled, error
        if not isinstance(error, ClientLost):
            return settled, error
        if self.answered_clients() >= self.min_clients:
            return True, None  # close with the answers in hand; later ones are stale
        if self.straggler_deadline_s >= self.round_timeout_s or self.done:
            return True, error
        # Short of min_clients at the straggler deadline: the round closes once they have answered, within the
        # rest of the round's timeout.
        self.stragglers_waited = True
        self.opened, self.timeout_s = now, self.round_timeout_s - self.straggler_deadline_s
        return super().verdict(now)


@dataclass(eq=False)
class Unmasking(Barrier):
    """Secure aggregation's unmask sub-exchange: each asked client's reply, or its refusal.

    A session lost here does not fail the barrier: the unmasking goes on with the replies
    that came (the aggregator decides whether they are enough), and so does a timeout."""

    run_id: str = ""
    round_id: int = 0
    expected: dict[int, set[int]] = field(default_factory=dict)  # session key -> clients asked
    replies: dict[int, UnmaskReply] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # client -> why it refused (or sent garbage)
    bytes_down: int = 0
    bytes_up: int = 0

    def accept(self, session: Session, reply: pb.UnmaskReply, size: int) -> bool:
        """Take a client's reply; False if this barrier does not wait on it."""
        asked = self.expected.get(session.key)
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

    def lose(self, session: Session, reason: str, now: float, final: bool = False) -> None:
        if session.key in self.pending and not self.done:
            self._heard(session)  # its clients give no unmasking

    def verdict(self, now: float) -> tuple[bool, BaseException | None]:
        settled, error = super().verdict(now)
        return settled, None if isinstance(error, ClientLost) else error  # silent clients give no unmasking either
