"""Starting and stopping fedsaddle's processes: the coordinator's pool, client processes on this machine.

Used by the command line (`fedsaddle local`, the gRPC experiment), the tests and
the benchmarks, so that there is one way to start clients and one way to reap them.
Client processes are started with subprocess, never forked from a process that
holds gRPC objects (grpc/grpc#13873).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from fedsaddle.common.indices import parse_indices
from fedsaddle.server.config import RunConfig
from fedsaddle.server.pool import PoolError
from fedsaddle.server.transport.grpc_pool import GrpcPool, MissingClients

CLIENT_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # for tests that start processes themselves


def client_env() -> dict[str, str]:
    """The environment client processes start with: this one's (as it is now), unbuffered."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def client_command(address: str, indices: str, *extra: str, quiet: bool = True) -> list[str]:
    """The command line of a client process hosting `indices` (e.g. '0-4')."""
    quiet_flag = ["--quiet"] if quiet else []
    return [
        sys.executable,
        "-m",
        "fedsaddle",
        *quiet_flag,
        "client",
        "--coordinator",
        address,
        "--clients",
        indices,
        *extra,
    ]


def start_clients(
    address: str,
    groups: Sequence[str],
    *,
    quiet: bool = True,
    capture: bool = True,
    extra: Sequence[str] = (),
    data: Mapping[int, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """One client process per group of indices, dialing the coordinator at `address`.

    `data`: each client's own data file; a process is given only its own clients' files.
    """
    output: int | IO[bytes] | None = subprocess.PIPE if capture else None
    processes = []
    for spec in groups:
        files: list[str] = []
        if data:
            for index in parse_indices(spec):
                files += ["--data", data[index]]
        command = client_command(address, spec, *extra, *files, quiet=quiet)
        processes.append(subprocess.Popen(command, env=client_env(), stdout=output, stderr=output))
    return processes


def reap(processes: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> list[int]:
    """Wait for processes to end (they should, after a goodbye); SIGTERM, then SIGKILL, stragglers.

    Returns their exit codes, in order.
    """
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    return [process.returncode for process in processes]


def index_groups(num_clients: int, per_process: int) -> list[str]:
    """Client indices split into processes of `per_process` clients: ['0-4', '5-9']."""
    groups = []
    for first in range(0, num_clients, per_process):
        last = min(first + per_process, num_clients) - 1
        groups.append(f"{first}-{last}" if last > first else str(first))
    return groups


def coordinator_pool(config: RunConfig, listen: str | None = None) -> GrpcPool:
    """The gRPC pool a config describes (TLS and credentials included), listening on `listen`."""
    from fedsaddle.server.transport.auth import Authenticator, server_credentials

    transport = config.transport
    return GrpcPool(
        config.problem.num_clients,
        listen or transport.listen,
        chunk_bytes=transport.chunk_bytes,
        round_timeout_s=transport.round_timeout_s,
        rejoin_timeout_s=transport.rejoin_timeout_s,
        straggler_deadline_s=config.participation.straggler_deadline_s,
        min_clients=config.participation.min_clients,
        server_credentials=server_credentials(transport.tls) if transport.tls else None,
        authenticator=Authenticator.from_file(transport.credentials) if transport.credentials else None,
    )


def wait_for_children(
    pool: GrpcPool, children: Sequence[subprocess.Popen[bytes]], groups: Sequence[str], timeout: float
) -> None:
    """wait_for_clients, but give up at once, naming them, if client processes exit first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pool.wait_for_clients(min(0.25, max(0.01, deadline - time.monotonic())))
            return
        except MissingClients:
            dead = [(spec, c.returncode) for c, spec in zip(children, groups, strict=True) if c.poll() is not None]
            if dead:
                exits = ", ".join(f"clients {spec} (exit {code})" for spec, code in dead)
                raise PoolError(f"client process(es) exited before joining: {exits}") from None
            if time.monotonic() >= deadline:
                raise


@contextlib.contextmanager
def loopback_federation(
    config: RunConfig,
    per_process: int = 1,
    quiet_clients: bool = True,
    capture: bool = False,
    data: Mapping[int, str] | None = None,
) -> Iterator[tuple[GrpcPool, list[subprocess.Popen[bytes]]]]:
    """A coordinator pool on 127.0.0.1 and client processes for every index; all stopped afterwards."""
    pool = coordinator_pool(config, "127.0.0.1:0")
    groups = index_groups(config.problem.num_clients, per_process)
    # The operator runs both sides here, so the clients trust the config's plugin problem.
    trust = ["--problem", config.problem.plugin] if config.problem.plugin else []
    children: list[subprocess.Popen[bytes]] = []
    try:
        children = start_clients(pool.address, groups, quiet=quiet_clients, capture=capture, data=data, extra=trust)
        print(
            f"coordinator on {pool.address}; started {len(children)} client processes "
            f"for {config.problem.num_clients} clients",
            file=sys.stderr,
            flush=True,
        )
        wait_for_children(pool, children, groups, config.transport.join_timeout_s)
        yield pool, children
    finally:
        pool.close()
        reap(children)
