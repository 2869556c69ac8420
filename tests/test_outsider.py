"""The wire contract alone is enough: a client written from proto/fedsaddle.proto, without fedsaddle.

tests/outsider_client.py imports only grpc, numpy and the modules protoc
generates here from the proto. It serves linear_regression on its own files with
its own arithmetic, lists its clients out of index order in its Hello, and sends
chunked answers built with protobuf. A real coordinator runs the five algorithms
on it (Catalyst also with the objective stop rule, whose rounds ask for f_i);
every result equals the in-process run up to rounding (the arithmetic is not
fedsaddle's, so not bit for bit), and the counts are exactly the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import linear_regression_files, stop_processes

from fedsaddle import api
from fedsaddle.launch import CLIENT_ENV
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import RunStopped, run_all
from fedsaddle.server.transport.grpc_pool import GrpcPool

ROOT = Path(__file__).resolve().parent.parent
FEATURES, CLIENTS = 100, 5  # z has 200 entries, 1600 bytes: more than one 1024-byte chunk


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The protobuf and gRPC modules, generated from the proto as an outsider would."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("generated")
    proto = ROOT / "proto" / "fedsaddle.proto"
    code = protoc.main(["protoc", f"-I{proto.parent}", f"--python_out={out}", f"--grpc_python_out={out}", str(proto)])
    assert code == 0
    return out


def run_config() -> dict[str, Any]:
    return {
        "name": "outsider",
        "problem": {"name": "linear_regression", "num_clients": CLIENTS, "features": FEATURES, "lam": 0.1},
        "weighting": "samples",
        "evaluate_every": 4,
        "rounds": 24,
        "sync": {"kind": "fixed", "tau": 3},
        "algorithms": [
            {"name": "minibatch_md", "gamma": 0.05},
            {"name": "mirror_prox", "gamma": 0.05},
            {"name": "fedavg_s", "gamma_local": 0.02, "decay": "inverse_sqrt"},
            {"name": "scaffold_s", "gamma_local": 0.02},
            {"name": "scaffold_catalyst_s", "gamma_local": 0.02},
            # the paper's inner stop rule: every gradient round also asks for f_i(z)
            {
                "name": "scaffold_catalyst_s",
                "label": "catalyst_objective_stop",
                "gamma_local": 0.02,
                "stop": {"rule": "objective", "max_inner_syncs": 3},
            },
        ],
        "output": {"plot": False},
        "transport": {"chunk_bytes": 1024},
    }


def test_a_client_written_from_the_proto_alone_runs_every_algorithm(generated: Path, tmp_path: Path) -> None:
    paths = linear_regression_files(tmp_path, CLIENTS, FEATURES, seed=3, rows=(150, 40), held_out=(20, 10))
    config = run_config()
    expected = api.run(config, data=str(tmp_path / "client-{i}.npz"), out=tmp_path / "in-process").results

    script = str(ROOT / "tests" / "outsider_client.py")
    groups = [[0, 2, 1, 3], [4]]  # the first Hello lists its clients out of index order
    logs = [tmp_path / f"outsider-{k}.log" for k in range(len(groups))]
    with GrpcPool(CLIENTS, "127.0.0.1:0", chunk_bytes=1024, round_timeout_s=30) as pool:
        processes = []
        for group, log in zip(groups, logs, strict=True):
            command = [sys.executable, script, str(generated), pool.address, *(f"{i}={paths[i]}" for i in group)]
            with log.open("w") as stderr:
                processes.append(subprocess.Popen(command, env=CLIENT_ENV, stderr=stderr))
        try:
            pool.wait_for_clients(60)
            results = run_all(parse_config(config), pool)
            stacks = pool.numeric_stacks()
        finally:
            pool.close()
            codes = stop_processes(processes)
    assert codes == [0, 0], [log.read_text() for log in logs]
    assert stacks == {"not reported": [0, 1, 2, 3, 4]}  # Ready.numeric_stack is optional

    for got, want in zip(results, expected, strict=True):
        assert got.status == want.status == "ok", (got.name, got.detail)
        scale = np.abs(want.final_z).max()
        assert scale > 0.1  # the runs went somewhere
        np.testing.assert_allclose(got.final_z, want.final_z, rtol=0, atol=1e-10 * scale, err_msg=got.name)
        mse = [r["test_mse"] for r in got.records if "test_mse" in r]
        assert len(mse) >= 3
        np.testing.assert_allclose(mse, [r["test_mse"] for r in want.records if "test_mse" in r], rtol=1e-10)
        for category in ("algorithm", "evaluation"):
            for count in ("rounds", "floats_up", "floats_down", "messages_up", "messages_down"):
                assert got.traffic[category][count] == want.traffic[category][count], (got.name, category, count)


def test_a_client_that_does_not_echo_float32_is_refused_a_float32_run_naming_it(
    generated: Path, tmp_path: Path
) -> None:
    # The outsider reads the proto but not RunSpec.element_type: its Ready says FLOAT64 (the default), as a
    # client released before float32 runs does, and it would read 4-byte entries as 8-byte ones.
    paths = linear_regression_files(tmp_path, 2, 4, seed=3, rows=(20, 30), held_out=(5, 5))
    config = {**run_config(), "problem": {"name": "linear_regression", "num_clients": 2, "features": 4}}
    config.update(evaluate_every=0, precision="float32", algorithms=[{"name": "minibatch_md", "gamma": 0.05}])
    script = str(ROOT / "tests" / "outsider_client.py")
    log = tmp_path / "outsider.log"
    with GrpcPool(2, "127.0.0.1:0", chunk_bytes=1024, round_timeout_s=30) as pool:
        with log.open("w") as stderr:
            command = [sys.executable, script, str(generated), pool.address, *(f"{i}={paths[i]}" for i in (0, 1))]
            process = subprocess.Popen(command, env=CLIENT_ENV, stderr=stderr)
        try:
            pool.wait_for_clients(60)
            with pytest.raises(RunStopped) as caught:
                run_all(parse_config(config), pool)
        finally:
            pool.close()
            stop_processes([process])
    message = str(caught.value)
    assert "answers in FLOAT64, but run" in message and "has precision float32" in message, message
    assert caught.value.result.traffic["algorithm"]["rounds"] == 0  # refused before its first round
