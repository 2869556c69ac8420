"""Checkpoints: a coordinator that is killed resumes with the same bits.

Every `output.checkpoint_every` rounds the coordinator writes `checkpoint.npz`
into the run directory: the running algorithm's state (its synchronization clock
included), where its run loop stands, the pool's round counter and traffic
counts, how many lines of metrics.jsonl are covered, and the results of the
algorithms already finished. The write is atomic: a temporary file, fsync,
rename, fsync of the folder; a coordinator killed while writing leaves the
previous checkpoint intact.

`fedsaddle coordinator --resume RUN_DIR` checks the checkpoint against the run
directory's config before touching anything, trims metrics.jsonl to the lines
the checkpoint covers (the steps after it are run again), and goes on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsaddle.common.numeric import Precision, element_type
from fedsaddle.server.algorithms.base import StepCost, build_state, flatten_state
from fedsaddle.server.config import RunConfig
from fedsaddle.server.driver import AlgorithmResult, Resume, StepDone
from fedsaddle.server.pool import TrafficCounts

FORMAT = 1
NAME = "checkpoint.npz"

# A test aid: seconds to sleep between writing the temporary file and renaming it,
# so that a test can kill the coordinator in the middle of a checkpoint.
_PAUSE = float(os.environ.get("FEDSADDLE_TEST_CHECKPOINT_PAUSE", "0") or 0)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why. Nothing was changed."""


def config_digest(config: RunConfig) -> str:
    """The run's config, as its checkpoint names it: where it is watched from (monitor) is not part of it."""
    return hashlib.sha256(config.model_dump_json(exclude={"monitor"}).encode()).hexdigest()


@dataclass
class Checkpoint:
    """What a resumed coordinator needs."""

    config_sha256: str
    algorithm_index: int  # which of config.algorithms was running
    resume: Resume  # where it stood
    metrics_lines: int  # lines of metrics.jsonl written up to the checkpoint
    finished: list[AlgorithmResult]  # the algorithms already done (their records come from metrics.jsonl)
    precision: Precision = "float64"  # the run's element type: its state's arrays are of it


def write(run_dir: Path, checkpoint: Checkpoint) -> None:
    """Write the checkpoint atomically (the previous one stays until the new one is complete)."""
    resume = checkpoint.resume
    arrays, scalars = flatten_state(resume.at.state)
    meta = {
        "format": FORMAT,
        "config_sha256": checkpoint.config_sha256,
        "algorithm_index": checkpoint.algorithm_index,
        "run_id": resume.run_id,
        "steps": resume.at.steps,
        "spent": list(resume.at.spent),
        "round_id": resume.round_id,
        "traffic": resume.traffic,
        "elapsed_s": resume.elapsed_s,
        "faulty_reports": {str(client): count for client, count in resume.faulty_reports.items()},
        "faulty_rounds": resume.faulty_rounds,
        "metrics_lines": checkpoint.metrics_lines,
        "state_type": type(resume.at.state).__name__,
        "precision": checkpoint.precision,
        "state": scalars,
        "finished": [r.summary() for r in checkpoint.finished],
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    files = {f"state/{k}": v for k, v in arrays.items()}
    files.update({f"finished/{i}": r.final_z for i, r in enumerate(checkpoint.finished)})
    temporary = run_dir / (NAME + ".tmp")
    with open(temporary, "wb") as out:
        np.savez(out, __meta__=np.array(json.dumps(meta)), **files)  # type: ignore[arg-type]
        out.flush()
        os.fsync(out.fileno())
    if _PAUSE:
        print(f"writing checkpoint at round {resume.round_id}", file=sys.stderr, flush=True)
        time.sleep(_PAUSE)
    os.replace(temporary, run_dir / NAME)
    folder = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read(run_dir: Path, config: RunConfig, state_types: list[type]) -> Checkpoint:
    """The run directory's checkpoint, checked against its config; CheckpointError if it cannot be used.

    `state_types`: the state class of each of config.algorithms, in order.
    """
    path = run_dir / NAME
    if not path.exists():
        raise CheckpointError(
            f"{run_dir} has no {NAME}: the run wrote none before it stopped (see output.checkpoint_every)"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(str(archive["__meta__"]))
            arrays = {name: archive[name].copy() for name in archive.files if name != "__meta__"}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged or truncated ({exc}); it cannot be resumed from") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this fedsaddle reads format {FORMAT}")
    written = meta.get("precision", "float64")  # (a checkpoint from before the field: a float64 run's)
    if written != config.precision:
        raise CheckpointError(
            f"{path} was written by a run of precision {written}, and {run_dir / 'config.json'} asks for precision "
            f"{config.precision}: a run resumes only in the precision it ran in (its state's arrays are {written})"
        )
    if meta["config_sha256"] != config_digest(config):
        raise CheckpointError(f"{path} belongs to another config than {run_dir / 'config.json'}")
    index = int(meta["algorithm_index"])
    if not 0 <= index < len(config.algorithms) or meta["state_type"] != state_types[index].__name__:
        raise CheckpointError(
            f"{path} holds a {meta['state_type']} for algorithm {index}, which this config does not run"
        )
    state_arrays = {k.removeprefix("state/"): v for k, v in arrays.items() if k.startswith("state/")}
    element = element_type(config.precision)
    for name, array in state_arrays.items():
        if array.dtype.kind == "f" and array.dtype != element:
            raise CheckpointError(
                f"{path}: the state's array {name!r} is {array.dtype.name}, but the run has precision "
                f"{config.precision}; it cannot be resumed from"
            )
    try:
        state = build_state(state_types[index], meta["state"], state_arrays)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: the algorithm state is incomplete ({exc})") from None
    try:  # read back as the pool will, so that a damaged count is refused before anything starts
        for counts in meta["traffic"].values():
            TrafficCounts.from_dict(config.problem.num_clients, counts)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: the traffic counts are damaged ({exc})") from None
    finished = []
    for i, summary in enumerate(meta["finished"]):
        finished.append(
            AlgorithmResult(
                name=summary["name"],
                spec=summary["spec"],
                status=summary["status"],
                records=[],
                final_z=arrays[f"finished/{i}"],
                dist_x=summary["dist_x"],
                dist_z=summary["dist_z"],
                traffic=summary["traffic"],
                wall_s=summary["wall_s"],
                detail=summary["detail"],
                extra={k: summary[k] for k in ("meta_iterations", "syncs", "steps", "theta") if k in summary},
                floor=summary.get("reference_accuracy", 0.0),
                scale=math.nan if summary.get("distance_scale") is None else summary["distance_scale"],
                converged_below=config.output.converged_below,
            )
        )
    at = StepDone(int(meta["steps"]), state, StepCost(*meta["spent"]))
    try:  # (a checkpoint from before these fields: none were counted)
        faulty = {int(client): int(count) for client, count in meta.get("faulty_reports", {}).items()}
        faulty_rounds = int(meta.get("faulty_rounds", 0))
    except (AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: the counts of diverged reports are damaged ({exc})") from None
    resume = Resume(
        meta["run_id"], at, int(meta["round_id"]), meta["traffic"], [], float(meta["elapsed_s"]), faulty, faulty_rounds
    )
    return Checkpoint(meta["config_sha256"], index, resume, int(meta["metrics_lines"]), finished, written)
