"""The coordinator's protocol object (server/transport/protocol.py) against client sessions, in memory.

Bytes in, bytes out, a clock that moves when told: every case here takes
milliseconds. The socket tests (test_bad_answers.py, test_hostile.py) keep a few
of each kind, to show that the servicer carries the same decisions over gRPC.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import config
from federation import Federation, MemoryPool
from test_bad_answers import REFUSED_WITH, _garbled, answer

from fedsaddle.common import wire
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.driver import AlgorithmResult, RunStopped, run_algorithm
from fedsaddle.server.pool import ClientLost, ClientPool, PoolError, RunInfo
from fedsaddle.server.transport.actions import MissingClients, RoundResult, Send, run_spec
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.protocol import MAX_REFUSED_IN_A_ROUND
from fedsaddle.server.transport.refusal import Status
from fedsaddle.server.transport.sessions import Limits, State
from fedsaddle.server.transport.states import Idle, Presence

RUN = config(
    problem={"name": "paper_regression", "num_clients": 2, "dim": 3, "s": 2.0},
    algorithms=[{"name": "fedavg_s", "gamma_local": 0.05}],
    rounds=3,
    sync={"kind": "fixed", "tau": 4},
)
PROBLEM_1 = config(problem={"name": "paper_regression", "num_clients": 1, "dim": 3}, algorithms=RUN.algorithms).problem
INVALID = Status.INVALID_ARGUMENT


def clean_run(run: Any = RUN, algorithm: int = 0) -> AlgorithmResult:
    return run_algorithm(run.algorithms[algorithm], run, LocalPool())


def start(pool: MemoryPool, info: RunInfo, *by_hand: int) -> None:
    """Start a run; the hand-driven streams `by_hand` say Ready as their sessions would."""
    federation = pool.federation
    federation.honest.update(by_hand)
    try:
        pool.start_run(info)
    finally:
        federation.honest.difference_update(by_hand)


def started(**options: Any) -> tuple[Federation, MemoryPool, int]:
    """Two clients, client 0 driven by hand, and run 'r' started: the federation, its pool, client 0's stream."""
    federation = Federation(2, **options)
    hand = federation.join((0,), honest=False)
    federation.join((1,))
    pool = MemoryPool(federation)
    start(pool, RunInfo("r", RUN.problem, RUN.seed, 0.0), hand)
    return federation, pool, hand


def good_answer(federation: Federation, key: int) -> pb.Answer:
    """The honest answer of a hand-driven stream to the task it was sent (whatever else came with it)."""
    return answer_to(federation, key, federation.take(key))


def answer_to(federation: Federation, key: int, items: list[Any]) -> pb.Answer:
    (reply,) = [m for r in federation.answer(key, items) if (m := pb.ClientMessage.FromString(r)).HasField("answer")]
    return reply.answer


# -- whole runs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fedavg_s", "gamma_local": 0.05},
        {"name": "scaffold_s", "gamma_local": 0.05},
        {"name": "mirror_prox", "gamma": 0.02},
    ],
    ids=lambda a: a["name"],
)
def test_client_sessions_joined_in_memory_give_the_in_process_run_bit_for_bit(algorithm: dict[str, Any]) -> None:
    run = config(**{**RUN.model_dump(), "algorithms": [algorithm]})
    federation = Federation(2)
    federation.join((1,)), federation.join((0,))
    assert federation.protocol.missing() == []
    result = run_algorithm(run.algorithms[0], run, MemoryPool(federation))
    local = clean_run(run)
    assert result.z_sha256 == local.z_sha256
    assert result.traffic["algorithm"]["rounds"] == local.traffic["algorithm"]["rounds"] > 0
    assert isinstance(federation.protocol.state, Idle) and federation.protocol.next_deadline() is None


def test_a_hello_out_of_index_order_may_be_answered_in_its_order_and_no_other() -> None:
    run = config(**{**RUN.model_dump(), "problem": {**RUN.problem.model_dump(), "num_clients": 4}})
    federation = Federation(4)
    hand = federation.join((0, 2, 1, 3), honest=False)
    federation.take(hand)
    pool = MemoryPool(federation)
    refusals: list[str] = []

    def meanwhile() -> None:
        items = federation.take(hand)
        (good,) = [pb.ClientMessage.FromString(r).answer for r in federation.answer(hand, items)]
        assert list(good.client_indices) == [0, 2, 1, 3]
        federation.send(hand, answer(good, client_indices=[3, 2, 1, 0]))
        refusals.extend(r.details for r in federation.rejected(hand))
        federation.send(hand, pb.ClientMessage(answer=good))

    pool.meanwhile = meanwhile
    federation.honest.add(hand)  # it says Ready by itself; its answers are the test's
    pool.start_run = lambda info: (ClientPool.start_run(pool, info), federation.honest.discard(hand))  # type: ignore
    result = run_algorithm(run.algorithms[0], run, pool)
    assert result.z_sha256 == clean_run(run).z_sha256
    assert len(refusals) == run.rounds
    assert all("got [3, 2, 1, 0] (or as the Hello listed them: [0, 2, 1, 3])" in r for r in refusals)


