"""The coordinator protocol's state: one value, the operation under way, with exactly the data it needs.

`Coordination` (protocol.py) holds one of these at a time and replaces it whole on
each transition; which messages a joined session may send in each is written in
one table there (`ACCEPTS`). A state that waits on the sessions holds the barrier
(rounds.py) that counts what came.

    Idle ──await_federation──► Joining ──(all joined / timeout)──► Idle
    Idle ──start_run / open_round──► Presence ──► Starting / RoundOpen ──(settled)──► Idle
    Idle ──unmask──► Unmask ──(settled)──► Idle
    any ──goodbye──► Closed;  RoundOpen / Unmask ──abandon──► Closed (the coordinator stops)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedsaddle.server.transport.actions import Action
from fedsaddle.server.transport.rounds import Collecting, RunStart, Unmasking


@dataclass(frozen=True, slots=True)
class Idle:
    """Between operations."""


@dataclass(frozen=True, slots=True)
class Joining:
    """Waiting until every client index is held by a live session (`await_federation`), up to `deadline`."""

    deadline: float
    timeout: float  # how long it waits in all (for the error that names the missing clients)


@dataclass(frozen=True, slots=True)
class Presence:
    """Waiting, before a run's start or a round, for lost clients to rejoin (and load run `run_id`)."""

    when: str  # "before round 7"
    run_id: str | None
    deadline: float
    then: Callable[[float], list[Action]]  # what to do once everyone is present (it sets the next state)


@dataclass(frozen=True, slots=True)
class Starting:
    """A run's start: every session was sent the RunSpec; waiting for each one's Ready."""

    barrier: RunStart


@dataclass(frozen=True, slots=True)
class RoundOpen:
    """A round in flight: its task was sent; waiting for the participants' answers."""

    barrier: Collecting


@dataclass(frozen=True, slots=True)
class Unmask:
    """Secure aggregation's unmask sub-exchange: waiting for the asked clients' replies."""

    barrier: Unmasking


@dataclass(frozen=True, slots=True)
class Closed:
    """The coordinator stops: after the goodbye, or a round abandoned (a signal). Answers still on their way
    are refused quietly, and a stream that goes away is ended as the server shutting down."""


Operation = Idle | Joining | Presence | Starting | RoundOpen | Unmask | Closed
