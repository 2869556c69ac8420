"""fedsaddle: federated minimax (saddle-point) optimization over gRPC.

The command line is thin: it parses and checks arguments, then calls
fedsaddle.launch (processes), fedsaddle.server.runs (runs) and
fedsaddle.experiments (the paper's sweeps), and maps how they ended to an exit
code: 0 done, 1 the run failed, 2 bad usage or config, 130 interrupted.
Heavy modules are imported inside the commands, so `--help` stays fast.

The commands are grouped by what they do, one module each: run.py (simulate, coordinator, client, local),
experiment.py, data.py, problem.py (new, check-problem), inspection.py (show-config, compare-runs) and
deploy.py (deploy, health, new-token); arguments.py holds the parser's shared parts, signals.py Ctrl-C and
SIGTERM, credentials.py TLS and tokens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from fedsaddle import __version__
from fedsaddle.cli import data, deploy, experiment, inspection, problem, run
from fedsaddle.cli.arguments import HelpFormatter, global_flags
from fedsaddle.cli.shared import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, UsageError
from fedsaddle.cli.signals import interrupts_not_lost, say_interrupted, wraps_an_interrupt
from fedsaddle.common import blas

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedsaddle",
        description="Federated minimax (saddle-point) optimization over gRPC: the five algorithms of "
        "'Efficient Algorithms for Federated Saddle Point Optimization', newer baselines and plug-ins.",
        epilog="Run `fedsaddle COMMAND --help` for a command's options. Exit codes: 0 done, 1 the run failed, "
        "2 bad usage or config, 130 interrupted.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fedsaddle {__version__}")
    global_flags(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    run.add_commands(commands, fork=main)
    experiment.add_experiment(commands)
    deploy.add_commands(commands)
    data.add_data(commands)
    problem.add_new(commands)
    inspection.add_compare_runs(commands)
    problem.add_check_problem(commands)
    inspection.add_show_config(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (Ctrl-C outside a command's own handling: parsing, loading modules)
        say_interrupted()
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    blas.set_environment()  # before numpy loads (common/blas.py)
    sys.unraisablehook = interrupts_not_lost(sys.unraisablehook)
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
        say_interrupted()
        return EXIT_INTERRUPTED
    except Exception as exc:  # a failure not foreseen: say what, not a traceback
        if wraps_an_interrupt(exc):
            say_interrupted()
            return EXIT_INTERRUPTED
        if os.environ.get("FEDSADDLE_TRACEBACK"):
            raise
        from fedsaddle.server.pool import PoolError

        what = str(exc) or type(exc).__name__  # (a MemoryError says nothing else)
        print(f"fedsaddle: {'run failed' if isinstance(exc, PoolError) else 'error'}: {what}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return code
