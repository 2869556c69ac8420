"""Starting and stopping fedsaddle's processes: the coordinator's pool, client processes on this machine.

Used by the command line (`fedsaddle local`, the gRPC experiment), the tests and
the benchmarks, so that there is one way to start clients and one way to reap them.
Client processes are started with subprocess, or, for `fedsaddle local`, forked
from the coordinator's process before it creates any gRPC object (grpc/grpc#13873):
a forked client skips Python's start and the imports it shares with the
coordinator, which is most of a federation's start-up on a small machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Protocol

from fedsaddle.common.attacks import label_flipped
from fedsaddle.common.indices import parse_indices
from fedsaddle.server.config import RunConfig
from fedsaddle.server.pool import PoolError
from fedsaddle.server.transport.grpc_pool import GrpcPool, MissingClients

log = logging.getLogger("fedsaddle.coordinator")

CLIENT_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # for tests that start processes themselves
# The command line's main (cli.main), passed in by the command line: a forked client runs it. Passed in,
# because launch importing cli would close the cycle cli -> launch -> cli.
CommandLine = Callable[[Sequence[str]], int]


def client_env() -> dict[str, str]:
    """The environment client processes start with: this one's (as it is now), unbuffered."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def client_command(
    address: str, indices: str, *extra: str, quiet: bool = True, data: Mapping[int, str] | None = None
) -> list[str]:
    """The command line of a client process hosting `indices` (e.g. '0-4').

    `data`: the clients' data files by index; the process is given only its own clients' files.
    """
    quiet_flag = ["--quiet"] if quiet else []
    files = [arg for index in parse_indices(indices) if data for arg in ("--data", data[index])]
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
        *files,
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
        command = client_command(address, spec, *extra, quiet=quiet, data=data)
        processes.append(subprocess.Popen(command, env=client_env(), stdout=output, stderr=output))
    return processes


class ClientProcess(Protocol):
    """What the launcher uses of a client process: subprocess.Popen, or a ForkedClient."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedClient:
    """A client process forked from this one: Popen's interface, as far as the launcher uses it."""

    stdout: IO[bytes] | None = None
    stderr: IO[bytes] | None = None

    def __init__(self, pid: int, address_pipe: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pipe: int | None = address_pipe  # the child reads the coordinator's address from it

    def start(self, address: str) -> None:
        """Tell the child where the coordinator listens; it dials out."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe, address.encode())
        self.release()

    def release(self) -> None:
        """Close this side of the address pipe (a child not yet started then exits)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"client process {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_clients(
    groups: Sequence[str],
    entry: CommandLine,
    *,
    quiet: bool = True,
    extra: Sequence[str] = (),
    data: Mapping[int, str] | None = None,
) -> list[ForkedClient]:
    """start_clients, forked: each child waits for the coordinator's address (ForkedClient.start), then
    runs `entry` (the command line's main) on the arguments `client_command` gives.

    Call it before this process creates any gRPC object.
    """
    # Imported once, here, instead of in every child.
    from fedsaddle.client.service import ECHOES_COORDINATOR

    children: list[ForkedClient] = []
    parent = os.getpid()
    for spec in groups:
        read_end, write_end = os.pipe()
        sys.stdout.flush(), sys.stderr.flush()
        # Ctrl-C or SIGTERM in the middle of a fork would raise in the child before it set its own handlers
        # (a traceback from every child), or inside a fork hook of the parent's (lost): they wait for it.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the coordinator's handler
                # Ctrl-C reaches the whole process group; it is the coordinator's to act on (it stops the
                # run and says goodbye). A client that left on its own would fail the run first.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                _end_with(parent)
                os.close(write_end)
                for sibling in children:
                    sibling.release()  # the parent's ends of the siblings' pipes are not this child's
                address = os.read(read_end, 4096).decode()
                # The coordinator in the parent says why a run failed; every child repeating it buries that.
                logging.getLogger("fedsaddle").addFilter(lambda record: not getattr(record, ECHOES_COORDINATOR, False))
                if address:  # nothing: the coordinator did not start
                    command = client_command(address, spec, *extra, quiet=quiet, data=data)
                    code = entry(command[3:])  # after `python -m fedsaddle`
            except BaseException:  # print whatever ended it, then exit
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # (a signal held meanwhile is handled here)
        os.close(read_end)
        children.append(ForkedClient(pid, write_end))
    return children


HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _end_with(parent: int) -> None:
    """Have this forked client sent SIGTERM when its parent, the coordinator, dies (Linux), even of
    a SIGKILL: it would otherwise retry a coordinator that is gone for its whole connect timeout."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before that took effect
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def reap(processes: Sequence[ClientProcess], grace: float = 10.0) -> list[int]:
    """Wait for processes to end (they should, after a goodbye); SIGTERM, then SIGKILL, stragglers.

    Returns their exit codes, in order.
    """
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=2))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    return codes


def check_statistics(config: RunConfig, data: Mapping[int, str]) -> None:
    """Warn when the spec's public statistics contradict the clients' data, read here whole. The clients
    read and check their files again when the run starts: a file that cannot be read is their error."""
    from fedsaddle.common.problems import DataProblem, make_problem
    from fedsaddle.common.problems.statistics import disagreements

    indices = sorted(data)
    try:
        problem = make_problem(config.problem)
        if not isinstance(problem, DataProblem):
            return
        datas = [problem.load(data[i]) for i in indices]
        found = disagreements(problem, datas, indices)
    except Exception:  # a file or a plug-in that fails here fails in its client, which names it to the run
        return
    for disagreement in found:
        log.warning("%s", disagreement)


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
    address = listen or transport.listen
    pool = GrpcPool(
        config.problem.num_clients,
        address,
        chunk_bytes=transport.chunk_bytes,
        round_timeout_s=transport.round_timeout_s,
        rejoin_timeout_s=transport.rejoin_timeout_s,
        straggler_deadline_s=config.participation.straggler_deadline_s,
        min_clients=config.participation.min_clients,
        server_credentials=server_credentials(transport.tls) if transport.tls else None,
        authenticator=Authenticator.from_file(transport.credentials) if transport.credentials else None,
        limits=transport.limits,
        token_listen=transport.token_listen,
        token_credentials=server_credentials(transport.tls, client_certificates=False) if transport.tls else None,
    )
    warning = open_federation_warning(config, address)  # (once it listens: a port it cannot bind is the news)
    if warning is not None:
        log.warning("%s", warning)
    return pool


def open_federation_warning(config: RunConfig, address: str) -> str | None:
    """What to say when a coordinator is reachable from other hosts and lets anyone join."""
    if config.transport.credentials is not None or _loopback(address):
        return None
    return (
        f"OPEN FEDERATION: listening on {address} without credentials. Anyone who can reach this port can "
        "join as any free client index before your clients do, and answer in their place. Give the config "
        "transport.credentials (tokens or client certificates), or listen on a loopback address."
    )


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def wait_for_children(pool: GrpcPool, children: Sequence[ClientProcess], groups: Sequence[str], timeout: float) -> None:
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
    fork: CommandLine | None = None,
) -> Iterator[tuple[GrpcPool, list[ClientProcess]]]:
    """A coordinator pool on 127.0.0.1 and client processes for every index; all stopped afterwards.

    fork: the command line's main, to fork the client processes from this one with (see fork_clients)
    instead of starting them afresh; only before this process has created any gRPC object.
    """
    groups = index_groups(config.problem.num_clients, per_process)
    # The operator runs both sides here, so the clients trust the config's plugin problem.
    extra = ["--problem", config.problem.plugin] if config.problem.plugin else []
    flipped = label_flipped(config.attack.attack() if config.attack is not None else None)
    if flipped:  # a simulated label_flip is made where those clients' data loads: in their processes
        extra += ["--label-flipped", ",".join(map(str, flipped))]
    if data:
        # Every client's file is at hand here: compare the spec's statistics with all of them at once,
        # exactly, rather than each client process with its own share.
        check_statistics(config, data)
        extra.append("--statistics-checked")
    children: list[ClientProcess] = []
    pool: GrpcPool | None = None
    try:
        if fork:
            forked = fork_clients(groups, fork, quiet=quiet_clients, data=data, extra=extra)
            children = list(forked)
            pool = coordinator_pool(config, "127.0.0.1:0")
            for child in forked:
                child.start(pool.address)
        else:
            pool = coordinator_pool(config, "127.0.0.1:0")
            children = list(
                start_clients(pool.address, groups, quiet=quiet_clients, capture=capture, data=data, extra=extra)
            )
        print(
            f"coordinator on {pool.address}; started {len(children)} client processes "
            f"for {config.problem.num_clients} clients",
            file=sys.stderr,
            flush=True,
        )
        wait_for_children(pool, children, groups, config.transport.join_timeout_s)
        yield pool, children
    finally:
        if pool is not None:
            pool.close()
        for process in children:
            if isinstance(process, ForkedClient):
                process.release()
        # Ended by an exception (Ctrl-C, a failure to start): clients that never joined were told nothing,
        # and would wait for the coordinator until their connect timeout. The others were told goodbye.
        reap(children, grace=1.0 if sys.exc_info()[0] is not None else 10.0)