# -- answers ------------------------------------------------------------------------------


def test_bad_answers_are_rejected_with_precise_codes_and_the_run_ends_as_if_they_never_came() -> None:
    federation = Federation(2)
    first, second = federation.join((0,), honest=False), federation.join((1,), honest=False)
    codes: list[tuple[str, str]] = []

    def refused(message: pb.ClientMessage) -> str:
        federation.send(first, message)
        (rejected,) = federation.rejected(first)
        return pb.RejectCode.Name(rejected.code)

    def meanwhile() -> None:
        good_b = good_answer(federation, second)
        federation.send(second, pb.ClientMessage(answer=good_b))
        federation.send(second, pb.ClientMessage(answer=good_b))
        (duplicate,) = federation.rejected(second)
        codes.append(("duplicate", pb.RejectCode.Name(duplicate.code)))
        good = good_answer(federation, first)
        vectors = np.frombuffer(good.payload, dtype="<f8")
        nan, inf = vectors.copy(), vectors.copy()
        nan[2], inf[0] = np.nan, np.inf
        cases = {
            "short": answer(good, vectors[:-1]),
            "length mismatch": answer(good, payload_length=5),
            "nan": answer(good, nan),
            "inf": answer(good, inf),
            "stale round": answer(good, round_id=good.round_id - 1),
            "wrong run": answer(good, run_id="another-run"),
            "someone else's index": answer(good, client_indices=[1]),
            "no indices": answer(good, client_indices=[]),
        }
        for what, message in cases.items():
            codes.append((what, refused(message)))
        federation.send(first, answer(good, payload=b""))  # a header announcing chunks ...
        codes.append(("chunk gap", refused(pb.ClientMessage(chunk=pb.Chunk(offset=8, data=good.payload[8:])))))
        codes.append(("chunk without answer", refused(pb.ClientMessage(chunk=pb.Chunk(data=good.payload)))))
        federation.send(first, pb.ClientMessage(answer=good))

    pool = MemoryPool(federation)
    pool.meanwhile = meanwhile
    federation.honest.update((first, second))  # they say Ready by themselves; their answers are the test's
    pool.start_run = lambda info: (ClientPool.start_run(pool, info), federation.honest.clear())  # type: ignore
    result = run_algorithm(RUN.algorithms[0], RUN, pool)
    assert result.z_sha256 == clean_run().z_sha256  # none of the refused answers touched the state
    assert codes == [(what, REFUSED_WITH[what]) for what, _ in codes] and len(codes) == RUN.rounds * len(REFUSED_WITH)
    # After the run, an answer is refused: no round is open.
    federation.send(first, answer(pb.Answer(run_id="r", round_id=3, client_indices=[0])))
    (late,) = federation.rejected(first)
    assert pb.RejectCode.Name(late.code) == "FAILED_PRECONDITION" and "but no round is open" in late.details
    assert first not in federation.ended


def refusals_in_a_round(misbehave: Callable[[Federation, int, list[pb.ClientMessage]], None]) -> list[str]:
    """The details of every Rejected a hand-driven client gets for what `misbehave(federation, hand, good)` sends
    in one round, before its good answer (`good`: the header, then its chunks) completes the round. One client
    of d = 100 (answers of 200 entries, 1600 bytes) and chunk_bytes 1 KiB: at least 1 KiB per chunk but the last."""
    federation = Federation(1, chunk_bytes=1024)
    hand = federation.join((0,), honest=False)
    problem = config(problem={"name": "paper_regression", "num_clients": 1, "dim": 100}, algorithms=RUN.algorithms)
    pool = MemoryPool(federation)
    start(pool, RunInfo("r", problem.problem, 0, 0.0), hand)
    details: list[str] = []

    def meanwhile() -> None:
        good = [pb.ClientMessage.FromString(r) for r in federation.answer(hand, federation.take(hand))]
        misbehave(federation, hand, good)
        details.extend(r.details for r in federation.rejected(hand))
        for message in good:
            federation.send(hand, message)

    pool.meanwhile = meanwhile
    pool.gradients(np.ones(200))
    return details


