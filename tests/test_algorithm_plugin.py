"""A plug-in algorithm, installed by its entry point, runs in `simulate` and over `local` client
processes with the same bits; a client process without it refuses the run, naming the computation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import client_process, summary_of
from test_failures import Coordinator, write_config

from fedsaddle.launch import client_env

SOURCE = Path(__file__).resolve().parent.parent / "examples" / "algorithm-plugin" / "src"
CONFIG = {
    "name": "plugin",
    "problem": {"name": "quadratic_game", "num_clients": 3, "dim": 4, "heterogeneity": 0.5},
    "algorithms": [
        {"name": "fedprox_gda", "gamma_local": 0.05, "mu": 0.3},
        {"name": "fedprox_gda", "gamma_local": 0.05, "mu": 0.0, "label": "no_pull"},
        {"name": "fedavg_s", "gamma_local": 0.05, "decay": "constant"},
    ],
    "rounds": 25,
    "sync": {"kind": "random", "p": 0.25},
    "gradient_noise": 0.1,
    "output": {"plot": False},
}


def installed(folder: Path) -> dict[str, str]:
    """An environment in which the example is installed: its source on the path, and the package
    metadata pip would write (a dist-info folder with the entry point) beside it."""
    dist = folder / "fedsaddle_fedprox_gda-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedsaddle-fedprox-gda\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[fedsaddle.algorithms]\nfedprox_gda = fedsaddle_fedprox_gda:FEDPROX_GDA\n")
    path = os.pathsep.join(p for p in (str(folder), str(SOURCE), os.environ.get("PYTHONPATH", "")) if p)
    return {**client_env(), "PYTHONPATH": path}


def test_an_installed_plugin_algorithm_runs_in_simulate_and_local_with_the_same_bits(tmp_path: Path) -> None:
    env = installed(tmp_path / "site")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    results = []
    for command in ("simulate", "local"):
        out = tmp_path / command
        done = subprocess.run(
            [sys.executable, "-m", "fedsaddle", command, "--config", str(path), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        results.append({a["name"]: a for a in summary_of(out)["algorithms"]})
    simulated, local = results
    for name in ("fedprox_gda", "no_pull", "fedavg_s"):
        assert simulated[name]["status"] == local[name]["status"] == "ok"
        assert simulated[name]["z_sha256"] == local[name]["z_sha256"]
    # Without its proximal pull the plug-in is FedAvg-S with a constant step: the same bits.
    assert simulated["no_pull"]["z_sha256"] == simulated["fedavg_s"]["z_sha256"]
    assert simulated["fedprox_gda"]["z_sha256"] != simulated["fedavg_s"]["z_sha256"]


def test_an_unknown_algorithm_lists_the_installed_plugin(tmp_path: Path) -> None:
    env = installed(tmp_path / "site")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "algorithms": [{"name": "fedprox_gd", "gamma_local": 0.1}]}))
    done = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "simulate", "--config", str(path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode != 0
    assert "algorithms[0]: unknown name 'fedprox_gd' (did you mean 'fedprox_gda'?)" in done.stderr
    assert "'local_sgda_plus', 'fedprox_gda']" in done.stderr  # the built-in ones, then the installed ones


@pytest.mark.parametrize("lacking", [0, 2])
def test_a_client_without_the_plugin_refuses_the_run_naming_its_computation(tmp_path: Path, lacking: int) -> None:
    env = installed(tmp_path / "site")
    config = {**CONFIG, "algorithms": CONFIG["algorithms"][:1]}
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **config), tmp_path / "runs", env=env)
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = [client_process(address, i, env=None if i == lacking else env, quiet=False) for i in range(3)]
    code, log, _ = coordinator.finish_with(clients, 90)
    assert code == 1
    assert f"client {lacking}" in log
    assert "this client has no local computation 'fedprox_gda_steps'" in log, log


def test_a_client_whose_plugin_fails_to_load_says_why_in_its_refusal(tmp_path: Path) -> None:
    env = installed(tmp_path / "site")
    broken = dict(env)
    site = tmp_path / "broken-site"
    dist = site / "fedsaddle_fedprox_gda-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedsaddle-fedprox-gda\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[fedsaddle.algorithms]\nfedprox_gda = fedsaddle_fedprox_gda_gone:FEDPROX_GDA\n"
    )
    broken["PYTHONPATH"] = str(site)
    config = {**CONFIG, "algorithms": CONFIG["algorithms"][:1]}
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **config), tmp_path / "runs", env=env)
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = [client_process(address, i, env=broken if i == 1 else env, quiet=False) for i in range(3)]
    code, log, _ = coordinator.finish_with(clients, 90)
    assert code == 1
    assert "client 1" in log and "this client has no local computation 'fedprox_gda_steps'" in log, log
    assert "installed plug-ins that failed to load here: {'fedprox_gda': " in log
    assert "fedsaddle_fedprox_gda_gone:FEDPROX_GDA: ModuleNotFoundError" in log


def test_a_compute_task_larger_than_clients_take_fails_before_its_round_in_process_too() -> None:
    # A client refuses a COMPUTE task whose payload passes 4 x len(z) (the wire's bound); the pool checks
    # the same bound before it sends one, so simulate fails as the federation would, naming the task,
    # and the refused task is not a round.
    import numpy as np
    from conftest import config

    from fedsaddle.common.tasks import ComputeTask
    from fedsaddle.server.pool import PoolError, RunInfo
    from fedsaddle.server.transport.local_pool import LocalPool

    run = config(
        problem={"name": "paper_regression", "num_clients": 2, "dim": 3},
        algorithms=[{"name": "minibatch_md", "gamma": 0.1}],
    )
    pool = LocalPool()
    pool.start_run(RunInfo("large", run.problem, 0, 0.0, computations=("some_steps",)))
    z = np.zeros(6)
    padded = ComputeTask("some_steps", z, arrays=(("a", np.zeros(6)), ("b", np.zeros(6)), ("c", np.zeros(7))))
    with pytest.raises(PoolError, match=r"compute task 'some_steps': 25 payload entries, at most 4 x 6"):
        pool.exchange(padded)
    assert pool.round_id == 0
    assert ComputeTask("some_steps", z, arrays=(("a", np.zeros(18)),)).oversized() is None  # exactly 4 x 6


def test_an_installed_algorithm_whose_module_does_not_compile_is_named_with_its_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It used to escape as "fedsaddle: error: invalid syntax (__init__.py, line 1)", naming neither the
    # algorithm nor the file.
    from fedsaddle.server.algorithms.registry import AlgorithmNotFound, _load

    (tmp_path / "broken_algorithm.py").write_text("def oops(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AlgorithmNotFound) as caught:
        _load("broken_algorithm:BROKEN", "broken")
    assert str(caught.value) == (
        "algorithm 'broken' (broken_algorithm:BROKEN): importing 'broken_algorithm' failed: SyntaxError: "
        f"invalid syntax ({tmp_path / 'broken_algorithm.py'}, line 1)"
    )


UNDECLARED = """
from typing import Literal, NamedTuple
import numpy as np
from fedsaddle.server.algorithms import Algorithm, AlgorithmDef, AlgorithmSpecBase, ComputeTask, StepCost, no_exchange

