"""The parser's parts that several commands share: checked argument types whose errors name the value, the
help layout, the global flags, and the options that mean the same in every command that takes them."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import Any, TypeAlias

from fedsaddle.common.indices import parse_indices

# The subcommands of a parser, as add_subparsers returns them (a string: argparse's class is generic only in
# its type stubs).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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


def open_unit_interval(text: str) -> float:
    """A share strictly between 0 and 1."""
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text!r}")
    return value


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
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


def global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    # On the top-level parser these have defaults; on subcommands SUPPRESS keeps a flag
    # given before the subcommand from being reset by the subcommand's parser.
    default: Any = False if top else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log debug details")
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help="log warnings and errors only")


def add_command(
    commands: Commands, name: str, help: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """A command of the top-level parser, its help also its description, with the global flags; `func` runs it."""
    return add_subcommand(commands, name, help, help, func)


def add_group(commands: Commands, name: str, help: str, dest: str, metavar: str, title: str) -> Commands:
    """A command whose actions are subcommands of its own (`data split`), with the global flags; its
    subcommands, for add_subcommand."""
    group = commands.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
    global_flags(group, top=False)
    return group.add_subparsers(dest=dest, required=True, metavar=metavar, title=title)


def add_subcommand(
    subcommands: Commands,
    name: str,
    help: str,
    description: str,
    func: Callable[[argparse.Namespace], int],
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """A command, or an action of a group (add_group), with the global flags; `func` runs it."""
    p = subcommands.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=HelpFormatter)
    global_flags(p, top=False)
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


def with_monitor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--monitor",
        type=address(True),
        metavar="HOST:PORT",
        help="serve Prometheus metrics at /metrics and a live dashboard at / on this address (overrides "
        "monitor.listen; another host than 127.0.0.1 needs monitor.tls and monitor.token_file)",
    )
