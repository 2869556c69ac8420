"""The `fedsaddle` command: simulate, coordinator, client, local."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fedsaddle.common.config import ConfigError, RunConfig, load_config, parse_config, parse_indices

log = logging.getLogger("fedsaddle")

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2


class Stopped(Exception):
    """SIGTERM: finish cleanly (outputs written, clients told goodbye)."""


DEFAULT_CONFIG: dict[str, Any] = {
    "name": "paper-s10",
    "seed": 0,
    "problem": {"name": "paper_regression", "num_clients": 10, "dim": 10, "lam": 1e-5, "s": 10.0},
    "sync": {"kind": "fixed", "tau": 20},
    "rounds": 500,
    # The best of the paper's step grid {0.1, 0.05, 0.01} / max(s, 1) at s = 10, for every algorithm.
    "algorithms": [
        {"name": "minibatch_md", "gamma": 0.01},
        {"name": "mirror_prox", "gamma": 0.01},
        {"name": "fedavg_s", "gamma_local": 0.01, "decay": "inverse_sqrt"},
        {"name": "scaffold_s", "gamma_local": 0.01},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.01, "theta": 1.0},
    ],
}


def default_config() -> RunConfig:
    """The built-in run: the paper's problem at s = 10, 500 rounds, all five algorithms."""
    return parse_config(DEFAULT_CONFIG, source="built-in config")


def _config(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config) if args.config else default_config()
    updates: dict[str, Any] = {}
    if getattr(args, "out", None):
        updates["output"] = config.output.model_copy(update={"dir": args.out})
    if getattr(args, "listen", None):
        updates["transport"] = config.transport.model_copy(update={"listen": args.listen})
    return config.model_copy(update=updates) if updates else config


# -- commands --------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedsaddle.server.local_pool import LocalPool

    config = _config(args)
    return _run_and_report(config, LocalPool(), {"kind": "in-process"})


def _grpc_pool(config: RunConfig, listen: str) -> Any:
    from fedsaddle.server.auth import Authenticator, server_credentials
    from fedsaddle.server.grpc_pool import GrpcPool

    transport = config.transport
    return GrpcPool(
        config.problem.num_clients,
        listen,
        chunk_bytes=transport.chunk_bytes,
        round_timeout_s=transport.round_timeout_s,
        server_credentials=server_credentials(transport.tls) if transport.tls else None,
        authenticator=Authenticator.from_file(transport.credentials) if transport.credentials else None,
    )


def cmd_coordinator(args: argparse.Namespace) -> int:
    config = _config(args)
    pool = _grpc_pool(config, config.transport.listen)
    try:
        _install_sigterm()
        print(
            f"coordinator listening on {pool.address}; waiting for {config.problem.num_clients} clients",
            file=sys.stderr,
            flush=True,
        )
        pool.wait_for_clients(config.transport.join_timeout_s)
        return _run_and_report(config, pool, {"kind": "grpc", "address": pool.address})
    finally:
        pool.close()


def cmd_client(args: argparse.Namespace) -> int:
    from fedsaddle.client.service import ClientError, ClientOptions, serve

    indices = parse_indices(args.clients)
    token = _read_token(args.token_file)
    options = ClientOptions(
        args.coordinator,
        indices,
        name=args.name or "",
        connect_timeout_s=args.connect_timeout,
        credentials=_channel_credentials(args),
        metadata=(("authorization", f"Bearer {token}"),) if token else (),
        server_name=args.server_name,
    )
    try:
        serve(options)
    except ClientError as exc:
        log.error("%s", exc)
        return EXIT_RUN_FAILED
    return EXIT_OK