class ForgetfulSpec(AlgorithmSpecBase):
    name: Literal["forgetful"] = "forgetful"
    gamma_local: float = 0.1

class State(NamedTuple):
    z: np.ndarray

class Forgetful(Algorithm[State]):
    name = "forgetful"
    state_type = State
    def __init__(self, spec, run):
        self.gamma = spec.gamma_local
    def init(self, z0, seed):
        return no_exchange(State(z0.copy()))
    def step(self, state):
        d = yield ComputeTask("forgotten_steps", state.z, params=(("gamma", self.gamma),))
        return State(state.z - self.gamma * d.mean())
    def iterate(self, state):
        return state.z
    def step_cost(self, state):
        return StepCost(exchanges=1, paper=1)

def declared_steps(oracle, z, *, gamma):
    return oracle.gradient(z)

FORGETFUL = AlgorithmDef(ForgetfulSpec, Forgetful, computations={"declared_steps": declared_steps})
"""


def test_an_algorithm_that_asks_for_a_computation_it_does_not_declare_is_named_before_any_client_runs_it(
    tmp_path: Path,
) -> None:
    # The run announces the declared computations; a task naming another reached every client, which
    # died saying "this client has no local computation ...: install the package" (it was installed).
    site = tmp_path / "site"
    dist = site / "forgetful-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "forgetful_algorithm.py").write_text(UNDECLARED)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forgetful\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[fedsaddle.algorithms]\nforgetful = forgetful_algorithm:FORGETFUL\n")
    env = {**client_env(), "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "algorithms": [{"name": "forgetful"}]}))
    said = "the algorithm asked for the local computation 'forgotten_steps', which its AlgorithmDef does not declare"
    for command in ("simulate", "local"):
        done = subprocess.run(
            [sys.executable, "-m", "fedsaddle", command, "--config", str(path), "--out", str(tmp_path / command)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert said in done.stderr and "['declared_steps']" in done.stderr, done.stderr
        assert "install the package" not in done.stderr and "disconnected" not in done.stderr
