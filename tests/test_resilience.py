"""What real federations do, with real processes and signals: clients crash and rejoin, coordinators
start late, and faults that retrying cannot fix end a client at once, saying why."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import CLIENT_ENV, client_process, config, fedsaddle, stop_processes, summary_of
from formulas import expected_traffic
from test_failures import Coordinator, write_config

from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool

PROBLEM = {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 2.0}

# A kill must land while the run is still going. Rather than a long run, a short one that cannot end
# early: its coordinator writes a checkpoint every 100 rounds and pauses 1 s at each, so ROUNDS take
# at least 3 s however fast the machine, while a test kills at its first progress lines (round 3 or so).
ROUNDS = 301
CHECKPOINTS = {"plot": False, "checkpoint_every": 100}
PAUSED = {**CLIENT_ENV, "FEDSADDLE_TEST_CHECKPOINT_PAUSE": "1"}


def client(address: str, indices: int | str) -> subprocess.Popen[str]:
    return client_process(address, indices, "--connect-timeout", "30", text=True, quiet=False)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "scaffold_catalyst_s", "gamma_local": 0.02},
        {"name": "local_sgda_plus", "eta_x": 0.02, "snapshot_every": 2},  # COMPUTE tasks, a snapshot in its state
    ],
    ids=lambda a: a["name"],
)
def test_a_killed_client_that_restarts_rejoins_and_the_run_ends_bit_identical(
    tmp_path: Path, algorithm: dict[str, Any]
) -> None:
    fields: dict[str, Any] = dict(problem=PROBLEM, algorithms=[algorithm], rounds=ROUNDS, gradient_noise=0.1)
    path = write_config(tmp_path / "run.yaml", transport={"rejoin_timeout_s": 30}, output=CHECKPOINTS, **fields)
    coordinator = Coordinator(path, tmp_path / "runs", env=PAUSED)
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = [client(address, i) for i in range(3)]
    try:
        coordinator.wait_for(rf"round\s+\d+/{ROUNDS}", 60)
        clients[1].send_signal(signal.SIGKILL)
        clients[1].wait()
        coordinator.wait_for(r"client 1 \(.*\) disconnected", 30)
        clients.append(client(address, 1))  # the same indices, restarted
        coordinator.wait_for(r"client 1 \(.*\) rejoined", 30)
        code, log = coordinator.finish(timeout=120)
    finally:
        codes = stop_processes(clients)  # type: ignore[arg-type]
    assert code == 0, log
    assert codes[0] == codes[2] == codes[3] == 0 and codes[1] == -signal.SIGKILL
    (remote,) = summary_of(tmp_path / "runs")["algorithms"]
    run = config(**fields)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert remote["z_sha256"] == local.z_sha256  # as if nothing had happened
    counts = remote["traffic"]["algorithm"]
    if algorithm["name"] == "scaffold_catalyst_s":
        expected = expected_traffic(run, "scaffold_catalyst_s")
        assert {k: counts[k] for k in expected} == expected  # the documented formula still holds exactly
    logical = ("rounds", "messages_down", "messages_up", "floats_down", "floats_up")
    assert {k: counts[k] for k in logical} == {k: local.traffic["algorithm"][k] for k in logical}
    resent = remote["traffic"]["retransmission"]
    assert resent["bytes_down"] > 0  # the RunSpec, and the open round's task if one was open
    assert resent["messages_down"] in (0, 1)


def test_a_process_killed_again_and_again_in_a_sampled_noisy_run_changes_no_bit_and_no_count(tmp_path: Path) -> None:
    """Sampled clients, random synchronization and noise, with the process hosting clients 2 and 3
    killed mid-round three times: each time it is sent the open round for its sampled clients only."""
    fields: dict[str, Any] = dict(
        problem={**PROBLEM, "num_clients": 4},
        algorithms=[{"name": "scaffold_s", "gamma_local": 0.02}],
        rounds=ROUNDS,
        gradient_noise=0.1,
        sync={"kind": "random", "p": 0.2},
        participation={"fraction": 0.5},
    )
    path = write_config(tmp_path / "run.yaml", transport={"rejoin_timeout_s": 30}, output=CHECKPOINTS, **fields)
    coordinator = Coordinator(path, tmp_path / "runs", env=PAUSED)
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = [client(address, 0), client(address, 1), client(address, "2,3")]
    try:
        for _ in range(3):
            coordinator.wait_for(rf"round\s+\d+/{ROUNDS}", 60)
            clients[-1].send_signal(signal.SIGKILL)
            clients[-1].wait()
            coordinator.wait_for(r"clients \[2, 3\] \(.*\) disconnected", 30)
            clients.append(client(address, "2,3"))
            coordinator.wait_for(r"clients \[2, 3\] \(.*\) rejoined", 30)
        code, log = coordinator.finish(timeout=120)
    finally:
        codes = stop_processes(clients)  # type: ignore[arg-type]
    assert code == 0, log
    assert "refused" not in log
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL, -signal.SIGKILL, 0]
    (remote,) = summary_of(tmp_path / "runs")["algorithms"]
    run = config(**fields)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert remote["z_sha256"] == local.z_sha256
    counts = remote["traffic"]["algorithm"]
    for key in ("rounds", "messages_down", "messages_up", "floats_down", "floats_up"):
        assert counts[key] == local.traffic["algorithm"][key], key
    for key in ("per_client_floats_down", "per_client_floats_up"):
        assert counts[key] == list(local.traffic["algorithm"][key]), key


def test_a_client_that_does_not_come_back_fails_the_run_after_the_rejoin_timeout(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        problem=PROBLEM,
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=1_000_000,
        transport={"rejoin_timeout_s": 2},
        output={"plot": False},
    )
    coordinator = Coordinator(path, tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = [client(address, i) for i in range(3)]
    try:
        coordinator.wait_for(r"round\s+\d+/1000000", 60)
        killed_at = time.monotonic()
        clients[2].send_signal(signal.SIGKILL)
        code, log = coordinator.finish(timeout=60)
        waited = time.monotonic() - killed_at
    finally:
        codes = stop_processes(clients)  # type: ignore[arg-type]
    assert code == 1
    assert re.search(r"client 2 \(.*\) disconnected (during|before) round \d+.* did not rejoin within 2 s", log), log
    assert 2 <= waited < 20
    assert codes[0] == codes[1] == 1  # told that the run failed


def test_clients_started_before_the_coordinator_wait_for_it(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a free port, for a coordinator that starts a moment later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    clients = [client(address, i) for i in range(3)]
    time.sleep(1.5)  # the clients are retrying
    path = write_config(
        tmp_path / "run.yaml", problem=PROBLEM, algorithms=[{"name": "fedavg_s", "gamma_local": 0.02}], rounds=20
    )
    coordinator = Coordinator(path, tmp_path / "runs", listen=address)
    code, log, codes = coordinator.finish_with(clients, timeout=60)  # type: ignore[arg-type]
    assert code == 0, log
    assert codes == [0, 0, 0]


def test_the_last_client_to_join_is_sent_the_run_once_and_nothing_counts_as_resent(tmp_path: Path) -> None:
    # The last session to join completes the federation, and the run starts at once. It used to be
    # sent the RunSpec a second time, counted as a retransmission and logged as a rejoin, whenever
    # the run started while its Welcome was being written (one federation in five or so here).
    path = write_config(
        tmp_path / "run.yaml",
        problem={"name": "paper_regression", "num_clients": 10, "dim": 4},
        algorithms=[{"name": "minibatch_md", "gamma": 0.1}],
        rounds=3,
        transport={"rejoin_timeout_s": 5},
    )
    for attempt in range(5):
        out = tmp_path / f"runs-{attempt}"
        done = fedsaddle("local", "--config", str(path), "--out", str(out))
        assert done.returncode == 0, done.stderr
        assert "rejoined" not in done.stderr
        assert done.stderr.count("ready (dimension 8") == 10  # one Ready per client process
        resent = summary_of(out)["algorithms"][0]["traffic"]["retransmission"]
        assert (resent["messages_down"], resent["bytes_down"]) == (0, 0)


def fails_fast(args: list[str], cause: str) -> None:
    # The client is given 600 s to connect; ending within 120 s (a few seconds on a quiet machine) shows it
    # did not retry for that long, with room for a loaded machine's slow process starts.
    started = time.monotonic()
    done = fedsaddle("client", "--clients", "0", "--connect-timeout", "600", *args, timeout=120)
    assert done.returncode == 1, done.stderr
    assert cause in done.stderr, done.stderr
    assert time.monotonic() - started < 120  # not the 600 s connect timeout


@pytest.fixture(scope="module")
def tls_coordinator(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Any:
    folder = tmp_path_factory.mktemp("tls")
    path = write_config(
        folder / "run.yaml",
        problem=PROBLEM,
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=5,
        transport={
            "tls": {"cert": str(certs / "coordinator.pem"), "key": str(certs / "coordinator.key")},
            "join_timeout_s": 60,
        },
    )
    coordinator = Coordinator(path, folder / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    yield address, certs
    coordinator.process.send_signal(signal.SIGTERM)
    coordinator.finish(timeout=30)


def test_faults_that_retrying_cannot_fix_end_the_client_at_once_saying_why(tls_coordinator: Any) -> None:
    address, certs = tls_coordinator
    port = address.rsplit(":", 1)[1]
    ca = ["--ca", str(certs / "ca.pem")]
    fails_fast(["--coordinator", f"no-such-host.invalid:{port}"], "cannot find the host of no-such-host.invalid")
    fails_fast(["--coordinator", address], "closes every plaintext connection at once: it serves TLS (give --ca)")
    fails_fast(
        ["--coordinator", address, *ca, "--server-name", "other.example.org"],
        "is not for this name (give --server-name",
    )
    plain = Coordinator(
        write_config(
            Path(certs) / "plain.yaml",
            problem=PROBLEM,
            algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
            rounds=5,
            transport={"join_timeout_s": 60},
        ),
        Path(certs) / "runs",
    )
    plain_address = plain.wait_for(r"listening on (\S+);", 30).group(1)
    try:
        fails_fast(["--coordinator", plain_address, *ca], "the coordinator does not serve TLS (drop --ca)")
        fails_fast(["--coordinator", plain_address, "--clients", "7"], "client indices [7] are outside [0, 3)")
    finally:
        plain.process.send_signal(signal.SIGTERM)
        plain.finish(timeout=30)


def test_a_session_lost_mid_round_is_replaced_and_sent_the_task_again() -> None:
    import threading

    import grpc
    import numpy as np
    from test_bad_answers import HandClient, two_joined

    from fedsaddle.proto import fedsaddle_pb2 as pb
    from fedsaddle.server.transport.grpc_pool import GrpcPool

    run = config(problem={**PROBLEM, "num_clients": 2}, algorithms=[{"name": "minibatch_md", "gamma": 0.1}])
    with GrpcPool(2, "127.0.0.1:0", rejoin_timeout_s=10) as pool, grpc.insecure_channel(pool.address) as channel:
        steady, leaving = two_joined(pool, channel)
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(run.algorithms[0], run, pool)))
        runner.start()
        task = steady.next_task()
        assert leaving.next_task().round_id == task.round_id == 1
        steady.send(pb.ClientMessage(answer=steady.good(task)))
        leaving.close()  # gone without answering round 1
        leaving.ended()  # (a real client would retry a Hello refused while its old session lingers)
        with grpc.insecure_channel(pool.address) as second:
            back = HandClient(second, [1])  # the same index, a new session
            back.welcome()
            again = back.next_task()  # after its Ready, the open round's task, again
            assert again.round_id == 1 and again.payload == task.payload
            back.send(pb.ClientMessage(answer=back.good(again)))
            for _ in range(run.rounds - 1):  # the rest of the run, answered by both
                for hand in (steady, back):
                    hand.send(pb.ClientMessage(answer=hand.good(hand.next_task())))
            runner.join(timeout=30)
            back.close()
        steady.close()
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert outcome["r"].z_sha256 == local.z_sha256
    resent = outcome["r"].traffic["retransmission"]
    assert resent["messages_down"] == 1 and resent["floats_down"] == np.size(local.final_z)
    assert outcome["r"].traffic["algorithm"]["messages_down"] == 2 * run.rounds


def test_a_session_that_rejoins_a_sampled_round_is_sent_the_task_for_its_sampled_clients_only() -> None:
    import threading

    import grpc
    import numpy as np
    from test_bad_answers import HandClient

    from fedsaddle.proto import fedsaddle_pb2 as pb
    from fedsaddle.server.transport.grpc_pool import GrpcPool

    run = config(
        problem={**PROBLEM, "num_clients": 2},
        algorithms=[{"name": "minibatch_md", "gamma": 0.1}],
        rounds=6,
        participation={"fraction": 0.5},  # one of the session's two clients takes part in each round
    )
    with GrpcPool(2, "127.0.0.1:0", rejoin_timeout_s=10) as pool, grpc.insecure_channel(pool.address) as channel:
        leaving = HandClient(channel, [0, 1])
        leaving.welcome()
        pool.wait_for_clients(10)
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(run.algorithms[0], run, pool)))
        runner.start()
        task = leaving.next_task()
        (sampled,) = task.client_indices
        leaving.close()  # gone without answering round 1
        leaving.ended()
        with grpc.insecure_channel(pool.address) as second:
            back = HandClient(second, [0, 1])
            back.welcome()
            again = back.next_task()  # the open round's task, naming the sampled client only
            assert again.round_id == 1 and list(again.client_indices) == [sampled]
            for _ in range(run.rounds):
                back.send(pb.ClientMessage(answer=back.good(again)))
                if _ < run.rounds - 1:
                    again = back.next_task()
            runner.join(timeout=30)
            assert not runner.is_alive()
            back.close()
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert outcome["r"].z_sha256 == local.z_sha256
    resent = outcome["r"].traffic["retransmission"]
    assert resent["messages_down"] == 1 and resent["floats_down"] == np.size(local.final_z)  # one client's task


def test_a_session_that_rejoins_may_list_its_clients_in_another_order() -> None:
    import threading

    import grpc
    from test_bad_answers import HandClient

    from fedsaddle.proto import fedsaddle_pb2 as pb
    from fedsaddle.server.transport.grpc_pool import GrpcPool

    run = config(problem=PROBLEM, algorithms=[{"name": "minibatch_md", "gamma": 0.1}], rounds=4)
    with GrpcPool(3, "127.0.0.1:0", rejoin_timeout_s=10) as pool, grpc.insecure_channel(pool.address) as channel:
        steady, leaving = HandClient(channel, [0]), HandClient(channel, [1, 2])
        steady.welcome(), leaving.welcome()
        pool.wait_for_clients(10)
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.setdefault("r", run_algorithm(run.algorithms[0], run, pool)))
        runner.start()
        steady.send(pb.ClientMessage(answer=steady.good(steady.next_task())))
        leaving.next_task()
        leaving.close()  # gone without answering round 1
        leaving.ended()
        with grpc.insecure_channel(pool.address) as second:
            back = HandClient(second, [2, 1])  # the same clients, listed the other way round
            back.welcome()
            for _ in range(run.rounds):  # the open round's task again, then the rest of the run
                answer = back.good(back.next_task())
                assert list(answer.client_indices) == [2, 1]  # as its Hello lists them
                back.send(pb.ClientMessage(answer=answer))
                if _ < run.rounds - 1:
                    steady.send(pb.ClientMessage(answer=steady.good(steady.next_task())))
            runner.join(timeout=30)
            assert not runner.is_alive()
            back.close()
        steady.close()
    assert outcome["r"].z_sha256 == run_algorithm(run.algorithms[0], run, LocalPool()).z_sha256


def test_a_client_lost_between_rounds_that_does_not_rejoin_is_named_with_the_wait() -> None:
    import threading

    import grpc
    import numpy as np
    from test_bad_answers import HandClient

    from fedsaddle.proto import fedsaddle_pb2 as pb
    from fedsaddle.server.pool import ClientLost, RunInfo
    from fedsaddle.server.transport.grpc_pool import GrpcPool

    run = config(problem={**PROBLEM, "num_clients": 1}, algorithms=[{"name": "minibatch_md", "gamma": 0.1}])
    with GrpcPool(1, "127.0.0.1:0", rejoin_timeout_s=1) as pool:
        channel = grpc.insecure_channel(pool.address)
        hand = HandClient(channel, [0])
        hand.welcome()
        pool.wait_for_clients(10)
        first = threading.Thread(
            target=lambda: (pool.start_run(RunInfo("r", run.problem, run.seed, 0.0)), pool.gradients(np.ones(20)))
        )
        first.start()
        hand.send(pb.ClientMessage(answer=hand.good(hand.next_task())))
        first.join(timeout=10)
        channel.close()  # gone while no round is open
        deadline = time.monotonic() + 10
        while pool.missing() != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(
            ClientLost, match=r"client 0 \(.*\) disconnected before round 2, and did not rejoin within 1 s"
        ):
            pool.gradients(np.ones(20))
        assert time.monotonic() - started >= 1  # it waited for the rejoin
