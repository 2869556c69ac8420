"""The coordinator's side of the protocol, free of I/O: events in, actions out (the twin of ClientSession).

`Coordination` decides everything the coordinator's transport decides: who joins
(the Hello, the registry of indices), a run's start (a RunSpec to every session,
every Ready checked), each round (the task to the participants, their answers
checked and kept), rejoins and their deadlines, refusal counting, and the goodbye.
It is told the time with every call and never reads a clock, opens a socket or
awaits. It answers with actions (plain values, in actions.py) the shell (servicer.py,
grpc_pool.py) carries out:

- `Send(session, data)`: queue these serialized Instructions on the session's stream;
- `End(session, code, details)`: end the stream, with this status (None: an orderly end);
- `Greeted(session)`: the stream is past its Hello (admission stops counting it as waiting);
- `Settled(result)` / `Failed(error)`: the operation the pool waits on (all clients joined,
  a run started, a round collected) is over.

Events: `connect` (a stream opened), `receive` (a message from it), `stream_ended`
(the client closed its side, or its call went away), `drop` (its stream stopped
reading), `tick` (a deadline came); and the pool's operations: `await_federation`,
`start_run`, `open_round`, `abandon`, `goodbye`. After each, `next_deadline()` says
when to call `tick` if nothing else happens first: a stream's Hello deadline, a lost
client's rejoin deadline, a barrier's timeout, the straggler deadline. There is one
set of deadlines and no polling.

Its state is one value (states.py): Idle between operations; Joining until every
index is held; Presence before a run's start or a round while lost clients may still
rejoin (or load the run); Starting until every session is Ready; RoundOpen until the
round's answers are in; Unmask until secure aggregation's unmask replies are in;
Closed once the coordinator stops. Which messages a joined session may send in each
is one table (`ACCEPTS`, at the end of this file): a message of a kind its state does
not list is refused from that lookup. Each session has its own `State` (sessions.py):
greeting, joined, closing, ended.

Secure aggregation lives here as more of the same: its key agreement rides on the
run's start (each Ready carries public keys, kept with their epochs in `keys`,
server/secure.py; `broadcast` sends the key directory), a masked round is a RoundOpen
round whose answers are masked rows (RoundRequest.masked), and the unmask
sub-exchange is the Unmask state (`unmask`: small requests out, each client's reply
or refusal back; a lost or silent session fails nothing). A further exchange (a
separate key-agreement round, say) would be one more state and barrier here, and
one more row of the table; the shell would not change.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import assert_never, cast

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskRequest
from fedsaddle.common.secagg.settings import SecAggError
from fedsaddle.common.text import RefusalLog, printable
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import ClientLost, PoolError, RunInfo
from fedsaddle.server.secure import KeyEpochs, MaskedRound
from fedsaddle.server.transport import checks
from fedsaddle.server.transport.actions import (
    Action,
    End,
    Failed,
    Greeted,
    MissingClients,
    Received,
    Resent,
    RoundRequest,
    RoundResult,
    Send,
    Settled,
    UnmaskResult,
)
from fedsaddle.server.transport.identity import Identity
from fedsaddle.server.transport.refusal import Refusal, Status
from fedsaddle.server.transport.rounds import Barrier, Collecting, RunStart, Unmasking
from fedsaddle.server.transport.sessions import Incoming, Limits, Registry, Session, State
from fedsaddle.server.transport.states import (
    Closed,
    Idle,
    Joining,
    Operation,
    Presence,
    RoundOpen,
    Starting,
    Unmask,
)

log = logging.getLogger("fedsaddle.coordinator")

GOODBYE_GRACE_S = 2.0  # how long a told-goodbye session may take to close its side
NOT_REPORTED = "not reported"  # a client whose Ready leaves numeric_stack empty (an outside implementation)
# A session refused this many times in one round (since its last accepted answer) is ended. An honest
# one is refused once or twice in a round at most: a straggler's answer that comes after the round closed.
MAX_REFUSED_IN_A_ROUND = 32
# A client's reason for refusing a run is kept whole up to this many characters (4 KiB): a plug-in's
# import error or a data file's fault, with its path, fits; a hostile megabyte does not reach the log.
REFUSAL_CHARACTERS = 4096


def _drop_incoming(session: Session) -> None:
    """Forget the answer being read from a session; one being added to a round's sum is taken back out."""
    pending = session.incoming
    session.incoming = None
    if pending is not None and pending.fold is not None:
        pending.fold.abort_stream()


