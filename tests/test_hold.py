"""--hold, for orchestrators that restart whatever exits (a Kubernetes Deployment or StatefulSet): once
the run has ended, the coordinator answers health checks only (the server SERVING, the federation
NOT_SERVING) and the clients wait, until SIGTERM; a process stopped by SIGTERM mid-run does not hold.
Real processes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import CLIENT_ENV, fedsaddle, listening_address, stop_processes

from fedsaddle.common.wire import SERVICE

CONFIG = {
    "name": "held",
    "problem": {"name": "paper_regression", "num_clients": 2, "dim": 4, "s": 10.0},
    "rounds": 30,
    "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
    "output": {"plot": False},
}


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fedsaddle", *args],
        env=CLIENT_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def health(address: str, service: str) -> tuple[int, str]:
    """`fedsaddle health`'s exit code and the status it printed (or the error it said)."""
    done = fedsaddle("health", "--address", address, "--service", service, timeout=30)
    return done.returncode, (done.stdout.strip().rsplit(" ", 1)[-1] if done.stdout else done.stderr.strip())


def test_after_the_run_the_coordinator_answers_health_checks_and_the_clients_wait(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    coordinator = start(
        "coordinator", "--config", str(config), "--listen", "127.0.0.1:0", "--out", str(tmp_path / "runs"), "--hold"
    )
    clients: list[subprocess.Popen[str]] = []
    try:
        address = listening_address(coordinator)
        clients = [start("client", "--coordinator", address, "--clients", str(i), "--hold") for i in range(2)]
        deadline = time.monotonic() + 120
        while not list((tmp_path / "runs").glob("*/summary.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        (summary,) = (tmp_path / "runs").glob("*/summary.json")
        assert json.loads(summary.read_text())["transport"]["failure"] is None
        time.sleep(2)  # the run is over: had they exited, they would have by now
        assert coordinator.poll() is None and [c.poll() for c in clients] == [None, None]
        assert health(address, "") == (0, "SERVING")  # live
        assert health(address, SERVICE) == (1, "NOT_SERVING")  # not ready: no client is routed to it
        for process in (coordinator, *clients):
            process.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 0
        assert [c.wait(timeout=30) for c in clients] == [0, 0]
        assert "holding until SIGTERM" in coordinator.communicate()[1]
    finally:
        stop_processes([coordinator, *clients])  # type: ignore[list-item]


def under_way(tmp_path: Path) -> tuple[subprocess.Popen[str], list[subprocess.Popen[str]], str]:
    """A coordinator and two clients, all with --hold, a long run begun."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "rounds": 1000000}))
    coordinator = start(
        "coordinator", "--config", str(config), "--listen", "127.0.0.1:0", "--out", str(tmp_path / "runs"), "--hold"
    )
    address = listening_address(coordinator)
    clients = [start("client", "--coordinator", address, "--clients", str(i), "--hold") for i in range(2)]
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs").glob("*/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return coordinator, clients, address


def test_a_coordinator_stopped_mid_run_exits(tmp_path: Path) -> None:
    coordinator, clients, _ = under_way(tmp_path)
    try:
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 0  # outputs written, the clients told; no holding
        assert "holding" not in coordinator.communicate()[1]
        # Its goodbye says the run is over (stopped, not failed): the clients hold, as after a finished run.
        time.sleep(2)
        assert [c.poll() for c in clients] == [None, None]
        for client in clients:
            client.send_signal(signal.SIGTERM)
        assert [c.wait(timeout=30) for c in clients] == [0, 0]
    finally:
        stop_processes([coordinator, *clients])  # type: ignore[list-item]


def test_a_client_stopped_mid_run_exits_and_a_failed_run_holds_its_coordinator(tmp_path: Path) -> None:
    coordinator, clients, address = under_way(tmp_path)
    try:
        clients[0].send_signal(signal.SIGTERM)
        assert clients[0].wait(timeout=30) == 0  # stopped, not held
        # without transport.rejoin_timeout_s the run fails at once: the other client is told, and exits 1
        assert clients[1].wait(timeout=30) == 1
        deadline = time.monotonic() + 30
        while list((tmp_path / "runs").glob("*/summary.json")) == [] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        assert coordinator.poll() is None  # a failed run holds too: a Deployment would only run it again
        assert health(address, SERVICE) == (1, "NOT_SERVING")
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 1  # the run's own exit code
    finally:
        stop_processes([coordinator, *clients])  # type: ignore[list-item]
