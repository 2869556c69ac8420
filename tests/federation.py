"""The coordinator's protocol object and client sessions joined by function calls: bytes in, bytes out.

No socket, no event loop, no thread: a `Federation` feeds each message's bytes to
`Coordination` (server/transport/protocol.py) as the servicer would, carries out its
actions as the servicer would, and keeps the time itself (`advance`). An honest
client is a `MemoryClient`: a `ClientSession` (client/session.py) and its
`HostedClients` (client/hosted.py) driven as the client runtime drives them,
answering every instruction; a hand-driven one keeps its instructions in `inbox`
for the test to answer, or not.
`MemoryPool` is a ClientPool over a federation, so that whole algorithms run on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from fedsaddle.client import session as client
from fedsaddle.client.hosted import HostedClients
from fedsaddle.client.service import _Garbled as Garbled
from fedsaddle.client.service import _parse as parse_instruction
from fedsaddle.client.session import ClientSession
from fedsaddle.common import wire
from fedsaddle.common.attacks import Attack
from fedsaddle.common.secagg import messages
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.tasks import Answer, Task
from fedsaddle.common.worker import ShardCache
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import Category, ClientPool, RunInfo
from fedsaddle.server.secure import MaskedRound
from fedsaddle.server.transport.actions import (
    Action,
    End,
    Failed,
    Greeted,
    RoundRequest,
    RoundResult,
    Send,
    Settled,
    UnmaskResult,
    parse,
    round_request,
    run_spec,
)
from fedsaddle.server.transport.protocol import Coordination

CHUNK_BYTES = 1 << 20


Instruction = pb.Instruction | wire.RawChunk | wire.InlineTask


def instruction(data: bytes) -> Instruction:
    """An Instruction as the client runtime parses it (client/service.py: a Chunk, and a large inline Task,
    read by hand)."""
    parsed = parse_instruction(data)
    assert not isinstance(parsed, Garbled), f"the coordinator sent {parsed.size} bytes that are not an Instruction"
    return parsed


class MemoryClient:
    """A client process without its stream: its `ClientSession` and `HostedClients`, the session's actions
    carried out as the client runtime carries them out (client/service.py, `_carry_out`), on a clock that
    moves only when told (`now`)."""

    def __init__(
        self,
        indices: tuple[int, ...],
        shards: ShardCache | None = None,
        attack: Attack | None = None,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.indices = indices
        self.session = ClientSession(indices)
        self.hosted = HostedClients(indices, shards, attack)
        self.clock = clock
        self.closed: client.Close | None = None  # the Close of the last instruction that ended the session
        self.told: pb.ClientMessage | None = None  # the Failure the coordinator would be told last

    def hello(self, name: str) -> pb.ClientMessage:
        return self.session.hello(name)

    def handle(self, instruction: Instruction) -> list[pb.ClientMessage | bytes]:
        """The messages sent in reply, in order. An instruction that ends the session raises what the client
        process ends with (ClientError, or RunFailed), after keeping its Close (`closed`) and the Failure
        sent (`told`); a goodbye that ends it well returns what was sent before it (none). An error in the
        hosted clients' work is raised as it came, after keeping the Failure the runtime would send."""
        self.closed = None
        sent: list[pb.ClientMessage | bytes] = []
        try:
            actions = self.session.receive(instruction, self.clock())
            for action in actions:
                if isinstance(action, client.Send):
                    sent += action.messages
                elif isinstance(action, client.Compute):
                    actions += self.session.computed(action, self.hosted.compute(action), self.clock())
                elif isinstance(action, client.LoadRun):
                    actions += self.session.loaded(self.hosted.load(action), self.clock())
                elif isinstance(action, client.AgreeKeys):
                    actions += self.session.agreed(action, self.hosted.agree(action))
                elif isinstance(action, client.Unmask):
                    actions += self.session.unmasked(self.hosted.unmask(action))
                else:
                    self.closed, self.told = action, action.failure
                    error = action.error()
                    if error is not None:
                        raise error
                    return sent
        except Exception as exc:
            if self.closed is None:
                self.told = self.session.failure(instruction, exc)
            raise
        self.hosted.prepare_next()
        return sent


