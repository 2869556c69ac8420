"""Real client processes over gRPC on loopback: the same iterates and counts as in-process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import config, federation, stop_processes
from formulas import expected_traffic

from fedsaddle.launch import start_clients
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

FIVE: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.02},
    {"name": "mirror_prox", "gamma": 0.02},
    {"name": "fedavg_s", "gamma_local": 0.02, "decay": "inverse_sqrt"},
    {"name": "scaffold_s", "gamma_local": 0.02},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.02, "theta": 1.0},
]
PAPER = {"name": "paper_regression", "num_clients": 10, "dim": 10, "s": 5.0}


@pytest.fixture(scope="module")
def ten_processes() -> Iterator[GrpcPool]:
    with federation(10) as pool:
        yield pool
    assert pool.client_exit_codes == [0] * 10  # type: ignore[attr-defined]


# Federations of two and three client processes that run one test's run after another's, as `local` runs one
# algorithm after another: each run starts with its own RunSpec, and its bits and counts are its own.
@pytest.fixture(scope="module")
def two_processes() -> Iterator[GrpcPool]:
    with federation(2) as pool:
        yield pool
    assert pool.client_exit_codes == [0] * 2  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def three_processes() -> Iterator[GrpcPool]:
    with federation(3) as pool:
        yield pool
    assert pool.client_exit_codes == [0] * 3  # type: ignore[attr-defined]


def assert_same_run(remote: AlgorithmResult, local: AlgorithmResult) -> None:
    assert remote.status == local.status == "ok"
    assert remote.z_sha256 == local.z_sha256  # bit for bit
    assert [r["dist_z"] for r in remote.records] == [r["dist_z"] for r in local.records]
    for category in ("algorithm", "evaluation"):
        logical = {k: v for k, v in remote.traffic[category].items() if not k.startswith("bytes")}
        assert logical == {k: v for k, v in local.traffic[category].items() if not k.startswith("bytes")}


@pytest.mark.parametrize("algorithm", FIVE, ids=lambda a: a["name"])
def test_ten_client_processes_match_the_in_process_run_bit_for_bit(
    ten_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    run = config(problem=PAPER, algorithms=[algorithm], rounds=41)
    remote = run_algorithm(run.algorithms[0], run, ten_processes)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert_same_run(remote, local)
    counts = remote.traffic["algorithm"]
    expected = expected_traffic(run, algorithm["name"])
    assert {k: counts[k] for k in expected} == expected
    # the wire carries the payload plus framing: more bytes than 8 per float, but not much more
    assert 8 * counts["floats_down"] < counts["bytes_down"] < 8 * counts["floats_down"] + 200 * counts["messages_down"]
    assert 8 * counts["floats_up"] < counts["bytes_up"] < 8 * counts["floats_up"] + 200 * counts["messages_up"]


@pytest.mark.parametrize("algorithm", [FIVE[2], FIVE[4]], ids=lambda a: a["name"])
def test_random_synchronization_and_noise_reproduce_exactly_over_grpc(
    ten_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    run = config(
        problem=PAPER,
        algorithms=[algorithm],
        rounds=31,
        seed=11,
        sync={"kind": "random", "p": 0.1},
        gradient_noise=0.3,
    )
    first = run_algorithm(run.algorithms[0], run, ten_processes)
    again = run_algorithm(run.algorithms[0], run, ten_processes)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert_same_run(first, local)
    assert first.z_sha256 == again.z_sha256


NEWER: list[dict[str, Any]] = [
    {"name": "fedgda_gt", "eta": 0.01},
    {"name": "local_extragradient", "gamma": 0.01},
    {"name": "local_sgda_plus", "eta_x": 0.01, "eta_y": 0.02, "snapshot_every": 2},
]


@pytest.mark.parametrize("algorithm", NEWER, ids=lambda a: a["name"])
def test_the_newer_baselines_match_the_in_process_run_bit_for_bit_with_noise(
    ten_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    # Local Extragradient and Local SGDA+ travel as COMPUTE tasks (a named local computation):
    # the same bits and the same counts as in-process, random synchronization and noise included.
    run = config(
        problem=PAPER, algorithms=[algorithm], rounds=31, seed=5, sync={"kind": "random", "p": 0.2}, gradient_noise=0.3
    )
    remote = run_algorithm(run.algorithms[0], run, ten_processes)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert_same_run(remote, local)
    counts = remote.traffic["algorithm"]
    if algorithm["name"] == "local_sgda_plus":  # z and the snapshot x~ down, one vector up, per sync
        assert counts["floats_down"] == counts["rounds"] * 10 * (20 + 10)
        assert counts["floats_up"] == counts["rounds"] * 10 * 20


def test_objective_stop_rule_matches_over_grpc(ten_processes: GrpcPool) -> None:
    algorithm = {**FIVE[4], "stop": {"rule": "objective", "rtol": 1e-2}}
    run = config(problem=PAPER, algorithms=[algorithm], rounds=61)
    remote = run_algorithm(run.algorithms[0], run, ten_processes)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert_same_run(remote, local)
    assert remote.extra["meta_iterations"] == local.extra["meta_iterations"] >= 1


def test_processes_hosting_several_clients_give_the_same_iterates() -> None:
    problem = {"name": "quadratic_game", "num_clients": 7, "dim": 3, "heterogeneity": 0.5}
    run = config(problem=problem, algorithms=[{"name": "scaffold_s", "gamma_local": 0.05}], rounds=21)
    with federation(7, groups=["0-3", "4", "5-6"]) as pool:
        remote = run_algorithm(run.algorithms[0], run, pool)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert_same_run(remote, local)
    # logical counts are per client; the wire carried one broadcast copy per process
    assert remote.traffic["algorithm"]["messages_down"] == 7 * 21
    assert remote.traffic["algorithm"]["bytes_down"] < 8 * remote.traffic["algorithm"]["floats_down"]


@pytest.mark.parametrize("algorithm", FIVE[2:], ids=lambda a: a["name"])
def test_chunked_local_steps_with_noise_match_the_in_process_run_bit_for_bit(
    two_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    # dim 1.5e5: z alone is 2.4 MB, over the 2 MiB chunk, so every task is chunked; a process that
    # hosts one client runs its local steps in the task's own buffer (no regularizer), or in a
    # copy (Catalyst).
    problem = {"name": "paper_regression", "num_clients": 2, "dim": 150_000, "s": 5.0}
    run = config(problem=problem, algorithms=[algorithm], rounds=9, seed=3, gradient_noise=0.3)
    remote = run_algorithm(run.algorithms[0], run, two_processes)
    assert_same_run(remote, run_algorithm(run.algorithms[0], run, LocalPool()))
    assert remote.traffic["algorithm"]["bytes_down"] > 9 * 2 * 8 * 300_000  # every task really went


@pytest.mark.parametrize("algorithm", FIVE, ids=lambda a: a["name"])
def test_large_inline_payloads_read_by_hand_match_the_in_process_run_bit_for_bit(
    three_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    # dim 2e4: z is 320 kB, over the 64 KiB from which an inline payload is read by hand (a view into the
    # received message, not protobuf's copies), and under the 2 MiB chunk: tasks and answers go inline.
    problem = {"name": "paper_regression", "num_clients": 3, "dim": 20_000, "s": 5.0}
    run = config(problem=problem, algorithms=[algorithm], rounds=6, seed=4)
    remote = run_algorithm(run.algorithms[0], run, three_processes)
    assert_same_run(remote, run_algorithm(run.algorithms[0], run, LocalPool()))
    traffic = remote.traffic["algorithm"]
    assert traffic["messages_up"] >= 3 and traffic["bytes_up"] > traffic["messages_up"] * 8 * 40_000  # whole z


def test_a_vector_of_ten_million_entries_travels_end_to_end() -> None:
    # dim 5e6: z = (x, y) has 1e7 float64 entries, 80 MB, 40 chunks of 2 MiB each way.
    problem = {"name": "paper_regression", "num_clients": 2, "dim": 5_000_000, "s": 1.0}
    run = config(problem=problem, algorithms=[{"name": "minibatch_md", "gamma": 0.1}], rounds=2)
    with federation(2, round_timeout_s=120) as pool:
        remote = run_algorithm(run.algorithms[0], run, pool)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert remote.final_z.size == 10_000_000
    assert remote.z_sha256 == local.z_sha256
    assert remote.traffic["algorithm"]["bytes_up"] > 2 * 2 * 80_000_000
    assert np.isfinite(remote.dist_z) and remote.dist_z < local.records[0]["dist_z"]


def test_a_fixed_receive_window_smaller_than_a_chunk_changes_no_bit() -> None:
    # 64 KiB windows under 2 MiB chunks of a 2.4 MB vector: every answer flows a window at a time.
    from fedsaddle.server.transport.sessions import Limits

    problem = {"name": "paper_regression", "num_clients": 3, "dim": 150_000, "s": 5.0}
    run = config(problem=problem, algorithms=[FIVE[3]], rounds=7, seed=2)
    with federation(3, limits=Limits(receive_window_mib=0.0625)) as pool:
        remote = run_algorithm(run.algorithms[0], run, pool)
    assert_same_run(remote, run_algorithm(run.algorithms[0], run, LocalPool()))
    assert remote.traffic["algorithm"]["bytes_up"] > 7 * 3 * 8 * 300_000


def test_the_receive_window_is_gRPCs_own_or_at_least_64_kib() -> None:
    from fedsaddle.server.config import ConfigError

    fields: dict[str, Any] = dict(problem=PAPER, algorithms=[FIVE[0]])
    assert config(**fields).transport.limits.receive_window_mib == 1  # fixed: memory flat in the clients
    assert config(**fields, transport={"limits": {"receive_window_mib": 0}})  # gRPC's own
    assert config(**fields, transport={"limits": {"receive_window_mib": 0.0625}})
    with pytest.raises(ConfigError, match=r"receive_window_mib must be 0 \(gRPC's own\) or at least 0.0625"):
        config(**fields, transport={"limits": {"receive_window_mib": 0.01}})


def test_a_fault_of_the_coordinator_on_a_message_ends_that_stream_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # The protocol raises on client 0's first answer, as a bug of the coordinator's would: its log says so
    # with the traceback, the stream ends (INTERNAL to the client), and the round fails at once naming the
    # lost session, instead of the stream's reader dying silently and the round timing out on client 0.
    from fedsaddle.server.pool import ClientLost, RunInfo

    problem = config(
        problem={"name": "paper_regression", "num_clients": 2, "dim": 10},
        algorithms=[{"name": "minibatch_md", "gamma": 0.1}],
    )
    with federation(2, round_timeout_s=600) as pool:
        receive, faulted = pool.protocol.receive, []

        def faulty(key: int, received: Any, now: float) -> Any:
            message = received.message
            answer = message is not None and message.WhichOneof("body") == "answer"
            if answer and not faulted and tuple(message.answer.client_indices) == (0,):
                faulted.append(key)
                raise RuntimeError("a fault of the coordinator's own")
            return receive(key, received, now)

        pool.protocol.receive = faulty  # type: ignore[method-assign]
        pool.start_run(RunInfo("faulty", problem.problem, 0, 0.0))
        with pytest.raises(ClientLost) as lost:
            pool.gradients(np.zeros(20))
    assert faulted and lost.value.client_indices == (0,)
    assert "no answer within" not in str(lost.value)
    assert "internal error on a message from" in caplog.text and "a fault of the coordinator's own" in caplog.text


def test_a_fault_of_the_coordinator_at_a_deadline_fails_the_waiting_operation_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The protocol raises when the join deadline comes, as a bug of the coordinator's would: the wait fails at
    # once with the fault named, instead of waiting forever on a deadline no timer would fire again.
    pool = GrpcPool(2, "127.0.0.1:0")
    processes = start_clients(pool.address, ["0"])  # client 1 never comes: the wait ends at its deadline
    try:
        deadline = time.monotonic() + 60
        while pool.missing() != [1] and time.monotonic() < deadline:  # client 0 in, however loaded the machine
            time.sleep(0.05)
        tick = pool.protocol.tick

        def faulty(now: float) -> Any:
            raise RuntimeError("a fault of the coordinator's own")

        pool.protocol.tick = faulty  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match=r"internal error in the coordinator at a deadline .*fault of the"):
            pool.wait_for_clients(1.0)
        pool.protocol.tick = tick  # type: ignore[method-assign]
        assert pool.missing() == [1]  # the loop and the sessions outlive the fault
    finally:
        pool.close()
        stop_processes(processes)
    assert "internal error at a deadline" in caplog.text
