"""fedsaddle as a Python tool: a built wheel works outside the repository, `new problem` starts a package
whose test passes, and plug-ins load from their config's folder without PYTHONPATH."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import listening_address

from fedsaddle.experiments.datasets import split
from fedsaddle.launch import CLIENT_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "fedsaddle"  # the console script pip made, as a user runs it


def run(command: list[str], cwd: Path, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in CLIENT_ENV.items() if k != "PYTHONPATH"}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**clean, **env})


def test_a_wheel_installed_in_a_fresh_venv_runs_a_federation_outside_the_repository(tmp_path: Path) -> None:
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                 str(REPO)], cwd=tmp_path)  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("fedsaddle-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # The package data: the wire contract and the typing marker; the generated modules it imports.
    assert {"fedsaddle/proto/fedsaddle.proto", "fedsaddle/py.typed", "fedsaddle/proto/fedsaddle_pb2.py"} <= names
    assert "fedsaddle/examples/paper-s10.yaml" in names  # the built-in run's config
    assert {"fedsaddle/cli/__init__.py", "fedsaddle/cli/run.py", "fedsaddle/problem_template.py"} <= names
    assert "fedsaddle/server/algorithms/scaffold_s.py" in names
    assert not any(name.startswith(("server/", "common/", "tests/")) for name in names)  # one import name
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path).returncode == 0
    # The dependencies come from this environment (no package index here); fedsaddle itself from the wheel.
    site = Path(run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    cwd=tmp_path).stdout.strip())  # fmt: skip
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = run([str(venv / "bin" / "pip"), "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([str(venv / "bin" / "python"), "-c", "import fedsaddle.api, fedsaddle.cli; print(fedsaddle.__file__)"],
                cwd=elsewhere)  # fmt: skip
    assert where.stdout.strip().startswith(str(site)), where
    done = run([str(venv / "bin" / "fedsaddle"), "local", "--quiet-clients"], cwd=elsewhere, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scaffold_catalyst_s" in done.stdout and (elsewhere / "runs").is_dir()


def test_new_problem_writes_a_package_whose_test_passes_and_whose_config_runs(tmp_path: Path) -> None:
    made = run([str(SCRIPT), "new", "problem", "robust_fit"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    package = tmp_path / "robust_fit"
    assert (package / "src" / "robust_fit" / "problem.py").is_file()
    tested = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=package)
    assert tested.returncode == 0, tested.stdout[-3000:]
    assert "2 passed" in tested.stdout
    # The config names the class by its path; run from another folder, with no PYTHONPATH, it is found
    # beside the config (its src/), in the coordinator and in the client processes `local` starts.
    split("diabetes", 4, "iid", seed=0, out=package / "data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in ("simulate", "local"):
        done = run([str(SCRIPT), command, "--config", str(package / "run.yaml"), "--data",
                    str(package / "data" / "client-{i:03d}.npz")], cwd=elsewhere)  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert "scaffold_s" in done.stdout
    again = run([str(SCRIPT), "new", "problem", "robust_fit"], cwd=tmp_path)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    bad = run([str(SCRIPT), "new", "problem", "Robust-Fit"], cwd=tmp_path)
    assert bad.returncode == 2 and "must be a Python module name in lower case" in bad.stderr
    shadow = run([str(SCRIPT), "new", "problem", "numpy"], cwd=tmp_path)
    assert shadow.returncode == 2 and "a package of that name would shadow it" in shadow.stderr
    built_in = run([str(SCRIPT), "new", "problem", "auc"], cwd=tmp_path)
    assert built_in.returncode == 2 and "is a built-in problem's" in built_in.stderr
    assert not (tmp_path / "numpy").exists() and not (tmp_path / "auc").exists()
    algorithm = run([str(SCRIPT), "new", "algorithm", "mine"], cwd=tmp_path)
    assert (
        algorithm.returncode == 2
        and "an algorithm plug-in starts from the package examples/algorithm-plugin" in algorithm.stderr
    )


def test_a_plugin_that_cannot_be_found_says_what_to_do_and_for_which_processes(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "problem": {"name": "my_problem", "plugin": "mypkg.problems:MyProblem", "num_clients": 2},
                "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
            }
        )
    )
    done = run([str(SCRIPT), "simulate", "--config", str(config)], cwd=tmp_path)
    assert done.returncode == 2
    said = " ".join(done.stderr.split())
    assert "cannot import 'mypkg.problems': No module named 'mypkg'" in said
    assert f"looked on sys.path and in {tmp_path}" in said
    assert "the coordinator, which reads the config, and every client process (started with --problem" in said
    assert "pip install -e PACKAGE_FOLDER" in said and "PYTHONPATH" in said


@pytest.mark.skipif(not SCRIPT.exists(), reason="the fedsaddle console script is not installed beside Python")
def test_a_client_process_finds_a_plugin_in_the_folder_it_is_started_in(tmp_path: Path) -> None:
    assert run([str(SCRIPT), "new", "problem", "shifted"], cwd=tmp_path).returncode == 0
    package = tmp_path / "shifted"
    split("diabetes", 4, "iid", seed=0, out=package / "data")
    coordinator = subprocess.Popen(
        [str(SCRIPT), "coordinator", "--config", str(package / "run.yaml"), "--listen", "127.0.0.1:0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in CLIENT_ENV.items() if k != "PYTHONPATH"},
    )
    try:
        address = listening_address(coordinator)
        client = run([str(SCRIPT), "--quiet", "client", "--coordinator", address, "--clients", "0-3", "--problem",
                      "shifted.problem:Shifted", "--data", "data/client-{i:03d}.npz"], cwd=package)  # fmt: skip
        assert client.returncode == 0, client.stderr[-2000:]
        out, _ = coordinator.communicate(timeout=60)
        assert coordinator.returncode == 0 and "scaffold_s" in out
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
