"""The coordinator's running sum (server/fold.py): the aggregation rule's bits, whatever order answers come in.

In memory: every arrival order, chunking and weighting gives the bits of `aggregate` /
`aggregate_rows`, and an answer refused half-way leaves the sum as it was. Over real
processes: a first client that answers last (its process stopped) leaves the round's
mean bit-identical to the in-process one, while the coordinator holds no more than its
reorder bound of answers and stops reading the streams whose turn has not come.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from conftest import config, stop_processes
from federation import Federation, MemoryPool

from fedsaddle.common import wire
from fedsaddle.common.numeric import sha256
from fedsaddle.common.tasks import Answer, GradientTask, LocalStepsTask
from fedsaddle.launch import start_clients
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.algorithms.base import aggregate, aggregate_rows
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.pool import ClientLost, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.rounds import Collecting
from fedsaddle.server.transport.sessions import Limits


def _rule(rows: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """The mean as `RoundAnswers.mean()` takes it in process."""
    mean: np.ndarray = (
        aggregate_rows(list(rows), weights) if rows.shape[1] > 4096 else aggregate(rows[None], weights)[0]
    )
    return mean


@pytest.mark.parametrize("entries", [7, 5000])
@pytest.mark.parametrize("weighted", [False, True])
def test_any_arrival_order_gives_the_rules_bits(entries: int, weighted: bool) -> None:
    rng = np.random.default_rng(entries)
    n = 9
    rows = rng.standard_normal((n, entries)) * 10.0 ** rng.integers(-8, 8, (n, 1))
    weights = rng.integers(1, 1000, n).astype(np.float64) if weighted else None
    expected = sha256(_rule(rows, weights))
    groups = [(0,), (1, 2, 3), (4,), (5, 6), (7, 8)]  # one answer per process, as sessions send them
    for trial in range(12):
        order = rng.permutation(len(groups))
        fold = OrderedFold(range(n), weights, n)
        for g in order:
            clients = groups[g]
            fold.offer(Answer(clients, rows[list(clients)]))
        assert fold.added == n
        assert fold.held_bytes == 0
        assert sha256(fold.mean(range(n), weights)) == expected, (trial, order)


def test_a_round_closed_without_some_clients_sums_the_others_in_order() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, 50))
    fold = OrderedFold(range(6), None, 6)
    for clients in [(5,), (2, 3), (4,)]:  # 0 and 1 never answer (a straggler deadline closed the round)
        fold.offer(Answer(clients, rows[list(clients)]))
    assert fold.added == 0 and fold.early == 3 and fold.held_bytes == 4 * 50 * 8
    answered = [2, 3, 4, 5]
    assert sha256(fold.mean(answered, None)) == sha256(_rule(rows[answered], None))


def test_clients_that_sit_the_round_out_let_the_sum_go_past_them() -> None:
    rows = np.random.default_rng(5).standard_normal((5, 30))
    fold = OrderedFold(range(5), None, 5)
    fold.offer(Answer((2, 3, 4), rows[[2, 3, 4]]))
    assert fold.added == 0 and fold.next_client == 0
    fold.skip((0, 1))  # their process rejoined too late to answer this round
    assert fold.added == 3 and fold.held_bytes == 0 and fold.next_client is None
    assert sha256(fold.mean([2, 3, 4], None)) == sha256(_rule(rows[[2, 3, 4]], None))


@pytest.mark.parametrize("chunk", [1028, 4096, 777])
def test_an_answer_added_chunk_by_chunk_has_the_rules_bits_and_a_refused_one_changes_nothing(chunk: int) -> None:
    rng = np.random.default_rng(chunk)
    n, entries = 5, 1000
    rows = rng.standard_normal((n, entries))
    weights = rng.integers(1, 50, n).astype(np.float64)
    fold = OrderedFold(range(n), weights, n)
    fold.offer(Answer((0,), rows[[0]]))
    fold.offer(Answer((3, 4), rows[[3, 4]]))  # early: waits for 1 and 2

    def stream(clients: tuple[int, ...], payload: bytes) -> None:
        assert fold.begin_stream(clients, entries)
        for offset in range(0, len(payload), chunk):
            fold.stream_chunk(offset, payload[offset : offset + chunk])

    before = fold.total.copy() if fold.total is not None else None
    bad = rows[[1, 2]].copy()
    bad[1, 900] = np.inf  # in the last chunks: the first ones were added already
    with pytest.raises(wire.WireError, match="client 2: entry 900 is inf"):
        stream((1, 2), bad.tobytes())
    assert not fold.streaming
    assert before is not None and fold.total is not None and fold.total.tobytes() == before.tobytes()
    assert not fold.begin_stream((3, 4), entries)  # not their turn
    stream((1, 2), rows[[1, 2]].tobytes())
    fold.end_stream(None)
    assert fold.added == n and fold.streamed == 1 and fold.held_bytes == 0
    assert sha256(fold.mean(range(n), weights)) == sha256(_rule(rows, weights))


def test_an_answer_refused_half_added_is_taken_out_and_its_good_one_counts_once() -> None:
    # In memory, through the coordinator's protocol: answers of 1600 bytes in chunks of 1024. Client 1
    # answers first (early, held); client 0's answer is added chunk by chunk, its second chunk carries an
    # inf and is refused, then its good answer comes: the mean is the in-process one, bit for bit.
    federation = Federation(2, chunk_bytes=1024)
    hand = federation.join((0,), honest=False)
    federation.join((1,))
    pool = MemoryPool(federation)
    pool.fold = True
    problem = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 100}, algorithms=[MD])
    info = RunInfo("r", problem.problem, 0, 0.0)
    federation.honest.add(hand)
    pool.start_run(info)
    federation.honest.discard(hand)
    refusals: list[str] = []

    def meanwhile() -> None:
        good = [pb.ClientMessage.FromString(r) for r in federation.answer(hand, federation.take(hand))]
        assert [len(m.chunk.data) for m in good[1:]] == [1024, 576]
        data = bytearray(good[2].chunk.data)
        data[8 * 10 : 8 * 11] = np.array([np.inf]).tobytes()  # entry 128 + 10 of client 0's row
        bad = pb.ClientMessage(chunk=pb.Chunk(offset=good[2].chunk.offset, data=bytes(data)))
        for message in (good[0], good[1], bad):
            federation.send(hand, message)
        fold = pool.federation.protocol.collecting.fold  # type: ignore[union-attr]
        assert fold is not None and fold.early == 1 and not fold.streaming  # 1 held; 0's first chunk taken out
        refusals.extend(r.details for r in federation.rejected(hand))
        for message in good:
            federation.send(hand, message)

    pool.meanwhile = meanwhile
    z = np.linspace(-1.0, 1.0, 200)
    remote = pool.gradients(z)
    local = LocalPool()
    local.start_run(info)
    assert sha256(remote.mean()) == sha256(local.gradients(z).mean())
    assert refusals == ["client 0: entry 138 is inf (non-finite values are refused)"]
    fold = pool.last_fold
    assert fold is not None and fold.streamed == 1 and fold.added == 2 and fold.held_bytes == 0


# -- over real processes ---------------------------------------------------------------------

MD = {"name": "minibatch_md", "gamma": 0.1}
GROUPS = ["0", "1-3", "4-6", "7-9", "10-11"]  # 12 clients in 5 processes; client 0's alone
DIM = 200  # x and y in R^200: 3200 bytes per client, in chunks of 1028 (not a whole number of entries)
CHUNK = 1028
ANSWER = 3 * 2 * DIM * 8  # bytes of one 3-client process's answer


def _watch(pool: GrpcPool, stopped: int, seen: list[Collecting], done: threading.Event) -> None:
    """Resume the stopped first client once the round holds an early answer and has stopped reading a stream."""
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        round_ = pool.protocol.collecting
        if round_ is not None and round_.fold is not None and round_.fold.early and pool.service._paused:
            seen.append(round_)
            break
        time.sleep(0.005)
    import os

    os.kill(stopped, signal.SIGCONT)


def test_a_first_client_that_answers_last_changes_no_bit_and_the_buffer_stays_bounded() -> None:
    problem = {"name": "paper_regression", "num_clients": 12, "dim": DIM, "s": 2.0}
    run = config(problem=problem, algorithms=[{"name": "minibatch_md", "gamma": 0.1}], seed=4)
    info = RunInfo("late-first", run.problem, run.seed, 0.0)
    bound = ANSWER  # room for one process's answer out of turn
    pool = GrpcPool(12, "127.0.0.1:0", chunk_bytes=CHUNK, limits=Limits(reorder_mib=bound / (1 << 20)))
    processes = start_clients(pool.address, GROUPS)
    local = LocalPool()
    try:
        pool.wait_for_clients(60)
        pool.start_run(info)
        local.start_run(info)
        rng = np.random.default_rng(0)
        z = rng.standard_normal(2 * DIM)
        tasks = [
            GradientTask(z, exact=True, want_objective=True),
            LocalStepsTask(z, 3, 0.01, control=rng.standard_normal(2 * DIM)),
            GradientTask(z, batch=2),
        ]
        for task in tasks:
            seen: list[Collecting] = []
            done = threading.Event()
            processes[0].send_signal(signal.SIGSTOP)
            watcher = threading.Thread(target=_watch, args=(pool, processes[0].pid, seen, done))
            watcher.start()
            try:
                remote = pool.exchange(task)
            finally:
                done.set()
                watcher.join()
            alone = local.exchange(task)
            assert sha256(remote.mean()) == sha256(alone.mean())
            if remote.objective is not None:  # carried through the fold, in index order
                assert alone.objective is not None
                # client 0 computes f_0 alone in its process, the others three or two to a process, the
                # in-process pool all twelve at once: the same bits
                assert remote.objective.tobytes() == alone.objective.tobytes()
            (round_,) = seen  # the round held an early answer and left a stream unread
            fold = round_.fold
            assert fold is not None and fold.added == 12 and fold.early >= 1
            assert 0 < fold.peak_held_bytes <= bound  # never more than the bound waited for its turn
            assert round_.peak_admitted_bytes <= bound + ANSWER  # the bound, and the answer the sum waits on
            assert fold.streamed >= 1  # answers in their turn are added as they are read, not kept
        assert pool.traffic["algorithm"].rounds == 3
        assert pool.traffic["algorithm"].messages_up == 3 * 12
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        pool.close()
        stop_processes(processes)


def test_a_round_out_of_time_names_the_client_the_sum_waits_on_not_the_streams_it_held_back() -> None:
    # In memory: neither client answers round 1. Client 1's stream is one the shell would not read while
    # the sum waits on client 0 (its answer is longer than a chunk and the reorder buffer has no room), so
    # the timeout names client 0 alone, and says one more session was held back.
    federation = Federation(2, chunk_bytes=1024, limits=Limits(reorder_mib=0), round_timeout_s=5.0)
    first, second = federation.join((0,), honest=False), federation.join((1,), honest=False)
    pool = MemoryPool(federation)
    pool.fold = True
    problem = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 100}, algorithms=[MD])
    info = RunInfo("r", problem.problem, 0, 0.0)
    federation.honest.update((first, second))
    pool.start_run(info)
    federation.honest.difference_update((first, second))
    pool.meanwhile = lambda: federation.advance(5.0)
    with pytest.raises(ClientLost) as lost:
        pool.gradients(np.zeros(200))
    assert lost.value.client_indices == (0,)
    assert str(lost.value).startswith("round 1: no answer within 5 s from client 0 (")
    assert str(lost.value).endswith("; 1 more sessions were not being read while the sum waited on these")


def _straggler_run(fold: bool) -> tuple[Federation, int, MemoryPool]:
    """In memory, 2 clients, a straggler deadline of 1 s with min_clients 1, answers of two 1 KiB chunks; the
    run started, client 0's stream driven by hand (its key), client 1 honest."""
    federation = Federation(2, chunk_bytes=1024, straggler_deadline_s=1.0, min_clients=1, round_timeout_s=5.0)
    first = federation.join((0,), honest=False)
    federation.join((1,))
    pool = MemoryPool(federation)
    pool.fold = fold
    problem = config(problem={"name": "paper_regression", "num_clients": 2, "dim": 100}, algorithms=[MD])
    federation.honest.add(first)
    pool.start_run(RunInfo("r", problem.problem, 0, 0.0))
    federation.honest.discard(first)
    return federation, first, pool