class Federation:
    """A Coordination object, its clients, and a clock that moves only when told."""

    def __init__(self, num_clients: int, chunk_bytes: int = CHUNK_BYTES, **options: object) -> None:
        self.now = 0.0
        welcome = pb.Welcome(federation_id="f", num_clients=num_clients, chunk_bytes=chunk_bytes)
        self.protocol = Coordination(num_clients, welcome, **options)  # type: ignore[arg-type]
        self.chunk_bytes = chunk_bytes
        self.clients: dict[int, MemoryClient] = {}  # every stream's client: it computes the good answers
        self.honest: set[int] = set()  # the streams whose session answers by itself
        self.inbox: dict[int, list[Instruction]] = {}  # what the others were sent
        self.ended: dict[int, End] = {}
        self.greeted: set[int] = set()
        self.outcomes: list[Settled | Failed] = []
        self.sent_bytes = 0

    def connect(self, peer: str = "") -> int:
        key = self.protocol.connect(peer or f"ipv4:127.0.0.1:{50000 + len(self.clients)}", None, self.now)
        self.inbox[key] = []
        return key

    def join(self, indices: tuple[int, ...], name: str = "memory", honest: bool = True) -> int:
        """A client process's stream, its Hello sent: its key."""
        key = self.connect()
        client = MemoryClient(indices, clock=lambda: self.now)
        self.clients[key] = client
        if honest:
            self.honest.add(key)
        self.send(key, client.hello(name))
        return key

    def send(self, key: int, message: pb.ClientMessage | bytes) -> None:
        data = message if isinstance(message, bytes) else message.SerializeToString()
        self.carry_out(self.protocol.receive(key, parse(data), self.now))

    def close(self, key: int) -> None:
        """The client closes its side."""
        self.carry_out(self.protocol.stream_ended(key, self.now))

    def advance(self, seconds: float) -> None:
        """Time passes; the deadlines it crosses are handled, in order."""
        until = self.now + seconds
        while (deadline := self.protocol.next_deadline()) is not None and deadline <= until:
            self.now = max(self.now, deadline)
            self.carry_out(self.protocol.tick(self.now))
        self.now = until
        self.carry_out(self.protocol.tick(self.now))

    def carry_out(self, actions: Iterable[Action]) -> None:
        todo = deque(actions)
        while todo:
            action = todo.popleft()
            if isinstance(action, Send):
                if action.session in self.ended:
                    continue
                self.sent_bytes += len(action.data)
                received = instruction(action.data)
                if action.session not in self.honest:
                    self.inbox[action.session].append(received)
                    welcome = isinstance(received, pb.Instruction) and received.HasField("welcome")
                    if welcome and action.session in self.clients:
                        self.clients[action.session].handle(received)  # its chunk size, for its good answers
                    continue
                for reply in self.clients[action.session].handle(received):
                    data = reply if isinstance(reply, bytes) else reply.SerializeToString()
                    todo.extend(self.protocol.receive(action.session, parse(data), self.now))
            elif isinstance(action, End):
                self.ended.setdefault(action.session, action)
                if action.code is not None:  # a status replaces an orderly end
                    self.ended[action.session] = action
            elif isinstance(action, Greeted):
                assert action.session not in self.greeted, "greeted twice"
                self.greeted.add(action.session)
            else:
                self.outcomes.append(action)

    def take(self, key: int) -> list[Instruction]:
        """What a hand-driven stream was sent since the last take."""
        taken, self.inbox[key] = self.inbox[key], []
        return taken

    def answer(self, key: int, items: Iterable[Instruction]) -> list[bytes]:
        """The honest replies (serialized) of a hand-driven stream's session to these instructions (its Welcome
        was handed to the session as it came, in carry_out: one session takes one Welcome)."""
        replies: list[bytes] = []
        for item in items:
            if isinstance(item, pb.Instruction) and item.HasField("welcome"):
                continue
            for reply in self.clients[key].handle(item):
                replies.append(reply if isinstance(reply, bytes) else reply.SerializeToString())
        return replies

    def rejected(self, key: int) -> list[pb.Rejected]:
        """The Rejected instructions a hand-driven stream was sent since the last take."""
        return [i.rejected for i in self.take(key) if isinstance(i, pb.Instruction) and i.HasField("rejected")]

    def operate(self, begin: Callable[[float], list[Action]], meanwhile: Callable[[], None] | None = None) -> object:
        """Begin one of the protocol's operations, let `meanwhile` act, and return how it settled."""
        self.outcomes.clear()
        self.carry_out(begin(self.now))
        if meanwhile is not None and not self.outcomes:
            meanwhile()
        assert len(self.outcomes) == 1, f"the operation did not settle: {self.outcomes}"
        outcome = self.outcomes.pop()
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome.result


