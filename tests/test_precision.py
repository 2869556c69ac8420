"""precision: float32: float32 on the wire, in the state, in checkpoints and in the final iterate; the same
bits in process and over gRPC; the same counts as float64, at half the bytes; float64 runs as before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    config,
    federation,
    fedsaddle,
    linear_regression_files,
    simulate_stopped_at_a_checkpoint,
)
from test_failures import write_config

from fedsaddle.common import wire
from fedsaddle.common.numeric import sha256
from fedsaddle.common.tasks import GradientTask, LocalStepsTask
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.algorithms.base import flatten_state
from fedsaddle.server.batch import BatchRun, run_batch
from fedsaddle.server.config import ConfigError
from fedsaddle.server.driver import AlgorithmResult, StepDone, run_algorithm
from fedsaddle.server.pool import ClientPool
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

EIGHT: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.02},
    {"name": "mirror_prox", "gamma": 0.02},
    {"name": "fedavg_s", "gamma_local": 0.02, "decay": "inverse_sqrt"},
    {"name": "scaffold_s", "gamma_local": 0.02},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.02, "theta": 1.0},
    {"name": "local_sgda_plus", "eta_x": 0.02},
    {"name": "fedgda_gt", "eta": 0.02},
    {"name": "local_extragradient", "gamma": 0.02},
]
PAPER = {"name": "paper_regression", "num_clients": 4, "dim": 10, "s": 5.0}
NOISY = {"sync": {"kind": "random", "p": 0.3}, "gradient_noise": 0.05}


def float32_run(algorithm: dict[str, Any], **fields: Any) -> Any:
    return config(problem=PAPER, algorithms=[algorithm], rounds=41, **{"precision": "float32", **NOISY, **fields})


def run_with_states(run: Any, pool: ClientPool) -> tuple[AlgorithmResult, set[str]]:
    """The run's result, and the dtypes of every array of every state it went through."""
    dtypes: set[str] = set()

    def on_step(_run: Any, step: StepDone, _pool: ClientPool) -> None:
        arrays, _ = flatten_state(step.state)
        dtypes.update(str(array.dtype) for array in arrays.values())

    return run_algorithm(run.algorithms[0], run, pool, on_step=on_step), dtypes


@pytest.fixture(scope="module")
def four_processes() -> Iterator[GrpcPool]:
    # Two processes of two clients each: an answer carries two rows (the fold's block path).
    with federation(4, groups=["0,1", "2,3"]) as pool:
        yield pool
    assert pool.client_exit_codes == [0, 0]  # type: ignore[attr-defined]


# The paper's inner stop rule: every gradient round also carries f_i(z) (Answer.objective, float32 too).
OBJECTIVE_STOP = {**EIGHT[4], "label": "objective_stop", "stop": {"rule": "objective", "max_inner_syncs": 3}}


@pytest.mark.parametrize("algorithm", [*EIGHT, OBJECTIVE_STOP], ids=lambda a: a.get("label") or a["name"])
def test_a_float32_run_over_grpc_equals_the_in_process_run_bit_for_bit(
    four_processes: GrpcPool, algorithm: dict[str, Any]
) -> None:
    run = float32_run(algorithm)
    remote, remote_dtypes = run_with_states(run, four_processes)
    local, local_dtypes = run_with_states(run, LocalPool())
    assert remote.status == local.status == "ok", (remote.detail, local.detail)
    assert remote.final_z.dtype == local.final_z.dtype == np.float32
    assert remote_dtypes == local_dtypes == {"float32"}  # the algorithm's state never widens
    assert remote.z_sha256 == local.z_sha256 == sha256(local.final_z)
    assert [r["dist_z"] for r in remote.records] == [r["dist_z"] for r in local.records]
    # The same exchanges and entries as the float64 run; on the wire, 4 bytes an entry plus framing.
    wide = run.model_copy(update={"precision": "float64"})
    float64 = run_algorithm(wide.algorithms[0], wide, LocalPool())
    counts = remote.traffic["algorithm"]
    for key in ("rounds", "messages_down", "messages_up", "floats_down", "floats_up"):
        assert counts[key] == local.traffic["algorithm"][key] == float64.traffic["algorithm"][key], key
    # (a task goes once to each process of two clients; each client's row goes up)
    assert 2 * counts["floats_down"] < counts["bytes_down"] < 2 * counts["floats_down"] + 100 * counts["messages_down"]
    assert 4 * counts["floats_up"] < counts["bytes_up"] < 4 * counts["floats_up"] + 100 * counts["messages_up"]
    # Rounded, not another method: the float32 iterate stays near the float64 one.
    np.testing.assert_allclose(local.final_z, float64.final_z, rtol=0, atol=1e-4 * np.abs(float64.final_z).max())


