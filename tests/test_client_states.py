"""The client's protocol object alone (client/session.py): its states and the actions it returns.

No data is loaded and nothing is computed here: the results a `HostedClients` would
feed back (`Loaded`, an answer's bytes, a `Refusal`) are made by the test, so each
state's transitions and each refusal are seen as values. The session never reads a
clock or freezes the collector: both are made to fail if it tries.
"""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import pytest

from fedsaddle.client.session import (
    AgreeKeys,
    ClientSession,
    Close,
    Closed,
    Compute,
    Connecting,
    Ending,
    Joined,
    Loaded,
    Loading,
    LoadRun,
    Refusal,
    RunFailed,
    Send,
    Unmask,
    Unserved,
    Welcomed,
    Working,
)
from fedsaddle.common import wire
from fedsaddle.common.secagg import crypto
from fedsaddle.common.tasks import GradientTask, LocalStepsTask
from fedsaddle.proto import fedsaddle_pb2 as pb

WELCOME = pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=4096))
RUN = pb.Instruction(run=pb.RunSpec(run_id="r", problem_json="{}", dimension=8))


def loaded(dimension: int = 8, secure: bool = False, lone: bool = False) -> Loaded:
    return Loaded(dimension, (), (), ("test_mse",), secure, lone, "numpy 2 (openblas)")