def test_a_refused_answers_chunks_are_read_and_refused_once_and_tiny_chunks_are_refused() -> None:
    def misbehave(federation: Federation, hand: int, good: list[pb.ClientMessage]) -> None:
        assert [len(m.chunk.data) for m in good[1:]] == [1024, 576]
        federation.send(hand, good[0])
        federation.send(hand, pb.ClientMessage(chunk=pb.Chunk(offset=0, data=good[1].chunk.data[:512])))
        stale = answer(good[0].answer, round_id=good[0].answer.round_id - 1)
        for message in (stale, *good[1:]):  # its chunks are read and dropped: refused once in all
            federation.send(hand, message)
        huge = answer(good[0].answer, round_id=0, payload_length=10**12)
        for message in (huge, good[1]):  # but not beyond what its clients could send
            federation.send(hand, message)

    details = refusals_in_a_round(misbehave)
    assert details[0].endswith("every chunk but the last carries at least 1024 bytes")
    assert details[1:] == [
        "stale answer for round 0; the coordinator is waiting on round 1",
        "stale answer for round 0; the coordinator is waiting on round 1",
        "a Chunk without an Answer before it",
    ]


@pytest.mark.parametrize("empty_payload", [False, True], ids=["no payload field", "an empty payload field"])
def test_a_refused_answer_padded_past_64_kib_has_its_chunks_read_and_dropped_whether_its_payload_is_empty_or_absent(
    empty_payload: bool,
) -> None:
    # An empty bytes field is no payload to protobuf, whether it is written or left out: a stale header whose
    # other fields (an unknown one here) take it past the 64 KiB from which a payload is read by hand is
    # refused once, and the chunks that follow it are read and dropped, as for any refused header.
    def misbehave(federation: Federation, hand: int, good: list[pb.ClientMessage]) -> None:
        stale = answer(good[0].answer, round_id=good[0].answer.round_id - 1).answer.SerializeToString()
        padding = bytes([0xFA, 0x06]) + wire.varint(wire.BY_HAND_ABOVE) + bytes(wire.BY_HAND_ABOVE)  # field 111
        inner = stale + (bytes([0x2A, 0x00]) if empty_payload else b"") + padding
        federation.send(hand, bytes([0x1A]) + wire.varint(len(inner)) + inner)
        for message in good[1:]:
            federation.send(hand, message)

    assert refusals_in_a_round(misbehave) == ["stale answer for round 0; the coordinator is waiting on round 1"]


def _kept(vectors: np.ndarray) -> int:
    """The bytes an answer's vectors keep alive: the buffer under their views (a message, if they view one)."""
    base: Any = vectors
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return len(base) if isinstance(base, bytes | bytearray) else int(base.nbytes)


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "kept whole"])
def test_an_answer_padded_with_other_fields_keeps_no_more_than_its_payload_while_it_waits(fold: bool) -> None:
    # Client 1 answers before client 0, with its 48 payload bytes in a message padded to 1 MiB by an unknown
    # field: its answer waits (in the fold's reorder buffer, or with the round's answers when they are not
    # added up as they come), and must keep its payload alone, not the whole message.
    federation = Federation(2)
    first, second = federation.join((0,), honest=False), federation.join((1,), honest=False)
    pool = MemoryPool(federation)
    pool.fold = fold
    start(pool, RunInfo("r", RUN.problem, RUN.seed, 0.0), first, second)
    kept: list[tuple[int, int]] = []

    def meanwhile() -> None:
        early = answer_to(federation, second, federation.take(second)).SerializeToString()
        padding = bytes([0xFA, 0x06]) + wire.varint(1 << 20) + bytes(1 << 20)  # field 111, unknown
        federation.send(second, bytes([0x1A]) + wire.varint(len(early) + len(padding)) + early + padding)
        round_ = federation.protocol.collecting
        assert round_ is not None and (round_.fold is not None) == fold
        (held,) = round_.fold._blocks.values() if round_.fold is not None else round_.answers.values()
        kept.append((_kept(held.vectors), held.vectors.nbytes))
        federation.send(first, pb.ClientMessage(answer=good_answer(federation, first)))

    pool.meanwhile = meanwhile
    pool.gradients(np.ones(6))
    ((pinned, payload),) = kept
    assert payload == 48 and pinned <= payload + payload // 16


def test_the_32nd_refusal_in_a_round_ends_the_session_and_names_the_first() -> None:
    federation = Federation(1)
    hand = federation.join((0,), honest=False)
    for offset in range(40):
        federation.send(hand, pb.ClientMessage(chunk=pb.Chunk(offset=offset, data=b"x")))
    assert len(federation.rejected(hand)) == MAX_REFUSED_IN_A_ROUND - 1
    end = federation.ended[hand]
    assert end.code == INVALID and end.details == (
        "32 messages refused while no round was open; the first: a Chunk without an Answer before it"
    )
    assert federation.protocol.missing() == [0]


