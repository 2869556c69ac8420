"""Experiment trackers: a run's records, as metrics.jsonl has them, also in TensorBoard and MLflow.

`output.trackers: [tensorboard, mlflow]` turns them on. Each record of each algorithm (one per step:
rounds, distances, evaluation metrics, epsilon, ...) goes to

* tensorboard: event files in RUN_DIR/tensorboard/ALGORITHM/, one TensorBoard run per algorithm, a
  scalar per record field at the record's step (written with tensorboardX: `pip install
  'fedsaddle[tensorboard]'`; TensorBoard keeps scalars as 32-bit floats);
* mlflow: MLflow's local file store in RUN_DIR/mlruns/, an experiment named after the config's `name`
  and an MLflow run per algorithm, with the algorithm's fields and the run's setup as parameters and
  every record field as a metric at the record's step (`pip install 'fedsaddle[mlflow]'`, mlflow-skinny).

Values that are not finite (metrics.jsonl's null) are left out. metrics.jsonl stays the record of
the run; the trackers are written from the same records, as they come. A run resumed from its
checkpoint writes them anew from its own records (TensorBoard's folder is replaced; MLflow's runs of
the first attempt are marked deleted), so they hold what metrics.jsonl holds.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedsaddle.server.config import ConfigError, RunConfig

# The library each tracker writes with, and the extra that installs it.
LIBRARIES = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow")}
FLUSH_S = 1.0  # MLflow's records are sent in batches at most this far apart (and at the end)


def check(config: RunConfig) -> None:
    """ConfigError naming the tracker whose library is not installed."""
    for name in config.output.trackers:
        module, extra = LIBRARIES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"output.trackers: {name} needs {module}, which is not installed: pip install 'fedsaddle[{extra}]'"
            )


def _values(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers, by field (its step apart, and what is not finite left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


class _TensorBoard:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writers: dict[str, Any] = {}

    def record(self, algorithm: str, step: int, values: Mapping[str, float]) -> None:
        writer = self.writers.get(algorithm)
        if writer is None:
            from tensorboardX import SummaryWriter

            writer = self.writers[algorithm] = SummaryWriter(logdir=str(self.folder / algorithm), flush_secs=5)
        for key, value in values.items():
            writer.add_scalar(key, value, global_step=step)

    def close(self, failure: str | None) -> None:
        for writer in self.writers.values():
            writer.close()


class _MLflow:
    def __init__(self, folder: Path, config: RunConfig) -> None:
        # MLflow 3 keeps its file store "in maintenance mode" and refuses it unless told otherwise; a run
        # directory is a file store's natural home, so this process says so (an operator's own value wins).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=folder.resolve().as_uri())
        self.config = config
        known = self.client.get_experiment_by_name(config.name) if folder.exists() else None
        if known is None:
            self.experiment = self.client.create_experiment(config.name)
        else:  # a resumed run: its records are written again, and the runs that held them are marked deleted
            self.experiment = known.experiment_id
            for run in self.client.search_runs([self.experiment]):
                self.client.delete_run(run.info.run_id)
        self.runs: dict[str, str] = {}
        self.pending: dict[str, list[Any]] = {}
        self.flushed = time.monotonic()

    def _run(self, algorithm: str) -> str:
        run_id = self.runs.get(algorithm)
        if run_id is None:
            spec = next(a for a in self.config.algorithms if a.display_name == algorithm)
            run_id = self.client.create_run(self.experiment, run_name=algorithm).info.run_id
            params = {f"algorithm.{key}": value for key, value in spec.model_dump(mode="json").items()}
            params |= {
                "problem": self.config.problem.name,
                "num_clients": self.config.problem.num_clients,
                "seed": self.config.seed,
                "rounds": self.config.rounds,
                "round_convention": str(self.config.round_convention),
            }
            from mlflow.entities import Param

            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
            self.runs[algorithm] = run_id
        return run_id

    def record(self, algorithm: str, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        run_id = self._run(algorithm)
        stamp = int(time.time() * 1000)
        self.pending.setdefault(run_id, []).extend(Metric(k, v, stamp, step) for k, v in values.items())
        if time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        for run_id, metrics in self.pending.items():
            for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
                self.client.log_batch(run_id, metrics=metrics[start : start + 1000])
        self.pending.clear()
        self.flushed = time.monotonic()

    def close(self, failure: str | None) -> None:
        self.flush()
        for run_id in self.runs.values():
            self.client.set_terminated(run_id, status="FINISHED" if failure is None else "FAILED")


class Trackers:
    """The trackers a config turns on, writing into a run directory."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        """A resumed run's trackers start anew: it writes every record again (see `replay`)."""
        check(config)
        self.writers: list[_TensorBoard | _MLflow] = []
        for name in config.output.trackers:
            if name == "tensorboard":
                shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
                self.writers.append(_TensorBoard(run_dir / "tensorboard"))
            else:
                self.writers.append(_MLflow(run_dir / "mlruns", config))

    def record(self, algorithm: str, record: Mapping[str, Any]) -> None:
        values = _values(record)
        for writer in self.writers:
            writer.record(algorithm, int(record["step"]), values)

    def replay(self, algorithm: str, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.record(algorithm, record)

    def close(self, failure: str | None) -> None:
        for writer in self.writers:
            writer.close(failure)
