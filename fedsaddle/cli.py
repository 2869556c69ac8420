"""fedsaddle: federated minimax (saddle-point) optimization over gRPC.

The command line is thin: it parses and checks arguments, then calls
fedsaddle.launch (processes), fedsaddle.server.coordinator (runs) and
fedsaddle.experiments (the paper's sweeps), and maps how they ended to an exit
code: 0 done, 1 the run failed, 2 bad usage or config, 130 interrupted.
Heavy modules are imported inside the commands, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsaddle import __version__
from fedsaddle.common import blas
from fedsaddle.common.indices import parse_indices

if TYPE_CHECKING:
    import grpc

    from fedsaddle.progress import Progress
    from fedsaddle.server.config import RunConfig
    from fedsaddle.server.coordinator import Outcome
    from fedsaddle.server.driver import AlgorithmResult
    from fedsaddle.server.pool import ClientPool

log = logging.getLogger("fedsaddle")
_LOADED = time.perf_counter()

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Arguments that cannot work together, or a file they name that cannot be read: exit 2."""


# The built-in run: the paper's problem at s = 10 with all five algorithms, read from the example file that
# documents every field (installed with the package as fedsaddle.examples, see pyproject.toml).
BUILT_IN_CONFIG = "paper-s10.yaml"


# -- argument types: checked values, errors that name them ----------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def number(low: float, inclusive: bool) -> Callable[[str], float]:
    """A finite number above `low` (or at least `low`, if `inclusive`)."""

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (value >= low if inclusive else value > low) or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if inclusive else '>'} {low:g}, got {text!r}"
            )
        return value

    return check


positive_float = number(0, inclusive=False)
non_negative_float = number(0, inclusive=True)


def window_mib(text: str) -> float:
    """A receive window in MiB: 0 (gRPC's own) or at least 1/16 (64 KiB), as transport.limits.receive_window_mib."""
    value = non_negative_float(text)
    if 0 < value < 0.0625:
        raise argparse.ArgumentTypeError(f"must be 0 (gRPC's own window) or at least 0.0625 (64 KiB), got {text!r}")
    if value > 1024:
        raise argparse.ArgumentTypeError(f"must be at most 1024, got {text!r}")
    return value


def address(allow_port_zero: bool) -> Callable[[str], str]:
    """HOST:PORT with a port in range ([host]:port for IPv6)."""

    def check(text: str) -> str:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {text!r}")
        low = 0 if allow_port_zero else 1
        if not port.isdigit() or not low <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"port must be a number from {low} to 65535, got {port!r} in {text!r}")
        return text

    return check


def indices(text: str) -> str:
    try:
        parse_indices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# -- commands -----------------------------------------------------------------------------


def built_in_config() -> RunConfig:
    """The run the commands make without --config: examples/paper-s10.yaml, as installed."""
    from importlib import resources

    from fedsaddle.server.config import load_config

    with resources.as_file(resources.files("fedsaddle.examples").joinpath(BUILT_IN_CONFIG)) as path:
        return load_config(path)


def _config(args: argparse.Namespace) -> RunConfig:
    from fedsaddle.server.config import load_config
    from fedsaddle.server.trackers import check as check_trackers

    config = load_config(args.config) if args.config else built_in_config()
    check_trackers(config)  # before a coordinator waits for its clients
    updates: dict[str, Any] = {}
    if getattr(args, "out", None):
        updates["output"] = config.output.model_copy(update={"dir": args.out})
    if getattr(args, "listen", None):
        updates["transport"] = config.transport.model_copy(update={"listen": args.listen})
    config = config.model_copy(update=updates) if updates else config
    return _with_monitor(config, args)