def test_a_late_answer_refused_once_a_round_never_adds_up_to_the_limit() -> None:
    federation, pool, late = started(straggler_deadline_s=0.05, min_clients=1)
    previous: list[pb.Answer] = []
    codes: list[str] = []

    def meanwhile() -> None:
        task = federation.take(late)
        if previous:  # its answer to the round before: refused, once this round
            federation.send(late, pb.ClientMessage(answer=previous.pop()))
            codes.extend(pb.RejectCode.Name(r.code) for r in federation.rejected(late))
        previous.append(answer_to(federation, late, task))
        federation.advance(0.05)  # the straggler deadline closes the round with the prompt client alone

    pool.meanwhile = meanwhile
    for _ in range(40):
        answers = pool.gradients(np.ones(6))
        assert answers.indices == (1,)
    assert codes == ["FAILED_PRECONDITION"] * 39 and federation.ended == {}


def test_a_round_whose_quorum_answers_after_the_straggler_deadline_closes_with_that_answer() -> None:
    # Client 1 (the quorum: min_clients 1) answers 0.1 s after the round opened, past its 0.05 s straggler
    # deadline; client 0 does not answer. The round closes at once with client 1's answer, as "closes after
    # 0.05 s once 1 client has answered" says, instead of waiting out the round's timeout for client 0.
    federation = Federation(2, straggler_deadline_s=0.05, min_clients=1, round_timeout_s=60.0)
    late, prompt = federation.join((0,), honest=False), federation.join((1,), honest=False)
    pool = MemoryPool(federation)
    start(pool, RunInfo("r", RUN.problem, RUN.seed, 0.0), late, prompt)
    opened = federation.now

    def meanwhile() -> None:
        federation.advance(0.1)  # the straggler deadline passes with no answer
        assert federation.protocol.collecting is not None  # (short of the quorum: still open)
        federation.send(prompt, pb.ClientMessage(answer=good_answer(federation, prompt)))

    pool.meanwhile = meanwhile
    answers = pool.gradients(np.ones(6))
    assert answers.indices == (1,)
    assert federation.now - opened == pytest.approx(0.1)  # closed by the answer, not by the timeout


def test_an_answer_that_crosses_the_goodbye_is_refused_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fedsaddle.coordinator")
    federation = Federation(1)
    hand = federation.join((0,), honest=False)
    federation.carry_out(federation.protocol.goodbye("the run is over", pb.DONE))
    (goodbye,) = [i for i in federation.take(hand) if isinstance(i, pb.Instruction) and i.HasField("goodbye")]
    assert goodbye.goodbye.outcome == pb.DONE
    assert federation.ended[hand].code is None and federation.ended[hand].linger_s > 0
    federation.ended.clear()  # (the stream lingers: the client may still write)
    federation.send(hand, answer(pb.Answer(run_id="r", round_id=1, client_indices=[0])))
    federation.close(hand)
    late = [r for r in caplog.records if "as the coordinator stops" in r.getMessage()]
    assert len(late) == 1 and late[0].levelno == logging.DEBUG and "but no round is open" in late[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("ended its session" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("seed", range(60))
def test_garbled_messages_before_each_answer_never_change_the_run_or_break_the_coordinator(seed: int) -> None:
    # As the socket test of the same name (test_bad_answers.py), with many more draws: the run ends as a
    # clean one, or ends naming client 0 and why; never another result, an exception or a hang.
    rng = np.random.default_rng(seed)
    federation = Federation(2, round_timeout_s=20)
    hostile = federation.join((0,), honest=False)
    federation.join((1,))
    pool = MemoryPool(federation)

    def meanwhile() -> None:
        if hostile in federation.ended:
            federation.advance(20)  # the round times out on it, or ends on its loss
            return
        good = good_answer(federation, hostile)
        for _ in range(int(rng.integers(5))):
            federation.send(hostile, _garbled(good, rng))
        federation.send(hostile, pb.ClientMessage(answer=good))
        if not federation.outcomes:
            federation.advance(20)

    federation.honest.add(hostile)  # it says Ready by itself; then the test speaks for it
    pool.start_run = lambda info: (ClientPool.start_run(pool, info), federation.honest.discard(hostile))  # type: ignore
    pool.meanwhile = meanwhile
    try:
        result = run_algorithm(RUN.algorithms[0], RUN, pool)
    except RunStopped as stopped:
        assert re.match(r"client 0 \(memory at .*\) was ended by the coordinator \(.+\)", str(stopped)), stopped
        return
    if result.status == "diverged":
        assert "client 0" in result.detail or "clients [0]" in result.detail
    else:
        assert result.status == "ok" and result.z_sha256 == clean_run().z_sha256


# -- hellos -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "code", "message"),
    [
        (b"\xff\xff\xff\xff not a protobuf", INVALID, "bytes that are not a ClientMessage"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[0])).SerializeToString()[:-1], INVALID,
         "6 bytes that are not a ClientMessage: field hello at byte 0: its length says 5 bytes, 4 remain"),
        (pb.ClientMessage(ready=pb.Ready(run_id="x")).SerializeToString(), INVALID, "must start with a Hello"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2)).SerializeToString(), INVALID, "no client indices given"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[2])).SerializeToString(), INVALID,
         "client indices [2] are outside [0, 2)"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[0, 0])).SerializeToString(), INVALID,
         "client indices repeat: [0]"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[0] * 10**6)).SerializeToString(),
         INVALID, "1000000 client indices given; the federation has 2"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[1])).SerializeToString(),
         Status.ALREADY_EXISTS, "client indices [1] are already connected"),
        (pb.ClientMessage(hello=pb.Hello(protocol_version=1, client_indices=[0])).SerializeToString(), INVALID,
         "protocol version 1 is not supported"),
    ],
)  # fmt: skip
def test_bad_first_messages_are_refused_and_change_nothing(first: bytes, code: Status, message: str) -> None:
    federation = Federation(2)
    holder = federation.join((1,))
    stream = federation.connect()
    federation.send(stream, first)
    end = federation.ended[stream]
    assert end.code == code and message in end.details
    assert stream in federation.greeted  # admission no longer counts it as waiting
    assert federation.protocol.missing() == [0] and holder not in federation.ended
    assert federation.protocol.next_deadline() is None  # its Hello deadline is gone with it


