"""output.trackers: a run's records in TensorBoard's event files and MLflow's file store, read back with
the libraries' own readers (TensorBoard's EventAccumulator, MLflow's client) and found equal to
metrics.jsonl, after a plain run and after a run resumed from its checkpoint."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedsaddle.cli import main
from fedsaddle.server import trackers
from fedsaddle.server.config import ConfigError, parse_config

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard (the reader) is not installed"
)
pytest.importorskip("tensorboardX", reason="tensorboardX is not installed: pip install 'fedsaddle[tensorboard]'")
pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'fedsaddle[mlflow]'")

CONFIG: dict[str, Any] = {
    "name": "tracked",
    "problem": {"name": "paper_regression", "num_clients": 3, "dim": 4, "s": 10.0},
    "rounds": 60,
    "evaluate_every": 4,  # grad_norm on some steps only: a field not in every record
    "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}, {"name": "minibatch_md", "gamma": 0.01}],
    "output": {"plot": False, "gradient_norm": True, "trackers": ["tensorboard", "mlflow"]},
}


def simulate(folder: Path, config: dict[str, Any], *flags: str) -> Path:
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--quiet", "simulate", "--config", str(path), "--out", str(folder / "runs"), *flags]) == 0
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


def jsonl(run_dir: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """metrics.jsonl as algorithm -> field -> [(step, value)], finite numbers only (the trackers' share)."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        name = record.pop("algorithm")
        step = record.pop("step")
        for key, value in record.items():
            if isinstance(value, int | float) and math.isfinite(value):
                series[name][key].append((step, float(value)))
    return series


def tensorboard(run_dir: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    found: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for folder in sorted((run_dir / "tensorboard").iterdir()):
        accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
        accumulator.Reload()
        found[folder.name] = {
            tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]
        }
    return found


def mlflow_runs(run_dir: Path) -> tuple[dict[str, dict[str, list[tuple[int, float]]]], dict[str, Any]]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tracked")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    series = {
        run.info.run_name: {
            key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics
        }
        for run in runs
    }
    return series, {run.info.run_name: run for run in runs}


def as_float32(series: dict[str, dict[str, list[tuple[int, float]]]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    return {
        name: {key: [(step, float(np.float32(value))) for step, value in points] for key, points in fields.items()}
        for name, fields in series.items()
    }


def test_the_trackers_hold_the_records_of_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = simulate(tmp_path, CONFIG)
    want = jsonl(run_dir)
    assert set(want) == {"scaffold_s", "minibatch_md"}
    assert {"rounds", "dist_x", "dist_z", "grad_norm", "time_s"} <= set(want["scaffold_s"])
    assert len(want["scaffold_s"]["grad_norm"]) < len(want["scaffold_s"]["rounds"])  # a sparse field
    # TensorBoard keeps scalars as 32-bit floats: the same numbers, rounded so
    assert tensorboard(run_dir) == as_float32(want)
    # MLflow keeps them as they are
    series, runs = mlflow_runs(run_dir)
    assert series == want
    assert runs["scaffold_s"].data.params["algorithm.gamma_local"] == "0.01"
    assert runs["minibatch_md"].data.params["num_clients"] == "3"
    assert {run.info.status for run in runs.values()} == {"FINISHED"}


def test_a_resumed_run_writes_each_record_once(tmp_path: Path) -> None:
    config = {**CONFIG, "output": {**CONFIG["output"], "checkpoint_every": 20}}
    run_dir = simulate(tmp_path, config)
    first = jsonl(run_dir)
    # as if the run had been killed after its last checkpoint: no summary, so it resumes from there
    (run_dir / "summary.json").unlink()
    assert main(["--quiet", "simulate", "--resume", str(run_dir)]) == 0
    want = jsonl(run_dir)
    assert {k: [s for s, _ in v] for k, v in want["minibatch_md"].items()} == {
        k: [s for s, _ in v] for k, v in first["minibatch_md"].items()
    }
    # one event file per algorithm, written anew: each step once, no record of the first attempt twice
    assert sorted(p.parent.name for p in (run_dir / "tensorboard").rglob("events.*")) == ["minibatch_md", "scaffold_s"]
    assert tensorboard(run_dir) == as_float32(want)
    assert mlflow_runs(run_dir)[0] == want


def test_a_tracker_is_named_once_and_known() -> None:
    with pytest.raises(ConfigError, match="each tracker at most once"):
        parse_config({**CONFIG, "output": {"trackers": ["mlflow", "mlflow"]}})
    with pytest.raises(ConfigError, match=r"output\.trackers"):
        parse_config({**CONFIG, "output": {"trackers": ["wandb"]}})


def test_a_missing_library_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert main(["simulate", "--config", str(path), "--out", str(tmp_path / "runs")]) == 2
    assert "output.trackers: mlflow needs mlflow, which is not installed: pip install 'fedsaddle[mlflow]'" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "runs").exists()
