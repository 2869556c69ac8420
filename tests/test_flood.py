"""A flood of idle connections from one address, with real sockets on loopback: the coordinator closes
what carries nothing, counts and says so, and honest clients still get in."""

from __future__ import annotations

import json
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from conftest import CLIENT_ENV, client_process, config, fedsaddle, stop_processes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_failures import Coordinator, write_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from flooder import PREFACE, SETTINGS, session_headers  # bench/flooder.py

from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport import gate as gate_module
from fedsaddle.server.transport.gate import MAX_SWEEP_S, OVER_CAP_GRACE_S, SWEEP_S, ConnectionGate, sweep_interval
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.sessions import Limits

FLOOD_SOURCE = "127.0.0.2"  # the flood's address; honest peers come from 127.0.0.1
FLOODER = Path(__file__).resolve().parent.parent / "bench" / "flooder.py"


@contextmanager
def idle_connections(address: str, count: int, stream: bool = False) -> Iterator[list[socket.socket]]:
    """`count` connections from FLOOD_SOURCE that send the HTTP/2 preface and SETTINGS (and, with `stream`,
    open a Session call) and never read."""
    host, port = address.rsplit(":", 1)
    hello = PREFACE + SETTINGS + (session_headers(address.encode()) if stream else b"")
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((FLOOD_SOURCE, 0))
            sock.settimeout(10)
            sock.connect((host, int(port)))
            sock.sendall(hello)
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def hung_up(sockets: list[socket.socket], expected: int, within: float) -> int:
    """How many of the sockets the other side has closed, once `expected` have been, or after `within`
    seconds, and then 0.5 s more (to see any more closed). It never reads."""
    poller = select.poll()
    for sock in sockets:
        poller.register(sock, select.POLLRDHUP | select.POLLHUP)
    closed: set[int] = set()
    end = time.monotonic() + within
    while len(closed) < expected and time.monotonic() < end:
        closed.update(fd for fd, _ in poller.poll(100))
    settle = time.monotonic() + 0.5
    while time.monotonic() < settle:
        closed.update(fd for fd, _ in poller.poll(100))
    return len(closed)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return int(reply.status)


def test_the_gate_sweeps_less_often_when_a_sweep_is_costly() -> None:
    # A sweep of 2000 connections takes about 16 ms, of 8000 about 60 ms: at most 5 % of a core goes to it
    assert sweep_interval(0.001) == SWEEP_S == 0.25
    assert sweep_interval(0.02) == pytest.approx(0.4)
    assert sweep_interval(0.3) == MAX_SWEEP_S == 1.0


def test_one_address_keeps_at_most_its_cap_of_quiet_connections_and_health_answers() -> None:
    limits = Limits(handshake_timeout_s=60, max_quiet_per_peer=4)
    pool = GrpcPool(1, "127.0.0.1:0", limits=limits)
    pool.gate.filter_usable = False  # (the cap alone: a sweep while they open must not hold the address off)
    with pool, idle_connections(pool.address, 20) as held:
        # 16 are over the cap of 4 quiet connections from 127.0.0.2; 4 stay (their deadline is a minute away)
        assert hung_up(held, expected=16, within=20) == 16
        assert pool.gate.closed_over_cap == 16 and pool.gate.closed_silent == 0
        assert health(pool.address) == health_pb2.HealthCheckResponse.SERVING  # from 127.0.0.1: not capped