def test_a_joined_sessions_bytes_that_are_not_protobuf_end_it_naming_the_fault() -> None:
    # An Answer cut short (a client's own serializer, say): the details say which field and byte, as protobuf does not.
    federation = Federation(2)
    holder = federation.join((0,))
    answer = pb.ClientMessage(answer=pb.Answer(run_id="r", round_id=1, payload_length=1, payload=bytes(8)))
    federation.send(holder, answer.SerializeToString()[:-3])
    end = federation.ended[holder]
    assert end.code == INVALID
    assert end.details == (
        "bytes that are not a ClientMessage (16 bytes): field answer at byte 0: its length says 17 bytes, 14 remain"
    )


def test_a_stream_without_a_hello_is_ended_at_its_deadline_and_not_before() -> None:
    federation = Federation(1, limits=Limits(hello_timeout_s=10.0))
    silent = federation.connect()
    federation.advance(1.0)
    early = federation.connect()
    assert federation.protocol.next_deadline() == 10.0
    federation.advance(8.99)
    assert silent not in federation.ended
    federation.advance(0.01)
    end = federation.ended[silent]
    assert end.code == Status.DEADLINE_EXCEEDED and end.details == "no Hello within 10 s"
    assert early not in federation.ended and federation.protocol.next_deadline() == 11.0
    federation.send(early, federation_hello((0,)))
    assert early not in federation.ended and federation.protocol.next_deadline() is None


def federation_hello(indices: tuple[int, ...]) -> pb.ClientMessage:
    return pb.ClientMessage(hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=list(indices)))


def test_a_stream_that_ends_before_its_hello_is_refused() -> None:
    federation = Federation(1)
    stream = federation.connect()
    federation.close(stream)
    assert federation.ended[stream].code == INVALID
    assert federation.ended[stream].details == "the stream ended before a Hello"


def test_waiting_for_the_federation_settles_when_the_last_index_joins_or_names_the_missing_at_the_deadline() -> None:
    federation = Federation(3)
    federation.join((0,))
    federation.carry_out(federation.protocol.await_federation(5.0, federation.now))
    federation.join((2,))
    assert federation.outcomes == [] and federation.protocol.next_deadline() == 5.0
    federation.advance(5.0)
    (failed,) = federation.outcomes
    assert isinstance(failed.error, MissingClients) and str(failed.error) == "clients [1] did not join within 5 s"
    federation.outcomes.clear()
    federation.carry_out(federation.protocol.await_federation(5.0, federation.now))
    federation.join((1,))
    assert [o.result for o in federation.outcomes] == [None]  # type: ignore[union-attr]


# -- the run's start ----------------------------------------------------------------------


