"""Failures with real processes: a client killed mid-run, clients that never join."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from conftest import CLIENT_ENV, child_pids, read_stderr, start_clients, stop_processes


class Coordinator:
    """`fedsaddle coordinator` (or, with `command`, another fedsaddle command: `local`, `simulate`) as a
    subprocess, its stderr read line by line."""

    def __init__(
        self,
        config_path: Path,
        out: Path,
        listen: str = "127.0.0.1:0",
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
        command: str = "coordinator",
        own_group: bool = False,
        arguments: Sequence[str] | None = None,
    ) -> None:
        """`arguments`: the command's own, instead of --config CONFIG_PATH --out OUT (e.g. --resume RUN_DIR)."""
        own = ["--config", str(config_path), "--out", str(out)] if arguments is None else list(arguments)
        line = [*prefix, sys.executable, "-m", "fedsaddle", command, *own]
        command_line = line + (["--listen", listen] if command == "coordinator" else [])
        self.process = subprocess.Popen(
            command_line,
            env=env or CLIENT_ENV,
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=own_group,  # a process group of its own, as a terminal's command has
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.process.stderr is not None
        threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; saw:\n{''.join(self.seen)}")

    def finish_with(self, clients: Sequence[subprocess.Popen[bytes]], timeout: float) -> tuple[int, str, list[int]]:
        """Wait for the coordinator, then for its clients: (its exit code, its log, their exit codes)."""
        try:
            code, log = self.finish(timeout)
        finally:
            codes = stop_processes(clients)
        return code, log, codes

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.process.returncode, "".join(self.seen)


def write_config(path: Path, **fields: object) -> Path:
    path.write_text(yaml.safe_dump(fields))
    return path


@dataclass
class UnderWay:
    """A coordinator subprocess and its client processes, with a long run in progress."""

    coordinator: Coordinator
    clients: list[subprocess.Popen[bytes]]
    client_codes: list[int] = field(default_factory=list)  # filled when the block ends
    client_logs: list[str] = field(default_factory=list)  # their stderr, filled when the block ends


@contextmanager
def run_under_way(
    tmp_path: Path, algorithm: dict[str, Any], num_clients: int, quiet_clients: bool = True, **transport: Any
) -> Iterator[UnderWay]:
    """Start `fedsaddle coordinator` and one client process per client; yield once rounds are going."""
    config = write_config(
        tmp_path / "run.yaml",
        problem={"name": "paper_regression", "num_clients": num_clients, "dim": 10, "s": 1.0},
        algorithms=[algorithm],
        rounds=1_000_000,  # far longer than any test
        transport=transport,
        output={"plot": False},
    )
    coordinator = Coordinator(config, tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    state = UnderWay(coordinator, start_clients(address, [str(i) for i in range(num_clients)], quiet=quiet_clients))
    try:
        coordinator.wait_for(r"round\s+\d+/1000000", 60)
        yield state
    finally:
        logs = [read_stderr(c) for c in state.clients]
        state.client_codes = stop_processes(state.clients)
        state.client_logs = logs


def test_a_killed_client_stops_the_run_with_its_name_and_nothing_hangs(tmp_path: Path) -> None:
    algorithm = {"name": "minibatch_md", "gamma": 0.01}
    # The round timeout is far beyond finish's 30 s: only the broken connection can end the run in time.
    with run_under_way(tmp_path, algorithm, 3, round_timeout_s=300, join_timeout_s=60) as run:
        run.clients[1].send_signal(signal.SIGKILL)
        code, log = run.coordinator.finish(timeout=30)
    codes = run.client_codes
    assert code == 1
    assert re.search(
        r"run failed: client 1 \(.* at ipv4:127\.0\.0\.1:\d+\) disconnected (during|before) round \d+", log
    ), log
    # The others were told that the run failed, and why, and exit with an error.
    assert codes[0] == 1 and codes[2] == 1, run.client_logs
    for log_text in (run.client_logs[0], run.client_logs[2]):
        assert re.search(r"the coordinator ended the run as failed: client 1 \(.*\) disconnected", log_text), log_text
    assert codes[1] == -signal.SIGKILL
    (run_dir,) = list((tmp_path / "runs").iterdir())
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert re.search(
        r"disconnected (during|before) round", summary["transport"]["failure"]
    )  # recorded with the outputs
    assert summary["algorithms"][0]["status"] == "stopped"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) > 1  # the rounds so far are kept


def test_missing_clients_are_named_when_the_join_timeout_expires(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "run.yaml",
        problem={"name": "paper_regression", "num_clients": 4, "dim": 4},
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=5,
        transport={"join_timeout_s": 3},
    )
    coordinator = Coordinator(config, tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    code, log, codes = coordinator.finish_with(start_clients(address, ["0", "2"]), timeout=30)
    assert code == 1
    assert "clients [1, 3] did not join within 3 s" in log
    assert codes == [1, 1]  # the clients that joined are told the run failed (they once exited 0: issue 28)


def test_a_client_without_a_coordinator_gives_up_with_a_clear_error() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsaddle",
            "client",
            "--coordinator",
            "127.0.0.1:9",
            "--clients",
            "0",
            "--connect-timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "cannot reach the coordinator at 127.0.0.1:9 within 1 s" in done.stderr


def test_sigterm_stops_every_process_cleanly_with_outputs_written(tmp_path: Path) -> None:
    with run_under_way(tmp_path, {"name": "fedavg_s", "gamma_local": 0.01}, 2) as run:
        run.coordinator.process.send_signal(signal.SIGTERM)
        code, log = run.coordinator.finish(timeout=30)
    assert code == 0, log
    assert "stopped by SIGTERM; outputs written, clients told goodbye" in log
    assert run.client_codes == [0, 0], run.client_logs
    (run_dir,) = list((tmp_path / "runs").iterdir())
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert summary["transport"]["failure"] == "stopped by SIGTERM"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) > 1


def test_ctrl_c_stops_the_coordinator_and_its_clients_are_told_it_was_interrupted(tmp_path: Path) -> None:
    with run_under_way(tmp_path, {"name": "fedavg_s", "gamma_local": 0.01}, 2, quiet_clients=False) as run:
        run.coordinator.process.send_signal(signal.SIGINT)
        code, log = run.coordinator.finish(timeout=30)
    assert code == 130, log
    assert run.client_codes == [0, 0], run.client_logs
    # Not "the run is over": a client's operator must not read a Ctrl-C as a finished run.
    assert all("coordinator says goodbye" in c and "the coordinator was interrupted" in c for c in run.client_logs), (
        run.client_logs
    )
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert yaml.safe_load((run_dir / "summary.json").read_text())["transport"]["failure"] == "interrupted"


def test_a_client_stopped_by_sigterm_exits_cleanly_and_is_named(tmp_path: Path) -> None:
    with run_under_way(tmp_path, {"name": "minibatch_md", "gamma": 0.01}, 2) as run:
        run.clients[0].send_signal(signal.SIGTERM)
        code, log = run.coordinator.finish(timeout=30)
    assert code == 1
    assert re.search(r"run failed: client 0 \(.*\) disconnected (during|before) round \d+", log), log
    assert run.client_codes == [0, 1]  # the stopped client exits cleanly; the other learns the run failed


def running(pid: int) -> bool:
    """Whether a process exists and has not ended (a zombie waits only for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def local_under_way(tmp_path: Path, algorithm: dict[str, Any], own_group: bool = False) -> Coordinator:
    """`fedsaddle local` with 4 client processes, once its rounds are going."""
    path = write_config(
        tmp_path / "run.yaml",
        problem={"name": "paper_regression", "num_clients": 4, "dim": 10, "s": 1.0},
        algorithms=[algorithm],
        rounds=1_000_000,
    )
    local = Coordinator(path, tmp_path / "runs", command="local", own_group=own_group)
    local.wait_for(rf"{algorithm['name']}\s+round", 60)
    return local


def test_ctrl_c_on_fedsaddle_local_stops_the_run_and_not_its_clients_first(tmp_path: Path) -> None:
    # A terminal's Ctrl-C goes to the whole process group: the coordinator stops the run and says
    # goodbye; clients that left on their own SIGINT would fail the run before it could.
    local = local_under_way(tmp_path, {"name": "scaffold_s", "gamma_local": 0.01}, own_group=True)
    children = sorted(child_pids(local.process.pid))
    os.killpg(local.process.pid, signal.SIGINT)
    code, log = local.finish(timeout=30)
    output = local.process.stdout.read() if local.process.stdout else ""
    assert code == 130, log
    assert "run failed" not in log and "Traceback" not in log, log
    assert "[stopped]" in output
    assert not [pid for pid in children if running(pid)]


def test_the_client_processes_of_fedsaddle_local_end_with_it_even_when_it_is_killed(tmp_path: Path) -> None:
    local = local_under_way(tmp_path, {"name": "minibatch_md", "gamma": 0.01})
    children: list[int] = []
    try:
        children = sorted(child_pids(local.process.pid))
        assert len(children) == 4
        local.process.send_signal(signal.SIGKILL)  # no handler runs: the children are told by the kernel
        local.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in children if running(pid)]
        assert not left, f"client processes {left} outlived their coordinator"  # (not 60 s of retrying)
    finally:
        for pid in children:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
