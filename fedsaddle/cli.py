"""The `fedsaddle` command: simulate, coordinator, client, local."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from fedsaddle.common.config import ConfigError, RunConfig, load_config, parse_config

log = logging.getLogger("fedsaddle")

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2

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


def cmd_coordinator(args: argparse.Namespace) -> int:
    from fedsaddle.server.grpc_pool import GrpcPool

    config = _config(args)
    pool = GrpcPool(
        config.problem.num_clients,
        config.transport.listen,
        chunk_bytes=config.transport.chunk_bytes,
        round_timeout_s=config.transport.round_timeout_s,
    )
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
    from fedsaddle.client.service import ClientError, ClientOptions, parse_indices, serve

    indices = parse_indices(args.clients)
    options = ClientOptions(args.coordinator, indices, name=args.name or "", connect_timeout_s=args.connect_timeout)
    _install_sigterm()
    try:
        serve(options)
    except ClientError as exc:
        log.error("%s", exc)
        return EXIT_RUN_FAILED
    return EXIT_OK


def cmd_local(args: argparse.Namespace) -> int:
    """A coordinator in this process and client processes on loopback."""
    from fedsaddle.server.grpc_pool import GrpcPool

    config = _config(args)
    n = config.problem.num_clients
    per_process = max(1, args.clients_per_process)
    pool = GrpcPool(
        n, "127.0.0.1:0", chunk_bytes=config.transport.chunk_bytes, round_timeout_s=config.transport.round_timeout_s
    )
    children: dict[subprocess.Popen[bytes], str] = {}
    try:
        _install_sigterm()
        groups = [list(range(i, min(i + per_process, n))) for i in range(0, n, per_process)]
        for group in groups:
            spec = f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])
            quiet = ["--quiet"] if args.quiet_clients else []
            command = [
                sys.executable,
                "-m",
                "fedsaddle",
                *quiet,
                "client",
                "--coordinator",
                pool.address,
                "--clients",
                spec,
            ]
            children[subprocess.Popen(command)] = spec
        print(
            f"coordinator on {pool.address}; started {len(children)} client processes for {n} clients",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_children_to_join(pool, children, config.transport.join_timeout_s)
        return _run_and_report(
            config, pool, {"kind": "grpc", "address": pool.address, "client_processes": len(children)}
        )
    finally:
        pool.close()
        _reap(list(children))


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


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    config = _config(args)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


# -- helpers ---------------------------------------------------------------------------


def _run_and_report(config: RunConfig, pool: Any, transport: dict[str, Any]) -> int:
    from fedsaddle.server.coordinator import Progress, run_algorithm
    from fedsaddle.server.pool import PoolError
    from fedsaddle.server.report import make_run_dir, table, write_outputs

    progress = Progress()
    results = []
    run_dir = make_run_dir(config)
    failure: str | None = None
    try:
        for spec in config.algorithms:
            results.append(run_algorithm(spec, config, pool, progress=progress))
            progress.finish(spec.display_name)
    except PoolError as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        failure = "interrupted"
    write_outputs(run_dir, config, results, {**transport, "failure": failure})
    if results:
        print(table(results))
    print(f"run directory: {run_dir}")
    if failure is not None:
        log.error("run failed: %s", failure)
        return EXIT_RUN_FAILED
    return EXIT_OK


def _install_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


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
    p.set_defaults(func=cmd_client)

    p = commands.add_parser("local", help="coordinator plus client processes on 127.0.0.1 (default: built-in config)")
    with_config(p, required=False)
    p.add_argument("--clients-per-process", type=int, default=1, help="clients hosted by each process")
    p.add_argument("--quiet-clients", action="store_true", help="clients log warnings and errors only")
    p.set_defaults(func=cmd_local)

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