def _with_monitor(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The config, its monitor served on --monitor's address when given."""
    listen = getattr(args, "monitor", None)
    if not listen:
        return config
    from fedsaddle.server.config import MonitorSpec

    spec = (config.monitor or MonitorSpec()).model_copy(update={"listen": listen})
    return config.model_copy(update={"monitor": spec})


class _Watch:
    """The run's monitor (server/monitor), when its config asks for one: started before the federation is
    (a taken address is said at once), told of the pool, the steps and the outcome, closed with the command."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.monitor: Any = None

    def start(self, config: RunConfig) -> RunConfig:
        config = _with_monitor(config, self.args)
        if config.monitor is None or self.monitor is not None:
            return config
        from fedsaddle.common.monitoring import MonitorError
        from fedsaddle.server.monitor import Monitor

        try:
            self.monitor = Monitor(config, config.monitor)
        except MonitorError as exc:
            raise UsageError(str(exc)) from None
        print(
            f"monitor: dashboard at {self.monitor.url}, Prometheus metrics at {self.monitor.url}metrics",
            file=sys.stderr,
            flush=True,
        )
        return config

    def attach(self, pool: Any) -> None:
        if self.monitor is not None:
            self.monitor.attach(pool)

    def step(self, *hooks: Callable[..., None]) -> Callable[..., None]:
        """The driver's step hook: `hooks`, then the monitor's."""

        def step(run: Any, done: Any, pool: Any) -> None:
            for hook in hooks:
                hook(run, done, pool)
            if self.monitor is not None:
                self.monitor.on_step(run, done, pool)

        return step

    def finish(self, outcome: Outcome | None, config: RunConfig | None) -> None:
        if self.monitor is None:
            return
        if outcome is not None:
            self.monitor.finish(outcome)
        from fedsaddle.common.stop import Stopped

        linger = config.monitor.linger_s if config is not None and config.monitor is not None else 0.0
        signalled = outcome is not None and isinstance(outcome.cause, Stopped | KeyboardInterrupt)
        if outcome is not None and linger > 0 and not signalled:  # a last scrape sees the final counts
            time.sleep(linger)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def _device(args: argparse.Namespace) -> None:
    """This process's --device (and that of the client processes it starts); UsageError if this machine lacks it."""
    from fedsaddle.common import devices

    try:
        devices.choose(args.device)
    except devices.DeviceError as exc:
        raise UsageError(f"--device: {exc}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedsaddle.server.local_pool import LocalPool

    _device(args)
    _stop_on_sigterm()

    def local_pool(config: RunConfig) -> tuple[Any, dict[str, Any]]:
        pool = LocalPool(data=_data_paths(args.data, range(config.problem.num_clients)))
        return pool, pool.describe()

    if args.resume:
        return _resume(args, local_pool, _reference)
    if not args.config:
        raise UsageError("simulate needs --config (or --resume RUN_DIR)")
    config = _config(args)
    given = _given_reference(args, config)
    pool, transport = local_pool(config)
    if given is not None:
        return _run(config, pool, transport, given.z, accuracy=given.accuracy)
    return _run(config, pool, transport, _reference(config, pool))


def _given_reference(args: argparse.Namespace, config: RunConfig) -> Any:
    """--reference FILE: z* and its accuracy (server/reference.py), checked against the config's problem
    before any process starts; None without the option."""
    if not getattr(args, "reference", None):
        return None
    from fedsaddle.common.problems import make_problem
    from fedsaddle.server.reference import ReferenceError, load_reference

    problem = make_problem(config.problem)
    try:
        reference = load_reference(Path(args.reference), config.problem.name, problem.dimension)
    except ReferenceError as exc:
        raise UsageError(str(exc)) from None
    exact = "exact (no .json beside it)" if reference.accuracy == 0 else f"accurate to {reference.accuracy:.1e}"
    log.info("measuring against z* from %s, %s", reference.path, exact)
    return reference


def _reference(config: RunConfig, pool: Any) -> Any:
    """z* for an in-process run: on real data, solved from every client's data (all at hand here)."""
    from fedsaddle.common.problems import DataError
    from fedsaddle.server.local_pool import reference_solution

    try:
        with _naming_memory(config):
            return reference_solution(config, pool.cache)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def _serving(config: RunConfig, listen: str | None, watch: _Watch | None = None) -> Any:
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
    _stop_on_sigterm()
    served: list[tuple[RunConfig, str]] = []  # the config and the address it listened on (for --hold)
    watch = _Watch(args)

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
            config = _config(args)
            if config.attack is not None and config.attack.kind == "label_flip":
                raise UsageError(
                    "attack: label_flip swaps labels in the Byzantine clients' own data, which a coordinator does not "
                    "hold: start those clients with `fedsaddle client --attack label_flip` instead"
                )
            given = _given_reference(args, config)  # before the clients are waited for
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

    if _TERMINATED:
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
        while not _TERMINATED:
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
    watch: _Watch | None = None,
) -> int:
    """Go on with the run in args.resume (its config is the run directory's) on the pool `pool_for(config)`
    makes, with the transport description the summary records."""
    from fedsaddle.progress import Progress
    from fedsaddle.server.checkpoint import CheckpointError
    from fedsaddle.server.coordinator import resume_run

    if args.config:
        raise UsageError("--resume takes the config from the run directory; leave out --config")
    if args.out:
        raise UsageError("--resume goes on in the run directory it names; leave out --out")
    given = None
    saved_config = Path(args.resume) / "config.json"
    if getattr(args, "reference", None) and saved_config.is_file():  # (resume_run names a folder without one)
        from fedsaddle.server.config import load_config

        given = _given_reference(args, load_config(saved_config))
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
    token = _read_token(args.token_file)
    hosted = parse_indices(args.clients)
    try:
        attack = parse_own_attack(args.attack, hosted) if args.attack else None
    except ValueError as exc:
        raise UsageError(f"--attack: {exc}") from None
    flipped = set(label_flipped(attack)) | set(parse_indices(args.label_flipped) if args.label_flipped else ())
    data = _data_paths(args.data, hosted)
    if not args.statistics_checked:  # (`fedsaddle local` checked every file before starting its clients)
        _check_client_start(tuple(args.problem or ()), hosted, data)
    options = ClientOptions(
        args.coordinator,
        hosted,
        name=args.name or "",
        connect_timeout_s=args.connect_timeout,
        receive_window_mib=args.receive_window_mib,
        credentials=_channel_credentials(args),
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


def cmd_local(args: argparse.Namespace) -> int:
    """A coordinator in this process and client processes on loopback."""
    from fedsaddle.common.problems import make_problem
    from fedsaddle.common.worker import no_data_files
    from fedsaddle.launch import loopback_federation

    _device(args)
    _stop_on_sigterm()
    watch = _Watch(args)
    with contextlib.ExitStack() as stack:  # the federation's processes end with the command
        stack.callback(watch.close)

        def federation(config: RunConfig) -> tuple[Any, dict[str, Any]]:
            config = watch.start(config)
            if config.transport.tls or config.transport.credentials:
                raise UsageError(
                    "`fedsaddle local` runs plaintext on loopback; use coordinator and client for TLS or tokens"
                )
            data = _data_paths(args.data, range(config.problem.num_clients))
            if not data and not make_problem(config.problem).synthetic:  # said now, not after starting every process
                raise UsageError(no_data_files(config.problem.name, range(config.problem.num_clients)))
            loopback = loopback_federation(config, args.clients_per_process, args.quiet_clients, data=data, fork=main)
            pool, processes = stack.enter_context(loopback)
            watch.attach(pool)
            return pool, {"kind": "grpc", "address": pool.address, "client_processes": len(processes)}

        if args.resume:
            return _resume(args, federation, watch=watch)
        config = _config(args)
        given = _given_reference(args, config)  # before any process starts
        pool, transport = federation(config)
        if given is not None:
            return _run(config, pool, transport, given.z, timed=True, accuracy=given.accuracy, watch=watch)
        return _run(config, pool, transport, timed=True, watch=watch)


def cmd_experiment(args: argparse.Namespace) -> int:
    """The paper's Experiments section, its ablations, and gradient noise."""
    from fedsaddle.progress import Progress

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("experiments draw figures and need matplotlib: pip install 'fedsaddle[plot]'") from None
    _refuse_flags_not_taken(args)
    out = Path(args.out) if args.out else Path("runs") / f"experiment-{args.which}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = "fedsaddle " + " ".join(sys.argv[1:])
    progress = Progress(unit="run")
    started = time.perf_counter()
    try:
        if args.which == "noise":
            from fedsaddle.experiments.noise import run_noise

            run_noise(out, command)
            print(f"report: {out} (noise.md, figure_noise.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "dp":
            try:
                import dp_accounting  # noqa: F401
            except ImportError:
                raise UsageError("experiment dp needs dp-accounting: pip install 'fedsaddle[privacy]'") from None
            from fedsaddle.experiments.dp import EPSILONS, Setup, run_dp

            dp_seeds = tuple(range(args.seeds or 10))
            epsilons = tuple(args.epsilons or EPSILONS)
            setup = Setup(rounds=args.rounds or Setup().rounds)
            total = len(dp_seeds) * (len(epsilons) + 2)  # per seed: plain, clipping only, one per epsilon
            run_dp(out, command, dp_seeds, epsilons, setup, lambda done: progress.update("runs", done, total))
            print(f"report: {out / 'table.md'} (figure_dp.png, runs.csv; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "problems":
            from fedsaddle.experiments.problems import ALGORITHMS, CASES, STEP_FACTORS, run_problems

            total = len(CASES) * len(ALGORITHMS) * len(STEP_FACTORS)
            rounds = args.rounds or 1000
            run_problems(out, command, rounds, lambda done: progress.update("runs", done, total))
            print(f"report: {out / 'problems.md'} (figure_problems.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "agnostic":
            from fedsaddle import api
            from fedsaddle.experiments.agnostic import run_agnostic

            seeds = range(args.seeds or 10)
            grpc = args.transport == "grpc"
            run_agnostic(
                api.run,
                out,
                command,
                seeds,
                args.rounds or 2000,
                grpc,
                lambda n: progress.update("seeds", n, len(seeds)),
            )
            print(f"report: {out / 'agnostic.md'} (figure_agnostic.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "deep-auc":
            return _deep_auc(args, out, command, progress)
        if args.which == "robust-mlp":
            return _robust_mlp(args, out, command, progress)
        if args.which == "ablations":
            from fedsaddle.experiments.ablations import run_ablations, variant_count

            total = variant_count()
            run_ablations(out, command, progress=lambda done: progress.update("ablation variants", done, total))
            print(f"report: {out / 'ablations.md'} ({time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "compare":
            return _compare(args, out, command, progress)
        return _paper_experiment(args, out, command, progress)
    finally:
        progress.close()


# The flags each experiment takes (--out: all of them). The others run on setups of their own, documented
# in their reports, and a flag they would ignore is refused rather than silently dropped.
EXPERIMENT_FLAGS: dict[str, tuple[str, ...]] = {
    "paper": ("seeds", "s", "rounds", "convention", "tau", "init", "transport"),
    "ablations": (),
    "noise": (),
    "problems": ("rounds",),
    "agnostic": ("seeds", "rounds", "transport"),
    "dp": ("seeds", "rounds", "epsilons"),
    "deep-auc": ("seeds", "rounds", "libauc_python", "jobs"),
    "robust-mlp": ("seeds", "rounds", "jobs"),
    "compare": (
        "seeds",
        "s",
        "rounds",
        "convention",
        "tau",
        "algorithms",
        "problems",
        "eps",
        "grid",
        "ray",
        "config",
        "data",
        "reference",
    ),
}


COMPARE_FLAGS = ("algorithms", "problems", "eps", "grid", "ray", "config", "data", "reference")


def _refuse_flags_not_taken(args: argparse.Namespace) -> None:
    takes = EXPERIMENT_FLAGS.get(args.which)
    if takes is None:
        return
    given = [
        name
        for name in (
            "seeds",
            "s",
            "rounds",
            "epsilons",
            "convention",
            "tau",
            "init",
            "transport",
            "libauc_python",
            "jobs",
            *COMPARE_FLAGS,
        )
        if getattr(args, name, None) is not None and name not in takes
    ]
    if given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        allowed = ", ".join(f"--{name.replace('_', '-')}" for name in (*takes, "out"))
        raise UsageError(f"experiment {args.which} does not take {flags} (it takes {allowed})")


def _deep_auc(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("experiment deep-auc needs PyTorch: pip install 'fedsaddle[torch,data]'") from None
    if args.libauc_python is not None and not Path(args.libauc_python).is_file():
        raise UsageError(f"--libauc-python {args.libauc_python}: no such file (a Python that has libauc)")
    from fedsaddle import api
    from fedsaddle.experiments.deep_auc import run_deep_auc

    started = time.perf_counter()
    try:
        run_deep_auc(
            api.run,
            out,
            command,
            range(args.seeds or 10),
            args.rounds or 20,
            args.libauc_python,
            lambda done, total: progress.update("runs", done, total),
            jobs=args.jobs or 1,
        )
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    print(f"report: {out / 'deep_auc.md'} (runs.csv, figure_deep_auc.png; {time.perf_counter() - started:.1f} s)")
    return EXIT_OK


def _robust_mlp(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("experiment robust-mlp needs PyTorch: pip install 'fedsaddle[torch,data]'") from None
    from fedsaddle import api
    from fedsaddle.experiments.robust_mlp import run_robust_mlp

    started = time.perf_counter()
    run_robust_mlp(
        api.run,
        out,
        command,
        range(args.seeds or 10),
        args.rounds or 30,
        lambda done, total: progress.update("runs", done, total),
        jobs=args.jobs or 1,
    )
    print(f"report: {out / 'robust_mlp.md'} (runs.csv, figure_robust_mlp.png; {time.perf_counter() - started:.1f} s)")
    return EXIT_OK


def _own_problem(args: argparse.Namespace) -> Any:
    """--config (with --data and --reference): the config's problem as `experiment compare` runs it, with
    z* (its reference_solution from all clients' data, or --reference) and each algorithm's step as the
    config writes it (the grid's scale 1)."""
    from fedsaddle.common.problems import DataError, make_problem
    from fedsaddle.common.worker import ShardCache
    from fedsaddle.experiments.compare import STEP_FIELDS, OwnProblem
    from fedsaddle.server.config import load_config
    from fedsaddle.server.local_pool import reference_solution

    config = load_config(args.config)
    problem = make_problem(config.problem)
    data = _data_paths(args.data, range(config.problem.num_clients))
    if problem.synthetic and data:
        raise UsageError(f"--data: problem {config.problem.name} is synthetic; it generates its own data")
    reference, accuracy = None, 0.0
    if args.reference:
        given = _given_reference(args, config)
        reference, accuracy = tuple(given.z.tolist()), given.accuracy
    elif not problem.synthetic:
        if not data:
            raise UsageError(f"--data: problem {config.problem.name} reads each client's data file; name them")
        try:
            found = reference_solution(config, ShardCache(data=data))
        except DataError as exc:
            raise UsageError(str(exc)) from None
        if found is None:
            raise UsageError(
                f"problem {config.problem.name} computes no reference_solution(): give z* with --reference FILE.npy "
                "(fedsaddle check-problem --save-reference FILE.npy writes it)"
            )
        reference = tuple(found.tolist())
    bases: dict[str, float] = {}
    for spec in config.algorithms:
        fields = spec.model_dump()
        step = next((fields[name] for name in STEP_FIELDS if isinstance(fields.get(name), int | float)), None)
        if step is not None and spec.name not in bases:
            bases[spec.name] = float(step)
    entry = config.problem.model_dump(mode="json", exclude_none=True)
    extra = {"weighting": config.weighting, "gradient_noise": config.gradient_noise, "init": config.init}
    return OwnProblem(config.problem.name, entry, extra, data, reference, accuracy, bases)


def _compare(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    from fedsaddle.experiments import compare
    from fedsaddle.server.config import RoundConvention

    grids: dict[str, tuple[float, ...]] = {}
    for given in args.grid or ():
        name, _, values = given.partition("=")
        try:
            grids[name] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise UsageError(f"--grid {given}: expected NAME=SCALE,SCALE,... (numbers)") from None
    own = _own_problem(args) if args.config else None
    if own is None and (args.data or args.reference):
        raise UsageError("--data and --reference go with --config (the problem of your own config)")
    if own is not None and args.ray and own.data:
        raise UsageError("--ray places tasks on other nodes, which do not hold your data files: leave out --ray")
    algorithms = args.algorithms or (list(own.bases) if own is not None else None)
    problems = args.problems or ([] if own is not None else None)
    if own is not None and own.name in (problems or []):
        raise UsageError(f"--problems names {own.name}, the config's problem: leave it out (--config runs it)")
    try:
        setup = compare.Setup(
            algorithms=tuple(algorithms or compare.DEFAULT_ALGORITHMS),
            problems=(*(problems if problems is not None else compare.DEFAULT_PROBLEMS), *([own.name] if own else [])),
            own=own,
            s_values=tuple(args.s) if args.s else compare.DEFAULT_S,
            seeds=tuple(range(args.seeds or compare.DEFAULT_SEEDS)),
            rounds=args.rounds or compare.DEFAULT_ROUNDS,
            eps=args.eps or compare.DEFAULT_EPS,
            convention=RoundConvention(args.convention or "exchanges"),
            tau=args.tau or 20,
            grids=grids,
        )
    except compare.CompareError as exc:
        raise UsageError(str(exc)) from None
    where = f"the Ray cluster at {args.ray}" if args.ray else "local processes"
    print(f"{setup.size} runs in {len(setup.tasks())} tasks on {where}", file=sys.stderr)
    started = time.perf_counter()

    def count(done: int) -> None:
        progress.update("runs", done, setup.size)

    try:
        if args.ray:
            from fedsaddle.experiments.ray_tasks import run_on_ray

            results = run_on_ray(setup.tasks(), args.ray, count)
        else:
            results = compare.run_local(setup.tasks(), progress=count)
    except compare.CompareError as exc:
        raise UsageError(str(exc)) from None
    elapsed = time.perf_counter() - started
    nodes = sorted({r.node for r in results})
    compare.report(out, setup, results, command)
    (out / "placement.csv").write_text(compare.placement_csv(setup, results))
    print(f"{setup.size} runs in {elapsed:.1f} s on {len(nodes)} node(s)", file=sys.stderr)
    figures = ", ".join(f"figure_{problem}.png" for problem in setup.problems)
    print(f"report: {out / 'compare.md'} (runs.csv, summary.csv, placement.csv, {figures})")
    return EXIT_OK


def _paper_experiment(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    from fedsaddle.experiments.grid import STEP_SCALES, VARIANTS, Grid, run_grid, run_rows_on
    from fedsaddle.experiments.report import write_report
    from fedsaddle.server.config import RoundConvention

    grpc = args.transport == "grpc"
    default_s = (0.0, 5.0, 10.0) if grpc else tuple(float(s) for s in range(16))
    grid = Grid(
        s_values=tuple(args.s) if args.s else default_s,
        seeds=tuple(range(args.seeds if args.seeds else (1 if grpc else 5))),
        rounds=args.rounds or 500,
        convention=RoundConvention(args.convention or "exchanges"),
        tau=args.tau or 20,
        overrides={"init": args.init or "ones"},
        # Over gRPC every point runs again through client processes: the paper's own grid only.
        step_scales=STEP_SCALES if grpc else None,
        variants={} if grpc else VARIANTS,
    )
    print(
        f"{grid.size} runs: {len(grid.s_values)} values of s x {len(grid.seeds)} seeds x {len(grid.algorithms)} "
        "algorithms, each on its step grid",
        file=sys.stderr,
    )
    started = time.perf_counter()
    rows = run_grid(grid, progress=lambda done: progress.update("in-process sweep", done, grid.size))
    print(f"in-process sweep: {time.perf_counter() - started:.2f} s", file=sys.stderr)
    if not grpc:
        write_report(out, grid, rows, command)
        print(f"report: {out}  (runs.csv, figure1_curves.png, figure2_final_vs_s.png, table.md)")
        return EXIT_OK
    from fedsaddle.launch import loopback_federation

    first = grid.config(grid.algorithms[0], grid.s_values[0], grid.scales(grid.algorithms[0])[0], grid.seeds[0])
    with loopback_federation(first, 1, True) as (pool, _):
        remote = run_rows_on(
            pool, grid, [row.key for row in rows], lambda done: progress.update("over gRPC", done, len(rows))
        )
    same = sum(
        a.result.z_sha256 == b.result.z_sha256
        and [r["dist_x"] for r in a.result.records] == [r["dist_x"] for r in b.result.records]
        for a, b in zip(rows, remote, strict=True)
    )
    print(f"gRPC (10 client processes) vs in-process batch: {same}/{len(rows)} runs identical bit for bit")
    write_report(out, grid, remote, command)
    print(f"report: {out}")
    return EXIT_OK if same == len(rows) else EXIT_RUN_FAILED


def cmd_deploy_kubernetes(args: argparse.Namespace) -> int:
    """Write Kubernetes manifests for a federation, and the form of them that `podman kube play` runs."""
    import yaml

    from fedsaddle import kube
    from fedsaddle.server.config import read_yaml

    try:
        raw = read_yaml(Path(args.config).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read config {args.config}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"config {args.config} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"config {args.config} must be a mapping of fields, got {type(raw).__name__}")
    from fedsaddle.common.problems.registry import add_plugin_folder
    from fedsaddle.server.config import parse_config

    add_plugin_folder(Path(args.config).parent)  # a plug-in problem beside its config, as load_config does
    config = parse_config(raw, source=f"config {args.config}")
    clients = args.clients if args.clients is not None else config.problem.num_clients
    options = kube.Options(
        clients=clients,
        name=args.name,
        image=args.image,
        client_image=args.client_image,
        tls_dir=Path(args.tls_dir) if args.tls_dir else None,
        tokens=args.tokens,
        runs_size=args.runs_size,
        data_size=args.data_size,
    )
    try:
        manifests = kube.cluster(raw, options)
    except kube.ManifestError as exc:
        raise UsageError(str(exc)) from None
    written = kube.write(manifests, Path(args.out))
    kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in manifests.objects)
    print(f"{written[0]}: {kinds}")
    print(f"{Path(args.out) / 'podman'}: the same federation for `podman kube play` (docs/how-to/kubernetes.md)")
    names = kube.names(args.name)
    print(f"then: kubectl apply -f {written[0]}; the run directory is on the claim {names['runs']}")
    if manifests.config.transport.rejoin_timeout_s == 0:
        print(
            "note: transport.rejoin_timeout_s is 0, so a client pod that is deleted or restarted fails the run; "
            "set it (e.g. 60) for the pod to rejoin",
            file=sys.stderr,
        )
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """Ask a coordinator's standard health service; exit 0 when it is serving."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = _channel_credentials(args)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    if credentials is not None:
        channel = grpc.secure_channel(args.address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}{_health_hint(args, exc)}", file=sys.stderr)
            return EXIT_RUN_FAILED
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_RUN_FAILED


def _health_hint(args: argparse.Namespace, error: Any) -> str:
    """What to give when a closed connection comes from TLS: the port's answer to a TLS hello shows it
    (client/probe.py), as the client does."""
    import grpc

    from fedsaddle.client.probe import TlsFiles, probe

    text = (error.details() or "").lower()
    if error.code() != grpc.StatusCode.UNAVAILABLE or "refused" in text:
        return ""
    verdict = probe(args.address, TlsFiles(args.ca, args.cert, args.key) if args.ca else None)
    if not args.ca:
        return " (it serves TLS: give --ca)" if verdict.speaks_tls else ""
    if verdict.refused_the_client and not args.cert:
        return " (a mutual-TLS coordinator also needs --cert and --key)"
    if verdict.refused_the_client:
        return " (it does not accept this certificate: is it signed by the coordinator's client CA?)"
    return ""


def cmd_new_token(args: argparse.Namespace) -> int:
    """Print a fresh token for a client identity, and the line for the credentials file."""
    import secrets

    from fedsaddle.server.transport.auth import token_hash

    token = secrets.token_urlsafe(32)
    print(f"# give this token to {args.name} (e.g. in a file for --token-file):\n{token}\n")
    print("# and add this to the coordinator's credentials file, under `identities:`")
    spec = ",".join(str(i) for i in parse_indices(args.clients))
    print(f"  {args.name}:\n    indices: [{spec}]\n    token_sha256: {token_hash(token)}")
    return EXIT_OK


def cmd_data_split(args: argparse.Namespace) -> int:
    """Split a table (CSV, Parquet) or a bundled dataset into one data file per client, summarize each
    client's share, print the public statistics of each problem's spec, and write them into a config."""
    from fedsaddle.experiments.datasets import (
        DATASETS,
        Table,
        binned,
        by_dataset_column,
        describe,
        load_dataset,
        load_image_table,
        load_table,
        problem_entry,
        split,
        write_config,
    )
    from fedsaddle.experiments.images import ImageError, is_image_source
    from fedsaddle.experiments.tables import TableError, TableSpec

    source = args.file or args.dataset
    if source is None:
        raise UsageError(
            "data split needs a table (FILE, a .csv or .parquet), images (FILE, a .npy, .npz or a folder of class "
            f"subfolders) or --dataset {{{','.join(DATASETS)}}}"
        )
    if args.file and args.dataset:
        raise UsageError("give the table as FILE or as --dataset, not both")
    bundled = source in DATASETS
    images = not bundled and is_image_source(source)
    table_options = (args.target, args.features, args.group, args.positive, args.task)
    bins = _bins(args)
    if args.labels is not None and not images:
        raise UsageError("--labels gives the labels of images in a .npy file")
    try:
        if images:
            if any(option is not None for option in (args.target, args.features, args.group, args.by, args.task)):
                raise UsageError(
                    f"{source} holds images: their classes are the labels; --target, --features, --group, --by and "
                    "--task are for a table (--positive CLASS makes one class against the rest)"
                )
            dataset: str | Table = load_image_table(source, args.labels, args.positive)
        elif bundled:
            if any(option is not None for option in table_options):
                raise UsageError(
                    f"{source} is a bundled dataset with its own columns; "
                    "--target, --features, --group, --positive and --task are for your own table"
                )
            dataset = source
            if args.by is not None and args.partition == "by-column":  # one of its own columns
                dataset = by_dataset_column(load_dataset(source), args.by)
        else:
            if Path(source).suffix.lower() not in (".csv", ".parquet", ".pq") and not Path(source).exists():
                raise UsageError(
                    f"{source!r} is neither a bundled dataset {list(DATASETS)} nor a .csv or .parquet file"
                )
            if args.target is None:
                raise UsageError(f"{source}: name the target column with --target")
            features = tuple(f.strip() for f in args.features.split(",") if f.strip()) if args.features else ()
            spec = TableSpec(args.target, features, args.group, args.by, args.task, args.positive)
            dataset = load_table(source, spec)
        if args.partition == "by-column" and images:
            raise UsageError("images have no site column; by-column is for a table (--by)")
        if args.by is not None and args.partition != "by-column":
            raise UsageError("--by names the site column of --partition by-column")
        if args.partition == "by-column" and args.by is None:
            raise UsageError(
                "--partition by-column needs --by COLUMN (the column whose values, or bins, are the sites)"
            )
        if bins is not None:
            if args.partition != "by-column":
                raise UsageError("--bins and --quantiles cut the --by column of --partition by-column")
            assert isinstance(dataset, Table)
            dataset = binned(dataset, args.by, *bins)
        if args.partition != "by-column" and args.clients is None:
            raise UsageError(f"the {args.partition} partition needs --clients N")
        out = Path(args.out)
        summary = split(dataset, args.clients, args.partition, args.seed, out, args.test_fraction, args.alpha)
        print(describe(summary))
        print(f"wrote {out / 'client-000.npz'} ... client-{summary['clients'] - 1:03d}.npz, test.npz, summary.json")
        if args.config:
            entry = problem_entry(summary, args.problem)
            name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in Path(source).stem) or "federation"
            print(write_config(Path(args.config), entry, name))
        elif args.problem:
            problem_entry(summary, args.problem)  # (refuses a problem that does not fit)
    except (TableError, ImageError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def _bins(args: argparse.Namespace) -> tuple[list[float] | None, int | None] | None:
    """--bins EDGES or --quantiles Q, as binned() takes them; None without either."""
    if args.bins is not None and args.quantiles is not None:
        raise UsageError("give --bins EDGES or --quantiles Q, not both")
    if args.quantiles is not None:
        return None, args.quantiles
    if args.bins is None:
        return None
    try:
        return [float(edge) for edge in args.bins.split(",") if edge.strip()], None
    except ValueError:
        raise UsageError(f"--bins: edges must be numbers separated by commas, got {args.bins!r}") from None


def cmd_data_inspect(args: argparse.Namespace) -> int:
    """Describe a client's data file: rows, features, labels, groups, and what each problem makes of it."""
    from fedsaddle.experiments.inspect import inspect_file

    try:
        print(inspect_file(args.file))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_new(args: argparse.Namespace) -> int:
    """Write a package to start a problem of one's own from, with a test that passes."""
    from fedsaddle.scaffold import ScaffoldError, new_problem

    if args.kind == "algorithm":
        raise UsageError(
            "`fedsaddle new` writes problem packages only; an algorithm plug-in starts from the package "
            "examples/algorithm-plugin in fedsaddle's repository (docs: how-to/own-algorithm.md)"
        )
    out = Path(args.out or args.name)
    try:
        written = new_problem(args.name, out, torch=args.torch)
    except ScaffoldError as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {out} && pytest   (then edit src/{args.name}/problem.py; README.md says what to change)")
    return EXIT_OK


def cmd_compare_runs(args: argparse.Namespace) -> int:
    from fedsaddle.compare import RunDirError, main_compare

    try:
        code, lines = main_compare(args.first, args.second, args.limit)
    except RunDirError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines))
    return code


def cmd_check_problem(args: argparse.Namespace) -> int:
    from fedsaddle.check import check_problem, distances
    from fedsaddle.common.problems import DataError, ProblemError, make_problem

    config = _config(args)
    paths = _data_paths(args.data, range(config.problem.num_clients))
    for run_dir in args.run_dir or []:
        if not (Path(run_dir) / "summary.json").is_file():
            raise UsageError(f"--run-dir {run_dir}: no summary.json there (not the run directory of a finished run)")
    try:
        report = check_problem(config, paths, args.points, args.pairs, args.seed, args.seconds)
    except (DataError, ProblemError) as exc:
        print(f"FAILED loading: {exc}")
        return EXIT_RUN_FAILED
    print("\n".join(report.lines))
    if report.failure is not None:
        return EXIT_RUN_FAILED
    assert report.z_star is not None
    if args.save_reference:
        from fedsaddle.server.reference import ReferenceError, save_reference

        found = report.z_star
        try:
            written, note = save_reference(
                Path(args.save_reference), found.z, found.accuracy, found.residual, found.method, config.problem.name
            )
        except ReferenceError as exc:
            raise UsageError(str(exc)) from None
        print(f"z* written to {written}, its accuracy to {note} (simulate/local/coordinator --reference {written})")
    dim_x, _ = make_problem(config.problem).dims()
    for run_dir in args.run_dir or []:
        print("\n".join(distances(report, Path(run_dir), dim_x)))
    return EXIT_OK


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(_config(args).model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


# -- running a config and what its ending means ---------------------------------------------


def _run(
    config: RunConfig,
    pool: ClientPool,
    transport: dict[str, Any],
    reference: Any = None,
    timed: bool = False,
    accuracy: float = 0.0,
    watch: _Watch | None = None,
) -> int:
    """Run a config; `timed`: say how long after the command the first round was done; `accuracy`:
    the reference's (distances finer than it are shown as below it); `watch`: its monitor."""
    from fedsaddle.progress import Progress
    from fedsaddle.server.coordinator import run_config

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
        _say_interrupted(" (outputs written)")
        return EXIT_INTERRUPTED
    log.error("run failed: %s", outcome.failure)
    return EXIT_RUN_FAILED


_INTERRUPTED: list[bool] = []  # one entry per interrupt the command stopped for


def _say_interrupted(what: str = "") -> None:
    _INTERRUPTED.append(True)
    # The command stops for this interrupt: one more (a lost one sent again, a second Ctrl-C) must not
    # end the process by the signal while it says so and exits 130.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"fedsaddle: interrupted{what}", file=sys.stderr)


def _wraps_an_interrupt(exc: BaseException) -> bool:
    """A Ctrl-C that a library turned into an error of its own (pydantic's serializer, which runs the
    signal's handler inside its Rust code, reports 'Error serializing to JSON: KeyboardInterrupt')."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt) or str(seen).rstrip(": ").endswith("KeyboardInterrupt"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _interrupts_not_lost(
    hook: Callable[[sys.UnraisableHookArgs], object],
) -> Callable[[sys.UnraisableHookArgs], object]:
    """sys.unraisablehook that delivers a lost Ctrl-C again. Python runs a signal's handler wherever the
    main thread is, a finalizer or a weak reference's callback included (the garbage collector's); there
    the handler's KeyboardInterrupt is 'ignored', with a traceback, and the interrupt is lost. So it is
    sent again, from another thread, to be handled where it can stop the command."""

    def unraisable(what: sys.UnraisableHookArgs) -> None:
        if what.exc_type is not None and issubclass(what.exc_type, KeyboardInterrupt):
            said = len(_INTERRUPTED)
            if said:  # the command has stopped for an interrupt already
                return

            def again() -> None:
                if len(_INTERRUPTED) == said:  # (not if the command has stopped for one meanwhile)
                    os.kill(os.getpid(), signal.SIGINT)

            resend = threading.Timer(0.01, again)
            resend.daemon = True
            resend.start()
            return
        hook(what)

    return unraisable


def _since_start() -> float:
    """Seconds since this process started (the kernel's start time; else since this module loaded)."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _LOADED


_TERMINATED: list[bool] = []  # an entry once SIGTERM has come (`--hold` then does not hold)


def _stop_on_sigterm() -> None:
    from fedsaddle.common.stop import Stopped

    def stop(signum: int, frame: object) -> None:
        _TERMINATED.append(True)
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


def _data_paths(given: list[str] | None, hosted: Sequence[int]) -> dict[int, str]:
    from fedsaddle.common.problems.data import data_paths

    try:
        return data_paths(given, hosted)
    except ValueError as exc:
        raise UsageError(f"--data: {exc}") from None


def _read_token(path: str | None) -> str:
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read token file {path}: {exc.strerror}") from None
    return os.environ.get("FEDSADDLE_TOKEN", "").strip()


def _channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --ca (and --cert/--key for mutual TLS), or None for plaintext."""
    import grpc

    if not args.ca:
        if args.cert or args.key:
            raise UsageError("--cert and --key need --ca (they are for mutual TLS)")
        return None
    if bool(args.cert) != bool(args.key):
        raise UsageError("--cert and --key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.ca), private_key=read(args.key), certificate_chain=read(args.cert)
    )


# -- the parser -------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, and keeps descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # An option without a default (None), or whose help says what it defaults to, gets no
        # second "(default: None)".
        if action.default is None or "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Lines break at spaces only: a command or option name (deep-auc, --save-every) stays whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    # On the top-level parser these have defaults; on subcommands SUPPRESS keeps a flag
    # given before the subcommand from being reset by the subcommand's parser.
    default: Any = False if top else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log debug details")
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help="log warnings and errors only")


def _tls_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", help="CA certificate (PEM) that signed the coordinator's; turns TLS on")
    p.add_argument("--cert", help="this side's certificate (PEM), for mutual TLS")
    p.add_argument("--key", help="this side's private key (PEM), for mutual TLS")
    p.add_argument("--server-name", help="name to expect in the coordinator's certificate (default: the host)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedsaddle",
        description="Federated minimax (saddle-point) optimization over gRPC: the five algorithms of "
        "'Efficient Algorithms for Federated Saddle Point Optimization', newer baselines and plug-ins.",
        epilog="Run `fedsaddle COMMAND --help` for a command's options. Exit codes: 0 done, 1 the run failed, "
        "2 bad usage or config, 130 interrupted.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fedsaddle {__version__}")
    _global_flags(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    def command(name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        _global_flags(p, top=False)
        p.set_defaults(func=func)
        return p

    def with_config(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--config", help=f"run config, YAML or JSON ({default})")
        p.add_argument("--out", help="folder for run directories (overrides output.dir)")

    def with_data(p: argparse.ArgumentParser, whose: str) -> None:
        p.add_argument(
            "--data",
            action="append",
            metavar="PATH",
            help=f"{whose} own data file (.npz or .csv): once per client in index order, or one pattern "
            "with {i}, e.g. data/client-{i:03d}.npz (problems on real data; synthetic ones need none)",
        )

    def with_device(p: argparse.ArgumentParser, whose: str) -> None:
        p.add_argument(
            "--device",
            metavar="DEVICE",
            help=f"where {whose} PyTorch problems compute: cpu, cuda or cuda:K (default: $FEDSADDLE_DEVICE, else "
            "cpu; numpy problems ignore it)",
        )

    def with_resume(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="go on with a run that was stopped, from its last checkpoint (the config is the run directory's)",
        )

    def with_reference(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--reference",
            metavar="FILE.npy",
            help="z* to measure distances against (check-problem --save-reference writes it, with its accuracy "
            "in FILE.json beside it: distances finer than that are shown as below it; no .json: exact)",
        )

    p = command("simulate", "run a config in one process (the in-process transport)", cmd_simulate)
    with_config(p, "required, unless --resume")
    with_data(p, "each client's")
    with_device(p, "this process's")
    with_resume(p)
    with_reference(p)

    def with_monitor(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--monitor",
            type=address(True),
            metavar="HOST:PORT",
            help="serve Prometheus metrics at /metrics and a live dashboard at / on this address (overrides "
            "monitor.listen; another host than 127.0.0.1 needs monitor.tls and monitor.token_file)",
        )

    p = command("coordinator", "serve a config to client processes over gRPC", cmd_coordinator)
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

    p = command("client", "host clients' data and run their local steps", cmd_client)
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
    _tls_options(p)
    p.add_argument(
        "--monitor",
        type=address(True),
        metavar="HOST:PORT",
        help="serve this process's Prometheus metrics (tasks answered, compute time, bytes) at /metrics",
    )
    p.add_argument("--monitor-cert", help="the monitor's TLS certificate (PEM; needed off loopback)")
    p.add_argument("--monitor-key", help="its private key (PEM)")
    p.add_argument("--monitor-token-file", help="file holding the token a scraper must send (needed off loopback)")

    p = command("local", "a coordinator and client processes on 127.0.0.1 (default: the built-in config)", cmd_local)
    with_config(p, "default: built-in")
    p.add_argument("--clients-per-process", type=positive_int, default=1, help="clients hosted by each process")
    p.add_argument("--quiet-clients", action="store_true", help="clients log warnings and errors only")
    with_data(p, "each client's")
    with_device(p, "the client processes'")
    with_resume(p)
    with_reference(p)
    with_monitor(p)

    p = command("experiment", "reproduce the paper's experiments (figures, tables, CSV)", cmd_experiment)
    p.add_argument(
        "which",
        choices=["paper", "ablations", "noise", "problems", "agnostic", "dp", "deep-auc", "robust-mlp", "compare"],
        help="the paper's sweep, ablations of its open choices, stochastic gradients, the real problems, "
        "agnostic federated learning on breast_cancer, differential privacy (held-out AUC against epsilon), "
        "federated deep AUC maximization with a CNN on digits, group-robust training of an MLP (both PyTorch), "
        "or a comparison of chosen algorithms on chosen problems (docs/how-to/compare.md)",
    )
    p.add_argument(
        "--seeds",
        type=positive_int,
        help="seeds per setting (default 5, or 1 with --transport grpc; the docs use 20; 10 for dp, agnostic, "
        "deep-auc and robust-mlp; 3 for compare)",
    )
    p.add_argument(
        "--s",
        type=non_negative_float,
        nargs="+",
        help="values of s (default 0..15; 0 5 10 with --transport grpc; 1 10 for compare)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        help="communication budget per run (default 500; 1000 for problems; 20 for dp; 2000 for agnostic; 20 for "
        "deep-auc; 30 for robust-mlp; 300 for compare)",
    )
    p.add_argument(
        "--epsilons", type=positive_float, nargs="+", help="dp: target epsilons (default 0.5 1 2 4 8; delta 1e-5)"
    )
    # The names of RoundConvention's members (server/config.py is not imported until a command needs it).
    p.add_argument(
        "--convention", choices=["exchanges", "paper"], help="paper, compare: what a round is (default exchanges)"
    )
    p.add_argument("--tau", type=positive_int, help="paper, compare: local steps per sync (default 20)")
    p.add_argument("--init", choices=["ones", "zeros", "random"], help="paper: starting point z0 (default ones)")
    p.add_argument(
        "--transport",
        choices=["inprocess", "grpc"],
        help="paper, agnostic: inprocess (default), or grpc: also run the points over 10 client processes and "
        "check them bit for bit",
    )
    p.add_argument(
        "--algorithms",
        nargs="+",
        metavar="NAME",
        help="compare: algorithms as a config names them (default: the paper's five)",
    )
    p.add_argument(
        "--problems",
        nargs="+",
        metavar="NAME",
        help="compare: paper, linear_regression, auc, fair_logistic, or an installed synthetic problem "
        "(default: paper linear_regression)",
    )
    p.add_argument("--eps", type=positive_float, help="compare: the accuracy for rounds to eps (default 1e-6)")
    p.add_argument(
        "--grid",
        action="append",
        metavar="NAME=SCALE,...",
        help="compare: an algorithm's own step scales (times the problem's base step); repeatable",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="compare: also the problem of this config (a plug-in, or one on data files with --data), each "
        "algorithm's step in it as the grid's scale 1; its algorithms are the default --algorithms",
    )
    with_data(p, "compare --config: each client's")
    p.add_argument(
        "--reference",
        metavar="FILE.npy",
        help="compare --config: z* of the config's problem (default: its reference_solution from all the data)",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="compare: run the tasks on the Ray cluster whose head is at HOST:PORT ('local': a one-node Ray)",
    )
    p.add_argument(
        "--libauc-python",
        metavar="PATH",
        help="deep-auc: a Python with libauc, torch and fedsaddle, for the centralized LibAUC baseline",
    )
    p.add_argument(
        "--jobs", type=positive_int, help="deep-auc, robust-mlp: runs at once, each in a process of its own (default 1)"
    )
    p.add_argument("--out", help="report folder (default: runs/experiment-WHICH-TIME)")

    p = command("health", "check a coordinator's gRPC health service (exit 0 if serving)", cmd_health)
    p.add_argument("--address", type=address(False), default="127.0.0.1:50051", help="HOST:PORT of the coordinator")
    p.add_argument("--service", default="", help="service to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the answer")
    _tls_options(p)

    deploy = commands.add_parser(
        "deploy",
        help="write manifests that run a federation on a cluster",
        description="write manifests that run a federation on a cluster",
        formatter_class=_HelpFormatter,
    )
    _global_flags(deploy, top=False)
    deploy_commands = deploy.add_subparsers(dest="deploy_command", required=True, metavar="TARGET", title="targets")
    p = deploy_commands.add_parser(
        "kubernetes",
        help="Kubernetes manifests (and the form podman kube play runs) for a config and its clients",
        description="Write OUT/kubernetes.yaml: the config as a ConfigMap, the coordinator as a Deployment with a "
        "Service (probes: the gRPC health service), its run directories on a PersistentVolumeClaim, the clients "
        "as a StatefulSet whose pod ordinal is the client index, each pod with a data volume of its own, and TLS "
        "files and tokens as Secrets. OUT/podman/ holds the same federation in the form `podman kube play` "
        "(4.3) takes: Pods and PersistentVolumeClaims, and ConfigMaps for --configmap.",
        epilog="example:\n  fedsaddle deploy kubernetes --config run.yaml --clients 10 --tls-dir certs --tokens "
        "--out k8s/\n  kubectl apply -f k8s/kubernetes.yaml",
        formatter_class=_HelpFormatter,
    )
    _global_flags(p, top=False)
    p.set_defaults(func=cmd_deploy_kubernetes)
    p.add_argument("--config", required=True, help="run config, YAML or JSON")
    p.add_argument(
        "--clients", type=int, help="client pods, one per index: the config's problem.num_clients (the default)"
    )
    p.add_argument("--out", required=True, help="folder for the manifests")
    p.add_argument("--name", default="fedsaddle", help="prefix of every object's name")
    p.add_argument("--image", default="fedsaddle:latest", help="the coordinator's image")
    p.add_argument("--client-image", default="fedsaddle-client:latest", help="the clients' image")
    p.add_argument(
        "--tls-dir",
        metavar="DIR",
        help="ca.pem, coordinator.pem, coordinator.key (scripts/dev-certs.sh): the coordinator serves TLS, the "
        "clients check it with ca.pem; its certificate must name the Service, NAME-coordinator",
    )
    p.add_argument(
        "--tokens",
        action="store_true",
        help="a fresh token per client index, in a Secret, and the coordinator's credentials file of their hashes",
    )
    p.add_argument("--runs-size", default="1Gi", help="storage requested for the run directories")
    p.add_argument("--data-size", default="1Gi", help="storage requested for each client's data volume")

    p = command("new-token", "make a token for a client identity", cmd_new_token)
    p.add_argument("--name", required=True, help="the identity's name (e.g. site-a)")
    p.add_argument("--clients", required=True, type=indices, help="indices it may speak for: 3, 0,2,5 or 0-4")

    data = commands.add_parser(
        "data",
        help="prepare client data files",
        description="prepare client data files",
        formatter_class=_HelpFormatter,
    )
    _global_flags(data, top=False)
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION", title="actions")
    p = data_commands.add_parser(
        "split",
        help="split a table (CSV, Parquet), images or a bundled dataset into one file per client",
        description="Split a table of your own (.csv, or .parquet with the data extra), images of your own (a .npy "
        "of N x C x H x W with --labels, a .npz of images and labels, or a folder of one subfolder of PNG or .npy "
        "images per class) or a dataset bundled with scikit-learn into one .npz file per client (plus held-out "
        "rows), print each client's share and the public statistics each problem's spec needs, and optionally "
        "write them into a config.",
        epilog="examples:\n"
        "  fedsaddle data split patients.csv --target outcome --partition label-skew --clients 3 --out data/\n"
        "  fedsaddle data split patients.parquet --target outcome --partition by-column --by hospital --out data/\n"
        "  fedsaddle data split --dataset breast_cancer --clients 10 --out data/ --config run.yaml\n"
        "  fedsaddle data split scans.npy --labels labels.npy --partition label-skew --clients 10 --out data/\n"
        "  fedsaddle data split digits/ --positive 7 --clients 10 --out data/   # digits/0/*.png ... digits/9/*.png",
        formatter_class=_HelpFormatter,
    )
    _global_flags(p, top=False)
    p.set_defaults(func=cmd_data_split)
    p.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help="your table: .csv (a header line) or .parquet; or images: .npy, .npz (images and labels) or a folder "
        "with a subfolder of images per class",
    )
    p.add_argument("--labels", metavar="FILE", help="images in a .npy: their labels, a .npy of one per image")
    p.add_argument(
        "--dataset", metavar="NAME", help="a bundled dataset instead: diabetes, diabetes_fair, breast_cancer"
    )
    p.add_argument("--target", metavar="COLUMN", help="the column to predict (two values: classes 0 and 1)")
    p.add_argument(
        "--features", metavar="A,B,...", help="feature columns, in this order (default: every other numeric column)"
    )
    p.add_argument("--group", metavar="COLUMN", help="a sensitive attribute of two values (for fair_logistic)")
    p.add_argument(
        "--positive",
        metavar="VALUE",
        help="the target value that is class 1 (default: the larger one); images: the class (label or subfolder) "
        "against the rest",
    )
    p.add_argument("--task", choices=["classification", "regression"], help="default: two target values are classes")
    p.add_argument(
        "--partition",
        choices=["iid", "label-skew", "by-column"],
        default="iid",
        help="how rows are dealt: equal shares, Dirichlet label skew, or one client per value of --by",
    )
    p.add_argument(
        "--by",
        metavar="COLUMN",
        help="the site column of --partition by-column: one client per value (or per bin, with --bins or "
        "--quantiles); a column of your table, or of a bundled dataset's features; it is left out of the features",
    )
    p.add_argument(
        "--bins",
        metavar="E1,E2,...",
        help="cut the numeric --by column at these increasing edges, in the column's units as the data holds "
        "them: k edges make k + 1 clients, (-inf, E1), [E1, E2), ..., [Ek, inf)",
    )
    p.add_argument(
        "--quantiles",
        type=positive_int,
        metavar="Q",
        help="cut the numeric --by column into Q bins of about equal row counts (one client each)",
    )
    p.add_argument("--clients", type=positive_int, help="number of clients (files); by-column: the number of sites")
    p.add_argument("--alpha", type=positive_float, default=0.5, help="Dirichlet concentration of label-skew")
    p.add_argument("--test-fraction", type=positive_float, default=0.2, help="share of rows held out for evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of the split")
    p.add_argument("--out", required=True, help="folder for the client files")
    p.add_argument(
        "--problem",
        choices=["auc", "fair_logistic", "linear_regression"],
        help="the problem of --config (default: auc for classes, fair_logistic with --group, else linear_regression)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="write the problem and its statistics into this config (a new file gets a starter config)",
    )

    p = data_commands.add_parser(
        "inspect",
        help="describe a client's data file",
        description="Describe a client's data file (.npz or .csv): rows, held-out rows, features, labels, groups, "
        "and the statistics each problem's spec would take from it.",
        formatter_class=_HelpFormatter,
    )
    _global_flags(p, top=False)
    p.set_defaults(func=cmd_data_inspect)
    p.add_argument("file", metavar="FILE", help="a client's data file")

    p = command("new", "start a package for a problem of your own, with a passing test", cmd_new)
    p.add_argument(
        "kind", choices=["problem", "algorithm"], help="what to start (an algorithm: see examples/algorithm-plugin)"
    )
    p.add_argument("name", help="its name, a Python module name (e.g. robust_regression)")
    p.add_argument("--out", help="folder to write (default: ./NAME; must not exist or be empty)")
    p.add_argument(
        "--torch", action="store_true", help="a problem written in PyTorch (an MLP; needs the torch extra to run)"
    )

    p = command(
        "compare-runs",
        "compare two run directories: exit 0 if they computed the same (hashes, final iterates, counts, metrics), "
        "1 if not; wall-clock times, wire bytes and where outputs went are ignored",
        cmd_compare_runs,
    )
    p.add_argument("first", metavar="RUN_DIR", help="a run directory (holds summary.json)")
    p.add_argument("second", metavar="OTHER_RUN_DIR", help="the run directory to compare it with")
    p.add_argument("--limit", type=positive_int, default=20, help="differences to print at most")

    p = command(
        "check-problem",
        "check a problem (a plug-in, on its data files) before federating it: gradient against finite differences "
        "of the objective, monotonicity of G, and its saddle point z* (reference_solution, or numerical); "
        "exit 0 if every check passes, 1 naming the first that fails",
        cmd_check_problem,
    )
    p.add_argument("--config", help="run config naming the problem (default: the built-in one)")
    with_data(p, "each client's")
    p.add_argument("--points", type=positive_int, default=3, help="random points for the gradient check")
    p.add_argument("--pairs", type=positive_int, default=20, help="random pairs for the monotonicity check")
    p.add_argument("--seed", type=int, default=0, help="seed of the random points")
    p.add_argument("--seconds", type=positive_float, default=60.0, help="time allowed for a numerical z*")
    p.add_argument(
        "--save-reference",
        metavar="FILE.npy",
        help="write z* to FILE.npy and its accuracy to FILE.json beside it (what --reference reads)",
    )
    p.add_argument(
        "--run-dir",
        action="append",
        metavar="RUN_DIR",
        help="print each final iterate's distance to z* (never finer than z*'s accuracy); repeatable",
    )

    p = command("show-config", "print a config with every default filled in", cmd_show_config)
    p.add_argument("--config", help="config file (default: the built-in one)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (Ctrl-C outside a command's own handling: parsing, loading modules)
        _say_interrupted()
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    blas.set_environment()  # before numpy loads (common/blas.py)
    sys.unraisablehook = _interrupts_not_lost(sys.unraisablehook)
    args = build_parser().parse_args(argv)
    # gRPC's C core writes INFO lines of its own (a peer's failed TLS handshake, a GOAWAY) to stderr, in
    # its own format: shown with -v only (an operator's GRPC_VERBOSITY still wins). Read when grpc loads.
    if not args.verbose:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(
        level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr, force=True
    )
    for library in ("matplotlib", "PIL"):  # -v is fedsaddle's debug details, not a font search's hundred lines
        logging.getLogger(library).setLevel(max(level, logging.INFO))
    from fedsaddle.common.eventloop import EventLoopChoiceError
    from fedsaddle.common.stop import Stopped
    from fedsaddle.server.config import ConfigError

    try:
        code: int = args.func(args)
    except (ConfigError, UsageError, EventLoopChoiceError) as exc:
        print(f"fedsaddle: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Stopped:
        print("fedsaddle: stopped by SIGTERM", file=sys.stderr)
        return EXIT_OK
    except KeyboardInterrupt:
        _say_interrupted()
        return EXIT_INTERRUPTED
    except Exception as exc:  # a failure not foreseen: say what, not a traceback
        if _wraps_an_interrupt(exc):
            _say_interrupted()
            return EXIT_INTERRUPTED
        if os.environ.get("FEDSADDLE_TRACEBACK"):
            raise
        from fedsaddle.server.pool import PoolError

        what = str(exc) or type(exc).__name__  # (a MemoryError says nothing else)
        print(f"fedsaddle: {'run failed' if isinstance(exc, PoolError) else 'error'}: {what}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