def test_a_ready_with_an_error_the_wrong_dimension_or_no_samples_stops_the_run_before_round_one() -> None:
    federation = Federation(2)
    honest, broken = federation.join((0,), honest=False), federation.join((1,), honest=False)
    failures = []

    def ready(bad: pb.Ready, weighting: str) -> None:
        (spec,) = [i for i in federation.take(honest) if isinstance(i, pb.Instruction) and i.HasField("run")]
        good = pb.ClientMessage(ready=pb.Ready(run_id=bad.run_id, dimension=6, sample_counts=[40]))
        federation.send(honest, federation.answer(honest, [spec])[0] if weighting == "uniform" else good)
        federation.take(broken)
        federation.send(broken, pb.ClientMessage(ready=bad))

    for run_id, bad, weighting in (
        ("r1", pb.Ready(run_id="r1", error="data/client-1.npz: row 5 holds NaN"), "uniform"),
        ("r2", pb.Ready(run_id="r2", dimension=8), "uniform"),
        ("r3", pb.Ready(run_id="r3", dimension=6, sample_counts=[0]), "samples"),
    ):
        info = RunInfo(run_id, RUN.problem, RUN.seed, 0.0, weighting)  # type: ignore[arg-type]
        with pytest.raises(PoolError) as error:
            federation.operate(
                lambda now, info=info: federation.protocol.start_run(info, run_spec(info), now),
                lambda bad=bad, weighting=weighting: ready(bad, weighting),
            )
        failures.append(str(error.value))
    assert failures == [
        "client 1 (memory at ipv4:127.0.0.1:50001) cannot serve run r1: data/client-1.npz: row 5 holds NaN",
        "client 1 (memory at ipv4:127.0.0.1:50001) has data of dimension 8, but run r2 expects 6",
        "client 1 (memory at ipv4:127.0.0.1:50001) reported 0 training samples for client 1: weighted by samples, "
        "every client must bring some",
    ]
    assert honest not in federation.ended and broken not in federation.ended


def test_a_second_ready_ends_the_session_and_the_next_round_says_why() -> None:
    federation = Federation(1)
    hand = federation.join((0,))
    pool = MemoryPool(federation)
    pool.start_run(RunInfo("twice", PROBLEM_1, 0, 0.0))
    federation.send(hand, pb.ClientMessage(ready=pb.Ready(run_id="twice", dimension=6, numeric_stack="another")))
    assert federation.ended[hand].details == "a second Ready for run 'twice'"
    assert pool.numeric_stacks() != {"another": [0]}
    lost = r"client 0 \(memory at .*\) was ended by the coordinator \(a second Ready for run 'twice'\) before round 1"
    with pytest.raises(ClientLost, match=lost):
        pool.gradients(np.ones(6))


def test_a_second_hello_ends_the_session_and_the_next_round_says_why() -> None:
    # A session's indices are its first Hello's: a second one (here claiming another index) is a protocol
    # violation, refused as a second Ready is; it claims nothing.
    federation = Federation(2)
    hand, other = federation.join((0,)), federation.join((1,))
    pool = MemoryPool(federation)
    pool.start_run(RunInfo("twice", RUN.problem, 0, 0.0))
    again = federation_hello((1,))
    federation.send(hand, again)
    said = f"a second Hello ({again.ByteSize()} bytes)"
    assert (federation.ended[hand].code, federation.ended[hand].details) == (INVALID, said)
    assert other not in federation.ended
    lost = rf"client 0 \(memory at .*\) was ended by the coordinator \({re.escape(said)}\) before round 1"
    with pytest.raises(ClientLost, match=lost):
        pool.gradients(np.ones(6))


def test_readys_for_a_run_not_under_way_count_as_refused() -> None:
    federation = Federation(1)
    hand = federation.join((0,))
    for _ in range(40):
        federation.send(hand, pb.ClientMessage(ready=pb.Ready(run_id="other", dimension=6)))
    assert federation.ended[hand].details == (
        "32 messages refused while no round was open; the first: a Ready for run 'other', not under way"
    )


# -- losses, rejoins and deadlines --------------------------------------------------------


def test_a_silent_session_fails_the_round_at_its_timeout_naming_it() -> None:
    federation, pool, _ = started(round_timeout_s=60.0)  # client 0 never answers

    def meanwhile() -> None:
        assert federation.protocol.next_deadline() == federation.now + 60.0
        federation.advance(59.9)
        assert federation.outcomes == []
        federation.advance(0.1)

    pool.meanwhile = meanwhile
    with pytest.raises(ClientLost, match=r"round 1: no answer within 60 s from client 0 \(memory at ") as lost:
        pool.gradients(np.ones(6))
    assert lost.value.client_indices == (0,)