def test_a_sweep_closes_at_most_its_share_of_over_cap_connections_the_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 20 connections from 127.0.0.2 to a port of this process, 4 allowed quiet: the 16 over the cap are closed
    # 5 a sweep (the share, lowered for the test), oldest first, not all at once when their grace ends.
    monkeypatch.setattr(gate_module, "OVER_CAP_PER_SWEEP", 5)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        peers, accepted = [], []
        try:
            for _ in range(20):
                peer = socket.socket()
                peer.bind((FLOOD_SOURCE, 0))
                peer.connect(("127.0.0.1", port))
                peers.append(peer)
                accepted.append(server.accept()[0])
            gate = ConnectionGate({port}, handshake_timeout_s=60, max_quiet_per_peer=4)
            start = time.monotonic()
            gate.sweep(start)  # all seen now: none over its grace yet
            ages = {fd: start + i * 0.01 for i, fd in enumerate(sorted(gate._connections))}
            for fd, seen in ages.items():
                gate._connections[fd].quiet_since = seen  # (one a hundredth of a second after the other)
            oldest = sorted(ages, key=ages.__getitem__)
            later = start + OVER_CAP_GRACE_S + 1
            assert [gate.sweep(later + i) for i in range(5)] == [5, 5, 5, 1, 0]
            assert gate.closed_over_cap == 16
            assert sorted(gate._connections) == sorted(oldest[16:])  # the 4 newest stay
            assert hung_up(peers, expected=16, within=5) == 16
        finally:
            for sock in peers + accepted:
                sock.close()


def test_connections_that_carry_no_hello_are_closed_at_the_handshake_deadline() -> None:
    limits = Limits(handshake_timeout_s=1, max_quiet_per_peer=100, hello_timeout_s=1)
    with (
        GrpcPool(1, "127.0.0.1:0", limits=limits) as pool,
        idle_connections(pool.address, 5) as bare,
        idle_connections(pool.address, 5, stream=True) as streams,
    ):
        # bare: closed at the deadline; a stream with no Hello: ended at hello_timeout_s, then closed as bare
        assert hung_up(bare + streams, expected=10, within=20) == 10
        assert pool.gate.closed_silent == 10 and pool.gate.closed_over_cap == 0


@pytest.mark.parametrize("stream", [False, True], ids=["bare", "stream-without-hello"])
def test_ten_clients_join_and_the_run_is_unchanged_while_one_address_holds_2000_idle_connections(
    tmp_path: Path, stream: bool
) -> None:
    fields = {
        "problem": {"name": "paper_regression", "num_clients": 10, "dim": 10, "s": 2.0},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.01}],
        "rounds": 100,
        "output": {"plot": False},
        "transport": {"join_timeout_s": 120},
    }
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **fields), tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 60).group(1)
    command = [sys.executable, str(FLOODER), address, "--connections", "2000", "--seconds", "240"]
    flood = subprocess.Popen([*command, *(["--stream"] if stream else [])], stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen[bytes]] = []
    try:
        assert flood.stdout is not None
        held = int(flood.stdout.readline().split()[1])  # the flood is on before any client starts:
        assert held > 32  # over its address's quiet cap (all 2000, or as many as it opened before it was held off)
        # ... and the gate is at work on it (the clients join while the flood's connections are being closed
        # and reopened; a run this short would otherwise end before the gate's first close on a quiet machine)
        coordinator.wait_for(r"closed \d+ connections from 127\.0\.0\.2", 60)
        for index in range(10):
            clients.append(client_process(address, index, "--connect-timeout", "120"))
        checked = fedsaddle("health", "--address", address, "--timeout", "30", timeout=60)
        assert checked.returncode == 0 and "SERVING" in checked.stdout, checked.stderr
        code, log = coordinator.finish(timeout=240)
    finally:
        codes = stop_processes(clients)
        flood.terminate()
        said, _ = flood.communicate(timeout=30)
    assert code == 0, log
    assert codes == [0] * 10
    assert "closes every plaintext connection" not in log
    opened, closed = (int(n) for n in re.findall(r"opened (\d+), closed by the coordinator (\d+)", said)[0])
    assert opened - 2000 <= closed and closed > 0  # it held no more than 2000, and the coordinator kept closing them
    assert re.search(r"closed \d+ connections from 127.0.0.2", log)  # said, rate-limited
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    closes = summary["transport"]["connections_closed"]
    assert closes["over_peer_cap"] > 0 and closes["held_off"] >= 1  # counted where operators look
    assert "new connections from 127.0.0.2 are dropped for now" in log
    (remote,) = summary["algorithms"]
    run = config(**fields)
    assert remote["z_sha256"] == run_algorithm(run.algorithms[0], run, LocalPool()).z_sha256


