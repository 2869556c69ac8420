"""The commands that run a config: simulate (in one process), coordinator and client (over gRPC, on any
hosts), local (a coordinator and client processes on loopback), and what a run's ending means for the
exit code."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsaddle.cli.arguments import (
    Commands,
    add_command,
    address,
    indices,
    positive_float,
    positive_int,
    window_mib,
    with_config,
    with_data,
    with_device,
    with_monitor,
    with_reference,
    with_resume,
)
from fedsaddle.cli.credentials import channel_credentials, read_token, tls_options
from fedsaddle.cli.shared import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RUN_FAILED,
    UsageError,
    config_from,
    data_paths_of,
    given_reference,
    log,
)
from fedsaddle.cli.signals import say_interrupted, stop_on_sigterm, terminated
from fedsaddle.cli.watch import Watch
from fedsaddle.common.indices import parse_indices

if TYPE_CHECKING:
    from fedsaddle.launch import CommandLine
    from fedsaddle.server.config import RunConfig
    from fedsaddle.server.driver import AlgorithmResult
    from fedsaddle.server.pool import ClientPool
    from fedsaddle.server.runs import Outcome

_LOADED = time.perf_counter()


def _device(args: argparse.Namespace) -> None:
    """This process's --device (and that of the client processes it starts); UsageError if this machine lacks it."""
    from fedsaddle.common import devices

    try:
        devices.choose(args.device)
    except devices.DeviceError as exc:
        raise UsageError(f"--device: {exc}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedsaddle.server.transport.local_pool import LocalPool

    _device(args)
    stop_on_sigterm()

    def local_pool(config: RunConfig) -> tuple[Any, dict[str, Any]]:
        pool = LocalPool(data=data_paths_of(args.data, range(config.problem.num_clients)))
        return pool, pool.describe()

    if args.resume:
        return _resume(args, local_pool, _reference)
    if not args.config:
        raise UsageError("simulate needs --config (or --resume RUN_DIR)")
    config = config_from(args)
    given = given_reference(args, config)
    pool, transport = local_pool(config)
    if given is not None:
        return _run(config, pool, transport, given.z, accuracy=given.accuracy)
    return _run(config, pool, transport, _reference(config, pool))


def _reference(config: RunConfig, pool: Any) -> Any:
    """z* for an in-process run: on real data, solved from every client's data (all at hand here)."""
    from fedsaddle.common.problems import DataError
    from fedsaddle.server.transport.local_pool import reference_solution

    try:
        with _naming_memory(config):
            return reference_solution(config, pool.cache)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def _serving(config: RunConfig, listen: str | None, watch: Watch | None = None) -> Any:
    """The coordinator's pool, once every client has joined."""
    from fedsaddle.launch import coordinator_pool

    pool = coordinator_pool(config, listen)
    if watch is not None:
        watch.attach(pool)  # (the dashboard shows the clients joining)
    try:
        token = config.transport.token_listen
        tokens = f"token identities on {token.rsplit(':', 1)[0]}:{pool.token_port}; " if token else ""
        print(
            f"coordinator listening on {pool.address}; {tokens}waiting for {config.problem.num_clients} clients",
            file=sys.stderr,
            flush=True,
        )
        pool.wait_for_clients(config.transport.join_timeout_s)
    except BaseException as exc:
        from fedsaddle.server.pool import PoolError

        if isinstance(exc, PoolError):  # the clients that did join are told the run failed, and why
            pool.failure = str(exc)
        pool.close()
        raise
    return pool


def cmd_coordinator(args: argparse.Namespace) -> int:
    stop_on_sigterm()
    served: list[tuple[RunConfig, str]] = []  # the config and the address it listened on (for --hold)
    watch = Watch(args)

    def serving(config: RunConfig) -> tuple[Any, dict[str, Any]]:
        config = watch.start(config)
        pool = _serving(config, args.listen, watch)
        served.append((config, pool.address))
        return pool, {"kind": "grpc", "address": pool.address}

    try:
        if args.resume:
            code = _resume(args, serving, watch=watch)
        else:
            if not args.config:
                raise UsageError("coordinator needs --config (or --resume RUN_DIR)")
            config = config_from(args)
            if config.attack is not None and config.attack.kind == "label_flip":
                raise UsageError(
                    "attack: label_flip swaps labels in the Byzantine clients' own data, which a coordinator does not "
                    "hold: start those clients with `fedsaddle client --attack label_flip` instead"
                )
            given = given_reference(args, config)  # before the clients are waited for
            pool, transport = serving(config)
            try:
                if given is not None:
                    code = _run(config, pool, transport, given.z, accuracy=given.accuracy, watch=watch)
                else:
                    code = _run(config, pool, transport, watch=watch)
            finally:
                pool.close()
        return _hold_coordinator(*served[-1], code) if args.hold else code  # (its monitor serves while it holds)
    finally:
        watch.close()


def _hold_coordinator(config: RunConfig, address: str, code: int) -> int:
    """--hold: once the run has ended, the coordinator's address serves the standard health service alone
    until SIGTERM: the server SERVING (a liveness probe passes), the federation NOT_SERVING (a readiness
    probe fails). An orchestrator that restarts whatever exits (a Deployment) neither restarts the
    coordinator, which would start the run again, nor routes clients to it. A run stopped by SIGTERM
    exits at once."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from fedsaddle.common.stop import Stopped
    from fedsaddle.server.transport.auth import server_credentials
    from fedsaddle.server.transport.servicer import SERVICE

    if terminated():
        return code
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls = config.transport.tls
    try:
        port = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        log.error("--hold: cannot listen on %s again; exiting", address)
        return code
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    print(
        f"the run has ended (exit code {code}); holding until SIGTERM: {address} answers health checks only "
        f"(the server SERVING, {SERVICE} NOT_SERVING)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not terminated():
            time.sleep(1.0)
    except Stopped:
        pass
    finally:
        server.stop(grace=1).wait()
    return code


def _hold_client() -> int:
    """--hold: a client whose run ended well waits for SIGTERM instead of exiting, so that an orchestrator
    that restarts whatever exits (a StatefulSet) does not start it again to dial a run that is over."""
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    print("the run has ended; holding until SIGTERM", file=sys.stderr, flush=True)
    while not stopped.wait(1.0):
        pass
    return EXIT_OK


def _resume(
    args: argparse.Namespace,
    pool_for: Callable[[RunConfig], tuple[Any, dict[str, Any]]],
    reference_for: Callable[[RunConfig, Any], Any] | None = None,
    watch: Watch | None = None,
) -> int:
    """Go on with the run in args.resume (its config is the run directory's) on the pool `pool_for(config)`
    makes, with the transport description the summary records."""
    from fedsaddle.progress import Progress
    from fedsaddle.server.checkpoint import CheckpointError
    from fedsaddle.server.runs import resume_run

    if args.config:
        raise UsageError("--resume takes the config from the run directory; leave out --config")
    if args.out:
        raise UsageError("--resume goes on in the run directory it names; leave out --out")
    given = None
    saved_config = Path(args.resume) / "config.json"
    if getattr(args, "reference", None) and saved_config.is_file():  # (resume_run names a folder without one)
        from fedsaddle.server.config import load_config

        given = given_reference(args, load_config(saved_config))
        reference_for = lambda config, pool: given.z  # noqa: E731
    progress = Progress(floor=given.accuracy if given is not None else 0.0)
    made: list[tuple[RunConfig, dict[str, Any]]] = []

    def pool_of(config: RunConfig) -> tuple[Any, dict[str, Any]]:
        pool, transport = pool_for(config)
        made.append((config, transport))
        return pool, {**transport, "resumed": True}

    step = watch.step(progress.step) if watch is not None else progress.step
    try:
        outcome = resume_run(
            Path(args.resume),
            pool_of,
            progress.rounds,
            step,
            reference_for=reference_for,
            reference_accuracy=given.accuracy if given is not None else 0.0,
        )
    except CheckpointError as exc:
        raise UsageError(f"cannot resume: {exc}") from None
    finally:
        progress.close()
    ((config, transport),) = made
    if watch is not None:
        watch.finish(outcome, config)
    _print_tables(outcome.results, config)
    print(f"run directory: {outcome.run_dir} (resumed)")
    return _exit_code(outcome, transport)


def cmd_client(args: argparse.Namespace) -> int:
    from fedsaddle.client.probe import TlsFiles
    from fedsaddle.client.service import ECHOES_COORDINATOR, ClientError, ClientOptions, serve
    from fedsaddle.client.session import RunFailed
    from fedsaddle.common.attacks import label_flipped, parse_own_attack

    _device(args)
    token = read_token(args.token_file)
    hosted = parse_indices(args.clients)
    try:
        attack = parse_own_attack(args.attack, hosted) if args.attack else None
    except ValueError as exc:
        raise UsageError(f"--attack: {exc}") from None
    flipped = set(label_flipped(attack)) | set(parse_indices(args.label_flipped) if args.label_flipped else ())
    data = data_paths_of(args.data, hosted)
    if not args.statistics_checked:  # (`fedsaddle local` checked every file before starting its clients)
        _check_client_start(tuple(args.problem or ()), hosted, data)
    options = ClientOptions(
        args.coordinator,
        hosted,
        name=args.name or "",
        connect_timeout_s=args.connect_timeout,
        receive_window_mib=args.receive_window_mib,
        credentials=channel_credentials(args),
        metadata=(("authorization", f"Bearer {token}"),) if token else (),
        server_name=args.server_name,
        data=data,
        trusted=tuple(args.problem or ()),
        client_certificate=bool(args.cert),
        check_statistics=not args.statistics_checked,
        tls_files=TlsFiles(args.ca, args.cert, args.key) if args.ca else None,
        attack=attack,
        flipped=tuple(sorted(flipped)),
    )
    metrics = _client_monitor(args, options)
    try:
        try:
            stopped_by = serve(options)
        except ClientError as exc:
            # The coordinator's reason, repeated at this site (marked: `fedsaddle local`, whose coordinator
            # says it in the same terminal, leaves it out: see launch.fork_clients).
            log.error("%s", exc, extra={ECHOES_COORDINATOR: isinstance(exc, RunFailed)})
            return EXIT_RUN_FAILED
        return _hold_client() if args.hold and not stopped_by else EXIT_OK  # (its metrics served while it holds)
    finally:
        if metrics is not None:
            metrics.close()


def _client_monitor(args: argparse.Namespace, options: Any) -> Any:
    """A client process's /metrics (client/monitor.py) on --monitor, before it dials the coordinator."""
    if not args.monitor:
        if args.monitor_cert or args.monitor_key or args.monitor_token_file:
            raise UsageError("--monitor-cert, --monitor-key and --monitor-token-file go with --monitor HOST:PORT")
        return None
    from fedsaddle.client.monitor import ClientStats, serve_metrics
    from fedsaddle.common.monitoring import Exposure, MonitorError

    options.stats = ClientStats(options.indices)
    exposure = Exposure(args.monitor, args.monitor_cert, args.monitor_key, args.monitor_token_file)
    try:
        server = serve_metrics(exposure, options.stats)
    except MonitorError as exc:
        raise UsageError(str(exc)) from None
    log.info("metrics at %s://%s/metrics", server.scheme, server.address)
    return server


def _check_client_start(plugins: Sequence[str], hosted: Sequence[int], data: dict[int, str]) -> None:
    """What a client can check before it connects (UsageError, exit 2, with the whole message): each
    --problem plug-in imports and is a problem class, and each --data file reads as a data file (unless a
    plug-in reads its files its own way, overriding `load`). What depends on the run's spec (a problem's
    own check: its features, its labels) is checked when a run starts, as the coordinator sends the spec."""
    from fedsaddle.common.problems import DataError, DataProblem, ProblemNotFound, read_client_data
    from fedsaddle.common.problems.registry import load_path

    own_format = False
    for plugin in plugins:
        try:
            cls = load_path(plugin, "plugin")
        except ProblemNotFound as exc:
            raise UsageError(f"--problem {plugin}: {exc}") from None
        own_format = own_format or (issubclass(cls, DataProblem) and cls.load is not DataProblem.load)
    if own_format:
        return
    for index, path in data.items():
        try:
            read_client_data(path)
        except DataError as exc:
            raise UsageError(f"client {index}: {exc}") from None


def cmd_local(args: argparse.Namespace, fork: CommandLine) -> int:
    """A coordinator in this process and client processes on loopback; `fork`: the command line's main, each
    client process's (launch.fork_clients)."""
    from fedsaddle.common.problems import make_problem
    from fedsaddle.common.worker import no_data_files
    from fedsaddle.launch import loopback_federation

    _device(args)
    stop_on_sigterm()
    watch = Watch(args)
    with contextlib.ExitStack() as stack:  # the federation's processes end with the command
        stack.callback(watch.close)

        def federation(config: RunConfig) -> tuple[Any, dict[str, Any]]:
            config = watch.start(config)
            if config.transport.tls or config.transport.credentials:
                raise UsageError(
                    "`fedsaddle local` runs plaintext on loopback; use coordinator and client for TLS or tokens"
                )
            data = data_paths_of(args.data, range(config.problem.num_clients))
            if not data and not make_problem(config.problem).synthetic:  # said now, not after starting every process
                raise UsageError(no_data_files(config.problem.name, range(config.problem.num_clients)))
            loopback = loopback_federation(config, args.clients_per_process, args.quiet_clients, data=data, fork=fork)
            pool, processes = stack.enter_context(loopback)
            watch.attach(pool)
            return pool, {"kind": "grpc", "address": pool.address, "client_processes": len(processes)}

        if args.resume:
            return _resume(args, federation, watch=watch)
        config = config_from(args)
        given = given_reference(args, config)  # before any process starts
        pool, transport = federation(config)
        if given is not None:
            return _run(config, pool, transport, given.z, timed=True, accuracy=given.accuracy, watch=watch)
        return _run(config, pool, transport, timed=True, watch=watch)


# -- running a config and what its ending means ---------------------------------------------


def _run(
    config: RunConfig,
    pool: ClientPool,
    transport: dict[str, Any],
    reference: Any = None,
    timed: bool = False,
    accuracy: float = 0.0,
    watch: Watch | None = None,
) -> int:
    """Run a config; `timed`: say how long after the command the first round was done; `accuracy`:
    the reference's (distances finer than it are shown as below it); `watch`: its monitor."""
    from fedsaddle.progress import Progress
    from fedsaddle.server.runs import run_config

    progress = Progress(floor=accuracy)
    first: list[float] = []

    def hook(name: str, spent: int, budget: int, dist_z: float) -> None:
        if timed and not first:
            first.append(_since_start())
            print(f"first round done {first[0]:.2f} s after the command started", file=sys.stderr, flush=True)
        progress.rounds(name, spent, budget, dist_z)

    step = watch.step(progress.step) if watch is not None else progress.step
    with _naming_memory(config):
        try:
            outcome = run_config(config, pool, transport, hook, reference, step, accuracy)
        finally:
            progress.close()
            pool.close()  # clients are told goodbye (and log it) before the table, which ends the output
        if watch is not None:
            watch.finish(outcome, config)
        if outcome.results:
            _print_tables(outcome.results, config)
        print(f"run directory: {outcome.run_dir}")
        return _exit_code(outcome, transport)


@contextlib.contextmanager
def _naming_memory(config: RunConfig) -> Iterator[None]:
    """Out of memory: say how large the problem's vectors are, the likely cause (a typo in its size)."""
    try:
        yield
    except MemoryError as exc:
        from fedsaddle.common.problems import make_problem

        dimension = make_problem(config.problem).dimension
        raise UsageError(
            f"not enough memory on this machine for problem {config.problem.name}: its vectors have "
            f"{dimension:,} entries, {_size(8 * dimension)} each ({exc})"
        ) from None


def _size(size: float) -> str:
    """Bytes in binary units: 1.6e+07 -> '15.3 MiB'."""
    unit = "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.3g} {unit}"


def _print_tables(results: Sequence[AlgorithmResult], config: RunConfig) -> None:
    """The results table, and the rounds each algorithm took to reach the config's accuracies."""
    from fedsaddle.server.report import rounds_table, table

    print(table(results))
    rounds = rounds_table(results, config)
    if rounds is not None:
        print(rounds)


def _exit_code(outcome: Outcome, transport: dict[str, Any]) -> int:
    from fedsaddle.common.stop import Stopped

    if outcome.unexpected:
        assert outcome.cause is not None
        raise outcome.cause  # outputs so far are written; main() reports it
    if outcome.failure is None:
        return EXIT_OK
    if isinstance(outcome.cause, Stopped):
        told = ", clients told goodbye" if transport.get("kind") == "grpc" else ""
        log.info("stopped by SIGTERM; outputs written%s", told)
        return EXIT_OK
    if isinstance(outcome.cause, KeyboardInterrupt):
        say_interrupted(" (outputs written)")
        return EXIT_INTERRUPTED
    log.error("run failed: %s", outcome.failure)
    return EXIT_RUN_FAILED


def _since_start() -> float:
    """Seconds since this process started (the kernel's start time; else since this module loaded)."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _LOADED


def add_commands(commands: Commands, fork: CommandLine) -> None:
    """simulate, coordinator, client and local; `fork`: the command line's main, which local forks its
    client processes from."""
    p = add_command(commands, "simulate", "run a config in one process (the in-process transport)", cmd_simulate)
    with_config(p, "required, unless --resume")
    with_data(p, "each client's")
    with_device(p, "this process's")
    with_resume(p)
    with_reference(p)

    p = add_command(commands, "coordinator", "serve a config to client processes over gRPC", cmd_coordinator)
    with_config(p, "required, unless --resume")
    p.add_argument("--listen", type=address(True), help="HOST:PORT to listen on (overrides transport.listen)")
    with_resume(p)
    p.add_argument(
        "--hold",
        action="store_true",
        help="when the run has ended, answer health checks only (the server SERVING, the federation NOT_SERVING) "
        "until SIGTERM instead of exiting: for orchestrators that restart what exits (a Kubernetes Deployment)",
    )
    with_reference(p)
    with_monitor(p)

    p = add_command(commands, "client", "host clients' data and run their local steps", cmd_client)
    p.add_argument("--coordinator", required=True, type=address(False), help="HOST:PORT of the coordinator")
    p.add_argument("--clients", required=True, type=indices, help="client indices this process hosts: 3, 0,2,5 or 0-4")
    p.add_argument("--name", help="name shown in the coordinator's logs (default: host:pid)")
    p.add_argument("--connect-timeout", type=positive_float, default=60.0, help="seconds to wait for the coordinator")
    p.add_argument(
        "--hold",
        action="store_true",
        help="when the run has ended well, wait for SIGTERM instead of exiting: for orchestrators that restart "
        "what exits (a Kubernetes StatefulSet)",
    )
    p.add_argument("--token-file", help="file holding this client's token (default: $FEDSADDLE_TOKEN, if set)")
    p.add_argument(
        "--receive-window-mib",
        type=window_mib,
        default=2.0,
        help="what gRPC takes in of the coordinator's stream before this process reads it (default 2): a fixed "
        "window bounds the memory a large task holds in gRPC's buffers, and caps the download at this window "
        "per round trip; 0: gRPC's own window, which grows with the link",
    )
    with_data(p, "each hosted client's")
    with_device(p, "the hosted clients'")
    p.add_argument(
        "--problem",
        action="append",
        metavar="MODULE:CLASS",
        help="a plugin problem this process agrees to load (built-in and entry-point problems always load)",
    )
    p.add_argument(
        "--attack",
        metavar="KIND[:VALUE]",
        help="research and tests: these clients lie about every answer (sign_flip, scale:FACTOR, gaussian:SIGMA, "
        "false_diverged), or train on swapped labels (label_flip; docs/robustness.md)",
    )
    # Set by `fedsaddle local` for a config's label_flip attack: the clients, among those hosted, that flip.
    p.add_argument("--label-flipped", help=argparse.SUPPRESS)
    # Set by `fedsaddle local` for the clients it starts: it compared the spec with all their data already.
    p.add_argument("--statistics-checked", action="store_true", help=argparse.SUPPRESS)
    tls_options(p)
    p.add_argument(
        "--monitor",
        type=address(True),
        metavar="HOST:PORT",
        help="serve this process's Prometheus metrics (tasks answered, compute time, bytes) at /metrics",
    )
    p.add_argument("--monitor-cert", help="the monitor's TLS certificate (PEM; needed off loopback)")
    p.add_argument("--monitor-key", help="its private key (PEM)")
    p.add_argument("--monitor-token-file", help="file holding the token a scraper must send (needed off loopback)")

    p = add_command(
        commands,
        "local",
        "a coordinator and client processes on 127.0.0.1 (default: the built-in config)",
        functools.partial(cmd_local, fork=fork),
    )
    with_config(p, "default: built-in")
    p.add_argument("--clients-per-process", type=positive_int, default=1, help="clients hosted by each process")
    p.add_argument("--quiet-clients", action="store_true", help="clients log warnings and errors only")
    with_data(p, "each client's")
    with_device(p, "the client processes'")
    with_resume(p)
    with_reference(p)
    with_monitor(p)