def test_a_client_lost_in_a_round_rejoins_and_is_sent_the_run_and_the_task_again() -> None:
    federation, pool, leaving = started(rejoin_timeout_s=30.0)
    bytes_before = federation.sent_bytes

    def meanwhile() -> None:
        federation.close(leaving)  # it goes before it answers
        assert federation.protocol.next_deadline() == federation.now + 30.0
        federation.advance(29.0)
        assert federation.outcomes == []
        federation.join((0,))  # back, as a new session: Welcome, RunSpec, Ready, the task again, its answer

    pool.meanwhile = meanwhile
    answers = pool.gradients(np.ones(6))
    assert answers.indices is None and answers.vectors is not None and answers.vectors.shape == (2, 6)
    assert federation.sent_bytes > bytes_before
    resent = federation.protocol.take_resent()
    assert resent.messages == 1 and resent.floats == 6 and resent.size > 0


def test_a_client_lost_in_a_round_that_does_not_rejoin_fails_it_at_the_rejoin_deadline() -> None:
    federation, pool, leaving = started(rejoin_timeout_s=30.0)

    def meanwhile() -> None:
        federation.close(leaving)
        federation.advance(29.999)
        assert federation.outcomes == []
        federation.advance(0.001)

    pool.meanwhile = meanwhile
    lost = r"client 0 \(memory at .*\) disconnected during round 1, and did not rejoin within 30 s"
    with pytest.raises(ClientLost, match=lost):
        pool.gradients(np.ones(6))


def test_a_round_waits_for_a_client_gone_between_rounds_without_polling() -> None:
    federation = Federation(1, rejoin_timeout_s=10.0)
    first = federation.join((0,))
    pool = MemoryPool(federation)
    pool.start_run(RunInfo("r", PROBLEM_1, 0, 0.0))
    pool.gradients(np.ones(6))
    federation.close(first)
    request_rejoin: list[int] = []

    def meanwhile() -> None:  # the round is not open yet: it waits for the client, until its deadline
        assert isinstance(federation.protocol.state, Presence)
        assert federation.protocol.next_deadline() == federation.now + 10.0
        federation.advance(4.0)
        request_rejoin.append(federation.join((0,)))  # RunSpec, Ready: the round opens and is answered

    pool.meanwhile = meanwhile
    answers = pool.gradients(np.ones(6))
    assert answers.vectors is not None and answers.vectors.shape == (1, 6) and len(request_rejoin) == 1
    federation.close(request_rejoin[0])
    pool.meanwhile = None
    with pytest.raises(ClientLost, match=r"client 0 .* disconnected before round 3"):
        pool.meanwhile = lambda: federation.advance(10.0)
        pool.gradients(np.ones(6))


def test_without_rejoins_a_client_gone_between_rounds_is_named_at_once() -> None:
    federation = Federation(1)
    first = federation.join((0,))
    pool = MemoryPool(federation)
    pool.start_run(RunInfo("between", PROBLEM_1, 0, 0.0))
    pool.gradients(np.ones(6))
    federation.close(first)
    with pytest.raises(ClientLost, match=r"client 0 \(memory at .*\) disconnected before round 2"):
        pool.gradients(np.ones(6))


def test_a_session_dropped_for_not_reading_fails_the_round_naming_it() -> None:
    federation, pool, slow = started()
    pool.meanwhile = lambda: federation.carry_out(federation.protocol.drop(slow, 1 << 27, federation.now))
    with pytest.raises(ClientLost, match=r"client 0 .* was dropped: .* stopped reading its stream \(134217728 bytes"):
        pool.gradients(np.ones(6))
    end = federation.ended[slow]
    assert end.code == Status.RESOURCE_EXHAUSTED and end.at_once


def test_the_round_result_counts_the_bytes_each_way() -> None:
    federation = Federation(2)
    federation.join((0,)), federation.join((1,))
    pool = MemoryPool(federation)
    pool.start_run(RunInfo("r", RUN.problem, RUN.seed, 0.0))
    before = federation.sent_bytes
    request_result: list[RoundResult] = []
    original = federation.operate

    def operate(begin: Any, meanwhile: Any = None) -> object:
        result = original(begin, meanwhile)
        if isinstance(result, RoundResult):
            request_result.append(result)
        return result

    federation.operate = operate  # type: ignore[method-assign]
    pool.gradients(np.ones(6))
    (result,) = request_result
    assert result.bytes_down == federation.sent_bytes - before > 2 * 6 * 8
    assert result.bytes_up > 2 * 6 * 8


def test_session_states_follow_a_sessions_life() -> None:
    federation = Federation(1)
    key = federation.connect()
    session = federation.protocol.sessions[key]
    assert session.state is State.GREETING
    federation.send(key, federation_hello((0,)))
    assert session.state is State.JOINED
    federation.carry_out(federation.protocol.goodbye("over", pb.DONE))
    assert session.state is State.CLOSING
    federation.close(key)
    assert session.state is State.ENDED


SAID = "cannot read /data/site-a/patients.csv: row 17 has age 212"


