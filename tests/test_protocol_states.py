"""The coordinator protocol's one state value and its table of what each state accepts, in memory.

`Coordination.state` is one of the variants of server/transport/states.py; `ACCEPTS`
(protocol.py) says which messages a joined session may send in each. Here each state
is reached by the pool's own operations on a `Federation` (tests/federation.py), a
message its row does not list is sent, and what the client sees and what the
protocol keeps are checked.
"""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
from conftest import config
from federation import CHUNK_BYTES, Federation, MemoryPool

from fedsaddle.common.secagg.party import UnmaskRequest
from fedsaddle.common.tasks import GradientTask
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.secure import KeyEpochs
from fedsaddle.server.transport import states
from fedsaddle.server.transport.actions import round_request, run_spec
from fedsaddle.server.transport.protocol import ACCEPTS, REFUSED
from fedsaddle.server.transport.refusal import Status
from fedsaddle.server.transport.servicer import GRPC_STATUS
from fedsaddle.server.transport.states import Closed, Idle, Operation

PROBLEM = config(
    problem={"name": "paper_regression", "num_clients": 2, "dim": 3},
    algorithms=[{"name": "fedavg_s", "gamma_local": 0.05}],
).problem
INFO = RunInfo("r", PROBLEM, 0, 0.0)
KINDS = {field.name for field in pb.ClientMessage.DESCRIPTOR.oneofs_by_name["body"].fields}


def in_state(name: str) -> tuple[Federation, int]:
    """A federation of two clients whose protocol is in state `name`, reached by the pool's operations; client
    0's stream is driven by hand (it answers nothing by itself): its key."""
    federation = Federation(2, rejoin_timeout_s=10.0)
    protocol = federation.protocol
    hand = federation.join((0,), honest=False)
    if name == "joining":  # client 1 has not come
        federation.carry_out(protocol.await_federation(30.0, federation.now))
        return federation, hand
    if name == "presence":  # the run waits for client 1 to come
        federation.carry_out(protocol.start_run(INFO, run_spec(INFO), federation.now))
        return federation, hand
    federation.join((1,))
    if name == "starting":  # client 0 has not said Ready
        federation.carry_out(protocol.start_run(INFO, run_spec(INFO), federation.now))
        return federation, hand
    if name != "idle":
        federation.honest.add(hand)  # it says Ready by itself
        MemoryPool(federation).start_run(INFO)
        federation.honest.discard(hand)
    if name == "round_open":  # client 0 has not answered round 0
        request = round_request(INFO, 0, GradientTask(np.ones(6)), CHUNK_BYTES, None)
        federation.carry_out(protocol.open_round(request, federation.now))
    elif name == "unmask":  # client 0 was asked to unmask round 0, and has not replied
        asked = UnmaskRequest(round_id=0, attempt=0, answered=(0, 1), dropped=(), shares=())
        federation.carry_out(protocol.unmask({0: asked}, federation.now))
    elif name == "closed":
        federation.carry_out(protocol.goodbye("done", pb.DONE))
    federation.take(hand)
    return federation, hand


STATES = {  # (by their names here, each reached as `in_state` says)
    "idle": Idle,
    "joining": states.Joining,
    "presence": states.Presence,
    "starting": states.Starting,
    "round_open": states.RoundOpen,
    "unmask": states.Unmask,
    "closed": Closed,
}
ANSWER = pb.ClientMessage(answer=pb.Answer(run_id="r", round_id=3, client_indices=[0]))
READY = pb.ClientMessage(ready=pb.Ready(run_id="another"))
UNMASKED = pb.ClientMessage(unmasked=pb.UnmaskReply(run_id="r", round_id=5, client=0))
# What each state refuses (the kinds its row of ACCEPTS leaves out), and why the session is told, or counted.
ILLEGAL = [
    ("idle", ANSWER),
    ("idle", UNMASKED),
    ("joining", ANSWER),
    ("joining", READY),
    ("joining", UNMASKED),
    ("presence", ANSWER),
    ("presence", UNMASKED),
    ("starting", ANSWER),
    ("starting", UNMASKED),
    ("round_open", UNMASKED),
    ("unmask", ANSWER),
    ("closed", ANSWER),
    ("closed", READY),
    ("closed", UNMASKED),
]


def test_each_state_is_reached_by_the_pool_operations_and_has_a_row_of_the_table() -> None:
    assert set(STATES.values()) == set(get_args(Operation)) == set(ACCEPTS)
    for name, kind in STATES.items():
        assert type(in_state(name)[0].protocol.state) is kind, name


def test_every_kind_of_message_is_taken_or_refused_in_every_state() -> None:
    assert "hello" not in REFUSED and set(REFUSED) <= KINDS
    for state, row in ACCEPTS.items():
        assert "hello" not in row and set(row) <= KINDS, state  # (a second Hello ends the session anywhere)
        assert {"chunk", "failure"} <= set(row), state  # (an answer's chunks, and a client that cannot go on)
        assert KINDS - set(row) - {"hello"} <= set(REFUSED), state
    accepts = {name: {k for k in ACCEPTS[kind] if k not in ("chunk", "failure")} for name, kind in STATES.items()}
    assert accepts == {
        "idle": {"ready"},
        "joining": set(),
        "presence": {"ready"},
        "starting": {"ready"},
        "round_open": {"ready", "answer"},
        "unmask": {"ready", "unmasked"},
        "closed": set(),
    }
    assert {(name, message.WhichOneof("body")) for name, message in ILLEGAL} == {
        (name, kind) for name, kind in STATES.items() for kind in KINDS - {"hello"} - set(ACCEPTS[kind])
    }