def test_a_client_killed_during_a_flood_rejoins_and_the_run_is_unchanged(tmp_path: Path) -> None:
    # A short run that cannot end before the kill: a checkpoint every 100 rounds, and a pause of 1 s at each.
    fields = {
        "problem": {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 2.0},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.01}],
        "rounds": 301,
        "output": {"plot": False, "checkpoint_every": 100},
        "transport": {"rejoin_timeout_s": 60},
    }
    paused = {**CLIENT_ENV, "FEDSADDLE_TEST_CHECKPOINT_PAUSE": "1"}
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **fields), tmp_path / "runs", env=paused)
    address = coordinator.wait_for(r"listening on (\S+);", 60).group(1)

    flood = subprocess.Popen(
        [sys.executable, str(FLOODER), address, "--connections", "2000", "--seconds", "240"],
        stdout=subprocess.PIPE,
        text=True,
    )
    clients: list[subprocess.Popen[bytes]] = []
    try:
        assert flood.stdout is not None
        assert int(flood.stdout.readline().split()[1]) > 32  # over the cap, before it was held off
        # The clients join once the flood is on, so that the run (a few seconds) is all within it.
        clients += [client_process(address, i, "--connect-timeout", "60") for i in range(3)]
        coordinator.wait_for(r"round\s+\d+/301", 120)
        clients[1].send_signal(signal.SIGKILL)
        clients[1].wait()
        coordinator.wait_for(r"client 1 \(.*\) disconnected", 60)
        clients.append(client_process(address, 1, "--connect-timeout", "60"))  # restarted while the flood goes on
        coordinator.wait_for(r"client 1 \(.*\) rejoined", 60)
        code, log = coordinator.finish(timeout=240)
    finally:
        codes = stop_processes(clients)
        flood.terminate()
        flood.communicate(timeout=30)
    assert code == 0, log
    assert codes[0] == codes[2] == codes[3] == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    (remote,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    run = config(**fields)
    assert remote["z_sha256"] == run_algorithm(run.algorithms[0], run, LocalPool()).z_sha256


def test_an_address_over_its_quiet_cap_has_its_new_connections_dropped_until_it_is_quiet() -> None:
    # 4 quiet connections allowed from one address; its 5th stream without a Hello is refused and the address
    # held off: its new connections are not established (the kernel drops their SYN), others' are.
    limits = Limits(handshake_timeout_s=60, max_quiet_per_peer=4, hello_timeout_s=60)
    with GrpcPool(1, "127.0.0.1:0", limits=limits) as pool:
        host, port = pool.address.rsplit(":", 1)
        target = (host, int(port))
        with idle_connections(pool.address, 5, stream=True):
            deadline = time.monotonic() + 10
            while pool.gate.held_off == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.gate.held_off == 1
            assert not connects(FLOOD_SOURCE, target)  # held off
            assert connects("127.0.0.3", target)  # another address is not
            assert health(pool.address) == health_pb2.HealthCheckResponse.SERVING
        # Its connections gone (closed by it), the filter is lifted after HOLD_OFF_S at a sweep.
        deadline = time.monotonic() + gate_module.HOLD_OFF_S + 10
        while not connects(FLOOD_SOURCE, target, timeout=0.5) and time.monotonic() < deadline:
            pass
        assert connects(FLOOD_SOURCE, target)


def connects(source: str, target: tuple[str, int], timeout: float = 1.0) -> bool:
    """Whether a TCP connection from `source` to `target` is established within `timeout` (then closed)."""
    with socket.socket() as sock:
        sock.bind((source, 0))
        sock.settimeout(timeout)
        try:
            sock.connect(target)
        except OSError:
            return False
        return True