@pytest.fixture(autouse=True)
def no_clock_no_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session is told the time, and leaves the collector alone: reading a clock or freezing fails.
    (The wall clock stays: the log's records read it.)"""

    def refused(*args: object) -> float:
        raise AssertionError("the session read a clock or froze the collector")

    for name in ("monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, refused)
    monkeypatch.setattr(gc, "freeze", refused)
    monkeypatch.setattr(gc, "unfreeze", refused)


def working(indices: tuple[int, ...] = (1, 4), **options: object) -> ClientSession:
    session = ClientSession(indices)
    assert session.receive(WELCOME, 0.0) == []
    assert session.receive(RUN, 0.0) == [LoadRun(RUN.run, 5, 4096)]
    session.loaded(loaded(**options), 100.0)  # type: ignore[arg-type]
    return session


def task(round_id: int, z: np.ndarray, **fields: object) -> pb.Instruction:
    (piece,) = wire.encode_task("r", round_id, GradientTask(z), 1 << 20)
    instruction = pb.Instruction.FromString(piece)
    for name, value in fields.items():
        if name == "client_indices":
            instruction.task.client_indices.extend(value)  # type: ignore[attr-defined]
        else:
            setattr(instruction.task, name, value)
    return instruction


def test_a_session_goes_from_hello_to_goodbye_one_state_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    session = ClientSession((1, 4))
    assert session.state == Connecting() and session.chunk_bytes == 0
    assert session.receive(WELCOME, 0.0) == []
    assert session.state == Welcomed(Joined(4096, 5)) and session.chunk_bytes == 4096
    # The RunSpec is handed out to be loaded; nothing may come until the result is fed back.
    assert session.receive(RUN, 1.0) == [LoadRun(RUN.run, 5, 4096)]
    assert session.state == Loading(Joined(4096, 5), RUN.run, 0)
    with pytest.raises(RuntimeError, match="an instruction received while Loading"):
        session.receive(task(1, np.ones(8)), 2.0)
    (send,) = session.loaded(loaded(), 3.0)
    assert isinstance(send, Send)
    (ready,) = send.messages
    assert isinstance(ready, pb.ClientMessage)
    assert ready.ready == pb.Ready(run_id="r", dimension=8, numeric_stack="numpy 2 (openblas)")
    state = session.state
    assert isinstance(state, Working)
    assert (state.run_id, state.dimension, state.metrics, state.said, state.answered) == ("r", 8, ("test_mse",), 3.0, 0)
    # A task is checked and decoded; the answer's bytes come back from whoever computed it.
    (compute,) = session.receive(task(1, np.arange(8.0)), 4.0)
    assert isinstance(compute, Compute) and compute.clients is None and compute.failure_round == 1
    assert isinstance(compute.task, GradientTask) and np.array_equal(compute.task.z, np.arange(8.0))
    assert session.computed(compute, [b"answer"], 5.0) == [Send([b"answer"])]
    assert state.answered == 1
    with caplog.at_level(logging.INFO, logger="fedsaddle.client"):
        (close,) = session.receive(pb.Instruction(goodbye=pb.Goodbye(reason="over", outcome=pb.DONE)), 6.0)
    assert close == Close(Ending.DONE, "over") and close.error() is None
    assert session.state == Closed(Ending.DONE, "over")
    assert caplog.messages[-1] == "coordinator says goodbye (1 tasks answered in the last run): over"
    with pytest.raises(RuntimeError, match="an instruction received while Closed"):
        session.receive(WELCOME, 7.0)


def test_a_chunked_task_is_assembled_in_the_working_state_and_handed_out_whole() -> None:
    session = working(dimension=512)
    z, control = np.arange(512.0), np.full(512, 0.5)  # 8 KiB in chunks of the Welcome's 4 KiB
    pieces = wire.encode_task("r", 3, LocalStepsTask(z, 2, 0.1, control=control), 4096)
    header, *chunks = pieces
    assert len(chunks) >= 2
    assert session.receive(pb.Instruction.FromString(header), 1.0) == []
    state = session.state
    assert isinstance(state, Working) and state.assembly is not None and state.assembly.message.round_id == 3
    for piece in chunks[:-1]:
        chunk = wire.read_chunk(piece)
        assert chunk is not None and session.receive(chunk, 1.0) == []
    last = wire.read_chunk(chunks[-1])
    assert last is not None
    (compute,) = session.receive(last, 1.0)
    assert isinstance(compute, Compute) and compute.failure_round == 0  # (a Chunk names no round)
    assert isinstance(compute.task, LocalStepsTask) and np.array_equal(compute.task.control, control)
    assert state.assembly is None


def test_the_usual_small_gradient_is_handed_out_undecoded_only_when_the_run_takes_the_few_calls_path() -> None:
    z = np.arange(8.0)
    lone = working((3,), lone=True)
    (compute,) = lone.receive(task(1, z), 0.0)
    assert isinstance(compute, Compute) and compute.task is None and compute.payload == z.tobytes()
    (named,) = lone.receive(task(2, z, client_indices=[3]), 0.0)  # it names its client: the general way
    assert isinstance(named, Compute) and isinstance(named.task, GradientTask) and named.clients == (3,)
    (general,) = working((3,)).receive(task(1, z), 0.0)
    assert isinstance(general, Compute) and isinstance(general.task, GradientTask)


def test_the_heartbeat_counts_on_the_time_it_is_told(caplog: pytest.LogCaptureFixture) -> None:
    session = working()  # loaded at t = 100
    (compute,) = session.receive(task(1, np.ones(8)), 0.0)
    with caplog.at_level(logging.INFO, logger="fedsaddle.client"):
        session.computed(compute, [], 159.0)
        assert caplog.messages == []
        session.computed(compute, [], 160.0)
        session.computed(compute, [], 219.0)
        session.computed(compute, [], 220.0)
    assert caplog.messages == ["run r: 2 tasks answered, now at round 1", "run r: 4 tasks answered, now at round 1"]


def test_a_run_that_cannot_be_loaded_is_refused_in_ready_and_its_tasks_end_the_session() -> None:
    session = ClientSession((1, 4))
    session.receive(WELCOME, 0.0)
    session.receive(RUN, 0.0)
    (send,) = session.loaded(Refusal("no data here"), 1.0)
    assert isinstance(send, Send) and [m.ready for m in send.messages] == [pb.Ready(run_id="r", error="no data here")]  # type: ignore[union-attr]
    state = session.state
    assert isinstance(state, Unserved) and state.run is RUN.run
    (close,) = session.receive(task(7, np.ones(8)), 2.0)
    assert isinstance(close, Close) and close.ending is Ending.REFUSED
    assert close.reason == "task for run 'r', which this process could not start"
    assert close.failure == pb.ClientMessage(failure=pb.Failure(run_id="r", round_id=7, reason=close.reason))
    assert isinstance(close.error(), RuntimeError) and not isinstance(close.error(), RunFailed)
    assert session.state is state  # what was refused changed nothing
    # The next RunSpec is loaded as the first was.
    assert session.receive(RUN, 3.0) == [LoadRun(RUN.run, 5, 4096)]


@pytest.mark.parametrize(
    ("instruction", "reason"),
    [
        (RUN, "the coordinator sent a RunSpec before its Welcome"),
        (task(1, np.ones(8)), "task for run 'r' before its RunSpec: the coordinator sent it before its Welcome"),
        (pb.Instruction(keys=pb.KeyDirectory(run_id="r")), "the coordinator sent a KeyDirectory before its Welcome"),
        (pb.Instruction(), "unknown instruction: none of the kinds this client knows (an empty one, or a later"),
    ],
)
def test_what_comes_before_the_welcome_is_refused_with_a_close_not_an_exception(
    instruction: pb.Instruction, reason: str
) -> None:
    session = ClientSession((1,))
    (close,) = session.receive(instruction, 0.0)
    assert isinstance(close, Close) and close.ending is Ending.REFUSED and close.reason.startswith(reason)
    assert close.failure is not None and close.failure.failure.reason == close.reason
    assert session.state == Connecting()


def test_a_failed_goodbye_closes_with_the_coordinators_reason_and_tells_it_nothing() -> None:
    session = working()
    goodbye = pb.Goodbye(reason="client 4 diverged", outcome=pb.FAILED)
    (close,) = session.receive(pb.Instruction(goodbye=goodbye), 1.0)
    assert close == Close(Ending.FAILED, "the coordinator ended the run as failed: client 4 diverged")
    assert isinstance(close.error(), RunFailed)


def test_a_malformed_task_closes_naming_it_for_the_person_and_plainly_for_the_coordinator() -> None:
    session = working()
    bad = task(2, np.ones(8))
    bad.task.payload_length = 7
    (close,) = session.receive(bad, 1.0)
    assert isinstance(close, Close) and close.failure is not None
    told = close.failure.failure.reason
    assert told.startswith("a task declares payload_length 7 (56 bytes) but carries an inline payload of 64 bytes")
    assert close.reason == f"malformed instruction from the coordinator: {told}"
    assert close.failure.failure.round_id == 2


def test_secure_aggregation_hands_out_key_agreement_and_unmasking_for_hosted_clients_only() -> None:
    plain = working()
    keys = pb.Instruction(keys=pb.KeyDirectory(run_id="r", epoch=2))
    keys.keys.keys.add(client=1, value=bytes(crypto.PUBLIC_KEY_BYTES))
    keys.keys.keys.add(client=4, value=bytes(range(crypto.PUBLIC_KEY_BYTES)))
    (close,) = plain.receive(keys, 0.0)
    assert isinstance(close, Close) and close.reason == "a key directory for run 'r', which has no secure aggregation"

    secure = working(secure=True)
    (agree,) = secure.receive(keys, 0.0)
    assert agree == AgreeKeys(2, {1: bytes(crypto.PUBLIC_KEY_BYTES), 4: bytes(range(crypto.PUBLIC_KEY_BYTES))})
    assert secure.agreed(agree, None) == []
    (refused,) = secure.agreed(agree, Refusal("refused the coordinator's key directory: epoch 2 is stale"))
    assert isinstance(refused, Close) and refused.failure is not None
    assert refused.failure.failure == pb.Failure(run_id="r", round_id=0, reason=refused.reason)

    request = pb.UnmaskRequest(run_id="r", round_id=3, client=4)
    assert secure.receive(pb.Instruction(unmask=request), 0.0) == [Unmask(request)]
    assert secure.unmasked(b"reply") == [Send([b"reply"])]
    request.client = 2
    (close,) = secure.receive(pb.Instruction(unmask=request), 0.0)
    assert isinstance(close, Close) and close.reason == "an unmask request for client 2, not hosted here"


def test_a_refused_masked_answer_closes_naming_the_tasks_round() -> None:
    session = working(secure=True)
    (compute,) = session.receive(task(6, np.ones(8)), 0.0)
    assert isinstance(compute, Compute)
    (close,) = session.computed(compute, Refusal("refused to answer: round 6 has 1 client"), 1.0)
    assert isinstance(close, Close) and close.failure is not None and close.failure.failure.round_id == 6
    state = session.state
    assert isinstance(state, Working) and state.answered == 0
