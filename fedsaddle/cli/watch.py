"""The run's monitor as a command runs it: started before the federation, told of each step, closed with
the command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedsaddle.cli.shared import UsageError, config_with_monitor

if TYPE_CHECKING:
    from fedsaddle.server.config import RunConfig
    from fedsaddle.server.runs import Outcome


class Watch:
    """The run's monitor (server/monitor), when its config asks for one: started before the federation is
    (a taken address is said at once), told of the pool, the steps and the outcome, closed with the command."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.monitor: Any = None

    def start(self, config: RunConfig) -> RunConfig:
        config = config_with_monitor(config, self.args)
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