@pytest.mark.parametrize(("state", "message"), ILLEGAL, ids=[f"{s}-{m.WhichOneof('body')}" for s, m in ILLEGAL])
def test_a_message_its_state_does_not_accept_is_refused_and_leaves_the_state_as_it_was(
    state: str, message: pb.ClientMessage
) -> None:
    federation, hand = in_state(state)
    protocol = federation.protocol
    before = protocol.state
    barrier = getattr(before, "barrier", None)
    pending = set(barrier.pending) if barrier is not None else None
    deadline = protocol.next_deadline()
    federation.send(hand, message)
    assert protocol.state is before and protocol.next_deadline() == deadline
    if barrier is not None:
        assert barrier.pending == pending and not barrier.done
    end = federation.ended.get(hand)
    assert end is None or end.code is None  # the session goes on (told goodbye, in the closed state)
    session = protocol.sessions[hand]
    assert session.refusals.count == 1
    rejected = federation.rejected(hand)
    kind = message.WhichOneof("body")
    if kind == "answer":
        details = "answer to round 3 of run 'r', but no round is open"
        assert session.refusals.first == details
        # Told with a Rejected; once the coordinator stops, refused quietly (its goodbye is on its way).
        told = [] if state == "closed" else [("FAILED_PRECONDITION", details)]
        assert [(pb.RejectCode.Name(r.code), r.details) for r in rejected] == told
    else:  # counted against the session, and not answered
        assert rejected == []
        said = "a Ready for run 'another', not under way" if kind == "ready" else "an unmasking for round 5, not asked"
        assert session.refusals.first == said


@pytest.mark.parametrize("state", list(STATES))
def test_a_second_hello_ends_the_session_in_every_state(state: str) -> None:
    federation, hand = in_state(state)
    federation.send(hand, pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[0])))
    end = federation.ended[hand]
    assert end.code is Status.INVALID_ARGUMENT and end.details.startswith("a second Hello (")


def test_an_abandoned_round_closes_the_protocol_and_any_other_abandoned_operation_leaves_it_idle() -> None:
    # A signal stops the pool mid-round: the coordinator stops, and the answers on their way cross its goodbye.
    federation, hand = in_state("round_open")
    federation.protocol.abandon()
    assert isinstance(federation.protocol.state, Closed) and federation.protocol.collecting is None
    federation.send(hand, ANSWER)
    assert federation.rejected(hand) == []  # refused quietly
    federation.protocol.abandon()
    assert isinstance(federation.protocol.state, Closed)
    for state in ("joining", "presence", "starting", "unmask"):
        federation, _ = in_state(state)
        federation.protocol.abandon()
        assert isinstance(federation.protocol.state, Closed if state == "unmask" else Idle), state
    assert federation.protocol.next_deadline() is None


def test_key_epochs_count_each_agreement_anew_of_clients_back_with_new_keys() -> None:
    keys = KeyEpochs()
    keys.keep((1, 0), (b"b" * 32, b"a" * 32))
    assert keys.public_keys == {0: b"a" * 32, 1: b"b" * 32} and not keys.due
    assert keys.problem_with("client 0", (0,), (b"c" * 32,), "r", rejoins=False) == (
        "client 0 rejoined run r with new keys, and the run takes no rejoins (transport.rejoin_timeout_s)"
    )
    assert keys.problem_with("client 0", (0,), (b"b" * 32,), "r", rejoins=True) == (
        "client 0 rejoined run r with public keys already in use"
    )
    assert keys.problem_with("client 0", (0,), (), "r", rejoins=True) == (
        "client 0 sent 0 public keys for 1 clients; run r uses secure aggregation"
    )
    assert keys.problem_with("client 0", (0,), (b"c" * 32,), "r", rejoins=True) is None
    keys.rejoined((0,), (b"c" * 32,))
    assert keys.due and keys.public_keys[0] == b"c" * 32
    sent = keys.agree_anew("r", recipients=3)
    directory = pb.Instruction.FromString(sent)
    assert (directory.keys.run_id, directory.keys.epoch, keys.epoch, keys.due) == ("r", 1, 1, False)
    assert {entry.client: entry.value for entry in directory.keys.keys} == {0: b"c" * 32, 1: b"b" * 32}
    assert keys.take_rekeys() == [((0,), 3 * len(sent))] and keys.take_rekeys() == []


def test_each_status_is_the_grpc_status_and_reject_code_of_its_name_and_number() -> None:
    reject_codes = dict(pb.RejectCode.items())  # (the statuses a Rejected may carry)
    for status in Status:
        assert GRPC_STATUS[status].name == status.name and GRPC_STATUS[status].value[0] == status.value
        assert reject_codes.get(status.name, status.value) == status.value
    assert set(reject_codes) - {"REJECT_CODE_UNSPECIFIED"} <= {s.name for s in Status}
