"""Waits that speak and exits that are right, with real processes: a client that cannot reach its
coordinator says so and why, soon and then every few seconds; a duplicate index is refused at once,
naming its holder; a coordinator names the clients it still waits for; the clients of a run that fails
at the join timeout exit 1 with its reason; Ctrl-C exits 130 with one line; `fedsaddle health` hints at
TLS as the client does."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import CLIENT_ENV, client_process, fedsaddle, stop_processes
from test_failures import Coordinator, write_config
from test_resume import free_address

from fedsaddle.server.config import TlsSpec
from fedsaddle.server.transport.auth import server_credentials
from fedsaddle.server.transport.grpc_pool import GrpcPool

PROBLEM = {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 2.0}
WAITING = re.compile(
    r"^(\S+ \S+) fedsaddle.client WARNING cannot reach the coordinator at \S+ yet \((.*)\); still trying for (\d+) s$"
)


def client(address: str, indices: str, connect_timeout: float) -> subprocess.Popen[str]:
    return client_process(address, indices, "--connect-timeout", str(connect_timeout), text=True, quiet=False)


def waits(log: str) -> list[tuple[float, str, int]]:
    """The client's 'cannot reach ... yet' lines: (when, by its log's clock; what it saw; seconds left)."""
    found = []
    for line in log.splitlines():
        match = WAITING.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((when, match.group(2), int(match.group(3))))
    return found


def test_a_client_that_cannot_reach_its_coordinator_says_so_soon_and_every_few_seconds() -> None:
    address = free_address()  # nothing listens there
    done = client(address, "0", connect_timeout=13)
    _, log = done.communicate(timeout=60)
    assert done.returncode == 1, log
    said = waits(log)
    assert len(said) >= 2, log
    assert all("Connection refused" in cause for _, cause, _ in said), log  # with the cause
    assert said[0][2] >= 11  # the first within 2 s of trying: 13 s less at most 2
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(said)]
    assert all(4 <= gap <= 7 for gap in gaps), gaps  # every few seconds, not every attempt
    assert f"cannot reach the coordinator at {address} within 13 s" in log.splitlines()[-1]


def test_a_duplicate_index_is_refused_at_once_naming_the_session_that_holds_it() -> None:
    with GrpcPool(2, "127.0.0.1:0") as pool:
        holder = client(pool.address, "0", connect_timeout=60)
        try:
            deadline = time.monotonic() + 60
            while pool.missing() != [1] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pool.missing() == [1]
            duplicate = client(pool.address, "0", connect_timeout=6)
            _, log = duplicate.communicate(timeout=60)
        finally:
            holder.terminate()
            stop_processes([holder])  # type: ignore[list-item]
    assert duplicate.returncode == 1
    said = waits(log)
    assert said and said[0][2] >= 4, log  # said at its first refusal, not at the end of its 6 s
    assert re.search(
        r"client indices \[0\] are already connected: client 0 \(.* at ipv4:127\.0\.0\.1:\d+\) holds it", said[0][1]
    )
    assert "are already connected" in log.splitlines()[-1]  # and the reason it gives up with


def test_clients_missing_because_their_session_was_refused_are_named_with_the_refusal() -> None:
    # A process claims clients 0 and 1 while 0 is held: it is refused, and 1 stays missing. The coordinator's
    # wait for the federation says why, instead of only "clients [1] did not join".
    from fedsaddle.server.transport.actions import MissingClients

    with GrpcPool(2, "127.0.0.1:0") as pool:
        processes = [client(pool.address, "0", connect_timeout=60)]
        try:
            deadline = time.monotonic() + 60
            while pool.missing() != [1] and time.monotonic() < deadline:
                time.sleep(0.1)
            processes.append(client(pool.address, "0-1", connect_timeout=60))
            with pytest.raises(MissingClients) as missing:
                pool.wait_for_clients(8)
        finally:
            stop_processes(processes)  # type: ignore[arg-type]
    assert re.fullmatch(
        r"clients \[1\] did not join within 8 s: a session from ipv4:127\.0\.0\.1:\d+ claiming \[0, 1\] was "
        r"refused: client indices \[0\] are already connected: client 0 \(.* at ipv4:127\.0\.0\.1:\d+\) holds it",
        str(missing.value),
    ), str(missing.value)


def test_clients_missing_because_their_hello_was_refused_are_named_with_the_reason() -> None:
    # A client of another protocol version claims both clients: refused at its Hello. The wait says so, not
    # only that they did not join (the reason was in the coordinator's log alone).
    import grpc

    from fedsaddle.proto import fedsaddle_pb2 as pb
    from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc
    from fedsaddle.server.transport.actions import MissingClients

    hello = pb.ClientMessage(hello=pb.Hello(protocol_version=1, client_indices=[1, 0], client_name="old"))
    with GrpcPool(2, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Session(iter([hello]), timeout=30))
        with pytest.raises(MissingClients) as missing:
            pool.wait_for_clients(2)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(
        r"clients \[0, 1\] did not join within 2 s: a session from ipv4:127\.0\.0\.1:\d+ claiming \[0, 1\] "
        r"was refused: protocol version 1 is not supported \(this coordinator speaks 2\)",
        str(missing.value),
    ), str(missing.value)


def test_a_coordinator_names_the_missing_clients_and_the_joined_ones_exit_1_when_it_gives_up(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        problem=PROBLEM,
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=5,
        transport={"join_timeout_s": 12},
        output={"plot": False},
    )
    coordinator = Coordinator(path, tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 60).group(1)
    joined = client(address, "0", connect_timeout=60)
    try:
        code, log = coordinator.finish(timeout=90)
        _, client_log = joined.communicate(timeout=60)
    finally:
        stop_processes([joined])  # type: ignore[list-item]
    assert code == 1, log
    assert len(re.findall(r"waiting for clients \[1, 2\] \(1 of 3 joined\)", log)) >= 2, log
    assert "clients [1, 2] did not join within 12 s" in log
    assert joined.returncode == 1, client_log
    assert "the coordinator ended the run as failed: clients [1, 2] did not join within 12 s" in client_log


def interpreter_start_s() -> float:
    """How long this machine takes to start an interpreter (not fedsaddle's to handle: Python's own)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.monotonic() - started