@pytest.mark.parametrize("algorithm", [EIGHT[2], EIGHT[4]], ids=lambda a: a["name"])
def test_float32_payloads_in_chunks_add_up_as_they_come_to_the_same_bits(algorithm: dict[str, Any]) -> None:
    # d = 600: a 2400-byte answer in 1024-byte chunks, cut inside entries; the fold reads them as they come.
    run = config(
        problem={**PAPER, "dim": 600},
        algorithms=[algorithm],
        rounds=12,
        precision="float32",
        transport={"chunk_bytes": 1024},
        **NOISY,
    )
    with federation(4, chunk_bytes=1024) as pool:
        remote = run_algorithm(run.algorithms[0], run, pool)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert remote.status == local.status == "ok"
    assert remote.z_sha256 == local.z_sha256
    assert pool.client_exit_codes == [0] * 4  # type: ignore[attr-defined]


def test_float32_halves_the_bytes_of_a_round_at_the_same_counts() -> None:
    # One federation, both precisions, d = 4000: the payloads dominate the framing.
    runs = {
        precision: config(
            problem={**PAPER, "dim": 2000},
            algorithms=[{"name": "scaffold_s", "gamma_local": 0.02}],
            rounds=9,
            precision=precision,
        )
        for precision in ("float64", "float32")
    }
    with federation(4) as pool:
        results = {p: run_algorithm(run.algorithms[0], run, pool) for p, run in runs.items()}
    wide, narrow = (results[p].traffic["algorithm"] for p in ("float64", "float32"))
    assert {k: v for k, v in wide.items() if not k.startswith("bytes")} == {
        k: v for k, v in narrow.items() if not k.startswith("bytes")
    }
    for direction in ("bytes_down", "bytes_up"):
        assert 0.49 < narrow[direction] / wide[direction] < 0.51, (direction, narrow[direction], wide[direction])


def test_a_float32_task_and_answer_travel_as_four_byte_entries() -> None:
    z = np.arange(5, dtype=np.float32) / 3
    control = -z
    task = LocalStepsTask(z, 3, 0.1, control=control)
    (header,) = wire.encode_task("r", 7, task, 1 << 20, dtype=wire.FLOAT32)
    message = pb.Instruction.FromString(header).task
    assert message.payload_length == 10 and len(message.payload) == 40
    assert message.payload == z.tobytes() + control.tobytes()
    back = wire.decode_task(message, message.payload, 5, dtype=wire.FLOAT32)
    assert isinstance(back, LocalStepsTask) and back.z_start.dtype == np.float32
    np.testing.assert_array_equal(back.z_start, z)
    np.testing.assert_array_equal(back.control, control)
    with pytest.raises(wire.WireError, match=r"payload_length 10 \(40 bytes\).*80 bytes \(20 float32 entries\)"):
        wire.check_inline(10, bytes(80), wire.FLOAT32)
    # float64, the default: 8 bytes an entry, and the RunSpec-free bytes of before.
    (wide,) = wire.encode_task("r", 7, GradientTask(z.astype(np.float64)), 1 << 20)
    assert len(pb.Instruction.FromString(wide).task.payload) == 40


def test_the_final_iterate_file_is_float32_and_hashes_as_the_summary_says(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        name="narrow",
        problem=PAPER,
        algorithms=[EIGHT[3]],
        rounds=21,
        precision="float32",
        output={"plot": False},
    )
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == "float32"
    (entry,) = summary["algorithms"]
    z = np.load(run_dir / entry["z_file"])
    assert z.dtype == np.dtype("<f4") and z.shape == (20,)
    assert entry["z_sha256"] == sha256(z)
    # the table's payload megabytes count 4 bytes an entry
    floats = entry["traffic"]["algorithm"]["floats_up"]
    assert f"/{floats * 4 / 1e6:.3f}" in done.stdout