class Coordination:
    """The coordinator's protocol state: sessions, the run, the operation under way, and its deadlines."""

    def __init__(
        self,
        num_clients: int,
        welcome: pb.Welcome,
        *,
        limits: Limits | None = None,
        round_timeout_s: float = 60.0,
        rejoin_timeout_s: float = 0.0,
        straggler_deadline_s: float | None = None,
        min_clients: int | None = None,
    ) -> None:
        self.registry = Registry(num_clients)
        self.welcome = pb.Instruction(welcome=welcome).SerializeToString()
        self.chunk_bytes = welcome.chunk_bytes
        self.min_piece = wire.min_piece(welcome.chunk_bytes)
        self.limits = limits or Limits()
        self.round_timeout_s, self.rejoin_timeout_s = round_timeout_s, rejoin_timeout_s
        self.straggler_deadline_s, self.min_clients = straggler_deadline_s, min_clients
        self.sessions: dict[int, Session] = {}
        self._next_key = 0
        self._greeting: OrderedDict[int, float] = OrderedDict()  # key -> Hello deadline (in deadline order)
        self.state: Operation = Idle()  # the operation under way (one at a time)
        self.refusals = RefusalLog(log)
        # What clients said in their own words (a Failure's reason, a Ready's error), by client index: the run's
        # failure quotes it to the operator, but the Goodbye to the other clients says instead that the client
        # told the coordinator why (the phrase quoting it, what replaces it). At most n entries.
        self._said: dict[int, tuple[str, str]] = {}
        # The run: its RunSpec (resent to sessions that rejoin), its dimension, the sample counts.
        self.run: RunInfo | None = None
        self._spec: bytes | None = None
        self._counts: list[int] | None = None
        self.keys = KeyEpochs()  # secure aggregation: each client's key in this run, and the re-agreements
        self._stacks: dict[int, str] = {}  # client index -> the numeric stack its process reported in Ready
        self._warned_stacks: dict[str, list[int]] = {}  # the differing stacks last warned about
        self._resent = [0, 0, 0]  # messages, float64 entries and bytes sent again to rejoining sessions

    # -- streams ----------------------------------------------------------------------------

    def connect(self, peer: str, identity: Identity | Refusal | None, now: float) -> int:
        """A stream opened (admitted by the shell): its key. It has `hello_timeout_s` to say Hello."""
        key = self._next_key
        self._next_key += 1
        self.sessions[key] = Session(key, peer, identity)
        self._greeting[key] = now + self.limits.hello_timeout_s
        return key

    def receive(self, key: int, received: Received, now: float) -> list[Action]:
        """A message from a session's stream."""
        session = self.sessions.get(key)
        if session is None or session.state is State.ENDED:
            return []
        actions: list[Action] = []
        try:
            if session.state is State.GREETING:
                self._hello(session, received, now, actions)
            else:
                self._dispatch(session, received, now, actions)
        except Refusal as refusal:
            self._end(session, refusal, now, actions)
        return self._settle(now, actions)

    def stream_ended(self, key: int, now: float, gone: bool = False) -> list[Action]:
        """The client closed its side, or (`gone`) its call went away: the server stopping, the client gone."""
        session = self.sessions.get(key)
        if session is None or session.state is State.ENDED:
            return []
        actions: list[Action] = []
        if session.state is State.GREETING:
            if gone:
                self._ended(session, actions)
                actions.append(End(key, None))
            else:
                self._end(session, Refusal(checks.INVALID, "the stream ended before a Hello"), now, actions)
        elif gone and isinstance(self.state, Closed) and session.state is not State.CLOSING:
            self._end(session, Refusal(Status.UNAVAILABLE, "the coordinator is shutting down"), now, actions)
        else:
            why = "ended its session" if session.state is State.CLOSING else "disconnected"
            self._close(session, why, now)
            actions.append(End(key, None))
        return self._settle(now, actions)

    def drop(self, key: int, undelivered: int, now: float) -> list[Action]:
        """The session's stream stopped reading (`undelivered` bytes wait, past their bound): it is lost, by name."""
        session = self.sessions.get(key)
        if session is None or session.state is State.ENDED:
            return []
        reason = f"{session.describe()} stopped reading its stream ({undelivered} bytes undelivered)"
        self._close(session, f"was dropped: {reason}", now)
        log.warning("ended the session of %s: %s", session.describe(), reason)
        actions: list[Action] = [End(key, Status.RESOURCE_EXHAUSTED, reason, at_once=True)]
        return self._settle(now, actions)

    def may_read(self, key: int) -> bool:
        """Whether the shell may read the session's next message now. False only in a folded round whose
        reorder buffer is full, for a session whose turn has not come: the shell asks again after the
        next event."""
        round_ = self.collecting
        if round_ is None:
            return True
        session = self.sessions.get(key)
        if session is None or session.state is not State.JOINED:
            return True
        pending = session.incoming
        if pending is not None and pending.fold is None and not pending.refused and round_.streams_into() is not None:
            self._stream_if_due(session, round_, pending)
        return round_.hold_bytes is None or round_.may_read(session)  # (no bound: every stream is read)

    def _stream_if_due(self, session: Session, round_: Collecting, pending: Incoming) -> None:
        """An answer whose header came before its clients were next in the sum (or, masked, while another
        answer was being added), and whose chunks have not been read: added chunk by chunk once it may be
        (its header was checked when it came)."""
        fold, expected = round_.streams_into(), round_.expectation(session)
        if fold is None or expected is None or pending.assembler.filled or pending.header.round_id != expected.round_id:
            return
        if tuple(pending.header.client_indices) == expected.indices and fold.begin_stream(
            expected.indices, expected.entries
        ):
            assembler = wire.Assembler(pending.assembler.total, min_piece=self.min_piece, keep=False)
            session.incoming = pending._replace(assembler=assembler, fold=fold)

    def forget(self, key: int) -> None:
        """The shell is done with the stream (it ended): nothing more is kept about it."""
        self.sessions.pop(key, None)
        self._greeting.pop(key, None)

    def greeting(self, key: int) -> bool:
        session = self.sessions.get(key)
        return session is not None and session.state is State.GREETING

    def tick(self, now: float) -> list[Action]:
        """Deadlines up to `now` have passed."""
        actions: list[Action] = []
        while self._greeting:
            key, deadline = next(iter(self._greeting.items()))
            if deadline > now:
                break
            timeout = f"no Hello within {self.limits.hello_timeout_s:g} s"
            self._end(self.sessions[key], Refusal(Status.DEADLINE_EXCEEDED, timeout), now, actions)
        return self._settle(now, actions)

    def next_deadline(self) -> float | None:
        """When to call `tick` if nothing happens before."""
        state = self.state
        match state:  # (class patterns without arguments: asked after every message, they cost least)
            case RoundOpen() | Starting() | Unmask():
                soonest: float | None = state.barrier.deadline()
            case Joining() | Presence():
                soonest = state.deadline
            case _:
                soonest = None
        if self._greeting:
            hello = next(iter(self._greeting.values()))
            soonest = hello if soonest is None else min(soonest, hello)
        return soonest

    # -- the pool's operations --------------------------------------------------------------

    def await_federation(self, timeout: float, now: float) -> list[Action]:
        """Settles when every client index is held; Failed(MissingClients) after `timeout` seconds."""
        self.state = Joining(now + timeout, timeout)
        return self._settle(now, [])

    def start_run(self, run: RunInfo, spec: bytes, now: float) -> list[Action]:
        """Send the RunSpec to every session and wait until all are Ready. Settles with the clients'
        sample counts by index when the run asked for them (else None); Failed naming any that is not."""
        self.run, self._spec, self._counts, self.keys = run, spec, None, KeyEpochs()

        def send_spec(now: float) -> list[Action]:
            sessions = self.registry.live()
            what = f"the start of run {run.run_id}"
            barrier = RunStart(
                list(sessions), what, now, self.round_timeout_s, self.rejoin_timeout_s, run_id=run.run_id
            )
            self.state = Starting(barrier)
            return [Send(s.key, spec) for s in sessions]

        return self._await_presence(f"before run {run.run_id}", None, send_spec, now)

    def open_round(self, request: RoundRequest, now: float) -> list[Action]:
        """Send one round's task to the participating sessions. Settles with a RoundResult."""
        run = self.run
        assert run is not None

        def send_task(now: float) -> list[Action]:
            taking_part: list[tuple[Session, tuple[int, ...]]] = []
            subset = request.subset
            # Secure aggregation: every client of the round, whose shares each masked row must carry.
            round_clients = tuple(sorted(subset)) if subset is not None else tuple(range(run.num_clients))
            for session in self.registry.live():
                mine = session.indices if subset is None else tuple(i for i in session.indices if i in subset)
                if mine:
                    taking_part.append((session, mine))
            expected = {
                s.key: checks.Expectation(
                    run.run_id,
                    request.round_id,
                    mine,
                    request.entries,
                    request.want_objective,
                    request.counts,
                    s.listed_for(mine),
                    request.masked,
                    round_clients,
                    run.secure.neighbours if run.secure is not None else 0,
                    run.element,
                )
                for s, mine in taking_part
            }
            fold, hold = None, None
            if request.fold:
                fold = OrderedFold(round_clients, request.weights, run.num_clients, run.element.str)
            entry_bytes = 8 if request.masked else run.element.itemsize
            if fold is not None or request.masked_sum is not None:
                answers_bytes = entry_bytes * request.entries * len(round_clients)
                # With a straggler deadline the answering clients are known only when the round closes, and
                # every answer that comes before it counts: none is held back (the buffer is not bounded).
                # Beyond the bound, the streams whose turn has not come are not read until the sum reaches
                # them (HTTP/2 flow control keeps the rest of their answers on the clients). Masked rows add
                # up in any order: their turn is whenever the answers being read leave room (one always is).
                # An answer of one message is read whatever the buffer holds (Collecting._room_for): a round
                # whose answers all are has no bound to keep, and its streams are never asked about it.
                bound = self.limits.reorder_bytes
                largest = entry_bytes * request.entries * max((len(mine) for _, mine in taking_part), default=0)
                if self.straggler_deadline_s is None and answers_bytes > bound and largest > self.chunk_bytes:
                    hold = bound
            round_ = Collecting(
                [s for s, _ in taking_part],
                f"round {request.round_id}",
                now,
                self.round_timeout_s,
                self.rejoin_timeout_s,
                expected=expected,
                pieces=request.pieces,
                pieces_for=request.pieces_for,
                floats_per_client=request.floats,
                straggler_deadline_s=self.straggler_deadline_s,
                min_clients=self.min_clients,
                fold=fold,
                masked_sum=request.masked_sum,
                hold_bytes=hold,
                inline_bytes=self.chunk_bytes,
            )
            self.state = RoundOpen(round_)
            # max(64 MiB by default, 3 rounds' tasks) may wait undelivered: more means a session stopped reading.
            bound = max(self.limits.max_undelivered_bytes, 3 * sum(len(p) for p in request.pieces))
            actions: list[Action] = []
            if self.keys.due:  # clients came back with new keys: the directory of the next epoch goes first
                actions, _ = self.broadcast(self.keys.agree_anew(run.run_id, len(self.registry.live())))
            for session, _ in taking_part:
                for piece in round_.task_for(session):
                    actions.append(Send(session.key, piece, bound))
                    round_.bytes_down += len(piece)
            return actions

        return self._await_presence(f"before round {request.round_id}", run.run_id, send_task, now)

    def unmask(self, requests: dict[int, UnmaskRequest], now: float) -> list[Action]:
        """Secure aggregation's unmask sub-exchange: each request to the session hosting its client.
        Settles with an UnmaskResult (a lost or silent session gives no replies; it fails nothing)."""
        run = self.run
        assert run is not None
        round_id = next(iter(requests.values())).round_id
        asked = [(s, sorted(set(s.indices) & set(requests))) for s in self.registry.live()]
        asked = [(s, clients) for s, clients in asked if clients]
        barrier = Unmasking(
            [s for s, _ in asked],
            f"the unmasking of round {round_id}",
            now,
            self.round_timeout_s,
            run_id=run.run_id,
            round_id=round_id,
            expected={s.key: set(clients) for s, clients in asked},
        )
        self.state = Unmask(barrier)
        actions: list[Action] = []
        serialized = messages.unmask_requests(run.run_id, requests)
        for session, clients in asked:
            for client in clients:
                data = serialized[client]
                actions.append(Send(session.key, data))
                barrier.bytes_down += len(data)
        return self._settle(now, actions)

    def broadcast(self, data: bytes) -> tuple[list[Action], int]:
        """Send an instruction to every live session (secure aggregation's key directory): the bytes sent."""
        sessions = self.registry.live()
        return [Send(s.key, data) for s in sessions], len(data) * len(sessions)

    def abandon(self) -> None:
        """The pool stopped waiting (interrupted by a signal): no operation is under way any more. A round
        or an unmasking abandoned so means the coordinator stops: the answers already on their way cross
        its goodbye, and are refused quietly, as after it."""
        self.state = Closed() if isinstance(self.state, RoundOpen | Unmask | Closed) else Idle()

    def goodbye(self, reason: str, outcome: pb.Outcome) -> list[Action]:
        """Say goodbye to every live session; each may then close its side."""
        self.state = Closed()
        # Longest first: a client's words may begin another's (a hostile client's "cannot" inside an honest
        # one's "cannot read /data/..."), and replacing the shorter first would leave the rest in the open.
        said = sorted(set(self._said.values()), key=lambda pair: -len(pair[0])) if outcome == pb.FAILED else []
        for phrase, instead in said:
            reason = reason.replace(phrase, instead)
        goodbye = pb.Instruction(goodbye=pb.Goodbye(reason=reason, outcome=outcome)).SerializeToString()
        actions: list[Action] = []
        for session in self.registry.live():
            session.state = State.CLOSING
            actions += [Send(session.key, goodbye), End(session.key, None, linger_s=GOODBYE_GRACE_S)]
        return actions

    @property
    def collecting(self) -> Collecting | None:
        """The round in flight, if one is (what it expects and what came)."""
        state = self.state
        return state.barrier if type(state) is RoundOpen else None

    def take_resent(self) -> Resent:
        """What was sent again to rejoining sessions since the last call (retransmission traffic)."""
        resent = Resent(*self._resent)
        self._resent[:] = [0, 0, 0]
        return resent

    def missing(self) -> list[int]:
        """The client indices no live session holds now."""
        return self.registry.missing()

    def numeric_stacks(self) -> dict[str, list[int]]:
        """What the clients reported computing with (numpy, BLAS kernel): the client indices of each."""
        grouped: dict[str, list[int]] = {}
        for index in sorted(self._stacks):
            grouped.setdefault(self._stacks[index], []).append(index)
        return grouped

    # -- settling the operation under way ---------------------------------------------------

    def _barrier(self) -> Barrier | None:
        state = self.state
        match state:
            case RoundOpen() | Starting() | Unmask():
                return state.barrier
        return None

    def _settle(self, now: float, actions: list[Action]) -> list[Action]:
        """Append Settled or Failed if the operation under way is over at `now` (after any event)."""
        state = self.state
        match state:  # (a round's first: every answer settles against it)
            case RoundOpen():
                round_ = state.barrier
                settled, error = round_.verdict(now)
                if settled:
                    self._cut_streams(round_, actions)
                    result = RoundResult(round_.in_order(), round_.bytes_down, round_.bytes_up, round_.fold)
                    self._finish(actions, Settled(result) if error is None else Failed(error))
            case Joining():
                if self.registry.complete:
                    self._finish(actions, Settled(None))
                    log.info("all %d clients connected", self.registry.num_clients)
                elif now >= state.deadline:
                    missing = MissingClients(self.registry.missing(), state.timeout, self.registry.why_missing())
                    self._finish(actions, Failed(missing))
            case Presence():
                self._check_presence(state, now, actions)
            case Starting():
                settled, error = state.barrier.verdict(now)
                if settled:
                    self._finish(actions, self._run_started(state.barrier) if error is None else Failed(error))
            case Unmask():
                unmasking = state.barrier
                settled, error = unmasking.verdict(now)
                if settled:
                    unmasked = UnmaskResult(
                        unmasking.replies, unmasking.refusals, unmasking.bytes_down, unmasking.bytes_up
                    )
                    self._finish(actions, Settled(unmasked) if error is None else Failed(error))
            case Idle() | Closed():
                pass
            case _:
                assert_never(state)
        return actions

    def _cut_streams(self, round_: Collecting, actions: list[Action]) -> None:
        """Answers being added to the round's sum chunk by chunk as it closes (a straggler deadline passed) are
        out: the sum is put back as it was before each, which the pool reads next, and the rest of their chunks
        is read and dropped, as a refused answer's is."""
        for session in round_.sessions:
            pending = session.incoming
            if pending is None or pending.fold is None:
                continue
            pending.fold.abort_stream()
            session.incoming = pending._replace(fold=None, refused=True)
            details = f"round {pending.header.round_id} closed while this answer was being read (it is stale)"
            # (not counted against the session: the round closing is no fault of its answer, and a Refusal
            # raised here, as the round settles, would leave it unsettled with no deadline armed)
            code = Status.FAILED_PRECONDITION
            self._reject(session, pending.header.round_id, code, details, actions, counted=False)

    def _finish(self, actions: list[Action], outcome: Settled | Failed) -> None:
        self.state = Idle()
        actions.append(outcome)

    def _await_presence(
        self, when: str, run_id: str | None, then: Callable[[float], list[Action]], now: float
    ) -> list[Action]:
        """Do `then` once every client is connected (and loaded for `run_id`, if given). With rejoins
        allowed, waits up to the rejoin timeout for missing clients to come back; ClientLost naming them
        if they do not."""
        self.state = Presence(when, run_id, now + self.rejoin_timeout_s, then)
        return self._settle(now, [])

    def _present(self, run_id: str | None) -> bool:
        if not self.registry.complete:
            return False
        return run_id is None or all(s.ready_run == run_id for s in self.registry.live())

    def _check_presence(self, presence: Presence, now: float, actions: list[Action]) -> None:
        if not self._present(presence.run_id) and self.rejoin_timeout_s > 0 and now < presence.deadline:
            return
        self.state = Idle()  # (until `then` opens what waited)
        try:
            sessions = self.registry.require_all(presence.when)
        except ClientLost as lost:
            if self.rejoin_timeout_s > 0:  # as a round's barrier says it of a client lost during the round
                lost = ClientLost(f"{lost}, and did not rejoin within {self.rejoin_timeout_s:g} s", lost.client_indices)
            self._finish(actions, Failed(lost))
            return
        unready = [s for s in sessions if presence.run_id is not None and s.ready_run != presence.run_id]
        if unready:
            said = f"{unready[0].describe()} rejoined {presence.when} but did not say Ready"
            self._finish(actions, Failed(ClientLost(said, unready[0].indices)))
            return
        actions += presence.then(now)
        self._settle(now, actions)  # (a round of no one is over at once)

    def _run_started(self, barrier: RunStart) -> Settled | Failed:
        run = self.run
        assert run is not None
        counts = [0] * run.num_clients
        for session in barrier.sessions:
            ready = barrier.ready[session.key]
            problem = self._problem_with(session, ready, run)
            if problem is not None:
                return Failed(PoolError(problem))
            session.ready_run = run.run_id
            for index, count in zip(session.hello_order, ready.sample_counts, strict=False):
                counts[index] = count
            self.keys.keep(session.hello_order, ready.public_keys)
            self._note_stack(session, ready)
        self._counts = counts if run.weighting == "samples" and run.secure is None else None
        self._warn_if_stacks_differ(run.run_id)
        return Settled(self._counts)

    def _problem_with(self, session: Session, ready: pb.Ready, run: RunInfo) -> str | None:
        """Why a session's Ready does not let the run go on, or None."""
        if ready.error:
            said = f"cannot serve run {run.run_id}: {printable(ready.error, REFUSAL_CHARACTERS)}"
            for index in session.indices:
                self._said[index] = (said, f"cannot serve run {run.run_id} (it told the coordinator why)")
            return f"{session.describe()} {said}"
        if ready.dimension != run.dimension:
            return (
                f"{session.describe()} has data of dimension {ready.dimension}, "
                f"but run {run.run_id} expects {run.dimension}"
            )
        wanted = pb.FLOAT32 if run.precision == "float32" else pb.FLOAT64
        if ready.element_type != wanted:
            said = (
                pb.ElementType.Name(ready.element_type)
                if ready.element_type in (pb.FLOAT32, pb.FLOAT64)
                else str(ready.element_type)
            )
            return (
                f"{session.describe()} answers in {said}, but run {run.run_id} has precision {run.precision} "
                f"(RunSpec.element_type {pb.ElementType.Name(wanted)}): a client that predates float32 runs "
                "cannot serve them; update it, or run with precision: float64"
            )
        if run.secure is not None:
            rejoins = self.rejoin_timeout_s > 0
            return self.keys.problem_with(session.describe(), session.indices, ready.public_keys, run.run_id, rejoins)
        reported = list(ready.sample_counts)
        if run.weighting == "samples" and len(reported) != len(session.indices):
            return f"{session.describe()} reported {len(reported)} sample counts for {len(session.indices)} clients"
        if run.weighting == "samples" and 0 in reported:
            empty = session.hello_order[reported.index(0)]
            return (
                f"{session.describe()} reported 0 training samples for client {empty}: weighted by samples, "
                "every client must bring some"
            )
        if self._counts is not None:  # a rejoining session must bring the same data
            before = [self._counts[i] for i in session.hello_order]
            if reported != before:
                return f"{session.describe()} rejoined with sample counts {reported[:8]}, had {before[:8]}"
        return None

    def _note_stack(self, session: Session, ready: pb.Ready) -> None:
        for index in session.indices:
            self._stacks[index] = printable(ready.numeric_stack, 256) or NOT_REPORTED

    def _warn_if_stacks_differ(self, run_id: str) -> None:
        """Warn when the clients' reported stacks differ, once for each grouping (not once per run)."""
        stacks = {k: v for k, v in self.numeric_stacks().items() if k != NOT_REPORTED}  # (the field is optional)
        if len(stacks) > 1 and stacks != self._warned_stacks:
            self._warned_stacks = stacks
            told = "; ".join(f"{stack} (clients {some(indices)})" for stack, indices in stacks.items())
            log.warning(
                "run %s: the client processes compute with different numeric stacks: %s. Matrix products may "
                "then differ in their last bits between clients and from simulate (set OPENBLAS_CORETYPE alike "
                "on every host)",
                run_id,
                told,
            )

    # -- a session's start and end ----------------------------------------------------------

    def _hello(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """The first message of a stream: a Hello, or the stream is refused."""
        try:
            if received.message is None:
                raise Refusal(checks.INVALID, f"{received.size} bytes that are not a ClientMessage: {received.fault}")
            if received.message.WhichOneof("body") != "hello":
                raise Refusal(checks.INVALID, "a session must start with a Hello")
            hello = received.message.hello
            if isinstance(session.identity, Refusal):
                raise session.identity
            indices = checks.hello_indices(hello, self.registry.num_clients)
            if session.identity is not None:
                session.identity.check_indices(indices)
            ordered = tuple(sorted(indices))
            session.indices, session.name = ordered, printable(hello.client_name, 256)
            session.listed = indices if indices != ordered else None
            self.registry.open(session)
        except Refusal as refusal:
            self.refusals.warn("refused a session from %s: %s", session.peer, refusal.details)
            message = received.message
            if message is not None and message.WhichOneof("body") == "hello":  # (its indices may be missing now)
                self.registry.refuse(session.peer, message.hello.client_indices, refusal.details)
            session.indices = ()
            self._ended(session, actions)
            actions.append(End(session.key, refusal.code, refusal.details))
            return
        session.state = State.JOINED
        del self._greeting[session.key]
        log.info("%s joined", session.describe())
        actions += [Greeted(session.key, joined=True), Send(session.key, self.welcome)]
        self._rejoined(session, now, actions)

    def _rejoined(self, session: Session, now: float, actions: list[Action]) -> None:
        """A session joined while a run is under way: it can only be a client coming back."""
        if self._spec is None:
            return
        state = self.state
        # The run's start now waits on it, or (rejoins allowed) its Ready comes to _ready.
        if (
            isinstance(state, Starting) and state.barrier.replace(session, now) is not None
        ) or self.rejoin_timeout_s > 0:
            self._resend(session, [self._spec], actions)
            run_id = self.run.run_id if self.run else "?"
            log.info("%s rejoined; sent it run %s", session.describe(), run_id)

    def _resend(self, session: Session, pieces: list[bytes], actions: list[Action], clients: int = 0) -> None:
        round_ = self.collecting
        floats = round_.floats_per_client * clients if round_ is not None else 0
        for piece in pieces:
            actions.append(Send(session.key, piece))
            self._resent[2] += len(piece)
        self._resent[0] += clients
        self._resent[1] += floats

    def _end(self, session: Session, refusal: Refusal, now: float, actions: list[Action]) -> None:
        """End a session from the coordinator's side, with the refusal's status."""
        if session.state is State.GREETING:
            self.refusals.warn("refused a session from %s: %s", session.peer, refusal.details)
            self._ended(session, actions)
        else:
            # The run that fails for it says why, not just that it left.
            self._close(session, f"was ended by the coordinator ({refusal.details})", now)
            log.warning("ended the session of %s: %s", session.describe(), refusal.details)
        actions.append(End(session.key, refusal.code, refusal.details))

    def _ended(self, session: Session, actions: list[Action]) -> None:
        """A stream that never joined is over."""
        session.state = State.ENDED
        if self._greeting.pop(session.key, None) is not None:
            actions.append(Greeted(session.key))

    def _close(self, session: Session, reason: str, now: float, final: bool = False) -> None:
        """A joined session is over: its indices are free, and the barrier waiting on it is told (`final`:
        the client said it cannot go on, and no rejoin is waited for)."""
        _drop_incoming(session)
        session.state = State.ENDED
        self.registry.close(session, reason)
        barrier = self._barrier()
        if barrier is not None:
            barrier.lose(session, reason, now, final)
        log.info("%s %s", session.describe(), reason)

    # -- what a joined session sends --------------------------------------------------------

    def _dispatch(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """Hand a joined session's message to the method its state's row of ACCEPTS names for its kind; a kind
        the row does not list is refused as REFUSED says for that kind."""
        if received.chunk is not None:  # the usual large message, read by hand
            kind: str | None = "chunk"
        else:
            message = received.message
            kind = message.WhichOneof("body") if message is not None else None
        handler = ACCEPTS[type(self.state)].get(kind) or REFUSED.get(kind, Coordination._unreadable)
        handler(self, session, received, now, actions)

    def _unreadable(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """What no state accepts from a joined session: bytes that are not a ClientMessage, one of no kind this
        coordinator knows, or a second Hello. The session is ended."""
        message = received.message
        if message is None:
            what = "bytes that are not a ClientMessage"
        elif (
            message.WhichOneof("body") == "hello"
        ):  # a session's indices are the first Hello's, for as long as it lasts
            what = "a second Hello"
        else:  # empty, or of a kind added after this coordinator was built
            what = "a ClientMessage of no kind this coordinator knows"
        fault = f": {received.fault}" if message is None else ""
        raise Refusal(checks.INVALID, f"{what} ({received.size} bytes){fault}")

    def _chunk(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """A Chunk: the next piece of the session's answer being read (accepted in every state: the round it
        answers may have closed while it came, which the complete answer's check then says)."""
        if received.chunk is not None:
            self._piece(session, received.chunk, received.size, actions)
        else:
            assert received.message is not None
            self._piece(session, received.message.chunk, received.size, actions)

    def _failure(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """The client cannot go on: the operation waiting on it fails with its reason, at once."""
        assert received.message is not None
        failed = f"failed: {printable(received.message.failure.reason, 1024) or 'no reason given'}"
        for index in session.indices:
            self._said[index] = (f" {failed}", " failed (it told the coordinator why)")
        self._close(session, failed, now, final=True)
        actions.append(End(session.key, None))

    def _unmasked(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """A client's unmask reply, in the unmasking (counted against the session if it was not asked for)."""
        state = self.state
        assert isinstance(state, Unmask) and received.message is not None
        if not state.barrier.accept(session, received.message.unmasked, received.size):
            self._unmasked_refused(session, received, now, actions)

    def _unmasked_refused(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        assert received.message is not None
        self._count_refusal(session, f"an unmasking for round {received.message.unmasked.round_id}, not asked")

    def _first_ready(self, session: Session, received: Received) -> pb.Ready:
        """The Ready a message carries; Refusal if the session said Ready for that run already."""
        assert received.message is not None
        ready = received.message.ready
        if ready.run_id and ready.run_id == session.ready_run:  # a Ready answers a RunSpec, once
            raise Refusal(checks.INVALID, f"a second Ready for run {printable(ready.run_id, 64)!r}")
        return ready

    def _ready_to_start(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """A Ready as the run starts: the start's, or a rejoining session's."""
        state = self.state
        assert isinstance(state, Starting)
        ready = self._first_ready(session, received)
        if not state.barrier.accept(session, ready):
            self._rejoin_ready(session, ready, now, actions)

    def _ready_to_rejoin(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """A Ready while a run may be under way: a rejoining session's (or a late one: a RunSpec resent as a
        run ended)."""
        self._rejoin_ready(session, self._first_ready(session, received), now, actions)

    def _ready_refused(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        self._not_under_way(session, self._first_ready(session, received))

    def _not_under_way(self, session: Session, ready: pb.Ready) -> None:
        self._count_refusal(session, f"a Ready for run {printable(ready.run_id, 64)!r}, not under way")

    def _rejoin_ready(self, session: Session, ready: pb.Ready, now: float, actions: list[Action]) -> None:
        """A rejoining session is loaded: it takes its place in the open round, and is sent the task
        again. Counted against the session if the Ready is not for the run under way."""
        run = self.run
        if run is None or ready.run_id != run.run_id:
            self._not_under_way(session, ready)
            return
        problem = self._problem_with(session, ready, run)
        round_ = self.collecting
        if problem is not None:
            if round_ is not None:
                round_.fail(PoolError(problem))
            log.error("%s", problem)
            return
        session.ready_run = run.run_id
        self._note_stack(session, ready)  # it may have come back on another machine, or another build
        self._warn_if_stacks_differ(run.run_id)
        if run.secure is not None:
            self.keys.rejoined(session.hello_order, ready.public_keys)
            if round_ is not None:
                # Its new keys do not fit the masks the others sent in this round: it sits the round out (one
                # of the clients that dropped), and takes part again after the key agreement of the next.
                round_.sit_out(session)
            return
        if round_ is not None and round_.replace(session, now) is not None:
            self._resend(session, round_.task_for(session), actions, len(round_.expected[session.key].indices))

    def _new_answer(self, session: Session, received: Received, actions: list[Action]) -> pb.Answer:
        """The Answer a message carries; an answer still being read from the session before it is dropped
        (and refused, unless it was already)."""
        assert received.message is not None
        pending = session.incoming
        if pending is not None:
            if not pending.refused:
                before = "a new Answer before the chunks"
                self._reject(session, pending.header.round_id, checks.INVALID, before, actions)
            _drop_incoming(session)
        return received.message.answer

    def _answer_refused(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """An Answer while no round is open: refused as checks.answer_header words it (FAILED_PRECONDITION, or
        PERMISSION_DENIED for clients not the session's own)."""
        header = self._new_answer(session, received, actions)
        try:
            checks.answer_header(header, session.indices, None, answered=False)
        except Refusal as refusal:
            self._refused_answer(session, header, refusal, received, actions)

    def _answer(self, session: Session, received: Received, now: float, actions: list[Action]) -> None:
        """An Answer in a round; `received.payload`: its payload, when it was read by hand (then the header's
        own is empty)."""
        header, size, inline = self._new_answer(session, received, actions), received.size, received.payload
        round_ = self.collecting
        expected = round_.expectation(session) if round_ is not None else None
        try:
            answered = round_ is not None and session.key in round_.answers
            length = checks.answer_header(header, session.indices, expected, answered)
        except Refusal as refusal:
            self._refused_answer(session, header, refusal, received, actions)
            return
        payload = header.payload if inline is None else inline  # (each read of a bytes field is a copy)
        if length and not payload:  # chunks follow
            fold = round_.streams_into() if round_ is not None else None
            if (
                fold is not None
                and expected is not None
                and tuple(header.client_indices) == expected.indices
                and fold.begin_stream(expected.indices, expected.entries)
            ):  # its clients are next in the sum: added chunk by chunk, never held whole
                assembler = wire.Assembler(length, min_piece=self.min_piece, keep=False)
                session.incoming = Incoming(header, assembler, size, fold=fold)
                return
            session.incoming = Incoming(header, wire.Assembler(length, min_piece=self.min_piece), size)
            return
        assert round_ is not None and expected is not None
        self._accept(session, round_, expected, header, payload, size, actions)

    def _refused_answer(
        self, session: Session, header: pb.Answer, refusal: Refusal, received: Received, actions: list[Action]
    ) -> None:
        """Tell the session its Answer was refused; chunks that may follow it are read, and not refused again."""
        self._reject(session, header.round_id, refusal.code, refusal.details, actions)
        run = self.run
        # (a masked row holds two more entries: the objective and the weight)
        most = len(session.indices) * (run.dimension + (2 if run.secure is not None else 0) if run else 0)
        if received.payload is not None or header.payload or not 0 < header.payload_length <= most:
            return  # (chunks that follow are refused one by one)
        # Its chunks may be on their way (a late answer, say): read them, but refuse only once.
        entry_bytes = 8 if run is None or run.secure is not None else run.element.itemsize
        skipped = wire.Assembler(entry_bytes * header.payload_length, min_piece=self.min_piece, keep=False)
        session.incoming = Incoming(header, skipped, received.size, refused=True)

    def _piece(self, session: Session, chunk: pb.Chunk | wire.RawChunk, size: int, actions: list[Action]) -> None:
        """A Chunk of the answer being assembled; the answer is offered when complete."""
        pending = session.incoming
        if pending is None:
            self._reject(session, 0, checks.INVALID, "a Chunk without an Answer before it", actions)
            return
        header, assembler, total, refused, fold = pending
        try:
            assembler.add(chunk)
        except wire.WireError as exc:  # the chunks themselves are out of order: what follows cannot be placed
            _drop_incoming(session)
            self._reject(session, header.round_id, checks.INVALID, str(exc), actions)
            return
        if fold is not None:
            try:
                fold.stream_chunk(chunk.offset, chunk.data)
            except wire.WireError as exc:  # a value refused (the sum is as it was before the answer): the
                # rest of its chunks are read and dropped, not refused one by one, as for a refused header
                fold.abort_stream()  # (once more, if the fold took it back already: it does nothing then)
                pending, refused, fold = pending._replace(refused=True, fold=None), True, None
                self._reject(session, header.round_id, checks.INVALID, str(exc), actions)
        if not assembler.done:
            session.incoming = pending._replace(size=total + size)
            return
        session.incoming = None
        if fold is not None:
            self._offer_added(session, header, fold, total + size, actions)
        elif not refused:
            self._offer(session, header, assembler.payload(), total + size, actions)

    def _offer(
        self, session: Session, header: pb.Answer, payload: bytes | memoryview, size: int, actions: list[Action]
    ) -> None:
        """A chunked answer is complete: checked again, as the round may have moved on while the chunks came."""
        round_ = self.collecting
        expected = round_.expectation(session) if round_ is not None else None
        try:
            answered = round_ is not None and session.key in round_.answers
            checks.answer_header(header, session.indices, expected, answered)
        except Refusal as refusal:
            self._reject(session, header.round_id, refusal.code, refusal.details, actions)
            return
        assert round_ is not None and expected is not None
        self._accept(session, round_, expected, header, payload, size, actions)

    def _offer_added(
        self, session: Session, header: pb.Answer, fold: OrderedFold | MaskedRound, size: int, actions: list[Action]
    ) -> None:
        """An answer added to the sum chunk by chunk is complete: checked again as `_offer` checks (then
        its objective too); if refused, the sum is put back as it was before it."""
        round_ = self.collecting
        expected = round_.expectation(session) if round_ is not None else None
        try:
            answered = round_ is not None and session.key in round_.answers
            checks.answer_header(header, session.indices, expected, answered)
            assert round_ is not None and expected is not None
            if round_.streams_into() is not fold:  # (a round that is over; its header would not have passed)
                raise Refusal(checks.INVALID, f"an answer to round {header.round_id}, which is over")
            answer = checks.answer(header, b"", expected._replace(entries=0))  # the vectors were checked as they came
        except Refusal as refusal:
            fold.abort_stream()
            self._reject(session, header.round_id, refusal.code, refusal.details, actions)
            return
        if isinstance(fold, MaskedRound):
            try:  # (its rows are in the sum: the round keeps their shares)
                fold.end_stream(answer.shares or ())
            except SecAggError as exc:  # (checks.answer passed it: the round's own view of it disagrees)
                round_.fail(PoolError(str(exc)))
                return
        else:
            fold.end_stream(answer.objective)
        session.refusals.count = 0
        round_.accept(session, answer, size, added=True)

    def _accept(
        self,
        session: Session,
        round_: Collecting,
        expected: checks.Expectation,
        header: pb.Answer,
        payload: bytes | memoryview,
        size: int,
        actions: list[Action],
    ) -> None:
        """Offer an answer whose header was checked against the open round: its vectors are checked here."""
        try:
            answer = checks.answer(header, payload, expected)
        except Refusal as refusal:
            self._reject(session, header.round_id, refusal.code, refusal.details, actions)
            return
        session.refusals.count = 0
        round_.accept(session, answer, size)

    def _reject(
        self,
        session: Session,
        round_id: int,
        code: Status,
        details: str,
        actions: list[Action],
        counted: bool = True,
    ) -> None:
        """Tell the session its answer was refused; end it (Refusal) after too many refusals in one round:
        each message costs the coordinator work, and a refused one buys nothing (`counted` False: the
        coordinator's own doing, not the session's, counts for nothing)."""
        if counted:
            self._count_refusal(session, details)
        if isinstance(self.state, Closed):  # an answer that crossed the goodbye (Ctrl-C, SIGTERM): expected, not news
            log.debug("refused an answer from %s as the coordinator stops: %s", session.describe(), details)
            return  # (nor for the client: its goodbye comes)
        self.refusals.warn("refused an answer from %s: %s", session.describe(), details)
        rejected = pb.Rejected(round_id=round_id, code=cast(pb.RejectCode, code.value), details=details)
        actions.append(Send(session.key, pb.Instruction(rejected=rejected).SerializeToString()))

    def _count_refusal(self, session: Session, details: str) -> None:
        """Count a message refused or ignored; Refusal once the session has had too many in this round."""
        round_ = self.collecting
        in_round = round_.what if round_ is not None else ""
        counted = session.refusals
        if counted.round != in_round:
            counted.count, counted.round = 0, in_round
        counted.count += 1
        if counted.count == 1:
            counted.first = details
        if counted.count >= MAX_REFUSED_IN_A_ROUND:
            where = f"in {in_round}" if in_round else "while no round was open"
            raise Refusal(checks.INVALID, f"{counted.count} messages refused {where}; the first: {counted.first}")


Handler = Callable[[Coordination, Session, Received, float, list[Action]], None]

# The messages a joined session may send in each state, by kind, and the method that takes each. A Chunk
# continues the answer the session is sending (the round may close while it comes) and a Failure ends the
# session, in any state; a Ready comes while a run is under way (its start, or a rejoin); an Answer only while
# a round is open; an unmask reply only in the unmasking.
ACCEPTS: Mapping[type[Operation], Mapping[str | None, Handler]] = {
    Idle: {"chunk": Coordination._chunk, "failure": Coordination._failure, "ready": Coordination._ready_to_rejoin},
    Joining: {"chunk": Coordination._chunk, "failure": Coordination._failure},
    Presence: {"chunk": Coordination._chunk, "failure": Coordination._failure, "ready": Coordination._ready_to_rejoin},
    Starting: {"chunk": Coordination._chunk, "failure": Coordination._failure, "ready": Coordination._ready_to_start},
    RoundOpen: {
        "chunk": Coordination._chunk,
        "failure": Coordination._failure,
        "ready": Coordination._ready_to_rejoin,
        "answer": Coordination._answer,
    },
    Unmask: {
        "chunk": Coordination._chunk,
        "failure": Coordination._failure,
        "ready": Coordination._ready_to_rejoin,
        "unmasked": Coordination._unmasked,
    },
    Closed: {"chunk": Coordination._chunk, "failure": Coordination._failure},
}

# How a message of a kind its state does not accept is refused. An Answer: a Rejected with the status saying
# why (no round is open), the session kept. A Ready or an unmask reply: counted against the session, which is
# ended after MAX_REFUSED_IN_A_ROUND. Any other kind (a second Hello, bytes of no kind): the session is ended.
REFUSED: Mapping[str | None, Handler] = {
    "answer": Coordination._answer_refused,
    "ready": Coordination._ready_refused,
    "unmasked": Coordination._unmasked_refused,
}
