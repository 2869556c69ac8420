"""Flood: honest clients joining a coordinator while one address holds thousands of idle connections.

For each kind of flood and each size, a `fedsaddle coordinator` process (10 clients, a
short run) is started on 127.0.0.1; bench/flooder.py then holds that many idle
connections from 127.0.0.2 (bare: the HTTP/2 preface and SETTINGS, never reading;
stream: the same and a Session call that never says Hello), reopening each one the
coordinator closes. Once the flood
holds them all, 10 `fedsaddle client` processes are started. Prints, per size: the
seconds from starting the clients to "all 10 clients connected" (their interpreters'
start-up included: the row with 0 connections is the reference), whether `fedsaddle
health` answered during the flood, the coordinator's RSS before the flood and its
peak during it, how many connections the flood opened and the coordinator closed, and
the exit codes. All traffic stays on loopback; every process is stopped at the end.

    python bench/flood.py [--sizes 0 500 2000 8000] [--kinds bare stream]
"""

from __future__ import annotations

import argparse
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from procfs import field_mib  # bench/procfs.py

from fedsaddle.launch import CLIENT_ENV, client_command

HERE = Path(__file__).resolve().parent
CLIENTS = 10
CONFIG = {
    "name": "flood",
    "problem": {"name": "paper_regression", "num_clients": CLIENTS, "dim": 10, "s": 2.0},
    "algorithms": [{"name": "minibatch_md", "gamma": 0.01}],
    "rounds": 200,
    "output": {"plot": False},
    "transport": {"join_timeout_s": 120},
}
KINDS = {"bare": "bare connections (preface and SETTINGS)", "stream": "streams without a Hello"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Lines:
    """A process's stderr, read line by line in a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        assert process.stderr is not None
        threading.Thread(target=self._read, args=(process.stderr,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.queue.put(line)

    def wait_for(self, pattern: str, timeout: float) -> float | None:
        """The time the first line matching `pattern` came, or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if re.search(pattern, line):
                return time.monotonic()
        return None


def rss(pid: int) -> int | None:
    return field_mib(f"/proc/{pid}/status", "VmRSS")


def one(size: int, stream: bool, folder: Path) -> str:
    config = folder / f"flood-{size}.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "fedsaddle", "coordinator", "--config", str(config)]
    command += ["--out", str(folder / "runs"), "--listen", address]
    quiet = {"stdout": subprocess.DEVNULL}
    coordinator = subprocess.Popen(command, env=CLIENT_ENV, stderr=subprocess.PIPE, text=True, **quiet)
    log = Lines(coordinator)
    flooder: subprocess.Popen[str] | None = None
    clients: list[subprocess.Popen[bytes]] = []
    peak = [0]
    sampling = threading.Event()
    try:
        if log.wait_for(r"listening on", 60) is None:
            return f"{size:>6}  the coordinator did not start"
        time.sleep(1.0)
        baseline = rss(coordinator.pid) or 0
        peak[0] = baseline

        def sample() -> None:
            while not sampling.is_set():
                peak[0] = max(peak[0], rss(coordinator.pid) or 0)
                time.sleep(0.1)

        threading.Thread(target=sample, daemon=True).start()
        if size:
            flood = [sys.executable, str(HERE / "flooder.py"), address, "--connections", str(size)]
            flood += ["--seconds", "300", *(["--stream"] if stream else [])]
            flooder = subprocess.Popen(flood, stdout=subprocess.PIPE, text=True)
            assert flooder.stdout is not None
            flooder.stdout.readline()  # "holding N"
        started = time.monotonic()
        for index in range(CLIENTS):
            client = client_command(address, str(index), "--connect-timeout", "60")
            clients.append(subprocess.Popen(client, env=CLIENT_ENV, stderr=subprocess.DEVNULL, **quiet))
        joined = log.wait_for(r"all \d+ clients connected", 90)
        health = subprocess.run(
            [sys.executable, "-m", "fedsaddle", "health", "--address", address, "--timeout", "10"],
            env=CLIENT_ENV,
            capture_output=True,
            text=True,
        )
        coordinator.wait(timeout=180)
        codes = [c.wait(timeout=30) for c in clients]
        sampling.set()
        opened = ""
        if flooder is not None:
            flooder.terminate()
            out, _ = flooder.communicate(timeout=30)
            opened = out.strip().splitlines()[-1] if out.strip() else ""
        join = f"{joined - started:6.2f}" if joined is not None else "  none"
        answered = "yes" if health.returncode == 0 else f"no ({health.stderr.strip()[-80:]})"
        return (
            f"{size:>6}  {join:>7}  {answered:>6}  {baseline:>5} -> {peak[0]:>5} MiB (+{peak[0] - baseline:>3})  "
            f"coordinator exit {coordinator.returncode}, clients {sorted(set(codes))}  {opened}"
        )
    finally:
        sampling.set()
        for process in [*clients, *([flooder] if flooder else []), coordinator]:
            if process.poll() is None:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 500, 2000, 8000])
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=sorted(KINDS),
        default=["bare", "stream"],
        help="bare: each connection sends the preface and SETTINGS; stream: and opens a Session, saying nothing",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds:
            print(
                f"flood of {KINDS[kind]} from 127.0.0.2, reopened as they close; {CLIENTS} client processes then join"
            )
            print("  size  join s  health  coordinator RSS                 outcome")
            for size in args.sizes:
                print(one(size, kind == "stream", Path(folder)), flush=True)


if __name__ == "__main__":
    main()
