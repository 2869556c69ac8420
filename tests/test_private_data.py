"""Private data over real processes: each client loads its own file; the coordinator never sees data.

Client processes get only their own files (`--data`); the coordinator's config
names the problem and public hyper-parameters. The federation equals the
in-process run bit for bit; bad data stops the run before round 1 naming the
client, its file and the fault.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from conftest import client_process, read_stderr, stop_processes, strict_json
from test_bad_answers import HandClient
from test_failures import Coordinator, write_config

from fedsaddle import api
from fedsaddle.experiments.datasets import split
from fedsaddle.launch import client_command, client_env
from fedsaddle.server.driver import RunInfo
from fedsaddle.server.report import rounds_table, table
from fedsaddle.server.transport.grpc_pool import GrpcPool

CLIENTS = 10
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plugin" / "src"


@pytest.fixture(scope="module")
def cancer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("breast_cancer")
    return folder, split("breast_cancer", CLIENTS, "label-skew", seed=5, out=folder)


def auc_config(summary: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "name": "auc",
        "problem": {"name": "auc", "num_clients": CLIENTS, "features": 30, "positive_rate": summary["positive_rate"]},
        "weighting": "samples",
        "evaluate_every": 10,
        "rounds": 41,
        "sync": {"kind": "fixed", "tau": 5},
        "algorithms": [
            {"name": "fedavg_s", "gamma_local": 0.01, "decay": "constant"},
            {"name": "scaffold_catalyst_s", "gamma_local": 0.01},
        ],
        "output": {"plot": False},
        **fields,
    }


def test_clients_on_their_own_files_match_the_in_process_run_bit_for_bit(
    tmp_path: Path, cancer: tuple[Path, dict[str, Any]]
) -> None:
    folder, summary = cancer
    config = auc_config(summary)
    pattern = str(folder / "client-{i:03d}.npz")
    local = api.run(config, data=pattern, out=tmp_path / "local")
    remote = api.run(config, data=pattern, transport="grpc", clients_per_process=3, out=tmp_path / "grpc")
    for a, b in zip(local.results, remote.results, strict=True):
        assert a.status == b.status == "ok"
        assert a.z_sha256 == b.z_sha256
        assert [r.get("test_auc") for r in a.records] == [r.get("test_auc") for r in b.records]
        assert a.traffic["evaluation"]["rounds"] == b.traffic["evaluation"]["rounds"] >= 3  # steps 0, 10, 20, ...
        assert a.traffic["algorithm"]["floats_up"] == b.traffic["algorithm"]["floats_up"]
    assert 0.5 < remote.results[1].records[-1]["test_auc"] <= 1.0
    # The run directory holds results, never data: no data file path, no row of any client.
    written = "".join(p.read_text() for p in remote.run_dir.iterdir() if p.suffix in (".json", ".jsonl"))
    assert str(folder) not in written and "client-000" not in written
    first_row = np.load(folder / "client-000.npz")["X"][0]
    assert f"{first_row[0]:.6f}" not in written


def test_the_final_iterate_is_evaluated_and_shown_where_no_distance_can_be(
    tmp_path: Path, cancer: tuple[Path, dict[str, Any]]
) -> None:
    # 41 rounds: FedAvg-S takes 41 steps (evaluated at 0, 10, 20, 30, 40 and the last, 41);
    # SCAFFOLD-Catalyst-S 20 steps of 2 rounds after a 1-round init (0, 10 and 20, the last).
    folder, summary = cancer
    config = auc_config(summary, output={"plot": True})
    remote = api.run(config, data=str(folder / "client-{i:03d}.npz"), transport="grpc", out=tmp_path / "grpc")
    fedavg, catalyst = remote.results
    assert [r["step"] for r in fedavg.records if "test_auc" in r] == [0, 10, 20, 30, 40, 41]
    assert [r["step"] for r in catalyst.records if "test_auc" in r] == [0, 10, 20]
    assert fedavg.traffic["evaluation"]["rounds"] == 6 and catalyst.traffic["evaluation"]["rounds"] == 3
    assert fedavg.traffic["algorithm"]["rounds"] == 41

    # A gRPC coordinator has no z*: the summary says null (strict JSON), the table '-', beside the final AUC.
    written = strict_json((remote.run_dir / "summary.json").read_text())
    for result, entry in zip(remote.results, written["algorithms"], strict=True):
        assert entry["dist_x"] is None and entry["dist_z"] is None
        assert entry["metrics"] == {"test_auc": result.records[-1]["test_auc"]}
        assert entry["rounds_to"] == {}  # no accuracy can be said to be reached
    assert rounds_table(remote.results, api.load(config)) is None
    lines = table(remote.results).splitlines()
    assert lines[0].split()[:4] == ["algorithm", "||x-x*||", "||z-z*||", "test_auc"]
    row = lines[3].split()
    assert row[:4] == ["scaffold_catalyst_s", "-", "-", f"{catalyst.records[-1]['test_auc']:.4g}"]
    # No distance to draw; the held-out metric is drawn instead.
    assert not (remote.run_dir / "distance.png").exists()
    assert (remote.run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_progress_of_a_run_without_a_known_solution_shows_its_held_out_metric(
    tmp_path: Path, cancer: tuple[Path, dict[str, Any]]
) -> None:
    folder, summary = cancer
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(auc_config(summary)))
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", str(tmp_path / "runs")]
    command += ["--data", str(folder / "client-{i:03d}.npz"), "--quiet-clients"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=client_env())
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fedavg_s ") and " round " in line]
    assert lines and all(re.search(r"round +\d+/41  test_auc 0\.\d+ ", line) for line in lines), lines
    assert "||z-z*||" not in done.stderr  # no z* over gRPC: no distance to show


def test_the_run_spec_of_a_real_problem_carries_no_data_and_no_seed(cancer: tuple[Path, dict[str, Any]]) -> None:
    _, summary = cancer
    config = api.load(auc_config(summary))
    with GrpcPool(CLIENTS, "127.0.0.1:0") as pool:
        # A connection each, as separate processes would have (channels in one process share one by default).
        own = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.insecure_channel(pool.address, options=own) for _ in range(CLIENTS)]
        hands = [HandClient(channels[i], [i], auto_ready=False) for i in range(CLIENTS)]
        for hand in hands:
            hand.welcome()
        pool.wait_for_clients(10)
        info = RunInfo("r", config.problem, config.seed, 0.0, "samples")
        failed: list[BaseException] = []

        def start() -> None:
            try:
                pool.start_run(info)
            except Exception as exc:  # the hand clients leave without saying Ready
                failed.append(exc)

        starter = threading.Thread(target=start, daemon=True)
        starter.start()
        specs = [hand.next().run for hand in hands]
        for spec in specs:
            assert not spec.HasField("synthetic_seed")
            assert json.loads(spec.problem_json) == config.problem.model_dump(mode="json")
            assert spec.want_sample_counts
        for hand in hands:
            hand.close()
        starter.join(timeout=10)
        for channel in channels:
            channel.close()
    assert len(failed) == 1 and "disconnected during the start of run r" in str(failed[0])


def start_coordinator(tmp_path: Path, config: dict[str, Any]) -> tuple[Coordinator, str]:
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **config), tmp_path / "runs")
    return coordinator, coordinator.wait_for(r"listening on (\S+);", 30).group(1)


def test_bad_data_stops_its_client_before_it_connects_naming_the_client_the_file_and_the_fault(
    tmp_path: Path, cancer: tuple[Path, dict[str, Any]]
) -> None:
    folder, _ = cancer
    broken = tmp_path / "client-007.npz"
    arrays = dict(np.load(folder / "client-007.npz"))
    arrays["X"][3, 4] = np.nan
    np.savez(broken, **arrays)
    # Nothing listens at port 9: the client never gets as far as dialling.
    command = client_command("127.0.0.1:9", "7", "--data", str(broken), "--connect-timeout", "30", quiet=False)
    done = subprocess.run(command, env=client_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"fedsaddle: client 7: {broken}: X[3, 4] is nan (NaN and Inf are refused)" in done.stderr, done.stderr
    assert "reach" not in done.stderr


def test_a_file_with_other_features_is_refused_before_round_one(
    tmp_path: Path, cancer: tuple[Path, dict[str, Any]]
) -> None:
    folder, summary = cancer
    narrow = tmp_path / "narrow.npz"
    arrays = dict(np.load(folder / "client-002.npz"))
    arrays["X"], arrays["X_test"] = arrays["X"][:, :28], arrays["X_test"][:, :28]
    np.savez(narrow, **arrays)
    coordinator, address = start_coordinator(tmp_path, auc_config(summary))
    files = [str(narrow) if i == 2 else str(folder / f"client-{i:03d}.npz") for i in range(CLIENTS)]
    code, log, _ = coordinator.finish_with(
        [client_process(address, i, "--data", files[i], quiet=False) for i in range(CLIENTS)], 60
    )
    assert code == 1
    assert f"client 2: {narrow}: 28 features, but the problem expects 30" in log, log


def test_a_client_without_its_file_or_trust_in_the_plugin_says_so(tmp_path: Path) -> None:
    split("diabetes", 2, "iid", seed=0, out=tmp_path / "data")
    plugin = "fedsaddle_target_shift:TargetShift"
    config = {
        "problem": {"name": "target_shift", "plugin": plugin, "num_clients": 2, "features": 10},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    env = {**client_env(), "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **config), tmp_path / "runs", env=env)
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    untrusting = client_process(address, 0, "--data", str(tmp_path / "data" / "client-000.npz"), env=env, quiet=False)
    no_file = client_process(address, 1, "--problem", plugin, env=env, quiet=False)
    code, log, _ = coordinator.finish_with([untrusting, no_file], 60)
    assert code == 1
    assert "comes from plugin 'fedsaddle_target_shift:TargetShift', which this process does not trust" in log
    assert "start it with --problem fedsaddle_target_shift:TargetShift" in log


def test_a_plugin_problem_runs_in_simulate_and_over_local_processes(tmp_path: Path) -> None:
    split("diabetes", 4, "label-skew", seed=0, out=tmp_path / "data")
    config = {
        "name": "shift",
        "problem": {
            "name": "target_shift",
            "plugin": "fedsaddle_target_shift:TargetShift",
            "num_clients": 4,
            "features": 10,
        },
        "rounds": 21,
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.1}],
        "output": {"plot": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**client_env(), "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
    data = str(tmp_path / "data" / "client-{i:03d}.npz")
    hashes = []
    for command in ("simulate", "local"):
        out = tmp_path / command
        done = subprocess.run(
            [sys.executable, "-m", "fedsaddle", command, "--config", str(path), "--data", data, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        (run_dir,) = out.iterdir()
        hashes.append(json.loads((run_dir / "summary.json").read_text())["algorithms"][0]["z_sha256"])
    assert hashes[0] == hashes[1]


def test_stopped_clients_print_the_reason(tmp_path: Path, cancer: tuple[Path, dict[str, Any]]) -> None:
    folder, summary = cancer
    # A file that reads, with fewer features than the run's spec says: refused when the run starts (a file
    # that does not read at all stops its client before it connects).
    narrow = tmp_path / "narrow.npz"
    arrays = dict(np.load(folder / f"client-{CLIENTS - 1:03d}.npz"))
    arrays["X"], arrays["X_test"] = arrays["X"][:, :28], arrays["X_test"][:, :28]
    np.savez(narrow, **arrays)
    coordinator, address = start_coordinator(tmp_path, auc_config(summary))
    clients = [
        client_process(address, i, "--data", str(folder / f"client-{i:03d}.npz"), quiet=False)
        for i in range(CLIENTS - 1)
    ]
    clients.append(client_process(address, CLIENTS - 1, "--data", str(narrow), quiet=False))
    try:
        code, log = coordinator.finish(60)
        messages = read_stderr(clients[-1])
    finally:
        stop_processes(clients)
    assert code == 1
    fault = f"client {CLIENTS - 1}: {narrow}: 28 features, but the problem expects 30"
    assert fault in log
    assert fault in messages and "the coordinator ended the run as failed" in messages


BLAS_SCRIPT = """
import json, sys
import numpy as np  # loaded first, as in a notebook: BLAS starts with a thread per core
from fedsaddle import api
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import run_all
from fedsaddle.server.transport.local_pool import LocalPool
config, pattern = json.loads(sys.argv[1]), sys.argv[2]
pool = LocalPool(data={i: pattern.format(i=i) for i in range(2)})  # no api around it
direct = run_all(parse_config(config), pool)
local = api.run(config, data=pattern, out=sys.argv[3] + "/local")
remote = api.run(config, data=pattern, transport="grpc", out=sys.argv[3] + "/grpc")
print(json.dumps([[r.z_sha256 for r in run] for run in (direct, local.results, remote.results)]))
"""


def test_a_notebook_with_multithreaded_blas_gets_the_same_bits_in_process_as_over_grpc(tmp_path: Path) -> None:
    # XᵀX of 6000 rows has other bits on two BLAS threads than on one: an in-process run, through
    # the api or on a LocalPool of its own, must use the count the client processes use
    # (common/blas.py), whatever the caller's numpy had.
    rng = np.random.default_rng(4)
    for i in range(2):
        x = rng.standard_normal((6000, 100))
        np.savez(tmp_path / f"c{i}.npz", X=x, y=x @ rng.standard_normal(100) + rng.standard_normal(6000))
    config = {
        "problem": {"name": "linear_regression", "num_clients": 2, "features": 100, "lam": 0.1},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    env = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    done = subprocess.run(
        [sys.executable, "-c", BLAS_SCRIPT, json.dumps(config), str(tmp_path / "c{i}.npz"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    direct, local, remote = json.loads(done.stdout.splitlines()[-1])
    assert direct == local == remote
