"""Separate hosts, for real: network namespaces joined by veth links on a private subnet.

The coordinator runs in one namespace and client processes in three others, each
reaching the coordinator by its address on the bridge. Needs root (skipped
otherwise); every namespace and link the test makes is removed afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CLIENT_ENV, config, stop_processes
from test_algorithm_plugin import installed
from test_failures import Coordinator, write_config

from fedsaddle.common.indices import parse_indices
from fedsaddle.experiments.datasets import split
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root and iproute2 to create network namespaces",
    ),
]

SUBNET = "10.77.0"  # inside our own namespaces only
COORDINATOR = f"{SUBNET}.1"
PORT = 50051


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Network:
    """A bridge in a hub namespace, and one namespace per host plugged into it."""

    def __init__(self, hosts: list[str]) -> None:
        self.tag = f"fs{os.getpid() % 100000}"
        self.hub = f"{self.tag}-hub"
        self.hosts = hosts
        self.made: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def link(self, index: int) -> str:
        return f"{self.tag}h{index}"  # <= 15 characters

    def __enter__(self) -> Network:
        try:
            ip("netns", "add", self.hub)
            self.made.append(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for index, host in enumerate(self.hosts):
                ns, link = self.namespace(host), self.link(index)
                ip("netns", "add", ns)
                self.made.append(ns)
                ip("link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b")
                ip("link", "set", f"{link}a", "netns", ns)
                ip("link", "set", f"{link}b", "netns", self.hub)
                ip("-n", ns, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", f"{link}a")
                ip("-n", ns, "link", "set", f"{link}a", "up")
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", self.hub, "link", "set", f"{link}b", "master", "br0")
                ip("-n", self.hub, "link", "set", f"{link}b", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # Deleting a namespace deletes the veth ends inside it; a veth pair dies with either end.
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    def run_in(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host)]

    def cut(self, index: int) -> None:
        """Unplug host `index` from the bridge: its packets are dropped, no connection reset."""
        ip("-n", self.hub, "link", "set", f"{self.link(index)}b", "down")


HOSTS = ["coordinator", "site-a", "site-b", "site-c"]
CLIENTS = {"site-a": "0-1", "site-b": "2", "site-c": "3"}


@pytest.fixture
def network() -> Iterator[Network]:
    with Network(HOSTS) as net:
        yield net
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [name for name in leftovers if name.startswith(f"{net.tag}-")]  # (another worker's may be live)


def start_host_clients(
    net: Network, data: dict[int, str] | None = None, env: dict[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """A client process on each host; with `data`, each is given its own clients' files only."""
    processes = []
    for host, indices in CLIENTS.items():
        command = [*net.run_in(host), sys.executable, "-m", "fedsaddle", "--quiet", "client"]
        command += ["--coordinator", f"{COORDINATOR}:{PORT}", "--clients", indices, "--name", host]
        command += ["--connect-timeout", "5"]  # a cut-off client retries this long before it gives up
        for index in parse_indices(indices) if data else ():
            command += ["--data", data[index]]
        processes.append(
            subprocess.Popen(command, env=env or CLIENT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    return processes


PROBLEM = {"name": "paper_regression", "num_clients": 4, "dim": 10, "s": 5.0}


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure-aggregation"])
def test_clients_on_three_hosts_with_their_own_data_match_the_in_process_run(
    network: Network, tmp_path: Path, secure: bool
) -> None:
    # Each host holds only its own clients' files (a copy in its own folder): real, private data.
    split("diabetes", 4, "label-skew", seed=0, out=tmp_path / "dataset")
    data: dict[int, str] = {}
    for host, indices in CLIENTS.items():
        (tmp_path / host).mkdir()
        for index in parse_indices(indices):
            data[index] = str(shutil.copy(tmp_path / "dataset" / f"client-{index:03d}.npz", tmp_path / host))
    problem = {"name": "linear_regression", "num_clients": 4, "features": 10, "lam": 0.1}
    algorithms = [
        {"name": "fedavg_s", "gamma_local": 0.05},
        {"name": "scaffold_s", "gamma_local": 0.05},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.05},
    ]
    fields: dict[str, Any] = dict(problem=problem, algorithms=algorithms, rounds=41, weighting="samples")
    if secure:  # each host's clients weigh and mask their own rows; the coordinator sees sums only
        fields["privacy"] = {"secure_aggregation": True}
    path = write_config(tmp_path / "run.yaml", output={"plot": False}, **fields)
    coordinator = Coordinator(path, tmp_path / "runs", f"{COORDINATOR}:{PORT}", network.run_in("coordinator"))
    coordinator.wait_for(r"listening on", 30)
    code, log, codes = coordinator.finish_with(start_host_clients(network, data), timeout=120)
    assert code == 0, log
    assert codes == [0, 0, 0]
    for host in CLIENTS:  # each client came from its own host's address
        assert re.search(rf"\({host} at ipv4:{SUBNET}\.\d+:\d+\) joined", log), log
    (run_dir,) = list((tmp_path / "runs").iterdir())
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    run = config(**fields)
    for spec, remote in zip(run.algorithms, summary["algorithms"], strict=True):
        local = run_algorithm(spec, run, LocalPool(data=data))
        assert remote["z_sha256"] == local.z_sha256
        for key in ("rounds", "messages_down", "messages_up", "floats_down", "floats_up"):
            assert remote["traffic"]["algorithm"][key] == local.traffic["algorithm"][key]
            if secure:
                assert remote["traffic"]["privacy"][key] == local.traffic["privacy"][key]


def test_a_plugin_algorithm_on_three_hosts_matches_simulate(network: Network, tmp_path: Path) -> None:
    # The example plug-in (examples/algorithm-plugin), installed on every host: its local computation
    # runs in each host's client process, and the run ends with simulate's bits and counts.
    env = installed(tmp_path / "site")
    algorithms = [{"name": "fedprox_gda", "gamma_local": 0.02, "mu": 0.3}, {"name": "local_sgda_plus", "eta_x": 0.02}]
    fields: dict[str, Any] = dict(problem=PROBLEM, algorithms=algorithms, rounds=31, gradient_noise=0.1)
    path = write_config(tmp_path / "run.yaml", output={"plot": False}, **fields)
    coordinator = Coordinator(path, tmp_path / "runs", f"{COORDINATOR}:{PORT}", network.run_in("coordinator"), env=env)
    coordinator.wait_for(r"listening on", 30)
    code, log, codes = coordinator.finish_with(start_host_clients(network, env=env), timeout=120)
    assert code == 0, log
    assert codes == [0, 0, 0]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    remote = yaml.safe_load((run_dir / "summary.json").read_text())["algorithms"]
    simulated = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "simulate", "--config", str(path), "--out", str(tmp_path / "simulated")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert simulated.returncode == 0, simulated.stderr
    (simulated_dir,) = list((tmp_path / "simulated").iterdir())
    local = yaml.safe_load((simulated_dir / "summary.json").read_text())["algorithms"]
    for ours, theirs in zip(local, remote, strict=True):
        assert theirs["status"] == ours["status"] == "ok"
        assert theirs["z_sha256"] == ours["z_sha256"], ours["name"]
        for key in ("rounds", "messages_down", "messages_up", "floats_down", "floats_up"):
            assert theirs["traffic"]["algorithm"][key] == ours["traffic"]["algorithm"][key]


def test_a_cut_link_fails_the_run_naming_the_client_and_nothing_stays_running(network: Network, tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        problem=PROBLEM,
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=1_000_000,
        transport={"round_timeout_s": 5},
        output={"plot": False},
    )
    coordinator = Coordinator(path, tmp_path / "runs", f"{COORDINATOR}:{PORT}", network.run_in("coordinator"))
    coordinator.wait_for(r"listening on", 30)
    clients = start_host_clients(network)
    try:
        coordinator.wait_for(r"round\s+\d+/1000000", 60)
        network.cut(HOSTS.index("site-b"))
        cut_at = time.monotonic()
        code, log = coordinator.finish(timeout=60)
        detected = time.monotonic() - cut_at
        # the cut client cannot hear the goodbye: it must give up by itself (keepalive, then reconnects)
        deadline = time.monotonic() + 60
        while clients[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        gave_up_by_itself = clients[1].poll() is not None
    finally:
        codes = stop_processes(clients)
    assert code == 1
    assert re.search(
        r"run failed: round \d+: no answer within 5 s from client 2 \(site-b at ipv4:10\.77\.0\.3:\d+\)", log
    ), log
    assert detected < 5 + 10  # the round timeout, plus process exit
    assert codes[0] == 1 and codes[2] == 1  # told the run failed
    assert gave_up_by_itself and codes[1] == 1