class MemoryPool(ClientPool):
    """A ClientPool over a Federation: `meanwhile` (if set) acts while each round waits."""

    def __init__(self, federation: Federation) -> None:
        super().__init__()
        self.federation = federation
        self.meanwhile: Callable[[], None] | None = None
        self.fold = False  # add the answers up as they come (server/fold.py), as GrpcPool does
        self.last_fold: OrderedFold | None = None

    def _folded(self) -> OrderedFold | None:
        return self.last_fold

    def _announce(self, run: RunInfo) -> list[int] | None:
        counts = self.federation.operate(lambda now: self.federation.protocol.start_run(run, run_spec(run), now))
        return counts if isinstance(counts, list) else None

    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        assert self.run is not None
        chunk = self.federation.chunk_bytes
        request = round_request(self.run, round_id, task, chunk, participants, fold=self.fold, weights=self.weights)
        result = self._round(request, category)
        self.last_fold = result.fold
        return result.answers

    def _round(self, request: RoundRequest, category: Category) -> RoundResult:
        """Open the round, let `meanwhile` act, and count the bytes it moved."""
        protocol = self.federation.protocol
        result = self.federation.operate(lambda now: protocol.open_round(request, now), self.meanwhile)
        assert isinstance(result, RoundResult)
        self.traffic[category].bytes_down += result.bytes_down
        self.traffic[category].bytes_up += result.bytes_up
        return result


class SecureMemoryPool(MemoryPool):
    """MemoryPool with secure aggregation, as GrpcPool runs it: each masked answer's rows go into the round's
    sum as the protocol reads them (`fold` off: the answers keep them, and the round adds them at the end)."""

    def _public_keys(self) -> dict[int, bytes]:
        return dict(self.federation.protocol.keys.public_keys)

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        assert self.run is not None
        actions, _ = self.federation.protocol.broadcast(messages.key_directory(self.run.run_id, epoch, keys))
        self.federation.carry_out(actions)

    def _exchange_masked(
        self,
        task: Task,
        round_id: int,
        category: Category,
        participants: tuple[int, ...] | None,
        rows: MaskedRound,
    ) -> list[MaskedAnswer]:
        assert self.run is not None
        chunk = self.federation.chunk_bytes
        masked_sum = rows if self.fold else None
        request = round_request(self.run, round_id, task, chunk, participants, True, masked_sum=masked_sum)
        return [messages.as_masked(answer) for answer in self._round(request, category).answers]

    def _unmask(self, requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskReply]:
        protocol = self.federation.protocol
        result = self.federation.operate(lambda now: protocol.unmask(requests, now))
        assert isinstance(result, UnmaskResult) and not result.refusals, result
        return result.replies
