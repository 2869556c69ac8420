"""Shared helpers: real client processes on loopback, always stopped afterwards."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, overload

import pytest

from fedsaddle.common import blas

blas.set_environment()  # as every fedsaddle process does, before numpy loads (common/blas.py)

import numpy as np  # noqa: E402

from fedsaddle import launch  # noqa: E402
from fedsaddle.launch import CLIENT_ENV  # noqa: E402
from fedsaddle.server.config import RunConfig, parse_config  # noqa: E402
from fedsaddle.server.transport.grpc_pool import GrpcPool  # noqa: E402

# The tests that press Ctrl-C send SIGINT to the processes they start. A suite started in the background of a
# shell (`nohup`, `cmd &`) inherits SIGINT ignored, and so would every process it starts, which would then never
# see it: give this process a handler, so that its children start with SIGINT's default disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def strict_json(text: str) -> Any:
    """JSON as every reader takes it: NaN and Infinity, which Python alone accepts, fail the test."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def fedsaddle(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fedsaddle ARGS` in a fresh process, to its end: exit code and text output. `env`: variables set for it
    beside the clients' usual environment."""
    return subprocess.run(
        [sys.executable, "-m", "fedsaddle", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**CLIENT_ENV, **(env or {})},
    )


def start_clients(address: str, groups: Sequence[str], quiet: bool = True) -> list[subprocess.Popen[bytes]]:
    return launch.start_clients(address, groups, quiet=quiet)


@overload
def client_process(
    address: str,
    indices: str | int,
    *extra: str,
    text: Literal[False] = False,
    quiet: bool = True,
    data: Mapping[int, str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]: ...


@overload
def client_process(
    address: str,
    indices: str | int,
    *extra: str,
    text: Literal[True],
    quiet: bool = True,
    data: Mapping[int, str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]: ...


def client_process(
    address: str,
    indices: str | int,
    *extra: str,
    text: bool = False,
    quiet: bool = True,
    data: Mapping[int, str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes] | subprocess.Popen[str]:
    """`fedsaddle client` hosting `indices`, dialing `address`, with its stdout and stderr piped (as text with
    `text`; its INFO lines too unless `quiet`). `extra`: its own options (e.g. --connect-timeout 10); `data`:
    the clients' files by index (it is given only its own); `env`: its environment instead of the usual one."""
    command = launch.client_command(address, str(indices), *extra, quiet=quiet, data=data)
    return subprocess.Popen(
        command, env=env or launch.client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text
    )


def read_stderr(process: subprocess.Popen[bytes], timeout: float = 30) -> str:
    """A process's stderr once it has exited (killed after `timeout`)."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err.decode(errors="replace") if err else ""


def summary_of(out: Path) -> dict[str, Any]:
    """summary.json of the one run directory under `out`."""
    (run_dir,) = out.iterdir()
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


def simulate_stopped_at_a_checkpoint(
    cwd: Path, *args: str, timeout: float = 60, past_round: int = 0
) -> tuple[Path, str]:
    """`fedsaddle simulate ARGS` in `cwd`, sent SIGTERM once it has written its first checkpoint (one after round
    `past_round`, if given: each checkpoint is then followed by a short pause); it must exit 0.

    The run directory it left (under cwd/runs) and its stderr."""
    pause = {"FEDSADDLE_TEST_CHECKPOINT_PAUSE": "0.05"} if past_round else {}
    first = subprocess.Popen(
        [sys.executable, "-m", "fedsaddle", "simulate", *args],
        cwd=cwd,
        env={**CLIENT_ENV, **pause},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = ""
    if past_round:
        assert first.stderr is not None
        for line in first.stderr:  # "writing checkpoint at round N", before each pause
            seen += line
            found = re.match(r"writing checkpoint at round (\d+)", line)
            if found and int(found.group(1)) > past_round:
                break
    else:
        deadline = time.monotonic() + timeout
        while not list((cwd / "runs").glob("*/checkpoint.npz")) and time.monotonic() < deadline:
            time.sleep(0.01)
    first.send_signal(signal.SIGTERM)
    _, rest = first.communicate(timeout=timeout)
    log = seen + rest
    assert first.returncode == 0, log
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir, log


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> list[int]:
    """Wait for the processes to end (they should, after a goodbye); kill stragglers."""
    return launch.reap(processes, grace)


@contextmanager
def federation(num_clients: int, groups: Sequence[str] | None = None, **pool_options: Any) -> Iterator[GrpcPool]:
    """A GrpcPool on 127.0.0.1 with client processes (one per client unless groups say otherwise)."""
    groups = groups or [str(i) for i in range(num_clients)]
    pool = GrpcPool(num_clients, "127.0.0.1:0", **pool_options)
    processes = start_clients(pool.address, groups)
    try:
        pool.wait_for_clients(60)
        yield pool
    finally:
        pool.close()
        codes = stop_processes(processes)
        pool.client_exit_codes = codes  # type: ignore[attr-defined]


def listening_address(coordinator: subprocess.Popen[str]) -> str:
    """HOST:PORT from a coordinator process's `coordinator listening on ...` line (its stderr, read up to it)."""
    assert coordinator.stderr is not None
    for line in coordinator.stderr:
        if "coordinator listening on " in line:
            return line.split("coordinator listening on ")[1].split(";")[0].strip()
    raise AssertionError("the coordinator did not say where it listens")


def linear_regression_files(
    folder: Path, clients: int, features: int, seed: int, rows: tuple[int, int], held_out: tuple[int, int]
) -> list[Path]:
    """Each client's own data file for linear_regression (client-I.npz): its own true weights (heterogeneous
    clients), rows[0] + I * rows[1] rows and held_out[0] + I * held_out[1] held-out ones (its test_mse's)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(clients):
        count, tests = rows[0] + rows[1] * i, held_out[0] + held_out[1] * i
        x, x_test = rng.standard_normal((count, features)), rng.standard_normal((tests, features))
        w = rng.standard_normal(features) + i
        path = folder / f"client-{i}.npz"
        y, y_test = x @ w + rng.standard_normal(count), x_test @ w + rng.standard_normal(tests)
        np.savez(path, X=x, y=y, X_test=x_test, y_test=y_test)
        paths.append(path)
    return paths


def config(**fields: Any) -> RunConfig:
    """A RunConfig from keyword fields (plain dicts, as a YAML file would give)."""
    return parse_config(fields)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A development CA with certificates for the coordinator and clients site-a, site-b and intruder
    (scripts/dev-certs.sh), made once for the whole run."""
    folder = tmp_path_factory.mktemp("certs")
    script = Path(__file__).parent.parent / "scripts" / "dev-certs.sh"
    subprocess.run(["bash", str(script), str(folder), "site-a", "site-b", "intruder"], check=True, capture_output=True)
    return folder


@pytest.fixture
def tmp_out(tmp_path: Any) -> Any:
    return tmp_path / "runs"


def child_pids(pid: int) -> set[int]:
    """The processes whose parent is `pid`, now."""
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in found.split()}


def under_ci() -> bool:
    """CI sets CI=true: there a test that needs a tool fails without it instead of skipping."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def require_tools(packages: dict[str, str], why: str) -> dict[str, str]:
    """The paths of the tools `packages` names (tool -> its Debian package); without one, the test says SKIPPED
    with the reason (and fails under CI, which installs them: .ci/run)."""
    paths = {name: shutil.which(name) for name in packages}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        install = " ".join(dict.fromkeys(packages[name] for name in missing))
        reason = f"{', '.join(missing)} not installed ({why}); on Debian: apt-get install -y {install}"
        if under_ci():
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    return {name: str(path) for name, path in paths.items()}