def test_float32_is_refused_with_secure_aggregation_and_with_dp_saying_why() -> None:
    with pytest.raises(
        ConfigError, match="precision: float32 does not combine with secure aggregation: its fixed-point"
    ):
        float32_run(EIGHT[0], privacy={"secure_aggregation": True})
    with pytest.raises(ConfigError, match="precision: float32 does not combine with differential privacy: rounding"):
        float32_run(EIGHT[0], privacy={"dp": {"clip": 1.0, "noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match=r"precision: .*'float64' or 'float32'"):
        float32_run(EIGHT[0], precision="float16")


def test_a_batch_of_runs_refuses_float32() -> None:
    run = float32_run(EIGHT[0])
    with pytest.raises(ValueError, match="precision float32, which batched runs do not offer"):
        run_batch([BatchRun(run, run.algorithms[0])])


def test_a_float32_run_resumes_to_the_same_bits_and_never_in_another_precision(tmp_path: Path) -> None:
    fields: dict[str, Any] = {
        "name": "narrow",
        "problem": {**PAPER, "num_clients": 3},
        "algorithms": [{"name": "scaffold_catalyst_s", "gamma_local": 0.02}],
        "rounds": 301,
        "precision": "float32",
        "output": {"plot": False, "checkpoint_every": 25},
        **NOISY,
    }
    path = write_config(tmp_path / "run.yaml", **fields)
    whole = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "whole"), timeout=300)
    assert whole.returncode == 0, whole.stderr
    (expected,) = (tmp_path / "whole").iterdir()
    # Stopped while writing its second checkpoint (each write pauses then), so a short run does not end first.
    run_dir, log = simulate_stopped_at_a_checkpoint(tmp_path, "--config", str(path), past_round=25)
    assert "stopped by SIGTERM" in log  # (cut short: the resumed run has rounds left to do)
    with np.load(run_dir / "checkpoint.npz") as archive:
        states = [archive[name] for name in archive.files if name.startswith("state/")]
    assert states and all(array.dtype == np.float32 for array in states)
    # The same run dir asked to go on in float64: refused, naming both precisions, nothing changed.
    config_file = run_dir / "config.json"
    written = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(written), "precision": "float64"}))
    before = (run_dir / "metrics.jsonl").read_text()
    refused = fedsaddle("simulate", "--resume", str(run_dir), timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "cannot resume: " in refused.stderr and "written by a run of precision float32" in refused.stderr
    assert "asks for precision float64" in refused.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before
    config_file.write_text(written)
    done = fedsaddle("simulate", "--resume", str(run_dir), timeout=300)
    assert done.returncode == 0, done.stderr
    (a,) = json.loads((expected / "summary.json").read_text())["algorithms"]
    (b,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert a["z_sha256"] == b["z_sha256"] and a["traffic"] == b["traffic"]


def test_simulate_and_local_give_the_same_float32_hashes_for_the_papers_five(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        name="narrow",
        problem={**PAPER, "num_clients": 2},
        algorithms=EIGHT[:5],
        rounds=21,
        precision="float32",
        output={"plot": False},
        **NOISY,
    )
    simulated = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "sim"))
    assert simulated.returncode == 0, simulated.stderr
    local = fedsaddle("local", "--config", str(path), "--out", str(tmp_path / "local"), "--quiet-clients")
    assert local.returncode == 0, local.stderr
    (sim,), (grpc,) = (tmp_path / "sim").iterdir(), (tmp_path / "local").iterdir()
    hashes = [[a["z_sha256"] for a in json.loads((d / "summary.json").read_text())["algorithms"]] for d in (sim, grpc)]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == 5
    same = fedsaddle("compare-runs", str(sim), str(grpc))
    assert same.returncode == 0 and same.stdout.startswith("same: "), same.stdout


def test_a_float32_run_on_private_data_weighted_by_samples_and_evaluated_is_the_same_over_grpc(tmp_path: Path) -> None:
    # Sample weights multiply float32 rows in the sums, and evaluation rounds carry float32 metrics.
    linear_regression_files(tmp_path, 3, 6, seed=5, rows=(40, 15), held_out=(10, 5))
    path = write_config(
        tmp_path / "run.yaml",
        name="private",
        problem={"name": "linear_regression", "num_clients": 3, "features": 6, "lam": 0.1},
        weighting="samples",
        evaluate_every=4,
        algorithms=[EIGHT[1], EIGHT[3]],
        rounds=21,
        precision="float32",
        output={"plot": False},
    )
    data = str(tmp_path / "client-{i}.npz")
    runs = {}
    for command, extra in (("simulate", []), ("local", ["--quiet-clients"])):
        done = fedsaddle(command, "--config", str(path), "--data", data, "--out", str(tmp_path / command), *extra)
        assert done.returncode == 0, done.stderr
        (run_dir,) = (tmp_path / command).iterdir()
        runs[command] = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    for simulated, federated in zip(runs["simulate"], runs["local"], strict=True):
        assert simulated["status"] == federated["status"] == "ok"
        assert simulated["z_sha256"] == federated["z_sha256"]
        assert simulated["metrics"] == federated["metrics"] and simulated["metrics"]["test_mse"] > 0
        mse = simulated["metrics"]["test_mse"]
        assert float(np.float32(mse)) == mse  # a float32 run's metrics are float32 values
