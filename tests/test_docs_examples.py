"""Code the documentation shows, run as the page writes it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import yaml
from conftest import CLIENT_ENV, fedsaddle

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_block_after(page: Path, marker: str) -> str:
    """The first ```python block after `marker` on a documentation page."""
    text = page.read_text()
    found = re.search(r"```python\n(.*?)```", text[text.index(marker) :], re.DOTALL)
    assert found is not None, f"no python block after {marker!r} in {page}"
    return found.group(1)


def test_the_per_client_weights_plugin_runs_under_uniform_and_is_refused_under_samples(tmp_path: Path) -> None:
    source = python_block_after(DOCS / "problems-authoring.md", "A complete plug-in of this kind")
    (tmp_path / "weighted_clients.py").write_text(source)
    for i, centre in enumerate(([1.0, 0.0], [0.0, 2.0], [-1.0, -1.0])):
        rows = np.array([centre, centre]) + np.array([[0.1, 0.0], [-0.1, 0.0]])
        np.savez(tmp_path / f"client-{i}.npz", X=rows, y=np.zeros(2))
    config = {
        "name": "weights",
        "problem": {"name": "weighted_clients", "plugin": "weighted_clients:WeightedClients", "num_clients": 3},
        "rounds": 200,
        "algorithms": [{"name": "mirror_prox", "gamma": 0.1}],
        "output": {"plot": False},
    }
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), CLIENT_ENV.get("PYTHONPATH", "")])}
    data = str(tmp_path / "client-{i}.npz")
    (tmp_path / "uniform.yaml").write_text(yaml.safe_dump(config))
    checked = fedsaddle("check-problem", "--config", str(tmp_path / "uniform.yaml"), "--data", data, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "monotonicity of G on 20 random pairs: ok" in checked.stdout
    ran = fedsaddle("simulate", "--config", str(tmp_path / "uniform.yaml"), "--data", data,
                    "--out", str(tmp_path / "runs"), env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (tmp_path / "samples.yaml").write_text(yaml.safe_dump({**config, "weighting": "samples"}))
    refused = fedsaddle("simulate", "--config", str(tmp_path / "samples.yaml"), "--data", data,
                        "--out", str(tmp_path / "runs"), env=env)  # fmt: skip
    assert refused.returncode != 0
    assert "weighted_clients weighs the clients by lambda itself: use weighting: uniform" in refused.stderr