def _goodbye_reason(federation: Federation, error: BaseException) -> str:
    actions = federation.protocol.goodbye(str(error), pb.FAILED)
    (reason,) = {pb.Instruction.FromString(a.data).goodbye.reason for a in actions if isinstance(a, Send)}
    return reason


def test_a_failure_between_rounds_reaches_the_operator_but_not_the_other_clients_in_its_own_words() -> None:
    # Client 0 answers round 1, then (e.g. in prepare_next, or on a KeyDirectory) fails between rounds. No
    # barrier waits on it, so the error comes from the next round's presence check: "... failed: SAID before
    # round 2". The Goodbye to the others says it failed and told the coordinator why.
    federation = Federation(2)
    hand = federation.join((0,), honest=False)
    federation.join((1,))
    pool = MemoryPool(federation)
    start(pool, RunInfo("r", RUN.problem, RUN.seed, 0.0), hand)

    def answer_by_hand() -> None:
        for reply in federation.answer(hand, federation.take(hand)):
            federation.send(hand, reply)

    pool.meanwhile = answer_by_hand
    pool.gradients(np.ones(6))
    federation.send(hand, pb.ClientMessage(failure=pb.Failure(run_id="r", round_id=0, reason=SAID)))
    with pytest.raises(ClientLost) as lost:
        pool.gradients(np.ones(6))
    assert SAID in str(lost.value)  # the operator's error keeps it: right
    reason = _goodbye_reason(federation, lost.value)
    assert SAID not in reason and "failed (it told the coordinator why) before round" in reason, reason


def test_a_ready_error_reaches_the_operator_but_not_the_other_clients_in_its_own_words() -> None:
    # A client's Ready.error is its own words (a data path, say): the run's failure quotes it, the Goodbye not.

    federation = Federation(2)
    hand = federation.join((0,), honest=False)
    federation.join((1,))
    info = RunInfo("r", RUN.problem, RUN.seed, 0.0)
    with pytest.raises(PoolError) as failed:
        federation.operate(
            lambda now: federation.protocol.start_run(info, run_spec(info), now),
            lambda: federation.send(hand, pb.ClientMessage(ready=pb.Ready(run_id="r", error=SAID))),
        )
    assert SAID in str(failed.value)
    reason = _goodbye_reason(federation, failed.value)
    assert SAID not in reason and "cannot serve run r (it told the coordinator why)" in reason, reason


def test_no_failing_clients_words_reach_the_goodbye_however_many_fail() -> None:
    # 20 clients fail on the same task, each in its own words (its own data path). The round fails on the first,
    # whose words the Goodbye must not carry however many Failures came after it.
    n = 21  # clients 0..19 fail; client 20 stays, and is told the Goodbye
    federation = Federation(n)
    keys = [federation.join((i,), honest=False) for i in range(n)]
    info = RunInfo("r", RUN.problem.model_copy(update={"num_clients": n}), RUN.seed, 0.0)
    pool = MemoryPool(federation)
    start(pool, info, *keys)

    def all_fail() -> None:
        for i, key in enumerate(keys[:-1]):
            said = f"cannot read /data/site-{i}/patients.csv"
            federation.send(key, pb.ClientMessage(failure=pb.Failure(run_id="r", round_id=1, reason=said)))

    pool.meanwhile = all_fail
    with pytest.raises(ClientLost) as lost:
        pool.gradients(np.ones(6))
    assert "/data/site-0/" in str(lost.value)
    reason = _goodbye_reason(federation, lost.value)
    assert "/data/site-" not in reason, reason


def test_a_failure_whose_words_begin_anothers_does_not_uncover_the_rest_of_them() -> None:
    # Client 1 fails in words that are the start of client 0's ("cannot"): replacing its phrase first inside
    # client 0's would leave the rest of client 0's words ("read /data/...") in the Goodbye to everyone.
    federation = Federation(3)
    keys = [federation.join((i,), honest=False) for i in range(3)]
    info = RunInfo("r", RUN.problem.model_copy(update={"num_clients": 3}), RUN.seed, 0.0)
    pool = MemoryPool(federation)
    start(pool, info, *keys)

    def both_fail() -> None:
        for key, said in ((keys[0], SAID), (keys[1], "cannot")):
            federation.send(key, pb.ClientMessage(failure=pb.Failure(run_id="r", round_id=1, reason=said)))

    pool.meanwhile = both_fail
    with pytest.raises(ClientLost) as lost:
        pool.gradients(np.ones(6))
    assert SAID in str(lost.value)
    reason = _goodbye_reason(federation, lost.value)  # (before the fix it leaked under half the hash seeds)
    assert "patients" not in reason and "failed (it told the coordinator why)" in reason, reason