@pytest.mark.parametrize("after", [0.6, 1.5, 4.0])
def test_ctrl_c_at_any_moment_of_fedsaddle_local_exits_130_with_one_line(tmp_path: Path, after: float) -> None:
    path = write_config(
        tmp_path / "run.yaml", problem=PROBLEM, algorithms=[{"name": "minibatch_md", "gamma": 0.01}], rounds=20000
    )
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", str(tmp_path / "runs")]
    delay = interpreter_start_s() + after
    process = subprocess.Popen(command, env=CLIENT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in out + err
    # One line says so, the last; a run under way also leaves its tables ([stopped]) on stdout.
    assert err.count("fedsaddle: interrupted") == 1
    assert err.rstrip().splitlines()[-1].startswith("fedsaddle: interrupted")
    assert not [line for line in err.splitlines() if " WARNING " in line or " ERROR " in line], err


def test_an_interrupt_raised_inside_exec_source_still_exits_130(tmp_path: Path) -> None:
    # CPython flags a KeyboardInterrupt raised in exec()'d source (dataclasses build their methods so,
    # while modules load) as unhandled even once caught, and `python -m` then ends by SIGINT (-2).
    (tmp_path / "interrupted.py").write_text(
        "import sys, fedsaddle.cli as cli\n"
        "from fedsaddle.cli.signals import say_interrupted\n"
        "def interrupted(argv=None):\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        say_interrupted()\n"
        "        return 130\n"
        "cli.main = interrupted\n"
        "from fedsaddle.entry import main\n"
        "sys.exit(main())\n"
    )
    env = {**CLIENT_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), CLIENT_ENV.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "interrupted"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "fedsaddle: interrupted\n"


def health(*args: str) -> Any:
    return fedsaddle("health", "--timeout", "10", *args, timeout=60)


def test_health_against_a_tls_coordinator_hints_as_the_client_does(certs: Path) -> None:
    tls = TlsSpec(cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"))
    with GrpcPool(1, "127.0.0.1:0", server_credentials=server_credentials(tls)) as pool:
        plain = health("--address", pool.address)
        trusted = health("--address", pool.address, "--ca", str(certs / "ca.pem"))
    assert plain.returncode == 1 and "(it serves TLS: give --ca)" in plain.stderr, plain.stderr
    assert not re.search(r"^I\d{4} ", plain.stderr, re.M)  # no gRPC C-core INFO lines without -v
    assert trusted.returncode == 0 and "SERVING" in trusted.stdout
    mutual = TlsSpec(
        cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"), client_ca=str(certs / "ca.pem")
    )
    with GrpcPool(1, "127.0.0.1:0", server_credentials=server_credentials(mutual)) as pool:
        no_certificate = health("--address", pool.address, "--ca", str(certs / "ca.pem"))
    assert no_certificate.returncode == 1
    assert "(a mutual-TLS coordinator also needs --cert and --key)" in no_certificate.stderr
