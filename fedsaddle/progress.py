"""Progress of long commands: a bar with an ETA on a terminal (tqdm), plain lines in logs."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from fedsaddle.server.reference import shown

if TYPE_CHECKING:
    from fedsaddle.server.driver import Run, StepDone
    from fedsaddle.server.pool import ClientPool


class Progress:
    """One bar per task (an algorithm's rounds, an experiment's runs).

    On a terminal it is a tqdm bar with rate and ETA; otherwise (logs, CI, pipes)
    a plain line every 10% and at the end, so output stays readable.
    """

    def __init__(self, stream: TextIO | None = None, unit: str = "round", floor: float = 0.0) -> None:
        self.stream = stream or sys.stderr
        self.unit = unit
        self.floor = floor  # z*'s accuracy: a distance finer than it is shown as below it
        self.tty = self.stream.isatty()
        self._bars: dict[str, Any] = {}
        self._deciles: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._metrics: dict[str, str] = {}  # by algorithm: its latest evaluation metrics, as a note

    def update(self, name: str, done: int, total: int, note: str = "") -> None:
        if self.tty:
            bar = self._bars.get(name)
            if bar is None:
                from tqdm import tqdm

                bar = self._bars[name] = tqdm(
                    total=total, desc=f"{name:<22}", unit=self.unit, file=self.stream, dynamic_ncols=True, leave=True
                )
            bar.update(done - bar.n)
            if note:
                bar.set_postfix_str(note, refresh=False)
            if done >= total:
                self.finish(name)
            return
        started = self._started.setdefault(name, time.perf_counter())
        decile = 10 * done // max(total, 1)
        if decile > self._deciles.get(name, -1):
            self._deciles[name] = decile
            elapsed = time.perf_counter() - started
            extra = f"  {note}" if note else ""
            self.stream.write(f"{name:<22} {self.unit} {done:>6}/{total}{extra}  {elapsed:7.1f} s\n")
            self.stream.flush()

    def finish(self, name: str) -> None:
        bar = self._bars.pop(name, None)
        if bar is not None:
            bar.close()

    def close(self) -> None:
        for name in list(self._bars):
            self.finish(name)

    def rounds(self, name: str, spent: int, budget: int, dist_z: float) -> None:
        """The driver's progress hook: rounds spent of the budget, ||z - z*|| (when known), and
        the latest evaluation metrics (when the run evaluates: see `step`)."""
        notes = ("" if dist_z != dist_z else f"||z-z*|| {shown(dist_z, self.floor)}", self._metrics.get(name, ""))
        self.update(name, spent, budget, "  ".join(note for note in notes if note))

    def step(self, run: Run, done: StepDone, pool: ClientPool) -> None:
        """The driver's step hook: keeps each algorithm's latest metrics for its note, with the round
        they were evaluated at ('test_auc 0.8976 (evaluated at round 200)'): between evaluations the
        note is the last evaluation's, and says so, never passed off as the current iterate's."""
        from fedsaddle.server.driver import record_metrics
        from fedsaddle.server.per_client import clients_of, progress_note

        record = run.records[-1]
        found = record_metrics(record)
        clients = clients_of(record)
        if found or clients:
            at = record[run.convention.record_key]
            values = "  ".join(f"{k} {v:.4g}" for k, v in found.items())
            if clients is not None:  # output.per_client: the worst client of each, and the spread
                values = "  ".join(part for part in (values, progress_note(clients)) if part)
            self._metrics[run.name] = f"{values} (evaluated at round {at})"
