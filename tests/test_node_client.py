"""A client in another language joins a real federation: examples/clients/node/client.js.

A coordinator, the Node.js client (hosting clients 2 and 0, listed out of index order) and a
`fedsaddle client` process (client 1) run linear_regression with Minibatch MD and SCAFFOLD-S on
127.0.0.1, with chunk_bytes small enough that tasks and answers travel in chunks. The run
directory the coordinator writes has the in-process run's counts exactly, and its final iterates
and test_mse to 1e-12 relative: the Node client's arithmetic is its own, so not bit for bit
(docs/explanation/numerics.md). Skipped, with the reason, without node or npm on PATH or when
`npm ci` cannot install the example's pinned packages (no registry).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLIENT_ENV, linear_regression_files, listening_address, stop_processes

from fedsaddle import api

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "clients" / "node"
FEATURES, CLIENTS = 40, 3  # z has 80 entries: a SCAFFOLD task (z, c) and a two-client answer are 1280 bytes
COUNTS = ("rounds", "messages_down", "messages_up", "floats_down", "floats_up")


@pytest.fixture(scope="module")
def node_modules(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's pinned packages, installed by `npm ci` into a copy of its package files.

    Kept in pytest's cache, one folder per package-lock.json, so that later runs skip the install."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not on PATH")
    lock = (EXAMPLE / "package-lock.json").read_bytes()
    name = f"node-client-{hashlib.sha256(lock).hexdigest()[:16]}"
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    folder = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    # One install at a time: the tests run in several worker processes, and `npm ci` rewrites node_modules.
    with open(folder / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        installed(folder)
    return folder / "node_modules"


def installed(folder: Path) -> None:
    """`npm ci` of the example's pinned packages into `folder`, unless a finished install is there already."""
    if not ((folder / "installed").exists() and (folder / "node_modules").is_dir()):
        for file in ("package.json", "package-lock.json"):
            shutil.copy(EXAMPLE / file, folder / file)
        command = ["npm", "ci", "--no-audit", "--no-fund", "--fetch-retries=1"]
        try:
            done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci did not finish within 180 s (no registry?)")
        if done.returncode != 0:
            said = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
            pytest.skip(f"npm ci failed (no registry?): {next((s for s in said if 'Error' in s), said[0])}")
        (folder / "installed").write_text("npm ci finished\n")


def run_config() -> dict[str, Any]:
    return {
        "name": "node",
        "problem": {"name": "linear_regression", "num_clients": CLIENTS, "features": FEATURES, "lam": 0.1},
        "weighting": "samples",
        "evaluate_every": 4,
        "rounds": 12,
        "sync": {"kind": "fixed", "tau": 3},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.05}, {"name": "scaffold_s", "gamma_local": 0.02}],
        "output": {"plot": False},
        "transport": {"chunk_bytes": 1024},
    }


def run_outputs(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The summary.json of the one run directory in `folder`, and each algorithm's final iterate."""
    (run_dir,) = folder.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, {a["name"]: np.load(run_dir / a["z_file"]) for a in summary["algorithms"]}


def federate(folder: Path, config: dict[str, Any], node_modules: Path) -> tuple[int, str, list[int], list[str]]:
    """A coordinator on 127.0.0.1 with the Node client (clients 2 and 0) and a `fedsaddle client` (client 1):
    the coordinator's exit code and its log, the clients' exit codes and their logs. Every process is stopped."""
    data = str(folder / "client-{i}.npz")
    (folder / "run.yaml").write_text(json.dumps(config))  # JSON is YAML
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedsaddle", "coordinator", "--config", str(folder / "run.yaml"),
         "--listen", "127.0.0.1:0", "--out", str(folder / "runs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLIENT_ENV,
    )  # fmt: skip
    # The example's own file, so that its default --proto (../../../proto/fedsaddle.proto) is the one tested;
    # NODE_PATH points node at the packages installed in the cache.
    node = ["node", str(EXAMPLE / "client.js"), "--clients", "2,0", "--data", data]
    python = [sys.executable, "-m", "fedsaddle", "client", "--clients", "1", "--data", data]
    environments = [{**CLIENT_ENV, "NODE_PATH": str(node_modules)}, CLIENT_ENV]
    logs = [folder / "node-client.log", folder / "fedsaddle-client.log"]
    clients: list[subprocess.Popen[bytes]] = []
    said = ""
    try:
        address = listening_address(coordinator)
        for command, env, log in zip([node, python], environments, logs, strict=True):
            with log.open("w") as output:
                clients.append(
                    subprocess.Popen([*command, "--coordinator", address], env=env, stdout=output, stderr=output)
                )
        _, said = coordinator.communicate(timeout=60)
    finally:
        codes = stop_processes(clients)
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.communicate()
    return coordinator.returncode, said, codes, [log.read_text() for log in logs]


def test_a_node_client_beside_a_fedsaddle_client_gives_the_in_process_counts_and_iterates(
    node_modules: Path, tmp_path: Path
) -> None:
    linear_regression_files(tmp_path, CLIENTS, FEATURES, seed=7, rows=(60, 20), held_out=(10, 5))
    api.run(run_config(), data=str(tmp_path / "client-{i}.npz"), out=tmp_path / "in-process")
    code, said, codes, logs = federate(tmp_path, run_config(), node_modules)
    assert code == 0, said
    assert codes == [0, 0], logs

    got, got_z = run_outputs(tmp_path / "runs")
    want, want_z = run_outputs(tmp_path / "in-process")
    stacks = got["transport"]["clients_numeric_stack"]
    assert [indices for stack, indices in stacks.items() if stack.startswith("node ")] == [[0, 2]], stacks
    for mine, theirs in zip(got["algorithms"], want["algorithms"], strict=True):
        name = mine["name"]
        assert mine["status"] == theirs["status"] == "ok", (name, mine["detail"])
        assert mine["rounds"] == theirs["rounds"] >= 11
        for category in ("algorithm", "evaluation"):
            for count in (*COUNTS, "per_client_floats_down", "per_client_floats_up"):
                assert mine["traffic"][category][count] == theirs["traffic"][category][count], (name, category, count)
        scale = np.abs(want_z[name]).max()
        assert scale > 0.1  # the run went somewhere
        np.testing.assert_allclose(got_z[name], want_z[name], rtol=0, atol=1e-12 * scale, err_msg=name)
        np.testing.assert_allclose(mine["metrics"]["test_mse"], theirs["metrics"]["test_mse"], rtol=1e-12)


def test_a_node_client_refuses_a_run_with_gradient_noise_and_the_coordinator_names_it(
    node_modules: Path, tmp_path: Path
) -> None:
    linear_regression_files(tmp_path, CLIENTS, FEATURES, seed=7, rows=(60, 20), held_out=(10, 5))
    code, said, codes, logs = federate(tmp_path, {**run_config(), "gradient_noise": 0.1}, node_modules)
    assert code == 1 and codes == [1, 1], (said, logs)
    assert "clients [0, 2]" in said and "cannot serve run" in said, said
    assert "this client computes exact gradients only" in said, said
