"""`fedsaddle experiment compare --ray` on a real two-node Ray cluster: a head and a worker in two
network namespaces joined by a bridge (10.77.0.1 and 10.77.0.2), as tests/test_multihost.py builds them.

Needs root and iproute2 (for the namespaces) and Ray (`pip install 'fedsaddle[ray]'`); skipped with the
reason otherwise. Each Ray node is one `ray start --block` process in its own process group, stopped by
its id afterwards (never `ray stop`, which ends every Ray process of the machine), and every namespace
is removed. It takes about a minute, most of it Ray starting: marked `ray_cluster` so that
`pytest -m "not ray_cluster"` leaves it out.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_multihost import SUBNET, Network

from fedsaddle.launch import CLIENT_ENV

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.ray_cluster,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 to create network namespaces"
    ),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed: pip install '.[ray]'"),
]

HEAD = f"{SUBNET}.1"
PORT = 6379
RAY = str(Path(sys.executable).parent / "ray")
# A grid of several tasks of a few seconds each: enough for Ray to place some on each one-CPU node.
GRID = [
    "--algorithms", "minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s",
    "--problems", "paper",
    "--s", "2", "5",
    "--seeds", "3",
    "--rounds", "200",
]  # fmt: skip


# Ray's token authentication, with a token of the test's own that every node and driver reads.
def ray_env(token: Path) -> dict[str, str]:
    return {
        **CLIENT_ENV,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # a SIGTERM stops a node at once (no work left to drain)
    }


def start_node(net: Network, host: str, address: str, temp: Path, head: bool, cpus: int = 1) -> subprocess.Popen[bytes]:
    env = ray_env(temp.parent / "token")
    command = [*net.run_in(host), RAY, "start", "--block", "--num-cpus", str(cpus), "--disable-usage-stats"]
    command += ["--node-ip-address", address, "--temp-dir", str(temp)]
    command += (
        ["--head", "--port", str(PORT), "--include-dashboard", "false"] if head else ["--address", f"{HEAD}:{PORT}"]
    )
    with open(temp.parent / f"{host}.log", "wb") as log:  # the node writes to its own copy of the file
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the node's process group (`ray start --block` shuts its raylet down), then SIGKILL to
    whatever of the group is left, and wait until none of it is."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    process.wait(timeout=5)


def wait_until_started(node: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    """Until `ray start` says the node runs (its log), failing with the log if it ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "Ray runtime started" in text:
            return
        if node.poll() is not None:
            raise AssertionError(f"ray start ended with {node.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"ray start did not finish within {timeout:.0f} s:\n{text[-3000:]}")


def alive_nodes(net: Network, env: dict[str, str]) -> int:
    """The cluster's live nodes, as a driver in the head's namespace sees them."""
    probe = f"import ray; ray.init(address='{HEAD}:{PORT}', log_to_driver=False); "
    probe += "print(sum(n['Alive'] for n in ray.nodes()))"
    done = subprocess.run(
        [*net.run_in("head"), sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@dataclass
class Cluster:
    net: Network
    env: dict[str, str]  # what a driver needs: the cluster's token


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 1) -> Iterator[Cluster]:
    """A Ray head at 10.77.0.1 and `nodes - 1` workers at 10.77.0.2, ..., each in its own namespace with
    `cpus` CPUs; every process, namespace and file is gone afterwards. (bench/compare_ray.py uses it too.)"""
    # Ray's socket paths must stay short: a short temp folder of our own, one per node.
    root = Path(f"/tmp/fsray{os.getpid() % 100000}")
    root.mkdir()
    (root / "token").write_text(secrets.token_hex(32))
    env = ray_env(root / "token")
    started = []
    hosts = ["head", *(f"worker{i}" for i in range(1, nodes))]
    try:
        with Network(hosts) as net:
            try:
                for index, host in enumerate(hosts):
                    address = f"{SUBNET}.{index + 1}"
                    started.append(start_node(net, host, address, root / host, head=index == 0, cpus=cpus))
                    wait_until_started(started[-1], root / f"{host}.log")
                assert alive_nodes(net, env) == nodes
                yield Cluster(net, env)
            finally:
                for node in reversed(started):
                    stop_node(node)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [name for name in leftovers if name.startswith(f"{net.tag}-")]  # (another worker's may be live)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with ray_cluster(2) as made:
        yield made


def runs(folder: Path) -> bytes:
    return (folder / "runs.csv").read_bytes()


def test_compare_on_two_ray_nodes_writes_the_local_runs_csv_and_uses_both(cluster: Cluster, tmp_path: Path) -> None:
    local = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "experiment", "compare", *GRID, "--out", str(tmp_path / "local")],
        env=CLIENT_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert local.returncode == 0, local.stderr
    command = [sys.executable, "-m", "fedsaddle", "experiment", "compare", *GRID, "--ray", f"{HEAD}:{PORT}"]
    remote = subprocess.run(
        [*cluster.net.run_in("head"), *command, "--out", str(tmp_path / "ray")],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert remote.returncode == 0, remote.stderr
    assert runs(tmp_path / "ray") == runs(tmp_path / "local")
    assert len(runs(tmp_path / "local").splitlines()) == 1 + 2 * 3 * (4 + 4 + 6 + 4)  # header, s x seeds x grids
    placement = list(csv.DictReader(io.StringIO((tmp_path / "ray" / "placement.csv").read_text())))
    nodes = {row["node"] for row in placement}
    assert len(placement) == 8 and len(nodes) == 2, placement  # both nodes ran tasks
    assert {row["node"] for row in csv.DictReader(io.StringIO((tmp_path / "local" / "placement.csv").read_text()))} == {
        "local"
    }
