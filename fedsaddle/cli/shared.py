"""What the commands share: the exit codes, the error that means bad usage, and the run config a command's
arguments name (its --config, --out, --listen and --monitor, its --data files and --reference)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsaddle.server.config import RunConfig

log = logging.getLogger("fedsaddle")

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Arguments that cannot work together, or a file they name that cannot be read: exit 2."""


# The built-in run: the paper's problem at s = 10 with all five algorithms, read from the example file that
# documents every field (installed with the package as fedsaddle.examples, see pyproject.toml).
BUILT_IN_CONFIG = "paper-s10.yaml"


def built_in_config() -> RunConfig:
    """The run the commands make without --config: examples/paper-s10.yaml, as installed."""
    from importlib import resources

    from fedsaddle.server.config import load_config

    with resources.as_file(resources.files("fedsaddle.examples").joinpath(BUILT_IN_CONFIG)) as path:
        return load_config(path)


def config_from(args: argparse.Namespace) -> RunConfig:
    """The run config the arguments name (--config, else the built-in run), with --out, --listen and
    --monitor in it; its trackers checked."""
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
    return config_with_monitor(config, args)


def config_with_monitor(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The config, its monitor served on --monitor's address when given."""
    listen = getattr(args, "monitor", None)
    if not listen:
        return config
    from fedsaddle.server.config import MonitorSpec

    spec = (config.monitor or MonitorSpec()).model_copy(update={"listen": listen})
    return config.model_copy(update={"monitor": spec})


def data_paths_of(given: list[str] | None, hosted: Sequence[int]) -> dict[int, str]:
    from fedsaddle.common.problems.data import data_paths

    try:
        return data_paths(given, hosted)
    except ValueError as exc:
        raise UsageError(f"--data: {exc}") from None


def given_reference(args: argparse.Namespace, config: RunConfig) -> Any:
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
