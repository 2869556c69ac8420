"""A config's runs: every algorithm of it on a pool, its run directory kept as it goes, and how it ended.

The run directory is written as the run goes: config.json first, a line of
metrics.jsonl per step (flushed), checkpoint.npz every `output.checkpoint_every`
rounds, and summary.json with the plots at the end, however the run ends. A
run directory with a checkpoint can be resumed (`resume_run`). The command line
decides what an ending means for the exit code (fedsaddle/cli/run.py); nothing here
exits or prints.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import make_problem
from fedsaddle.common.stop import Stopped
from fedsaddle.server import checkpoint
from fedsaddle.server.algorithms import build
from fedsaddle.server.config import RunConfig, load_config
from fedsaddle.server.driver import (
    AlgorithmResult,
    ProgressHook,
    Resume,
    Run,
    RunStopped,
    StepDone,
    StepHook,
    check_reference,
    run_algorithm,
)
from fedsaddle.server.pool import ClientPool, PoolError
from fedsaddle.server.report import iterates_folder, make_run_dir, strict_json, write_summary
from fedsaddle.server.trackers import Trackers
from fedsaddle.server.trackers import check as check_trackers

log = logging.getLogger("fedsaddle.coordinator")


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


class IterateKeeper:
    """output.save_every: an algorithm's iterate every `every` steps, as iterates-NAME/step-NNNNNN.npy
    (the final iterate's format). At most `limit` files: when one more is due, every other one kept
    is removed and the interval doubles, so the files always span the run so far, evenly."""

    def __init__(self, folder: Path, every: int, limit: int) -> None:
        self.folder, self.every, self.limit = folder, every, limit
        # A resumed run finds the files it kept before (the steps after its checkpoint are saved again).
        self.kept = sorted(int(path.stem.removeprefix("step-")) for path in folder.glob("step-*.npy"))
        spacing = math.gcd(*self.kept)  # the interval it had reached: a power of two times `every`
        while spacing and spacing % (2 * self.every) == 0:
            self.every *= 2

    def offer(self, step: int, z: Array) -> None:
        if step % self.every:
            return
        if step not in self.kept:
            if len(self.kept) >= self.limit:
                self.every *= 2
                for old in [s for s in self.kept if s % self.every]:
                    (self.folder / f"step-{old:06d}.npy").unlink(missing_ok=True)
                self.kept = [s for s in self.kept if s % self.every == 0]
                if step % self.every:
                    return
            self.kept.append(step)
        self.folder.mkdir(exist_ok=True)
        stored = "<f4" if z.dtype == np.float32 else "<f8"  # as the final iterate is written
        np.save(self.folder / f"step-{step:06d}.npy", np.ascontiguousarray(z, dtype=stored), allow_pickle=False)


class _Recorder:
    """Streams metrics.jsonl, keeps iterates along the way and writes checkpoints, step by step."""

    def __init__(self, config: RunConfig, run_dir: Path, metrics: IO[str], lines: int) -> None:
        self.config, self.run_dir, self.metrics, self.lines = config, run_dir, metrics, lines
        self.digest = checkpoint.config_digest(config)
        self.finished: list[AlgorithmResult] = []
        self.index = 0
        self.last_checkpoint = -1
        self.keepers: dict[str, IterateKeeper] = {}

    def on_step(self, run: Run, step: StepDone, pool: ClientPool) -> None:
        self.metrics.write(strict_json({"algorithm": run.name, **run.records[-1]}) + "\n")
        self.metrics.flush()
        self.lines += 1
        output = self.config.output
        if output.save_every is not None:
            if run.name not in self.keepers:
                folder = self.run_dir / iterates_folder(run.name)
                self.keepers[run.name] = IterateKeeper(folder, output.save_every, output.save_max)
            self.keepers[run.name].offer(step.steps, run.final_z)
        every = self.config.output.checkpoint_every
        rounds = pool.traffic["algorithm"].rounds
        if every and run.status == "ok" and (self.last_checkpoint < 0 or rounds - self.last_checkpoint >= every):
            self.last_checkpoint = rounds
            resume = Resume(
                run_id=pool.run.run_id if pool.run else "",
                at=step,
                round_id=pool.round_id,
                traffic={category: counts.as_dict() for category, counts in pool.traffic.items()},
                records=[],
                elapsed_s=time.perf_counter() - run.started,
                faulty_reports=dict(pool.faulty_reports),
                faulty_rounds=pool.faulty_rounds,
            )
            written = checkpoint.Checkpoint(
                self.digest, self.index, resume, self.lines, list(self.finished), self.config.precision
            )
            checkpoint.write(self.run_dir, written)


def run_config(
    config: RunConfig,
    pool: ClientPool,
    transport: dict[str, Any],
    progress: ProgressHook | None = None,
    reference: Array | None = None,
    on_step: StepHook | None = None,
    reference_accuracy: float = 0.0,
) -> Outcome:
    """Run the config's algorithms one after another; outputs are kept however the run ends.

    `reference`: a known z* to measure against (see run_algorithm), solved to `reference_accuracy`;
    `on_step` sees every step's record once it is written (the command line shows the latest
    metrics with it)."""
    check_reference(make_problem(config.problem), reference)  # before anything is written
    check_trackers(config)
    run_dir = make_run_dir(config)
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    return _run(config, pool, transport, run_dir, 0, [], None, progress, reference, on_step, reference_accuracy)


def resume_run(
    run_dir: Path,
    pool_for: Callable[[RunConfig], tuple[ClientPool, dict[str, Any]]],
    progress: ProgressHook | None = None,
    on_step: StepHook | None = None,
    reference_for: Callable[[RunConfig, ClientPool], Array | None] | None = None,
    reference_accuracy: float = 0.0,
) -> Outcome:
    """Go on with a checkpointed run in `run_dir` on the pool `pool_for(config)` makes, with the
    description of its transport that the summary records.

    CheckpointError if it cannot be resumed; then nothing in run_dir has changed.
    `reference_for(config, pool)`: z* to measure against, as run_config's `reference` (solved to
    `reference_accuracy`).
    """
    if not (run_dir / "config.json").is_file():
        raise checkpoint.CheckpointError(
            f"{run_dir} is not a run directory (it has no config.json): give the folder of one run, runs/NAME-TIME"
        )
    config = load_config(run_dir / "config.json")
    check_trackers(config)  # a library missing is said before the clients are waited for
    stopped = _why_it_stopped(run_dir / "summary.json")
    dim_x, _ = make_problem(config.problem).dims()  # (an algorithm may need z's split to be built)
    state_types = [build(spec, config.sync, dim_x=dim_x).state_type for spec in config.algorithms]
    saved = checkpoint.read(run_dir, config, state_types)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    if len(lines) < saved.metrics_lines:
        raise checkpoint.CheckpointError(
            f"{run_dir / 'metrics.jsonl'} has {len(lines)} lines, "
            f"fewer than the {saved.metrics_lines} its checkpoint covers"
        )
    kept = lines[: saved.metrics_lines]
    records: dict[str, list[dict[str, Any]]] = {}
    for line in kept:
        entry = json.loads(line)  # null: a value that was not finite (strict_json)
        name = entry.pop("algorithm")
        records.setdefault(name, []).append({k: math.nan if v is None else v for k, v in entry.items()})
    for result in saved.finished:
        result.records = records.get(result.name, [])
    current = config.algorithms[saved.algorithm_index].display_name
    resume = replace(saved.resume, records=records.get(current, []))
    log.info(
        "resuming %s from its checkpoint: %s at step %d, after %d rounds%s",
        run_dir,
        current,
        resume.at.steps,
        resume.traffic["algorithm"]["rounds"],
        f" (it had stopped: {stopped})" if stopped else "",
    )
    pool, transport = pool_for(config)  # (the coordinator's waits for every client to join)
    try:
        first, finished = saved.algorithm_index, saved.finished
        reference = None if reference_for is None else reference_for(config, pool)
        # Only now, with the pool and data in hand, is the run directory changed: the steps after the
        # checkpoint run again, and a stopped run's summary goes (this run writes its own when it ends).
        (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
        (run_dir / "summary.json").unlink(missing_ok=True)
        return _run(
            config, pool, transport, run_dir, first, finished, resume, progress, reference, on_step, reference_accuracy
        )
    finally:
        pool.close()


def _why_it_stopped(summary: Path) -> str | None:
    """Why the run of a run directory ended early, as its summary records it: None when it wrote no
    summary (it was killed). CheckpointError when it finished, or when the summary cannot tell."""
    if not summary.exists():
        return None
    try:
        failure = json.loads(summary.read_text())["transport"]["failure"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise checkpoint.CheckpointError(
            f"{summary} cannot be read ({type(exc).__name__}: {exc}), so whether the run finished is unknown; "
            "if it did not, remove that file and resume again"
        ) from exc
    if not failure:
        raise checkpoint.CheckpointError(
            f"{summary.parent} holds a finished run (its summary.json records every algorithm run to its end)"
        )
    return str(failure)


def _run(
    config: RunConfig,
    pool: ClientPool,
    transport: dict[str, Any],
    run_dir: Path,
    first: int,
    finished: list[AlgorithmResult],
    resume: Resume | None,
    progress: ProgressHook | None,
    reference: Array | None,
    on_step: StepHook | None = None,
    reference_accuracy: float = 0.0,
) -> Outcome:
    outcome = Outcome(list(finished), run_dir)
    trackers = Trackers(config, run_dir) if config.output.trackers else None
    if trackers is not None:  # a resumed run's records so far, as metrics.jsonl keeps them
        for result in finished:
            trackers.replay(result.name, result.records)
        if resume is not None and first < len(config.algorithms):
            trackers.replay(config.algorithms[first].display_name, resume.records)
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        recorder = _Recorder(config, run_dir, metrics, sum(len(r.records) for r in finished))
        recorder.lines += len(resume.records) if resume else 0
        recorder.finished = list(finished)

        def step(run: Run, done: StepDone, pool: ClientPool) -> None:
            recorder.on_step(run, done, pool)
            if trackers is not None:
                trackers.record(run.name, run.records[-1])
            if on_step is not None:
                on_step(run, done, pool)

        try:
            for index in range(first, len(config.algorithms)):
                # The pool counts each algorithm's rounds from 0: a new one checkpoints from its first step.
                recorder.index, recorder.last_checkpoint = index, -1
                spec = config.algorithms[index]
                start = resume if index == first else None
                result = run_algorithm(
                    spec,
                    config,
                    pool,
                    progress=progress,
                    reference=reference,
                    resume=start,
                    on_step=step,
                    reference_accuracy=reference_accuracy,
                )
                outcome.results.append(result)
                recorder.finished.append(result)
        except RunStopped as stop:
            outcome.results.append(stop.result)
            outcome.cause = stop.cause
            if isinstance(stop.cause, Stopped | KeyboardInterrupt):
                outcome.failure = "stopped by SIGTERM" if isinstance(stop.cause, Stopped) else "interrupted"
                pool.farewell = f"the coordinator was {outcome.failure}" + (
                    "; it can resume the run from its checkpoint (start the clients again then)"
                    if config.output.checkpoint_every > 0
                    else ""
                )
            else:
                outcome.failure = str(stop.cause)
                pool.failure = outcome.failure
    stacks = pool.numeric_stacks()
    notes: dict[str, Any] = {"clients_numeric_stack": stacks} if stacks else {}
    closed = pool.connections_closed()
    if any(closed.values()):  # a flood, or clients that waited long: the operator sees how many
        notes["connections_closed"] = closed
    if trackers is not None:
        trackers.close(outcome.failure)
    write_summary(run_dir, config, outcome.results, {**transport, **notes, "failure": outcome.failure})
    return outcome
