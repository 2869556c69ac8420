"""Commands that read and say, running nothing: show-config (a config with every default filled in) and
compare-runs (whether two run directories computed the same)."""

from __future__ import annotations

import argparse

from fedsaddle.cli.arguments import Commands, add_command, positive_int
from fedsaddle.cli.shared import EXIT_OK, UsageError, config_from


def cmd_compare_runs(args: argparse.Namespace) -> int:
    from fedsaddle.compare_runs import RunDirError, main_compare

    try:
        code, lines = main_compare(args.first, args.second, args.limit)
    except RunDirError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines))
    return code


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(config_from(args).model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def add_compare_runs(commands: Commands) -> None:
    p = add_command(
        commands,
        "compare-runs",
        "compare two run directories: exit 0 if they computed the same (hashes, final iterates, counts, metrics), "
        "1 if not; wall-clock times, wire bytes and where outputs went are ignored",
        cmd_compare_runs,
    )
    p.add_argument("first", metavar="RUN_DIR", help="a run directory (holds summary.json)")
    p.add_argument("second", metavar="OTHER_RUN_DIR", help="the run directory to compare it with")
    p.add_argument("--limit", type=positive_int, default=20, help="differences to print at most")


def add_show_config(commands: Commands) -> None:
    p = add_command(commands, "show-config", "print a config with every default filled in", cmd_show_config)
    p.add_argument("--config", help="config file (default: the built-in one)")
