"""Partial participation: sampled clients (reproducible, bit for bit across transports) and stragglers."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import config, federation
from test_failures import Coordinator, write_config

from fedsaddle.launch import start_clients
from fedsaddle.server.batch import BatchRun, run_batch
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.pool import sample_clients
from fedsaddle.server.transport.local_pool import LocalPool

PROBLEM = {"name": "quadratic_game", "num_clients": 7, "dim": 3, "heterogeneity": 0.5}
FIVE: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.1},
    {"name": "mirror_prox", "gamma": 0.1},
    {"name": "fedavg_s", "gamma_local": 0.05},
    {"name": "scaffold_s", "gamma_local": 0.05},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.05, "stop": {"rule": "objective", "rtol": 1e-2}},
]
# The newer baselines: two of them answer named local computations (COMPUTE tasks).
NEWER: list[dict[str, Any]] = [
    {"name": "fedgda_gt", "eta": 0.05},
    {"name": "local_extragradient", "gamma": 0.05},
    {"name": "local_sgda_plus", "eta_x": 0.05, "snapshot_every": 2},
]


def sampled(algorithm: dict[str, Any], **fields: Any) -> Any:
    return config(problem=PROBLEM, algorithms=[algorithm], rounds=25, participation={"fraction": 0.5}, seed=4, **fields)


def test_the_sample_is_drawn_from_the_seed_and_the_round() -> None:
    draws = [sample_clients(4, 0.5, 7, r) for r in range(1, 200)]
    assert all(d is not None and len(d) == 4 and list(d) == sorted(set(d)) for d in draws)
    assert len(set(draws)) > 20  # a new draw every round
    assert draws == [sample_clients(4, 0.5, 7, r) for r in range(1, 200)]
    assert sample_clients(4, 1.0, 7, 3) is None


def test_sampled_rounds_are_bit_identical_over_processes_hosting_several_clients() -> None:
    with federation(7, groups=["0-2", "3", "4-6"]) as pool:
        for algorithm in [*FIVE, *NEWER]:
            run = sampled(algorithm, gradient_noise=0.1)
            remote = run_algorithm(run.algorithms[0], run, pool)
            local = run_algorithm(run.algorithms[0], run, LocalPool())
            assert remote.z_sha256 == local.z_sha256, algorithm["name"]
            traffic = local.traffic["algorithm"]
            assert {k: v for k, v in remote.traffic["algorithm"].items() if not k.startswith("bytes")} == {
                k: v for k, v in traffic.items() if not k.startswith("bytes")
            }
            # Only the 4 drawn clients of each round are counted.
            assert traffic["messages_down"] == traffic["messages_up"] == 4 * traffic["rounds"]
            assert sum(traffic["per_client_floats_up"]) == traffic["floats_up"]
            assert min(traffic["per_client_floats_up"]) < max(traffic["per_client_floats_up"])


def test_a_batch_of_sampled_runs_equals_the_runs_alone() -> None:
    members = [BatchRun(run, run.algorithms[0]) for run in (sampled(a) for a in FIVE)]
    for member, result in zip(members, run_batch(members), strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool())
        assert result.z_sha256 == alone.z_sha256 and result.traffic == alone.traffic


@pytest.mark.parametrize("algorithm", [{**FIVE[2], "decay": "constant"}, FIVE[3], FIVE[4]], ids=lambda a: a["name"])
def test_sampled_runs_still_converge(algorithm: dict[str, Any]) -> None:
    homogeneous = {**PROBLEM, "heterogeneity": 0.0}
    run = config(problem=homogeneous, algorithms=[algorithm], rounds=400, participation={"fraction": 0.5})
    (result,) = [run_algorithm(run.algorithms[0], run, LocalPool())]
    assert result.dist_z < 1e-6


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "minibatch_md", "gamma": 0.02}, {"name": "local_extragradient", "gamma": 0.02}],
    ids=lambda a: a["name"],
)
def test_a_stopped_straggler_does_not_hold_up_the_run(tmp_path: Path, algorithm: dict[str, Any]) -> None:
    # Enough rounds that the run is surely still going when the first progress line (at 10%)
    # has been read and the straggler is stopped: rounds take about a millisecond here.
    rounds = 1000
    path = write_config(
        tmp_path / "run.yaml",
        problem={"name": "paper_regression", "num_clients": 3, "dim": 5},
        algorithms=[algorithm],
        rounds=rounds,
        participation={"straggler_deadline_s": 0.2, "min_clients": 2},
        transport={"round_timeout_s": 30},
        output={"plot": False},
    )
    coordinator = Coordinator(path, tmp_path / "runs")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = start_clients(address, ["0", "1", "2"])
    try:
        coordinator.wait_for(rf"round\s+\d+/{rounds}", 60)
        clients[2].send_signal(signal.SIGSTOP)  # a site that stops answering for a while
        time.sleep(3)
        clients[2].send_signal(signal.SIGCONT)
        code, log, codes = coordinator.finish_with(clients, timeout=120)
    finally:
        for process in clients:
            process.send_signal(signal.SIGCONT) if process.poll() is None else None
    assert code == 0, log
    assert codes == [0, 0, 0]
    (run_dir,) = (tmp_path / "runs").iterdir()
    (summary,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    traffic = summary["traffic"]["algorithm"]
    assert traffic["rounds"] == rounds
    assert traffic["messages_down"] == 3 * rounds  # every round was sent to everyone ...
    # ... and closed without the straggler while it was stopped
    assert 2 * rounds <= traffic["messages_up"] < 3 * rounds
    assert traffic["per_client_floats_up"][2] < traffic["per_client_floats_up"][0]