@contextlib.contextmanager
def _loopback_federation(config: RunConfig, per_process: int, quiet_clients: bool) -> Iterator[tuple[Any, int]]:
    """A GrpcPool on 127.0.0.1 and client processes for every index; all stopped afterwards."""
    n = config.problem.num_clients
    pool = _grpc_pool(config, "127.0.0.1:0")
    children: dict[subprocess.Popen[bytes], str] = {}
    try:
        for first in range(0, n, per_process):
            last = min(first + per_process, n) - 1
            spec = f"{first}-{last}" if last > first else str(first)
            quiet = ["--quiet"] if quiet_clients else []
            command = [sys.executable, "-m", "fedsaddle", *quiet, "client"]
            children[subprocess.Popen([*command, "--coordinator", pool.address, "--clients", spec])] = spec
        print(
            f"coordinator on {pool.address}; started {len(children)} client processes for {n} clients",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_children_to_join(pool, children, config.transport.join_timeout_s)
        yield pool, len(children)
    finally:
        pool.close()
        _reap(list(children))


def cmd_local(args: argparse.Namespace) -> int:
    """A coordinator in this process and client processes on loopback."""
    config = _config(args)
    if config.transport.tls or config.transport.credentials:
        raise ValueError("`fedsaddle local` runs plaintext on loopback; use coordinator and client for TLS or tokens")
    _install_sigterm()
    with _loopback_federation(config, max(1, args.clients_per_process), args.quiet_clients) as (pool, processes):
        transport = {"kind": "grpc", "address": pool.address, "client_processes": processes}
        return _run_and_report(config, pool, transport)


def cmd_experiment(args: argparse.Namespace) -> int:
    """The paper's Experiments section: the sweep, its figures and tables."""
    from fedsaddle.server import experiment

    if args.which == "noise":
        out = Path(args.out) if args.out else Path("runs") / f"experiment-noise-{time.strftime('%Y%m%d-%H%M%S')}"
        started = time.perf_counter()
        experiment.run_noise(out, "fedsaddle " + " ".join(sys.argv[1:]))
        print(f"report: {out} (noise.md, figure_noise.png; {time.perf_counter() - started:.1f} s)")
        return EXIT_OK
    if args.which == "ablations":
        out = Path(args.out) if args.out else Path("runs") / f"experiment-ablations-{time.strftime('%Y%m%d-%H%M%S')}"
        started = time.perf_counter()
        experiment.run_ablations(
            out, "fedsaddle " + " ".join(sys.argv[1:]), progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
        print(f"report: {out / 'ablations.md'} ({time.perf_counter() - started:.1f} s)")
        return EXIT_OK
    grpc = args.transport == "grpc"
    default_s = (0.0, 5.0, 10.0) if grpc else tuple(float(s) for s in range(16))
    grid = experiment.Grid(
        s_values=tuple(args.s) if args.s else default_s,
        seeds=tuple(range(args.seeds if args.seeds else (1 if grpc else 5))),
        rounds=args.rounds,
        convention=args.convention,
        tau=args.tau,
        overrides={"init": args.init},
    )
    command = "fedsaddle " + " ".join(sys.argv[1:])
    out = Path(args.out) if args.out else Path("runs") / f"experiment-paper-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = len(grid.algorithms) * len(grid.s_values) * len(grid.step_scales) * len(grid.seeds)
    print(
        f"{runs} runs: {len(grid.s_values)} values of s x {len(grid.step_scales)} steps x {len(grid.seeds)} seeds"
        f" x {len(grid.algorithms)} algorithms",
        file=sys.stderr,
    )
    started = time.perf_counter()
    rows = experiment.run_grid(grid, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"in-process sweep: {time.perf_counter() - started:.2f} s", file=sys.stderr)
    if grpc:
        first = grid.config(grid.algorithms[0], grid.s_values[0], grid.step_scales[0], grid.seeds[0])
        with _loopback_federation(first, 1, True) as (pool, _):
            remote = experiment.run_rows_on(pool, grid, [row.key for row in rows])
        same = sum(
            a.result.z_sha256 == b.result.z_sha256
            and [r["dist_x"] for r in a.result.records] == [r["dist_x"] for r in b.result.records]
            for a, b in zip(rows, remote, strict=True)
        )
        print(f"gRPC (10 client processes) vs in-process batch: {same}/{len(rows)} runs identical bit for bit")
        experiment.write_report(out, grid, remote, command)
        print(f"report: {out}")
        return EXIT_OK if same == len(rows) else EXIT_RUN_FAILED
    experiment.write_report(out, grid, rows, command)
    print(f"report: {out}  (runs.csv, figure1_curves.png, figure2_final_vs_s.png, table.md)")
    return EXIT_OK


def _wait_for_children_to_join(pool: Any, children: dict[subprocess.Popen[bytes], str], timeout: float) -> None:
    """wait_for_clients, but give up at once if a client process exits first."""
    from fedsaddle.server.grpc_pool import MissingClients
    from fedsaddle.server.pool import PoolError

    deadline = time.monotonic() + timeout
    while True:
        try:
            pool.wait_for_clients(min(0.5, max(0.01, deadline - time.monotonic())))
            return
        except MissingClients:
            dead = [(spec, c.returncode) for c, spec in children.items() if c.poll() is not None]
            if dead:
                exits = ", ".join(f"clients {spec} (exit {code})" for spec, code in dead)
                raise PoolError(f"client process(es) exited before joining: {exits}") from None
            if time.monotonic() >= deadline:
                raise


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
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RUN_FAILED
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_RUN_FAILED


def cmd_new_token(args: argparse.Namespace) -> int:
    """Print a fresh token for a client identity, and the line for the credentials file."""
    import secrets

    from fedsaddle.server.auth import token_hash

    indices = parse_indices(args.clients)
    token = secrets.token_urlsafe(32)
    print(f"# give this token to {args.name} (e.g. in a file for --token-file):\n{token}\n")
    print("# and add this to the coordinator's credentials file, under `identities:`")
    spec = ",".join(str(i) for i in indices)
    print(f"  {args.name}:\n    indices: [{spec}]\n    token_sha256: {token_hash(token)}")
    return EXIT_OK


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    config = _config(args)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


# -- helpers ---------------------------------------------------------------------------


def _run_and_report(config: RunConfig, pool: Any, transport: dict[str, Any]) -> int:
    from fedsaddle.server.coordinator import Progress, RunStopped, run_algorithm
    from fedsaddle.server.pool import PoolError
    from fedsaddle.server.report import make_run_dir, table, write_outputs

    progress = Progress()
    results = []
    run_dir = make_run_dir(config)
    failure: str | None = None
    unexpected: BaseException | None = None
    try:
        for spec in config.algorithms:
            results.append(run_algorithm(spec, config, pool, progress=progress))
            progress.finish(spec.display_name)
    except RunStopped as stop:
        results.append(stop.result)
        if isinstance(stop.cause, Stopped):
            failure = "stopped by SIGTERM"
        elif isinstance(stop.cause, KeyboardInterrupt):
            failure = "interrupted"
        else:
            failure = str(stop.cause)
            if not isinstance(stop.cause, PoolError):
                unexpected = stop.cause
    write_outputs(run_dir, config, results, {**transport, "failure": failure})
    if results:
        print(table(results))
    print(f"run directory: {run_dir}")
    if unexpected is not None:
        raise unexpected  # outputs so far are written; main() reports it
    if failure == "stopped by SIGTERM":
        log.info("stopped by SIGTERM; outputs written, clients told goodbye")
        return EXIT_OK
    if failure is not None:
        log.error("run failed: %s", failure)
        return EXIT_RUN_FAILED
    return EXIT_OK


def _install_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


def _read_token(path: str | None) -> str:
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
    return os.environ.get("FEDSADDLE_TOKEN", "").strip()


def _channel_credentials(args: argparse.Namespace) -> Any:
    """TLS credentials from --ca (and --cert/--key for mutual TLS), or None for plaintext."""
    import grpc

    if not args.ca:
        if args.cert or args.key:
            raise ValueError("--cert and --key need --ca (they are for mutual TLS)")
        return None
    if bool(args.cert) != bool(args.key):
        raise ValueError("--cert and --key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.ca), private_key=read(args.key), certificate_chain=read(args.cert)
    )


def _add_tls_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", help="CA certificate (PEM) that signed the coordinator's; turns TLS on")
    p.add_argument("--cert", help="this client's certificate (PEM), for mutual TLS")
    p.add_argument("--key", help="this client's private key (PEM), for mutual TLS")
    p.add_argument("--server-name", help="name to expect in the coordinator's certificate (default: the host)")


def _reap(children: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsaddle", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument("--config", required=required, help="run config (YAML or JSON)")
        p.add_argument("--out", help="folder for run directories (overrides output.dir)")

    p = commands.add_parser("simulate", help="run a config in one process (in-process transport)")
    with_config(p, required=True)
    p.set_defaults(func=cmd_simulate)

    p = commands.add_parser("coordinator", help="serve a config to client processes over gRPC")
    with_config(p, required=True)
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides transport.listen)")
    p.set_defaults(func=cmd_coordinator)

    p = commands.add_parser("client", help="host clients' data and run their local steps")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--clients", required=True, help="client indices this process hosts: 3, 0,2,5 or 0-4")
    p.add_argument("--name", help="name shown in the coordinator's logs (default host:pid)")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator")
    p.add_argument("--token-file", help="file holding this client's token (default: $FEDSADDLE_TOKEN, if set)")
    _add_tls_options(p)
    p.set_defaults(func=cmd_client)

    p = commands.add_parser("local", help="coordinator plus client processes on 127.0.0.1 (default: built-in config)")
    with_config(p, required=False)
    p.add_argument("--clients-per-process", type=int, default=1, help="clients hosted by each process")
    p.add_argument("--quiet-clients", action="store_true", help="clients log warnings and errors only")
    p.set_defaults(func=cmd_local)

    p = commands.add_parser("experiment", help="reproduce the paper's experiments (figures, tables, CSV)")
    p.add_argument(
        "which",
        choices=["paper", "ablations", "noise"],
        help="the paper's sweep, ablations of its choices, or stochastic gradients",
    )
    p.add_argument("--seeds", type=int, help="seeds per setting (default 5; 1 with --transport grpc)")
    p.add_argument("--s", type=float, nargs="+", help="values of s (default 0..15; 0 5 10 with --transport grpc)")
    p.add_argument("--rounds", type=int, default=500, help="communication budget per run")
    p.add_argument("--convention", choices=["exchanges", "paper"], default="exchanges", help="what a round is")
    p.add_argument("--tau", type=int, default=20, help="local steps per sync")
    p.add_argument("--init", choices=["ones", "zeros", "random"], default="ones", help="starting point")
    p.add_argument("--transport", choices=["inprocess", "grpc"], default="inprocess")
    p.add_argument("--out", help="report folder (default runs/experiment-paper-<time>)")
    p.set_defaults(func=cmd_experiment)

    p = commands.add_parser("health", help="check a coordinator's gRPC health service (exit 0 if serving)")
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the coordinator")
    p.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    _add_tls_options(p)
    p.set_defaults(func=cmd_health)

    p = commands.add_parser("new-token", help="make a token for a client identity")
    p.add_argument("--name", required=True, help="the identity's name (e.g. site-a)")
    p.add_argument("--clients", required=True, help="indices it may speak for: 3, 0,2,5 or 0-4")
    p.set_defaults(func=cmd_new_token)

    p = commands.add_parser("show-config", help="print a config with every default filled in")
    p.add_argument("--config", help="config file (default: the built-in one)")
    p.set_defaults(func=cmd_show_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"fedsaddle: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Stopped:
        print("fedsaddle: stopped by SIGTERM", file=sys.stderr)
        return EXIT_OK
    except KeyboardInterrupt:
        print("fedsaddle: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"fedsaddle: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a failure we did not foresee: say what, not a traceback
        if os.environ.get("FEDSADDLE_TRACEBACK"):
            raise
        from fedsaddle.server.pool import PoolError

        print(f"fedsaddle: {'run failed' if isinstance(exc, PoolError) else 'error'}: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