def _straggling(fold: bool) -> tuple[np.ndarray, tuple[int, ...] | None, list[pb.Rejected], bool]:
    """Client 0 sends its answer's header and first chunk, then the straggler deadline closes the round with
    client 1's answer alone; then the rest of client 0's chunks come. The round's mean, its clients, what
    client 0 was told, and whether the protocol took the late chunks without error."""
    federation, first, pool = _straggler_run(fold)
    rest: list[bytes] = []

    def meanwhile() -> None:
        header, chunk, *later = federation.answer(first, federation.take(first))  # (1600 bytes: two chunks)
        federation.send(first, header)
        federation.send(first, chunk)
        round_ = federation.protocol.collecting
        assert round_ is not None and (round_.fold is None) != (first in round_.answers or fold)
        federation.advance(1.5)  # the straggler deadline
        rest.extend(later)

    pool.meanwhile = meanwhile
    answers = pool.gradients(np.ones(200))
    mean = answers.mean().copy()
    for data in rest:
        federation.send(first, data)
    return mean, answers.indices, federation.rejected(first), federation.protocol.collecting is None


def test_an_answer_being_added_as_a_straggler_deadline_closes_the_round_is_taken_back_out_and_refused() -> None:
    folded, clients, told, idle = _straggling(fold=True)
    kept, kept_clients, _, _ = _straggling(fold=False)  # every answer kept whole: the sum taken at the end
    assert clients == kept_clients == (1,)
    assert folded.tobytes() == kept.tobytes()  # client 0's first chunk is not in the mean
    assert idle  # its later chunks were read and dropped, no error
    (rejected,) = told
    assert rejected.round_id == 1 and "closed while this answer was being read" in rejected.details


def test_a_stream_cut_by_the_straggler_deadline_is_no_refusal_of_its_client() -> None:
    # Client 0 had 31 messages refused in the round (one short of being ended), then began a good answer
    # in chunks; the straggler deadline closes the round on client 1's answer. Cutting the stream is the
    # coordinator's doing: it neither raises out of the deadline's tick (which left the round unsettled
    # and no timer armed) nor ends the session; the round settles with client 1's answer.
    federation, first, pool = _straggler_run(fold=True)

    def meanwhile() -> None:
        header, chunk, *_ = federation.answer(first, federation.take(first))
        for _ in range(31):
            federation.send(first, pb.ClientMessage(chunk=pb.Chunk(offset=0, data=b"x")))
        federation.send(first, header)
        federation.send(first, chunk)
        federation.advance(1.5)  # the straggler deadline

    pool.meanwhile = meanwhile
    answers = pool.gradients(np.ones(200))
    assert answers.indices == (1,)
    assert first not in federation.ended  # (still in the federation)
    told = federation.rejected(first)
    assert len(told) == 32 and "closed while this answer was being read" in told[-1].details
