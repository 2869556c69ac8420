"""Barriers on the coordinator's event loop: a run's start (every session Ready) and an open round.

A round completes when every participating session has answered; answers are
kept per session and handed back in client-index order, whatever order they
arrived in. A session lost while a barrier waits on it fails the barrier with
an error naming it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fedsaddle.common.tasks import Answer
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import ClientLost
from fedsaddle.server.transport.checks import Expectation
from fedsaddle.server.transport.sessions import Session


@dataclass(eq=False)
class Barrier:
    """Waits for one message from each of some sessions."""

    sessions: tuple[Session, ...]
    what: str  # for errors: "round 7", "the start of run r"
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def waiting_on(self) -> list[Session]:
        return [s for s in self.sessions if not self._has(s)]

    def _has(self, session: Session) -> bool:
        raise NotImplementedError

    def _check_done(self) -> None:
        if not self.future.done() and not self.waiting_on():
            self.future.set_result(None)

    def lose(self, session: Session, reason: str) -> None:
        """A session's stream ended; fail the barrier if it was still waited on."""
        if session in self.sessions and not self._has(session) and not self.future.done():
            self.future.set_exception(ClientLost(f"{session.describe()} {reason} during {self.what}", session.indices))

    async def wait(self, timeout: float) -> None:
        """Until complete; ClientLost naming the silent sessions after `timeout` seconds."""
        try:
            await asyncio.wait_for(asyncio.shield(self.future), timeout)
        except TimeoutError:
            silent = self.waiting_on()
            names = "; ".join(s.describe() for s in silent[:5])
            more = f" and {len(silent) - 5} more sessions" if len(silent) > 5 else ""
            raise ClientLost(
                f"{self.what}: no answer within {timeout:g} s from {names}{more}",
                tuple(i for s in silent for i in s.indices),
            ) from None


@dataclass(eq=False)
class RunStart(Barrier):
    """The start of a run: every session says Ready (or why it cannot serve the run)."""

    run_id: str = ""
    ready: dict[str, pb.Ready] = field(default_factory=dict)

    def _has(self, session: Session) -> bool:
        return session.id in self.ready

    def accept(self, session: Session, ready: pb.Ready) -> None:
        if session in self.sessions and ready.run_id == self.run_id and session.id not in self.ready:
            self.ready[session.id] = ready
            self._check_done()


@dataclass(eq=False)
class OpenRound(Barrier):
    """A round in flight: what each participating session must answer, and what it did."""

    expected: dict[str, Expectation] = field(default_factory=dict)  # by session id
    answers: dict[str, Answer] = field(default_factory=dict)
    bytes_up: int = 0

    def _has(self, session: Session) -> bool:
        return session.id in self.answers

    def expectation(self, session: Session) -> Expectation | None:
        return self.expected.get(session.id)

    def accept(self, session: Session, answer: Answer, size: int) -> None:
        self.answers[session.id] = answer
        self.bytes_up += size
        self._check_done()

    def in_order(self) -> list[Answer]:
        return [self.answers[s.id] for s in self.sessions]


@dataclass
class Barriers:
    """The barrier the coordinator waits on now, if any (one at a time)."""

    starting: RunStart | None = None
    round: OpenRound | None = None

    def lose(self, session: Session, reason: str) -> None:
        for barrier in (self.starting, self.round):
            if barrier is not None:
                barrier.lose(session, reason)
