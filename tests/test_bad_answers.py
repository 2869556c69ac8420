"""Bad input over real connections: each is refused with a precise code and changes nothing.

A representative few of each kind; the protocol object decides them all, and
test_coordination.py drives it through every case in memory."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import config
from federation import MemoryClient

from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import ClientLost, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.sessions import Limits

RUN = config(
    problem={"name": "paper_regression", "num_clients": 2, "dim": 3, "s": 2.0},
    algorithms=[{"name": "fedavg_s", "gamma_local": 0.05}],
    rounds=3,
    sync={"kind": "fixed", "tau": 4},
)


class HandClient:
    """A client session driven by the test, one message at a time, over a real stream.

    A reader thread answers RunSpecs with Ready, as a real client does (unless
    `auto_ready` is off), and queues every other instruction for the test. It hands
    the Welcome to the client's state itself: a RunSpec may follow at once, and the
    state refuses one that comes before its Welcome.
    """

    def __init__(
        self, channel: grpc.Channel, indices: list[int], version: int = pb.PROTOCOL_VERSION_2, auto_ready: bool = True
    ) -> None:
        self.requests: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        self.inbox: queue.Queue[pb.Instruction | grpc.RpcError | None] = queue.Queue()
        self.auto_ready = auto_ready
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        self.stream: Iterator[pb.Instruction] = stub.Session(iter(self.requests.get, None))
        self.state = MemoryClient(tuple(indices))  # computes the good answers, as a real client would
        hello = self.state.hello("hand")
        hello.hello.protocol_version = version  # type: ignore[assignment]
        self.send(hello)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for instruction in self.stream:
                if instruction.HasField("welcome"):
                    self.state.handle(instruction)
                if instruction.HasField("run") and self.auto_ready:
                    for reply in self.state.handle(instruction):
                        self.send(reply)
                else:
                    self.inbox.put(instruction)
        except grpc.RpcError as error:
            self.inbox.put(error)
        self.inbox.put(None)

    def send(self, message: pb.ClientMessage | bytes) -> None:
        """Send a message (a client hands answers over serialized)."""
        self.requests.put(pb.ClientMessage.FromString(message) if isinstance(message, bytes) else message)

    def close(self) -> None:
        self.requests.put(None)

    def ended(self, timeout: float = 10) -> None:
        """Wait until the coordinator has ended the stream (after `close`): the session is gone there too."""
        while (item := self.inbox.get(timeout=timeout)) is not None and not isinstance(item, grpc.RpcError):
            pass

    def next(self, timeout: float = 10) -> pb.Instruction:
        item = self.inbox.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        assert item is not None, "stream ended"
        return item

    def welcome(self) -> pb.Welcome:
        instruction = self.next()
        assert instruction.HasField("welcome"), instruction
        return instruction.welcome

    def next_task(self) -> pb.Task:
        instruction = self.next()
        assert instruction.HasField("task"), instruction
        return instruction.task

    def good(self, task: pb.Task) -> pb.Answer:
        (message,) = self.state.handle(pb.Instruction(task=task))
        assert isinstance(message, bytes)
        return pb.ClientMessage.FromString(message).answer

    def refused_with(self, message: pb.ClientMessage) -> str:
        """Send a bad message; the code of the Rejected instruction that must come back."""
        self.send(message)
        instruction = self.next()
        assert instruction.HasField("rejected"), instruction
        return pb.RejectCode.Name(instruction.rejected.code)


def two_joined(pool: GrpcPool, channel: grpc.Channel) -> tuple[HandClient, HandClient]:
    """Hand-driven sessions for clients 0 and 1, welcomed, and the pool holding both."""
    first, second = HandClient(channel, [0]), HandClient(channel, [1])
    first.welcome(), second.welcome()
    pool.wait_for_clients(10)
    return first, second


def answer(header: pb.Answer, values: np.ndarray[Any, Any] | None = None, **fields: Any) -> pb.ClientMessage:
    bad = pb.Answer()
    bad.CopyFrom(header)
    if values is not None:
        bad.payload = values.tobytes()
        bad.payload_length = values.size
    for name, value in fields.items():
        if name == "client_indices":
            del bad.client_indices[:]
            bad.client_indices.extend(value)
        else:
            setattr(bad, name, value)
    return pb.ClientMessage(answer=bad)


# The Rejected code each kind of bad answer gets.
REFUSED_WITH = {
    "duplicate": "ALREADY_EXISTS",
    "short": "INVALID_ARGUMENT",
    "length mismatch": "INVALID_ARGUMENT",
    "nan": "INVALID_ARGUMENT",
    "inf": "INVALID_ARGUMENT",
    "stale round": "FAILED_PRECONDITION",
    "wrong run": "FAILED_PRECONDITION",
    "someone else's index": "PERMISSION_DENIED",
    "no indices": "INVALID_ARGUMENT",
    "chunk gap": "INVALID_ARGUMENT",
    "chunk without answer": "INVALID_ARGUMENT",
}


def test_bad_answers_are_rejected_and_the_run_ends_as_if_they_never_came() -> None:
    pool = GrpcPool(2, "127.0.0.1:0")
    outcome: dict[str, AlgorithmResult] = {}
    channel = grpc.insecure_channel(pool.address)
    try:
        first, second = two_joined(pool, channel)
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(RUN.algorithms[0], RUN, pool)))
        runner.start()
        codes: list[tuple[str, str]] = []
        for _ in range(RUN.rounds):
            task_a, task_b = first.next_task(), second.next_task()
            good_a, good_b = first.good(task_a), second.good(task_b)
            second.send(pb.ClientMessage(answer=good_b))
            codes.append(("duplicate", second.refused_with(pb.ClientMessage(answer=good_b))))
            vectors = np.frombuffer(good_a.payload, dtype="<f8")
            codes.append(("short", first.refused_with(answer(good_a, vectors[:-1]))))
            codes.append(("length mismatch", first.refused_with(answer(good_a, payload_length=5))))
            nan, inf = vectors.copy(), vectors.copy()
            nan[2], inf[0] = np.nan, np.inf
            codes.append(("nan", first.refused_with(answer(good_a, nan))))
            codes.append(("inf", first.refused_with(answer(good_a, inf))))
            codes.append(("stale round", first.refused_with(answer(good_a, round_id=task_a.round_id - 1))))
            codes.append(("wrong run", first.refused_with(answer(good_a, run_id="another-run"))))
            codes.append(("someone else's index", first.refused_with(answer(good_b))))
            codes.append(("no indices", first.refused_with(answer(good_a, client_indices=[]))))
            chunked = answer(good_a, payload=b"")  # a header announcing chunks ...
            first.send(chunked)
            gap = pb.ClientMessage(chunk=pb.Chunk(offset=8, data=good_a.payload[8:]))  # ... and a gap
            codes.append(("chunk gap", first.refused_with(gap)))
            stray = pb.ClientMessage(chunk=pb.Chunk(offset=0, data=good_a.payload))
            codes.append(("chunk without answer", first.refused_with(stray)))
            first.send(pb.ClientMessage(answer=good_a))
        runner.join(timeout=30)
        assert not runner.is_alive()
        codes.append(("after the run", first.refused_with(pb.ClientMessage(answer=good_a))))
    finally:
        pool.close()
        channel.close()
    expected = {**REFUSED_WITH, "after the run": "FAILED_PRECONDITION"}
    assert codes == [(what, expected[what]) for what, _ in codes]
    assert len(codes) == (len(expected) - 1) * RUN.rounds + 1
    # None of the refused answers touched the state: the run equals a clean in-process run.
    local = run_algorithm(RUN.algorithms[0], RUN, LocalPool())
    assert outcome["r"].z_sha256 == local.z_sha256
    assert outcome["r"].traffic["algorithm"]["rounds"] == RUN.rounds


def _chunked_answer(client: HandClient, task: pb.Task) -> list[pb.ClientMessage]:
    """The answer a real client gives a task whose payload comes in Chunks after it: its messages."""
    replies = list(client.state.handle(pb.Instruction(task=task)))
    while not replies:
        replies = list(client.state.handle(client.next()))
    return [pb.ClientMessage.FromString(m) if isinstance(m, bytes) else m for m in replies]


def test_an_answer_refused_at_a_chunk_has_its_other_chunks_read_and_dropped_not_refused_one_by_one() -> None:
    # Chunks of 1 KiB: a client's answer of 512 entries comes in four, and client 0's is added to the sum as
    # it is read. A nan in its first chunk refuses the answer there, once; the three chunks after it are read
    # and dropped (proto: Chunk), and the good answer sent after them makes the round what it would have been.
    pool = GrpcPool(2, "127.0.0.1:0", chunk_bytes=1024)
    run = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 256}, algorithms=RUN.algorithms)
    info = RunInfo("chunks", run.problem, run.seed, 0.0)
    z = np.linspace(-1.0, 1.0, 512)
    result: dict[str, Any] = {}
    with grpc.insecure_channel(pool.address) as channel:
        try:
            first, second = two_joined(pool, channel)
            rounds = threading.Thread(
                target=lambda: (pool.start_run(info), result.setdefault("answers", pool.gradients(z)))
            )
            rounds.start()
            task = first.next_task()
            header, *chunks = _chunked_answer(first, task)
            assert len(chunks) == 4 and header.answer.payload_length == 512
            good = np.frombuffer(b"".join(c.chunk.data for c in chunks), dtype="<f8")
            spoiled = good.copy()
            spoiled[3] = np.nan
            first.send(header)
            first.send(pb.ClientMessage(chunk=pb.Chunk(offset=0, data=spoiled[:128].tobytes())))
            refusal = first.next().rejected
            for message in chunks[1:]:
                first.send(message)
            first.send(answer(header.answer, good))  # the whole answer inline, after the chunks
            for message in _chunked_answer(second, second.next_task()):
                second.send(message)
            rounds.join(timeout=30)
            assert not rounds.is_alive()
            first.close(), second.close()
            stray = []
            while (item := first.inbox.get(timeout=10)) is not None and not isinstance(item, grpc.RpcError):
                stray.append(item)
        finally:
            pool.close()
    assert refusal.round_id == task.round_id and pb.RejectCode.Name(refusal.code) == "INVALID_ARGUMENT"
    assert refusal.details == "client 0: entry 3 is nan (non-finite values are refused)"
    assert [i.WhichOneof("body") for i in stray if i.WhichOneof("body") == "rejected"] == []
    local = LocalPool()
    local.start_run(info)
    assert np.array_equal(result["answers"].mean(), local.gradients(z).mean())


def test_the_other_clients_are_told_a_client_failed_but_not_in_its_own_words() -> None:
    # A client's Failure names its fault to the coordinator, whose error says it to the operator; the Goodbye
    # to the rest of the federation says which client failed, and not what it said (its data, its paths).
    pool = GrpcPool(2, "127.0.0.1:0")
    run = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 3}, algorithms=RUN.algorithms)
    failed: dict[str, BaseException] = {}

    def one_round() -> None:
        pool.start_run(RunInfo("told", run.problem, run.seed, 0.0))
        try:
            pool.gradients(np.ones(6))
        except ClientLost as exc:
            failed["error"] = exc

    with grpc.insecure_channel(pool.address) as channel:
        try:
            first, second = two_joined(pool, channel)
            rounds = threading.Thread(target=one_round)
            rounds.start()
            task = first.next_task()
            second.send(pb.ClientMessage(answer=second.good(second.next_task())))
            said = "cannot read /data/site-a/patients.csv: row 17 has age 212"
            first.send(pb.ClientMessage(failure=pb.Failure(run_id=task.run_id, round_id=task.round_id, reason=said)))
            rounds.join(timeout=30)
            assert not rounds.is_alive()
            pool.failure = str(failed["error"])  # as the coordinator does (server/runs.py)
        finally:
            pool.close()
        while not (instruction := second.next()).HasField("goodbye"):  # (its answer may come after the failure:
            assert instruction.HasField("rejected"), instruction  # refused as stale)
        goodbye = instruction.goodbye
    assert re.fullmatch(r"client 0 \(hand at .*\) failed: " + re.escape(said) + r" during round \d+", pool.failure)
    assert goodbye.outcome == pb.FAILED
    assert re.fullmatch(
        r"client 0 \(hand at .*\) failed \(it told the coordinator why\) during round \d+", goodbye.reason
    )


def test_a_straggler_refused_once_a_round_stays_and_a_flood_of_refusals_in_one_round_ends_the_session() -> None:
    pool = GrpcPool(2, "127.0.0.1:0", straggler_deadline_s=0.05, min_clients=1)
    with grpc.insecure_channel(pool.address) as channel:
        straggler, prompt = two_joined(pool, channel)
        run = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 3}, algorithms=RUN.algorithms)
        rounds = threading.Thread(
            target=lambda: (
                pool.start_run(RunInfo("slow", run.problem, run.seed, 0.0)),
                [pool.gradients(np.ones(6)) for _ in range(40)],
            )
        )
        rounds.start()
        codes = []
        task = straggler.next_task()
        for i in range(40):  # its answer always comes after the round closed without it: refused, once a round
            late = straggler.good(task)
            prompt.send(pb.ClientMessage(answer=prompt.good(prompt.next_task())))
            if i < 39:
                task = straggler.next_task()  # the next round's task: this one is closed
                straggler.send(pb.ClientMessage(answer=late))
                codes.append(pb.RejectCode.Name(straggler.next().rejected.code))
        rounds.join(timeout=30)
        assert not rounds.is_alive() and pool.missing() == []
        # A flood of one-byte chunks while no round is open: the 32nd refusal ends the session.
        for offset in range(40):
            straggler.send(pb.ClientMessage(chunk=pb.Chunk(offset=offset, data=b"x")))
        details = []
        with pytest.raises(grpc.RpcError) as error:
            while True:
                details.append(straggler.next().rejected.details)
        straggler.close(), prompt.close()
        pool.close()
    assert codes == ["FAILED_PRECONDITION"] * 39
    assert details == ["a Chunk without an Answer before it"] * 31
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == (
        "32 messages refused while no round was open; the first: a Chunk without an Answer before it"
    )


def test_an_answer_with_huge_finite_entries_is_used_and_numpy_does_not_warn() -> None:
    # Its squares overflow the fast finiteness test (numeric.all_finite), which then looks entry by entry.
    run = config(**{**RUN.model_dump(), "rounds": 1, "algorithms": [{"name": "minibatch_md", "gamma": 1e-3}]})
    outcome: dict[str, AlgorithmResult] = {}
    with (
        warnings.catch_warnings(record=True) as caught,
        GrpcPool(2, "127.0.0.1:0") as pool,
        grpc.insecure_channel(pool.address) as channel,
    ):
        warnings.simplefilter("always")
        first, second = two_joined(pool, channel)
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(run.algorithms[0], run, pool)))
        runner.start()
        good = first.good(first.next_task())
        huge = np.full(len(good.payload) // 8, 1e200)
        first.send(answer(good, huge))
        second.send(pb.ClientMessage(answer=second.good(second.next_task())))
        runner.join(timeout=30)
        assert not runner.is_alive()
    assert outcome["r"].traffic["algorithm"]["rounds"] == 1  # accepted: the round closed
    assert np.abs(outcome["r"].final_z).max() > 1e190  # and used
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


@pytest.mark.parametrize(
    ("indices", "version", "code", "message"),
    [
        ([1], pb.PROTOCOL_VERSION_2, grpc.StatusCode.ALREADY_EXISTS, "client indices [1] are already connected"),
        ([0], pb.PROTOCOL_VERSION_1, grpc.StatusCode.INVALID_ARGUMENT, "protocol version 1 is not supported"),
    ],
)
def test_bad_hellos_are_refused(indices: list[int], version: int, code: grpc.StatusCode, message: str) -> None:
    with GrpcPool(2, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address) as channel:
        holder = HandClient(channel, [1])
        assert holder.welcome().num_clients == 2
        refused = HandClient(channel, indices, version)
        with pytest.raises(grpc.RpcError) as error:
            refused.welcome()
        assert error.value.code() == code
        assert message in error.value.details()
        holder.close()
        refused.close()


def test_a_second_hello_mid_round_ends_that_session_alone_and_it_may_rejoin() -> None:
    # A session's indices are its first Hello's. A second one (claiming the other client's index) mid-round is
    # refused as a second Ready is: that session ends with INVALID_ARGUMENT naming it, the other client's is
    # untouched, and with rejoins allowed the offender comes back and the run ends as if it never happened.
    run = config(**{**RUN.model_dump(), "algorithms": [{"name": "minibatch_md", "gamma": 0.05}]})
    outcome: dict[str, AlgorithmResult] = {}
    with GrpcPool(2, "127.0.0.1:0", rejoin_timeout_s=10) as pool, grpc.insecure_channel(pool.address) as channel:
        steady, offender = two_joined(pool, channel)
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(run.algorithms[0], run, pool)))
        runner.start()
        task = steady.next_task()
        assert offender.next_task().round_id == task.round_id == 1
        steady.send(pb.ClientMessage(answer=steady.good(task)))
        again = pb.ClientMessage(hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=[0]))
        offender.send(again)
        with pytest.raises(grpc.RpcError) as error:
            offender.next()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == f"a second Hello ({again.ByteSize()} bytes)"
        back = HandClient(channel, [1])  # the same index, a new session: sent the run and the open round's task
        back.welcome()
        resent = back.next_task()
        assert resent.round_id == 1 and resent.payload == task.payload
        back.send(pb.ClientMessage(answer=back.good(resent)))
        for _ in range(run.rounds - 1):
            for hand in (steady, back):
                hand.send(pb.ClientMessage(answer=hand.good(hand.next_task())))
        runner.join(timeout=30)
        assert not runner.is_alive()
        steady.close(), back.close()
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert outcome["r"].status == "ok" and outcome["r"].z_sha256 == local.z_sha256
    assert outcome["r"].traffic["algorithm"]["rounds"] == run.rounds


def raw_stream(channel: grpc.Channel) -> Any:
    """The Session method without protobuf: the test sends raw bytes."""
    return channel.stream_stream(
        "/fedsaddle.v2.Coordinator/Session", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


def test_bytes_that_are_not_protobuf_and_a_silent_stream_get_precise_statuses() -> None:
    limits = Limits(hello_timeout_s=1.0)
    with GrpcPool(1, "127.0.0.1:0", limits=limits) as pool, grpc.insecure_channel(pool.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(raw_stream(channel)(iter([b"\xff\xff\xff\xff not a protobuf"])))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a ClientMessage: byte 0: a field's key beyond 32 bits" in error.value.details()
        assert "DecodeError" not in error.value.details()
        silent: queue.Queue[bytes | None] = queue.Queue()
        with pytest.raises(grpc.RpcError) as error:
            list(raw_stream(channel)(iter(silent.get, None)))
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.value.details() == "no Hello within 1 s"  # the coordinator's limit, not a deadline of the call's
        silent.put(None)
        first = pb.ClientMessage(ready=pb.Ready(run_id="x")).SerializeToString()
        with pytest.raises(grpc.RpcError) as error:
            list(raw_stream(channel)(iter([first])))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must start with a Hello" in error.value.details()


def test_a_client_gone_between_rounds_is_named_at_the_next_round() -> None:
    pool = GrpcPool(1, "127.0.0.1:0")
    channel = grpc.insecure_channel(pool.address)
    try:
        hand = HandClient(channel, [0])
        hand.welcome()
        pool.wait_for_clients(10)
        run = config(problem={"name": "paper_regression", "num_clients": 1, "dim": 3}, algorithms=RUN.algorithms)
        starting = threading.Thread(target=pool.start_run, args=(RunInfo("between", run.problem, run.seed, 0.0),))
        starting.start()
        first_round = threading.Thread(target=lambda: (starting.join(), pool.gradients(np.ones(6))))
        first_round.start()
        task = hand.next_task()
        hand.send(pb.ClientMessage(answer=hand.good(task)))
        first_round.join(timeout=10)
        channel.close()  # the client goes away while no round is open
        deadline = time.monotonic() + 10
        while pool.missing() != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ClientLost, match=r"client 0 \(hand at ipv4:127\.0\.0\.1:\d+\) disconnected before round 2"):
            pool.gradients(np.ones(6))
    finally:
        pool.close()


def test_an_answer_that_crosses_the_goodbye_is_refused_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # Ctrl-C or SIGTERM closes the pool while answers are on their way: refusing them is expected, not news.
    caplog.set_level(logging.DEBUG, logger="fedsaddle.coordinator")
    pool = GrpcPool(1, "127.0.0.1:0")
    with grpc.insecure_channel(pool.address) as channel:
        hand = HandClient(channel, [0])
        hand.welcome()
        pool.wait_for_clients(10)
        run = config(problem={"name": "paper_regression", "num_clients": 1, "dim": 3}, algorithms=RUN.algorithms)
        first_round = threading.Thread(
            target=lambda: (pool.start_run(RunInfo("late", run.problem, run.seed, 0.0)), pool.gradients(np.ones(6)))
        )
        first_round.start()
        good = hand.good(hand.next_task())
        hand.send(pb.ClientMessage(answer=good))
        first_round.join(timeout=10)
        closing = threading.Thread(target=pool.close)
        closing.start()
        assert hand.next().HasField("goodbye")
        hand.send(pb.ClientMessage(answer=good))  # it crossed the goodbye
        hand.close()
        closing.join(timeout=10)
    late = [r for r in caplog.records if "as the coordinator stops" in r.getMessage()]
    assert len(late) == 1 and late[0].levelno == logging.DEBUG
    assert "but no round is open" in late[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _garbled(good: pb.Answer, rng: np.random.Generator) -> pb.ClientMessage:
    """A message a hostile or broken client might send in place of its answer `good`."""

    def pick(options: list[Any]) -> Any:
        return options[int(rng.integers(len(options)))]

    kind = rng.random()
    if kind < 0.2:
        return pb.ClientMessage(chunk=pb.Chunk(offset=pick([0, 8, 2**64 - 1]), data=bytes(pick([0, 1, 8, 4096]))))
    if kind < 0.3:
        ready = pb.Ready(run_id=pick(["", good.run_id, "y"]), dimension=pick([0, 6, 2**64 - 1]), error=pick(["", "x"]))
        return pb.ClientMessage(ready=ready)
    if kind < 0.35:
        return pb.ClientMessage(hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=[0]))
    bad = pb.Answer()
    bad.CopyFrom(good)
    values = np.frombuffer(good.payload, dtype="<f8")
    for _ in range(int(rng.integers(1, 4))):
        field = pick(["run_id", "round_id", "client_indices", "payload_length", "payload", "objective", "diverged"])
        if field == "run_id":
            bad.run_id = pick(["", "\x1b[2J", "r" * 100_000, good.run_id + "x"])
        elif field == "round_id":
            bad.round_id = pick([0, good.round_id - 1, good.round_id + 1, 2**64 - 1])
        elif field == "client_indices":
            del bad.client_indices[:]
            bad.client_indices.extend(pick([[], [1], [0, 0], [2**32 - 1], [0, 1]]))
        elif field == "payload_length":
            bad.payload_length = pick([0, good.payload_length + 1, 2**64 - 1])
        elif field == "payload":
            bad.payload = pick([b"", good.payload[:-1], good.payload + b"\0", np.full_like(values, np.nan).tobytes()])
        elif field == "objective":
            bad.objective = pick([b"\0" * 7, np.array([np.nan]).tobytes(), b"\0" * 16])
        else:
            bad.diverged = not bad.diverged
    return pb.ClientMessage(answer=bad)


@pytest.mark.parametrize("seed", range(2))  # (60 draws in memory: test_coordination.py)
def test_a_client_that_sends_anything_before_its_answers_cannot_change_the_run_or_break_the_coordinator(
    seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Up to 4 garbled messages before each good answer, drawn from the seed. Whatever they are, the run
    # ends as a clean one, or ends naming client 0 and why (its session ended for breaking the protocol,
    # or an answer that says it diverged): never another result, a hang or a traceback.
    caplog.set_level(logging.WARNING)
    rng = np.random.default_rng(seed)
    pool = GrpcPool(2, "127.0.0.1:0", round_timeout_s=20)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = run_algorithm(RUN.algorithms[0], RUN, pool)
        except Exception as exc:
            outcome["error"] = exc

    channel = grpc.insecure_channel(pool.address)
    try:
        hostile, honest = two_joined(pool, channel)
        runner = threading.Thread(target=run)
        runner.start()
        hostile_alive = True
        while runner.is_alive():
            try:
                instruction = honest.next(timeout=0.5)
            except (queue.Empty, AssertionError, grpc.RpcError):  # (the run ended)
                continue
            if not instruction.HasField("task"):
                continue
            honest.send(pb.ClientMessage(answer=honest.good(instruction.task)))
            while hostile_alive:
                try:
                    instruction = hostile.next(timeout=5)
                except (queue.Empty, AssertionError, grpc.RpcError):  # its session was ended
                    hostile_alive = False
                    break
                if instruction.HasField("task"):
                    good = hostile.good(instruction.task)
                    for _ in range(int(rng.integers(5))):
                        hostile.send(_garbled(good, rng))
                    hostile.send(pb.ClientMessage(answer=good))
                    break
        runner.join(timeout=60)
        assert not runner.is_alive()
    finally:
        pool.close()
        channel.close()
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records), caplog.text
    if "error" in outcome:
        assert re.match(r"client 0 \(hand at .*\) was ended by the coordinator \(.+\)", str(outcome["error"]))
    elif outcome["result"].status == "diverged":
        assert "client 0" in outcome["result"].detail or "clients [0]" in outcome["result"].detail
    else:
        assert outcome["result"].status == "ok"
        assert outcome["result"].z_sha256 == run_algorithm(RUN.algorithms[0], RUN, LocalPool()).z_sha256
