"""Bad answers over real connections: each is refused with a precise status and changes nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import config

from fedsaddle.common import wire
from fedsaddle.common.problems import make_shards
from fedsaddle.common.tasks import Answer
from fedsaddle.common.worker import Worker
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.local_pool import LocalPool
from fedsaddle.server.pool import ClientLost, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool

RUN = config(
    problem={"name": "paper_regression", "num_clients": 2, "dim": 3, "s": 2.0},
    algorithms=[{"name": "fedavg_s", "gamma_local": 0.05}],
    rounds=3,
    sync={"kind": "fixed", "tau": 4},
)
CHUNK = 1 << 20


class HandClient:
    """A client session driven by the test, one instruction at a time."""

    def __init__(self, channel: grpc.Channel, indices: list[int]) -> None:
        self.stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        self.indices = indices
        self.stream: Iterator[pb.Instruction] = self.stub.Join(
            pb.JoinRequest(protocol_version=pb.PROTOCOL_VERSION_1, client_indices=indices, client_name="hand")
        )
        self.session_id = next(self.stream).welcome.session_id
        self.unary = False  # answer with SubmitOne instead of the streaming Submit
        self.worker: Worker | None = None
        self.run_id = ""

    def next_task(self) -> pb.Task:
        for instruction in self.stream:
            if instruction.HasField("run"):
                run = instruction.run
                self.run_id = run.run_id
                shards = make_shards(RUN.problem, run.seed, self.indices)
                self.worker = Worker(shards, run.seed, run.gradient_noise)
            elif instruction.HasField("task"):
                return instruction.task
        raise AssertionError("stream ended")

    def answer_for(self, task: pb.Task) -> Answer:
        assert self.worker is not None
        return self.worker.execute(wire.decode_task(task, task.payload, 6), task.round_id)

    def submit(self, header: pb.Answer) -> grpc.StatusCode:
        try:
            if self.unary:
                self.stub.SubmitOne(header)
            else:
                self.stub.Submit(iter([pb.AnswerPart(answer=header)]))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def good(self, task: pb.Task) -> pb.Answer:
        (part,) = wire.encode_answer(self.session_id, task.run_id, task.round_id, self.answer_for(task), CHUNK)
        return part.answer


def with_payload(header: pb.Answer, values: np.ndarray[Any, Any], length: int | None = None) -> pb.Answer:
    bad = pb.Answer()
    bad.CopyFrom(header)
    bad.payload = values.tobytes()
    bad.payload_length = values.size if length is None else length
    return bad


def test_bad_answers_are_refused_and_the_run_ends_as_if_they_never_came() -> None:
    pool = GrpcPool(2, "127.0.0.1:0")
    outcome: dict[str, AlgorithmResult] = {}
    try:
        channel = grpc.insecure_channel(pool.address)
        first, second = HandClient(channel, [0]), HandClient(channel, [1])
        pool.wait_for_clients(10)
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(RUN.algorithms[0], RUN, pool)))
        runner.start()
        statuses: list[tuple[str, grpc.StatusCode]] = []
        for round_index in range(RUN.rounds):
            first.unary = second.unary = round_index % 2 == 1  # both RPCs check the same way
            task_a, task_b = first.next_task(), second.next_task()
            good_a, good_b = first.good(task_a), second.good(task_b)
            assert second.submit(good_b) == grpc.StatusCode.OK
            statuses.append(("duplicate", second.submit(good_b)))
            vectors = np.frombuffer(good_a.payload, dtype="<f8")
            statuses.append(("short", first.submit(with_payload(good_a, vectors[:-1]))))
            statuses.append(("length mismatch", first.submit(with_payload(good_a, vectors, length=5))))
            nan = vectors.copy()
            nan[2] = np.nan
            statuses.append(("nan", first.submit(with_payload(good_a, nan))))
            inf = vectors.copy()
            inf[0] = np.inf
            statuses.append(("inf", first.submit(with_payload(good_a, inf))))
            stale = pb.Answer()
            stale.CopyFrom(good_a)
            stale.round_id = task_a.round_id - 1
            statuses.append(("stale round", first.submit(stale)))
            other_run = pb.Answer()
            other_run.CopyFrom(good_a)
            other_run.run_id = "another-run"
            statuses.append(("wrong run", first.submit(other_run)))
            impostor = pb.Answer()
            impostor.CopyFrom(good_b)
            impostor.session_id = first.session_id
            statuses.append(("someone else's index", first.submit(impostor)))
            forged = pb.Answer()
            forged.CopyFrom(good_a)
            forged.session_id = "0" * 32
            statuses.append(("unknown session", first.submit(forged)))
            assert first.submit(good_a) == grpc.StatusCode.OK
        runner.join(timeout=30)
        assert not runner.is_alive()
        late = pb.Answer()
        late.CopyFrom(good_a)
        assert first.submit(late) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        pool.close()
        channel.close()
    expected = {
        "duplicate": grpc.StatusCode.ALREADY_EXISTS,
        "short": grpc.StatusCode.INVALID_ARGUMENT,
        "length mismatch": grpc.StatusCode.INVALID_ARGUMENT,
        "nan": grpc.StatusCode.INVALID_ARGUMENT,
        "inf": grpc.StatusCode.INVALID_ARGUMENT,
        "stale round": grpc.StatusCode.FAILED_PRECONDITION,
        "wrong run": grpc.StatusCode.FAILED_PRECONDITION,
        "someone else's index": grpc.StatusCode.PERMISSION_DENIED,
        "unknown session": grpc.StatusCode.UNAUTHENTICATED,
    }
    assert statuses == [(what, expected[what]) for what, _ in statuses]
    assert len(statuses) == len(expected) * RUN.rounds
    # None of the refused answers touched the state: the run equals a clean in-process run.
    local = run_algorithm(RUN.algorithms[0], RUN, LocalPool())
    assert outcome["r"].z_sha256 == local.z_sha256
    assert outcome["r"].traffic["algorithm"]["rounds"] == RUN.rounds


@pytest.mark.parametrize(
    ("indices", "code", "message"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "no client indices given"),
        ([2], grpc.StatusCode.INVALID_ARGUMENT, "client indices [2] are outside [0, 2)"),
        ([0, 0], grpc.StatusCode.INVALID_ARGUMENT, "client indices repeat"),
        ([1], grpc.StatusCode.ALREADY_EXISTS, "client indices [1] are already connected"),
    ],
)
def test_bad_joins_are_refused(indices: list[int], code: grpc.StatusCode, message: str) -> None:
    with GrpcPool(2, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address) as channel:
        holder = HandClient(channel, [1])
        assert holder.session_id
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        request = pb.JoinRequest(protocol_version=pb.PROTOCOL_VERSION_1, client_indices=indices)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Join(request))
        assert refused.value.code() == code
        assert message in refused.value.details()


def test_a_client_gone_between_rounds_is_named_at_the_next_round() -> None:
    pool = GrpcPool(1, "127.0.0.1:0")
    try:
        channel = grpc.insecure_channel(pool.address)
        hand = HandClient(channel, [0])
        pool.wait_for_clients(10)
        run = config(problem={"name": "paper_regression", "num_clients": 1, "dim": 3}, algorithms=RUN.algorithms)
        pool.start_run(RunInfo("between", run.problem, run.seed, 0.0))
        first_round = threading.Thread(target=pool.gradients, args=(np.ones(6),))
        first_round.start()
        task = hand.next_task()
        assert hand.submit(hand.good(task)) == grpc.StatusCode.OK
        first_round.join(timeout=10)
        channel.close()  # the client goes away while no round is open
        deadline = time.monotonic() + 10
        while pool.federation.missing() != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ClientLost, match=r"client 0 \(hand at ipv4:127\.0\.0\.1:\d+\) disconnected before round 2"):
            pool.gradients(np.ones(6))
    finally:
        pool.close()
