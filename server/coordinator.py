"""The coordinator's job: run every algorithm of a config on a pool, write the outputs, say how it ended.

The command line decides what an ending means for the exit code (fedsaddle/cli.py);
nothing here exits or prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsaddle.common.numeric import Array
from fedsaddle.server.config import RunConfig
from fedsaddle.server.driver import AlgorithmResult, ProgressHook, RunStopped, run_algorithm
from fedsaddle.server.pool import ClientPool, PoolError
from fedsaddle.server.report import make_run_dir, write_outputs


class Stopped(Exception):
    """SIGTERM: finish cleanly (outputs written, clients told goodbye)."""


@dataclass
class Outcome:
    """How a run of a config ended."""

    results: list[AlgorithmResult]
    run_dir: Path
    failure: str | None = None  # None: every algorithm ran to its budget (or diverged)
    cause: BaseException | None = None  # what stopped it, if something did

    @property
    def unexpected(self) -> bool:
        """Stopped by something other than the federation failing or a signal: a bug."""
        return self.cause is not None and not isinstance(self.cause, PoolError | Stopped | KeyboardInterrupt)


def run_config(
    config: RunConfig,
    pool: ClientPool,
    transport: dict[str, Any],
    progress: ProgressHook | None = None,
    reference: Array | None = None,
) -> Outcome:
    """Run the config's algorithms one after another; outputs are written however the run ends.

    `reference`: a known z* to measure against (see run_algorithm)."""
    outcome = Outcome([], make_run_dir(config))
    try:
        for spec in config.algorithms:
            outcome.results.append(run_algorithm(spec, config, pool, progress=progress, reference=reference))
    except RunStopped as stop:
        outcome.results.append(stop.result)
        outcome.cause = stop.cause
        if isinstance(stop.cause, Stopped):
            outcome.failure = "stopped by SIGTERM"
        elif isinstance(stop.cause, KeyboardInterrupt):
            outcome.failure = "interrupted"
        else:
            outcome.failure = str(stop.cause)
            pool.failure = outcome.failure
    write_outputs(outcome.run_dir, config, outcome.results, {**transport, "failure": outcome.failure})
    return outcome
