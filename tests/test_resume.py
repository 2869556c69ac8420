"""A run cut short resumes from its checkpoint, and ends as if nothing had happened.

Real processes and signals: the coordinator is killed at several points (between
checkpoints, in the second algorithm, in the middle of writing a checkpoint), a
new one resumes the run directory on the same address, and the clients, which
were never restarted, reconnect by themselves. A run stopped by SIGTERM, or failed
by a lost client, resumes too, with its clients started again. The final iterates,
every count and metrics.jsonl (no line missing, none twice) equal an uninterrupted
run's.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLIENT_ENV, client_process, fedsaddle, simulate_stopped_at_a_checkpoint, stop_processes
from test_failures import Coordinator, write_config

from fedsaddle.experiments.datasets import split

ROUNDS = 401
CONFIG: dict[str, Any] = {
    "name": "resumed",
    "problem": {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 3.0},
    "algorithms": [
        {"name": "fedavg_s", "gamma_local": 0.02},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.02, "stop": {"rule": "objective", "rtol": 1e-2}},
    ],
    "rounds": ROUNDS,
    "sync": {"kind": "random", "p": 0.2},
    "gradient_noise": 0.05,
    "output": {"plot": False, "checkpoint_every": 25},
}


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def without_time(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        line.pop("time_s")
    return lines


def simulated(folder: Path, config: dict[str, Any]) -> tuple[Path, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """`fedsaddle simulate` of `config` in `folder`: its run directory, and its summary and metrics lines."""
    path = write_config(folder / "simulated.yaml", **config)
    done = fedsaddle("simulate", "--config", str(path), "--out", str(folder / "simulated"), timeout=300)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (folder / "simulated").iterdir()
    return run_dir, (json.loads((run_dir / "summary.json").read_text()), without_time(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return simulated(tmp_path_factory.mktemp("uninterrupted"), CONFIG)[1]


def resume_coordinator(run_dir: Path, address: str) -> subprocess.Popen[str]:
    """`fedsaddle coordinator --resume run_dir`, listening on `address` (where its clients look for it)."""
    command = [sys.executable, "-m", "fedsaddle", "coordinator", "--resume", str(run_dir), "--listen", address]
    return subprocess.Popen(command, env=CLIENT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed_and_resumed(
    tmp_path: Path,
    kill_when: str,
    env: dict[str, str] | None = None,
    config: dict[str, Any] = CONFIG,
    data: dict[int, str] | None = None,
) -> tuple[Path, int, str, list[int]]:
    """Start a federation, SIGKILL the coordinator once `kill_when` shows in its log, resume it."""
    address = free_address()
    path = write_config(tmp_path / "run.yaml", **config)
    first = Coordinator(path, tmp_path / "runs", listen=address, env=env)
    clients = [
        client_process(address, i, "--connect-timeout", "60", data=data)
        for i in range(config["problem"]["num_clients"])
    ]
    try:
        first.wait_for(kill_when, 120)
        first.process.send_signal(signal.SIGKILL)
        first.finish(timeout=30)
        (run_dir,) = (tmp_path / "runs").iterdir()
        resumed = resume_coordinator(run_dir, address)
        _, log = resumed.communicate(timeout=300)
    finally:
        codes = stop_processes(clients)
    return run_dir, resumed.returncode, log, codes


def assert_same_as_uninterrupted(run_dir: Path, expected: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    summary, lines = expected
    resumed = json.loads((run_dir / "summary.json").read_text())
    for a, b in zip(summary["algorithms"], resumed["algorithms"], strict=True):
        assert a["name"] == b["name"] and a["status"] == b["status"] == "ok"
        assert a["z_sha256"] == b["z_sha256"]
        logical = ("rounds", "messages_down", "messages_up", "floats_down", "floats_up")
        logical += ("per_client_floats_down", "per_client_floats_up")
        assert {k: a["traffic"]["algorithm"][k] for k in logical} == {k: b["traffic"]["algorithm"][k] for k in logical}
        assert all(a.get(k) == b.get(k) for k in ("meta_iterations", "syncs", "steps"))
    assert without_time(run_dir / "metrics.jsonl") == lines  # none missing, none twice


def test_a_coordinator_killed_between_checkpoints_resumes_bit_identical(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    run_dir, code, log, codes = killed_and_resumed(tmp_path, r"fedavg_s\s+round\s+2\d\d/401")
    assert code == 0, log
    assert re.search(r"resuming .* from its checkpoint: fedavg_s at step \d+, after \d+ rounds", log), log
    assert codes == [0, 0, 0]  # never restarted: they reconnected to the new coordinator
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def test_a_secure_federation_killed_between_checkpoints_resumes_bit_identical_with_new_keys(tmp_path: Path) -> None:
    config = {**CONFIG, "name": "resumed-secure", "algorithms": CONFIG["algorithms"][:1]}
    config["privacy"] = {"secure_aggregation": True}
    _, expected = simulated(tmp_path, config)
    run_dir, code, log, codes = killed_and_resumed(tmp_path, r"fedavg_s\s+round\s+2\d\d/401", config=config)
    assert code == 0, log
    assert codes == [0, 0, 0]
    assert_same_as_uninterrupted(run_dir, expected)
    # The clients agreed on keys twice: once at the start, once with the resumed coordinator.
    (before,), (after,) = expected[0]["algorithms"], json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert after["traffic"]["privacy"]["rounds"] == before["traffic"]["privacy"]["rounds"] + 1


COMPUTING: dict[str, Any] = {
    **CONFIG,
    "name": "computing",
    "algorithms": [{"name": "local_sgda_plus", "eta_x": 0.02, "eta_y": 0.03, "snapshot_every": 3}],
}


def test_an_algorithm_of_compute_tasks_killed_between_checkpoints_resumes_bit_identical(tmp_path: Path) -> None:
    # Local SGDA+ runs its own client computation (COMPUTE tasks) and keeps a snapshot x~ in its
    # state: the framework's checkpoint carries it, and the resumed run ends as the uninterrupted one.
    _, expected = simulated(tmp_path, COMPUTING)
    run_dir, code, log, codes = killed_and_resumed(tmp_path, r"local_sgda_plus\s+round\s+2\d\d/401", config=COMPUTING)
    assert code == 0, log
    assert re.search(r"resuming .* from its checkpoint: local_sgda_plus at step \d+", log), log
    assert codes == [0, 0, 0]
    assert_same_as_uninterrupted(run_dir, expected)


def test_a_coordinator_killed_in_the_second_algorithm_keeps_the_first(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    run_dir, code, log, codes = killed_and_resumed(tmp_path, r"scaffold_catalyst_s\s+round\s+1\d\d/401")
    assert code == 0, log
    assert codes == [0, 0, 0]
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def test_a_coordinator_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    slow = {**CLIENT_ENV, "FEDSADDLE_TEST_CHECKPOINT_PAUSE": "1"}
    # The second checkpoint write: the first is complete, the second only a temporary file.
    run_dir, code, log, codes = killed_and_resumed(tmp_path, r"writing checkpoint at round [1-9]\d", env=slow)
    assert code == 0, log
    assert codes == [0, 0, 0]
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def stopped_and_resumed(tmp_path: Path, how: str) -> tuple[Path, int, str, int, str, list[int]]:
    """Start a federation and end its run early without killing the coordinator: SIGTERM to the
    coordinator ("term"), or SIGKILL to a client, which fails the run ("client"). Then resume it, with
    the clients started again (they were told the run ended, and exited)."""
    address = free_address()
    path = write_config(tmp_path / "run.yaml", **CONFIG)

    def start_clients() -> list[subprocess.Popen[bytes]]:
        return [client_process(address, i, "--connect-timeout", "60", quiet=False) for i in range(3)]

    first = Coordinator(path, tmp_path / "runs", listen=address)
    clients = start_clients()
    try:
        first.wait_for(r"fedavg_s\s+round\s+2\d\d/401", 120)
        if how == "term":
            first.process.send_signal(signal.SIGTERM)
        else:
            clients[1].send_signal(signal.SIGKILL)
        code, _ = first.finish(timeout=60)
        outputs = [c.communicate(timeout=30)[1].decode() for c in clients if c.returncode != -signal.SIGKILL]
        (run_dir,) = (tmp_path / "runs").iterdir()
        failure = json.loads((run_dir / "summary.json").read_text())["transport"]["failure"]
        resumed = resume_coordinator(run_dir, address)
        clients += start_clients()
        _, log = resumed.communicate(timeout=300)
    finally:
        codes = stop_processes(clients)
    return run_dir, code, failure, resumed.returncode, log + "".join(outputs), codes


def test_a_run_stopped_by_sigterm_resumes_bit_identical(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    run_dir, first, failure, code, log, codes = stopped_and_resumed(tmp_path, "term")
    assert first == 0 and failure == "stopped by SIGTERM"
    assert "it can resume the run from its checkpoint (start the clients again then)" in log  # the clients' goodbye
    assert code == 0, log
    resuming = r"resuming .* from its checkpoint: fedavg_s at step \d+, after \d+ rounds"
    assert re.search(resuming + r" \(it had stopped: stopped by SIGTERM\)", log), log
    assert codes == [0, 0, 0, 0, 0, 0]
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def test_a_run_failed_by_a_lost_client_resumes_bit_identical(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    run_dir, first, failure, code, log, codes = stopped_and_resumed(tmp_path, "client")
    assert first == 1 and re.match(r"client 1 \(.*\) disconnected (during|before) round \d+", failure), failure
    assert code == 0, log
    assert "(it had stopped: client 1 (" in log
    assert codes == [1, -signal.SIGKILL, 1, 0, 0, 0]  # the others were told the run failed
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def test_fedsaddle_local_resumes_a_run_it_was_stopped_in(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    path = write_config(tmp_path / "run.yaml", **CONFIG)
    first = Coordinator(path, tmp_path / "runs", command="local")
    first.wait_for(r"fedavg_s\s+round\s+2\d\d/401", 120)
    first.process.send_signal(signal.SIGTERM)
    code, _ = first.finish(timeout=60)
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["transport"]["failure"] == "stopped by SIGTERM"
    done = fedsaddle("local", "--resume", str(run_dir), "--quiet-clients", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "(it had stopped: stopped by SIGTERM)" in done.stderr
    assert f"run directory: {run_dir} (resumed)" in done.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted)


def private_run(tmp_path: Path, **fields: Any) -> tuple[dict[str, Any], str]:
    """AUC on breast cancer split over 3 clients, each with its own file under tmp_path/data, held-out
    rows evaluated and sample weights: the config (with `fields`), and the --data pattern."""
    shares = split("breast_cancer", 3, "iid", seed=2, out=tmp_path / "data")
    config = {
        "name": "private",
        "problem": {"name": "auc", "num_clients": 3, "features": 30, "positive_rate": shares["positive_rate"]},
        "weighting": "samples",
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.04}],
        "output": {"plot": False, "checkpoint_every": 25},
        **fields,
    }
    return config, str(tmp_path / "data" / "client-{i:03d}.npz")


def test_simulate_resumes_a_stopped_private_data_run_once_given_the_data(tmp_path: Path) -> None:
    config, pattern = private_run(tmp_path, evaluate_every=100, rounds=401)
    path = write_config(tmp_path / "run.yaml", **config)
    whole = fedsaddle("simulate", "--config", str(path), "--data", pattern, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    (expected,) = (tmp_path / "whole").iterdir()
    # Stopped while writing its second checkpoint (round 50; each write pauses then), so a short run does not
    # end first: it resumes from the first (round 25).
    run_dir, log = simulate_stopped_at_a_checkpoint(tmp_path, "--config", str(path), "--data", pattern, past_round=25)
    assert "stopped by SIGTERM; outputs written\n" in log  # (no clients to tell)
    assert json.loads((run_dir / "summary.json").read_text())["transport"]["failure"] == "stopped by SIGTERM"
    before = digest(run_dir)
    refused = fedsaddle("simulate", "--resume", str(run_dir), timeout=60)
    assert refused.returncode == 2 and "needs each client's own data file" in refused.stderr, refused.stderr
    assert digest(run_dir) == before  # the stopped run's summary and metrics are as they were
    done = fedsaddle("simulate", "--resume", str(run_dir), "--data", pattern, timeout=300)
    assert done.returncode == 0, done.stderr
    (a,) = json.loads((expected / "summary.json").read_text())["algorithms"]
    (b,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert a["z_sha256"] == b["z_sha256"] and a["metrics"] == b["metrics"]
    assert b["dist_z"] is not None and a["dist_z"] == b["dist_z"]  # z* solved from the data again
    assert without_time(run_dir / "metrics.jsonl") == without_time(expected / "metrics.jsonl")


def test_a_private_data_run_with_evaluation_resumes_bit_identical(tmp_path: Path) -> None:
    # Each client reloads its own file for the resumed run; the evaluations (every 10 steps and
    # the last) come out as in a run that was never interrupted.
    config, pattern = private_run(tmp_path, evaluate_every=10, rounds=301, sync={"kind": "random", "p": 0.2})
    data = {i: pattern.format(i=i) for i in range(3)}
    path = write_config(tmp_path / "whole.yaml", **config)
    whole = fedsaddle("local", "--config", str(path), "--data", pattern, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    (expected,) = (tmp_path / "whole").iterdir()
    (tmp_path / "killed").mkdir()
    run_dir, code, log, codes = killed_and_resumed(
        tmp_path / "killed", r"scaffold_s\s+round\s+1\d\d/301", config=config, data=data
    )
    assert code == 0, log
    assert re.search(r"resuming .* from its checkpoint: scaffold_s at step \d+, after \d+ rounds", log), log
    assert codes == [0, 0, 0]
    (a,) = json.loads((expected / "summary.json").read_text())["algorithms"]
    (b,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert a["z_sha256"] == b["z_sha256"] and a["metrics"] == b["metrics"] and 0.5 < b["metrics"]["test_auc"] <= 1
    assert a["traffic"]["evaluation"]["rounds"] == b["traffic"]["evaluation"]["rounds"] >= 2
    assert without_time(run_dir / "metrics.jsonl") == without_time(expected / "metrics.jsonl")


def digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()


def test_a_damaged_or_mismatched_checkpoint_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    address = free_address()
    path = write_config(tmp_path / "run.yaml", **{**CONFIG, "rounds": 1_000_000})
    coordinator = Coordinator(path, tmp_path / "runs", listen=address)
    clients = [client_process(address, i) for i in range(3)]
    try:
        coordinator.wait_for(r"fedavg_s\s+round", 60)
        deadline = time.monotonic() + 60
        while not list((tmp_path / "runs").glob("*/checkpoint.npz")) and time.monotonic() < deadline:
            time.sleep(0.1)  # the first checkpoint comes after 25 rounds
        coordinator.process.send_signal(signal.SIGKILL)
        coordinator.finish(timeout=30)
    finally:
        stop_processes(clients, grace=0)  # (they would wait for a coordinator again: only the run directory counts)
    (run_dir,) = (tmp_path / "runs").iterdir()

    def refused(expected: str) -> None:
        before = digest(run_dir)
        done = fedsaddle("coordinator", "--resume", str(run_dir), "--listen", address, timeout=60)
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr, done.stderr
        assert digest(run_dir) == before  # nothing was touched

    good = (run_dir / "checkpoint.npz").read_bytes()
    (run_dir / "checkpoint.npz").write_bytes(good[: len(good) // 2])
    refused("is damaged or truncated")
    (run_dir / "checkpoint.npz").write_bytes(good)
    with np.load(run_dir / "checkpoint.npz") as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(str(arrays["__meta__"]))
    meta["traffic"]["algorithm"]["per_client_floats_up"].pop()
    np.savez(run_dir / "checkpoint.npz", **{**arrays, "__meta__": np.array(json.dumps(meta))})
    refused("the traffic counts are damaged (per_client_floats_up has 2 entries for 3 clients)")
    (run_dir / "checkpoint.npz").write_bytes(good)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "seed": 1}))
    refused("belongs to another config")
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "summary.json").write_text(json.dumps({"transport": {"failure": None}, "algorithms": []}))
    refused("holds a finished run")
    (run_dir / "summary.json").write_text('{"transport": ')
    refused("summary.json cannot be read (JSONDecodeError")
    refused_elsewhere = fedsaddle("coordinator", "--resume", str(run_dir.parent), "--listen", address, timeout=60)
    assert refused_elsewhere.returncode == 2
    assert f"{run_dir.parent} is not a run directory (it has no config.json)" in refused_elsewhere.stderr
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint.npz").unlink()
    refused("has no checkpoint.npz")


EVERY = 20
FIVE: dict[str, Any] = {
    "name": "five",
    "problem": {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 3.0},
    "algorithms": [
        {"name": "minibatch_md", "gamma": 0.01},
        {"name": "mirror_prox", "gamma": 0.01},
        {"name": "fedavg_s", "gamma_local": 0.02},
        {"name": "scaffold_s", "gamma_local": 0.02},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.02},
    ],
    "rounds": 301,
    "sync": {"kind": "random", "p": 0.2},
    "gradient_noise": 0.05,
    "output": {"plot": False, "checkpoint_every": EVERY},
}


def last_rounds(run_dir: Path, algorithm: str) -> int:
    """The rounds of the last step of `algorithm` that metrics.jsonl records (each step's line is flushed)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(line["rounds"] for line in lines if line["algorithm"] == algorithm)


def test_a_coordinator_killed_in_each_of_five_algorithms_redoes_at_most_checkpoint_every_rounds(
    tmp_path: Path,
) -> None:
    names = [a["name"] for a in FIVE["algorithms"]]
    path = write_config(tmp_path / "run.yaml", **FIVE)
    run_dir, expected = simulated(tmp_path, FIVE)
    with np.load(run_dir / "checkpoint.npz") as archive:  # simulate checkpoints the last algorithm too
        assert json.loads(str(archive["__meta__"]))["algorithm_index"] == len(names) - 1

    address = free_address()
    coordinator = Coordinator(path, tmp_path / "runs", listen=address)
    clients = [client_process(address, i, "--connect-timeout", "60") for i in range(3)]
    redone: dict[str, int] = {}
    try:
        for name in names:  # killed once in each algorithm, each time resumed by a new coordinator
            coordinator.wait_for(rf"{name}\s+round\s+1\d\d/301", 120)
            coordinator.process.send_signal(signal.SIGKILL)
            coordinator.finish(timeout=30)
            (run_dir,) = (tmp_path / "runs").iterdir()
            reached = last_rounds(run_dir, name)
            coordinator = Coordinator(path, tmp_path, listen=address, arguments=["--resume", str(run_dir)])
            resumed = coordinator.wait_for(r"from its checkpoint: (\w+) at step \d+, after (\d+) rounds", 60)
            assert resumed.group(1) == name  # not an earlier algorithm's checkpoint
            redone[name] = reached - int(resumed.group(2))
        code, log = coordinator.finish(timeout=300)
    finally:
        if coordinator.process.poll() is None:
            coordinator.process.kill()
        codes = stop_processes(clients)
    assert code == 0, log
    assert codes == [0, 0, 0]  # never restarted: they reconnected to each new coordinator
    assert set(redone) == set(names)
    assert all(0 <= rounds <= EVERY for rounds in redone.values()), redone
    assert_same_as_uninterrupted(run_dir, expected)
