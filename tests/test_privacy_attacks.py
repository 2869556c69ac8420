"""A coordinator that breaks secure aggregation's rules, against real client processes: honest clients
refuse, naming the round, and the coordinator never gets what would unmask a client that answered."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from conftest import read_stderr, stop_processes

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.settings import SecAggSettings
from fedsaddle.common.tasks import GradientTask
from fedsaddle.launch import start_clients
from fedsaddle.server.pool import ClientLost, PoolError, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool

CLIENTS = 4  # threshold: a majority, 3
Rewrite = Callable[[dict[int, UnmaskRequest]], dict[int, UnmaskRequest]]


class Hostile(GrpcPool):
    """A coordinator that rewrites its unmask requests, or sends its key directory twice."""

    rewrite: Rewrite | None = None
    replay_keys = False
    # Sends the task of this round (the pool's id) under the id of an earlier one: (this round, the earlier).
    reorder: tuple[int, int] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gathered: dict[int, UnmaskReply] = {}
        self.refusals: dict[int, str] = {}

    def _collect(self, task: Any, round_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.reorder is not None and round_id == self.reorder[0]:
            round_id = self.reorder[1]
        return super()._collect(task, round_id, *args, **kwargs)

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        super()._send_directory(epoch, keys)
        if self.replay_keys:
            super()._send_directory(epoch, keys)

    async def _unmasking(
        self, run_id: str, requests: dict[int, UnmaskRequest]
    ) -> tuple[dict[int, UnmaskReply], dict[int, str], int, int]:
        if self.rewrite is not None:
            requests = self.rewrite(requests)
        replies, refusals, down, up = await super()._unmasking(run_id, requests)
        self.gathered, self.refusals = dict(replies), dict(refusals)
        return replies, refusals, down, up


@contextmanager
def federation(hostile: Hostile, clients: int = CLIENTS) -> Iterator[list[subprocess.Popen[bytes]]]:
    processes = start_clients(hostile.address, [str(i) for i in range(clients)], quiet=False)
    try:
        hostile.wait_for_clients(60)
        yield processes
    finally:
        hostile.close()
        logs = [read_stderr(p) for p in processes]
        stop_processes(processes)
        hostile.client_logs = logs  # type: ignore[attr-defined]


def start(pool: Hostile) -> None:
    problem = PaperRegressionSpec(num_clients=CLIENTS, dim=3)
    pool.start_run(RunInfo("attack", problem, seed=0, secure=SecAggSettings(0, 40, 1e4)))


def test_calling_a_client_that_answered_dropped_gets_no_unmasking_of_it() -> None:
    def call_client_1_dropped(requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskRequest]:
        # Client 1 answered. Say it dropped, and keep its shares back: the others cannot tell, and give
        # their pairwise seeds with 1; the coordinator now also needs b_1, which only 1's shares give.
        answered = tuple(i for i in requests[0].answered if i != 1)
        return {
            j: request._replace(
                answered=answered if j != 1 else request.answered,
                dropped=(1,),
                shares=tuple(s for s in request.shares if s[0] != 1),
            )
            for j, request in requests.items()
        }

    pool = Hostile(CLIENTS, "127.0.0.1:0")
    pool.rewrite = call_client_1_dropped
    with federation(pool):
        start(pool)
        with pytest.raises(
            PoolError, match=r"client 1 refused to unmask: round 1: the coordinator lists this client \(1\)"
        ):
            pool.exchange(GradientTask(np.ones(6)))
    # The seeds with 1 came from the others, but no share of b_1 from anyone: y_1 stays masked.
    assert sorted(pool.refusals) == [1]
    assert pool.gathered and all(1 in reply.seeds for reply in pool.gathered.values())
    assert not any(1 in reply.b_shares for reply in pool.gathered.values())


def test_claiming_fewer_survivors_than_the_threshold_is_refused_by_every_client() -> None:
    def two_survivors(requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskRequest]:
        return {
            j: request._replace(answered=(0, 1), dropped=(2, 3), shares=tuple(s for s in request.shares if s[0] < 2))
            for j, request in requests.items()
            if j < 2
        }

    pool = Hostile(CLIENTS, "127.0.0.1:0")
    pool.rewrite = two_survivors
    with federation(pool):
        start(pool)
        with pytest.raises(PoolError, match="round 1: only 2 clients answered, fewer than the threshold 3"):
            pool.exchange(GradientTask(np.ones(6)))
    assert sorted(pool.refusals) == [0, 1] and not pool.gathered


def test_a_replayed_key_directory_ends_every_honest_session_saying_why() -> None:
    pool = Hostile(CLIENTS, "127.0.0.1:0")
    pool.replay_keys = True
    with federation(pool):
        start(pool)
        with pytest.raises(ClientLost):
            pool.exchange(GradientTask(np.ones(6)))
    for log in pool.client_logs:  # type: ignore[attr-defined]
        assert "refused the coordinator's key directory" in log, log
        assert "key directory of epoch 0 refused: this client already agreed to epoch 0" in log, log


def test_a_task_for_an_earlier_round_is_not_masked_again() -> None:
    # Client 3 is never asked to unmask round 1 (the others are t = 3), so nothing of round 1 is left in it
    # once round 2 is masked. Round 3 then goes out as round 1 again: masked anew, it would carry the same
    # pairwise masks as the first time under a fresh self mask.
    def skip_client_3_in_round_1(requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskRequest]:
        return {j: request for j, request in requests.items() if request.round_id != 1 or j != 3}

    pool = Hostile(CLIENTS, "127.0.0.1:0", round_timeout_s=20)
    pool.rewrite = skip_client_3_in_round_1
    pool.reorder = (3, 1)
    with federation(pool):
        start(pool)
        pool.exchange(GradientTask(np.ones(6)))
        pool.exchange(GradientTask(np.zeros(6)))
        with pytest.raises(ClientLost):
            pool.exchange(GradientTask(np.ones(6)))
    refusal = "refused to answer: round 1: this client already masked round 2, a later one"
    for log in pool.client_logs:  # type: ignore[attr-defined]
        assert refusal in log, log


def test_different_stories_about_who_dropped_do_not_unmask_one_client_of_an_odd_round() -> None:
    # Five clients, all answered; target client 0. Client 0 is told 3 and 4 dropped (it gives its seeds with
    # them and its own share of b_0), 3 and 4 are told 0 answered and 1, 2 dropped (they give their shares of
    # b_0), 1 and 2 are told 0 dropped (they give their seeds with 0). Each story passes each client's own
    # checks unless the threshold counts the target's own share in both groups: with three shares of b_0 and
    # 0's seeds with all four others, the coordinator would strip every mask off 0's row.
    stories = {0: ((0, 1, 2), (3, 4)), 3: ((0, 3, 4), (1, 2)), 4: ((0, 3, 4), (1, 2))}
    stories |= {1: ((1, 2, 3, 4), (0,)), 2: ((1, 2, 3, 4), (0,))}

    def tell_each_its_own_story(requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskRequest]:
        told = {}
        for j, request in requests.items():
            answered, dropped = stories[j]
            shares = tuple(s for s in request.shares if s[0] in answered)
            told[j] = request._replace(answered=answered, dropped=dropped, shares=shares)
        return told

    pool = Hostile(5, "127.0.0.1:0")
    pool.rewrite = tell_each_its_own_story
    with federation(pool, 5):
        problem = PaperRegressionSpec(num_clients=5, dim=3)
        pool.start_run(RunInfo("attack", problem, seed=0, secure=SecAggSettings(0, 40, 1e4)))
        with pytest.raises(PoolError):
            pool.exchange(GradientTask(np.ones(6)))
    shares_of_b0 = [j for j, reply in pool.gathered.items() if 0 in reply.b_shares]
    seeds_with_0 = set(pool.gathered[0].seeds) if 0 in pool.gathered else set()
    seeds_with_0 |= {j for j, reply in pool.gathered.items() if 0 in reply.seeds}
    assert len(shares_of_b0) < 3 or seeds_with_0 != {1, 2, 3, 4}, (shares_of_b0, seeds_with_0)
