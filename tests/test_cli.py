"""The command line, end to end: simulate, coordinator + clients, local."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CLIENT_ENV, child_pids, fedsaddle, start_clients, strict_json, summary_of
from test_failures import Coordinator

SMALL: dict[str, Any] = {
    "name": "small",
    "problem": {"name": "paper_regression", "num_clients": 4, "dim": 5, "s": 3.0},
    "rounds": 25,
    "sync": {"kind": "random", "p": 0.2},
    "algorithms": [
        {"name": "minibatch_md", "gamma": 0.03},
        {"name": "mirror_prox", "gamma": 0.03},
        {"name": "fedavg_s", "gamma_local": 0.03},
        {"name": "scaffold_s", "gamma_local": 0.03},
        {"name": "scaffold_catalyst_s", "gamma_local": 0.03},
    ],
}


def test_simulate_writes_metrics_summary_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert f"run directory: {run_dir}" in done.stdout
    for name in ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s"):
        assert any(line.startswith(name) for line in done.stdout.splitlines())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    md = [r for r in records if r["algorithm"] == "minibatch_md"]
    assert [r["rounds"] for r in md] == list(range(26))
    assert (run_dir / "distance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [a["rounds"] for a in summary["algorithms"]] == [25, 24, 25, 25, 25]


def test_coordinator_and_client_processes_reproduce_simulate_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    assert fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "sim")).returncode == 0
    coordinator = Coordinator(path, tmp_path / "grpc")
    address = coordinator.wait_for(r"listening on (\S+);", 30).group(1)
    clients = start_clients(address, ["0-1", "2", "3"])  # one process may host several clients
    code, log, codes = coordinator.finish_with(clients, timeout=120)
    assert code == 0, log
    assert codes == [0, 0, 0]
    simulated, remote = summary_of(tmp_path / "sim"), summary_of(tmp_path / "grpc")
    assert remote["transport"]["kind"] == "grpc"
    for a, b in zip(simulated["algorithms"], remote["algorithms"], strict=True):
        assert a["name"] == b["name"]
        assert a["z_sha256"] == b["z_sha256"]
        assert a["traffic"]["algorithm"]["floats_up"] == b["traffic"]["algorithm"]["floats_up"]
        assert b["traffic"]["algorithm"]["bytes_up"] > 0 == a["traffic"]["algorithm"]["bytes_up"]


def test_local_runs_a_federation_of_processes_on_loopback(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "algorithms": SMALL["algorithms"][3:]}))
    done = fedsaddle("local", "--config", str(path), "--out", str(tmp_path / "runs"), "--quiet-clients")
    assert done.returncode == 0, done.stderr
    assert "started 4 client processes for 4 clients" in done.stderr
    assert "WARNING" not in done.stderr  # a clean run ends every session without a complaint
    assert "fedsaddle.client INFO" not in done.stderr  # --quiet-clients, forked clients included
    assert re.search(r"first round done \d+\.\d\d s after the command started", done.stderr)
    summary = summary_of(tmp_path / "runs")
    assert summary["transport"]["client_processes"] == 4
    assert all(a["status"] == "ok" for a in summary["algorithms"])
    simulated = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "sim"))
    assert simulated.returncode == 0, simulated.stderr
    # The client processes report one numeric stack, with the kernel simulate records as its own.
    ((stack, clients),) = summary["transport"]["clients_numeric_stack"].items()
    assert clients == [0, 1, 2, 3] and stack.startswith("numpy ")
    assert stack.endswith(", " + summary_of(tmp_path / "sim")["transport"]["blas"])
    hashes = [a["z_sha256"] for a in summary["algorithms"]]
    assert hashes == [a["z_sha256"] for a in summary_of(tmp_path / "sim")["algorithms"]]


def test_local_ends_its_output_with_the_table_after_the_sessions_have_ended(tmp_path: Path) -> None:
    # On a terminal stdout and stderr interleave: the coordinator's log of sessions ending
    # must not bury the results under it.
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "algorithms": SMALL["algorithms"][:1]}))
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", str(tmp_path / "runs")]
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=CLIENT_ENV
    )
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    ended = [k for k, line in enumerate(lines) if "ended its session" in line]
    assert len(ended) == 4, done.stdout
    header = min(k for k, line in enumerate(lines) if line.startswith("algorithm "))  # then the rounds table's
    assert max(ended) < header
    assert lines[-1].startswith("run directory: ")


def test_a_run_that_overflows_in_the_clients_is_reported_as_diverged_without_numpy_warnings(tmp_path: Path) -> None:
    # 60 local steps of size 1e100 overflow inside the client processes in the first round.
    path = tmp_path / "run.yaml"
    run = {
        "problem": {"name": "quadratic_game", "num_clients": 2, "dim": 4, "heterogeneity": 0.5},
        "sync": {"kind": "fixed", "tau": 60},
        "rounds": 5,
        "algorithms": [{"name": "fedavg_s", "gamma_local": 1e100, "decay": "constant"}],
    }
    path.write_text(yaml.safe_dump(run))
    done = fedsaddle("local", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (result,) = summary_of(tmp_path / "runs")["algorithms"]
    assert result["status"] == "diverged" and result["rounds"] == 1
    assert "RuntimeWarning" not in done.stderr + done.stdout  # the answers say so; numpy need not


@pytest.mark.parametrize("command", ["simulate", "local"])
def test_a_problem_too_large_for_memory_is_an_error_that_says_how_large(tmp_path: Path, command: str) -> None:
    # dim: 1e12 where 1e6 was meant. numpy alone said "Unable to allocate 14.6 TiB for an array with
    # shape (2000000000000,)", with nothing about the config; a single allocation of that size fails
    # at once under Linux's default overcommit heuristic, so this costs no memory.
    path = tmp_path / "run.yaml"
    run = {"problem": {"name": "paper_regression", "num_clients": 2, "dim": 10**12}, "rounds": 3}
    path.write_text(yaml.safe_dump({**run, "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}))
    done = fedsaddle(command, "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "fedsaddle: not enough memory on this machine for problem paper_regression: "
        "its vectors have 2,000,000,000,000 entries, 14.6 TiB each (Unable to allocate"
    ), last
    assert "Traceback" not in done.stderr


def test_outputs_stay_strict_json_when_the_iterate_overflows(tmp_path: Path) -> None:
    # Minibatch MD with a step of 1e200: after step 1, z is about 1e200 and its distance overflows.
    path = tmp_path / "run.yaml"
    run = {
        "problem": {"name": "quadratic_game", "num_clients": 2, "dim": 4},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 1e200}],
    }
    path.write_text(yaml.safe_dump(run))
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())

    lines = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert lines[0]["dist_x"] > 0 and lines[1]["dist_x"] is None and lines[1]["dist_z"] is None
    (result,) = strict_json((run_dir / "summary.json").read_text())["algorithms"]
    assert result["status"] == "diverged" and result["dist_x"] is None


def test_local_clients_are_processes_of_their_own_and_end_with_the_command(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "rounds": 1_000_000, "algorithms": SMALL["algorithms"][:1]}))
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", str(tmp_path / "runs")]
    local = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLIENT_ENV)
    try:
        assert local.stderr is not None
        for line in local.stderr:
            if "first round done" in line:
                break
        clients = child_pids(local.pid)
        assert len(clients) == 4  # one process per client, each with a pid of its own
        local.send_signal(signal.SIGTERM)
        _, err = local.communicate(timeout=60)
    finally:
        local.kill()
    assert local.returncode == 0, err
    assert "stopped by SIGTERM; outputs written, clients told goodbye" in err
    assert all(not Path(f"/proc/{pid}").exists() for pid in clients)  # reaped, none left behind


def test_show_config_prints_the_built_in_run() -> None:
    done = fedsaddle("show-config")
    assert done.returncode == 0
    shown = yaml.safe_load(done.stdout)
    assert shown["problem"]["s"] == 10.0 and shown["rounds"] == 500
    assert [a["name"] for a in shown["algorithms"]] == [
        "minibatch_md",
        "mirror_prox",
        "fedavg_s",
        "scaffold_s",
        "scaffold_catalyst_s",
    ]


def test_version_and_help_say_what_every_option_does_with_its_default() -> None:
    version = fedsaddle("--version")
    assert version.returncode == 0 and version.stdout.startswith("fedsaddle ")
    top = fedsaddle("--help").stdout
    for command in ("simulate", "coordinator", "client", "local", "experiment", "health", "new-token", "show-config"):
        assert f"    {command}" in top
    client = fedsaddle("client", "--help").stdout
    assert "seconds to wait for the coordinator (default: 60.0)" in " ".join(client.split())
    experiment = " ".join(fedsaddle("experiment", "--help").stdout.split())
    assert (
        "(default 500; 1000 for problems; 20 for dp; 2000 for agnostic; 20 for deep-auc; 30 for robust-mlp; "
        "300 for compare)" in experiment
    )
    assert (
        "(default 5, or 1 with --transport grpc; the docs use 20; 10 for dp, agnostic, deep-auc and robust-mlp; "
        "3 for compare)" in experiment
    )
    assert "dp: target epsilons (default 0.5 1 2 4 8; delta 1e-5)" in experiment
    split = " ".join(fedsaddle("data", "split", "--help").stdout.split())
    assert "Dirichlet concentration of label-skew (default: 0.5)" in split
    # An option without a default, or whose help names its default, gets no "(default: None)" after it.
    local = " ".join(fedsaddle("local", "--help").stdout.split())
    assert "run config, YAML or JSON (default: built-in) --out" in local
    assert "(default: None)" not in local + " ".join(client.split())


def test_global_flags_work_before_and_after_the_command() -> None:
    for args in (["--quiet", "show-config"], ["show-config", "--quiet"], ["-v", "show-config"], ["show-config", "-v"]):
        done = fedsaddle(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert yaml.safe_load(done.stdout)["rounds"] == 500


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["experiment", "paper", "--seeds", "0"], "argument --seeds: must be at least 1, got '0'"),
        (["local", "--clients-per-process", "0"], "argument --clients-per-process: must be at least 1, got '0'"),
        (["coordinator", "--config", "x.yaml", "--listen", "0.0.0.0:70000"], "port must be a number from 0 to 65535"),
        (["client", "--coordinator", "localhost", "--clients", "0"], "must be HOST:PORT, got 'localhost'"),
        (["client", "--coordinator", "h:1", "--clients", "2-1"], "client indices must look like"),
        (["client", "--coordinator", "h:1", "--clients", "4294967295"], "client indices must be below 4294967295"),
        (["new-token", "--name", "a", "--clients", "0,99999999999999999999"], "client indices must be below"),
        (
            ["client", "--coordinator", "h:1", "--clients", "0", "--connect-timeout", "-1"],
            "must be a finite number > 0, got '-1'",
        ),
        (
            ["client", "--coordinator", "h:1", "--clients", "0", "--connect-timeout", "inf"],
            "must be a finite number > 0, got 'inf'",
        ),
        (["client", "--coordinator", "h:1", "--clients", "0", "--cert", "c.pem"], "--cert and --key need --ca"),
        (
            ["client", "--coordinator", "h:1", "--clients", "0", "--receive-window-mib", "0.01"],
            "must be 0 (gRPC's own window) or at least 0.0625 (64 KiB), got '0.01'",
        ),
        (["simulate", "--config", "/nonexistent.yaml"], "cannot read config /nonexistent.yaml"),
        (
            ["experiment", "problems", "--tau", "5", "--init", "zeros"],
            "experiment problems does not take --tau, --init (it takes --rounds, --out)",
        ),
        (["experiment", "agnostic", "--s", "3"], "experiment agnostic does not take --s (it takes --seeds, --rounds,"),
        (["experiment", "paper", "--epsilons", "1"], "experiment paper does not take --epsilons"),
    ],
)
def test_bad_values_exit_2_naming_the_value(args: list[str], named: str) -> None:
    done = fedsaddle(*args)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr


def test_progress_is_plain_lines_when_output_is_not_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "rounds": 40, "algorithms": SMALL["algorithms"][:1]}))
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    lines = [line for line in done.stderr.splitlines() if line.startswith("minibatch_md")]
    assert len(lines) == 11  # the first round, then every 10% of the budget
    assert "round     40/40" in lines[-1] and "\r" not in done.stderr


def test_the_rounds_to_each_accuracy_are_printed_and_written_as_the_metrics_show_them(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    run = {
        "problem": {"name": "paper_regression", "num_clients": 4, "dim": 5, "s": 1.0},
        "rounds": 60,
        "sync": {"kind": "fixed", "tau": 5},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.2}, {"name": "scaffold_s", "gamma_local": 0.1}],
        "output": {"accuracies": [1.0, 0.1, 2.5e-2, 1e-30]},
    }
    path.write_text(yaml.safe_dump(run))
    done = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    printed = done.stdout.splitlines()
    start = printed.index(
        "communication rounds until ||x-x*|| <= accuracy (every exchange counted; -: not reached within 60 rounds)"
    )
    assert printed[start + 1].split() == ["algorithm", "1", "1e-01", "0.025", "1e-30"]
    written = {entry["name"]: entry["rounds_to"] for entry in summary_of(tmp_path / "runs")["algorithms"]}
    cells = {}
    for row, name in zip(printed[start + 3 : start + 5], ("minibatch_md", "scaffold_s"), strict=True):
        mine = [line for line in lines if line["algorithm"] == name]
        # The rounds of the first step whose ||x - x*|| is within the accuracy, read from metrics.jsonl.
        expected = {
            label: next((line["rounds"] for line in mine if line["dist_x"] <= accuracy), None)
            for label, accuracy in (("1", 1.0), ("1e-01", 0.1), ("0.025", 2.5e-2), ("1e-30", 1e-30))
        }
        assert written[name] == expected
        assert row.split() == [name, *("-" if v is None else str(v) for v in expected.values())]
        cells[name] = expected
    # Both reach 0.1 within the budget, SCAFFOLD-S sooner; MD never gets to 0.025, SCAFFOLD-S does; no one to 1e-30.
    assert cells["scaffold_s"]["1e-01"] < cells["minibatch_md"]["1e-01"]
    assert cells["minibatch_md"]["0.025"] is None and cells["scaffold_s"]["0.025"] is not None
    assert cells["minibatch_md"]["1e-30"] is None and cells["scaffold_s"]["1e-30"] is None


def test_the_rounds_table_shows_a_start_within_reach_and_a_run_stopped_before_its_first_step() -> None:
    import numpy as np

    from fedsaddle.server.config import parse_config
    from fedsaddle.server.driver import AlgorithmResult
    from fedsaddle.server.report import rounds_table

    config = parse_config(
        {"algorithms": [{"name": "minibatch_md", "gamma": 0.1}], "output": {"accuracies": [10, 1e-3]}}
    )
    traffic = {"algorithm": {"rounds": 3}}
    records: list[dict[str, float | int]] = [
        {"rounds": 0, "paper_rounds": 0, "dist_x": 2.0},
        {"rounds": 3, "paper_rounds": 3, "dist_x": 1e-4},
    ]
    ran = AlgorithmResult("ran", {}, "ok", records, np.zeros(2), 1e-4, 1e-4, traffic, 0.0)
    stopped = AlgorithmResult("stopped", {}, "stopped", [], np.zeros(2), math.nan, math.nan, traffic, 0.0)
    printed = rounds_table([ran, stopped], config)
    assert printed is not None
    _, header, _, first, second = printed.splitlines()
    assert header.split() == ["algorithm", "10", "1e-03"]
    assert first.split() == ["ran", "0", "3"]  # within 10 from the start: 0 rounds
    assert second.split() == ["stopped", "-", "-"]


def test_an_unforeseen_error_that_has_no_words_is_named_by_its_kind() -> None:
    # A bare MemoryError says nothing (numpy's say how much): the command says at least what it was.
    script = (
        "import sys\n"
        "from fedsaddle import cli\n"
        "from fedsaddle.cli import inspection\n"
        "def out_of_memory(args):\n"
        "    raise MemoryError\n"
        "inspection.cmd_show_config = out_of_memory\n"
        "sys.exit(cli.main(['show-config']))\n"
    )
    env = {k: v for k, v in CLIENT_ENV.items() if k != "FEDSADDLE_TRACEBACK"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "fedsaddle: error: MemoryError\n"


def test_a_coordinator_on_a_port_already_taken_says_so(tmp_path: Path) -> None:
    # gRPC says only "Failed to bind to address ...; set GRPC_VERBOSITY=debug ..."; the operator is told why.
    import socket

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"problem": {"name": "quadratic_game", "num_clients": 2, "dim": 2},
                                      "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}))  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = fedsaddle("coordinator", "--config", str(config), "--listen", address, "--out", str(tmp_path / "runs"))
    assert done.returncode == 1
    assert f"fedsaddle: run failed: cannot listen on {address}: Address already in use" in done.stderr
    assert "GRPC_VERBOSITY" not in done.stderr.splitlines()[-1]
    # An address not this host's (TEST-NET-1): the failure alone, not first a warning that the federation is open.
    done = fedsaddle("coordinator", "--config", str(config), "--listen", "192.0.2.1:5000", "--out", str(tmp_path / "r"))
    assert done.returncode == 1
    assert "fedsaddle: run failed: cannot listen on 192.0.2.1:5000: Cannot assign requested address" in done.stderr
    assert "OPEN FEDERATION" not in done.stderr


def test_verbose_shows_fedsaddle_details_not_the_plotting_librarys(tmp_path: Path) -> None:
    # -v printed matplotlib's font search, about a hundred DEBUG lines, whenever a run drew its figure.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"problem": {"name": "quadratic_game", "num_clients": 2, "dim": 2},
                                      "rounds": 5, "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
                                      "output": {"plot": True}}))  # fmt: skip
    done = fedsaddle("-v", "simulate", "--config", str(config), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "distance.png").exists()
    assert "matplotlib" not in done.stderr and "PIL" not in done.stderr


def test_local_on_a_data_problem_without_data_says_so_before_starting_any_process(tmp_path: Path) -> None:
    # It started a client process per client, and each then refused the run for want of its file.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"problem": {"name": "linear_regression", "num_clients": 3, "features": 2},
                                      "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}))  # fmt: skip
    done = fedsaddle("local", "--config", str(config), "--out", str(tmp_path / "runs"), timeout=30)
    assert done.returncode == 2, done.stderr
    assert "fedsaddle: problem linear_regression needs each client's own data file; none was given" in done.stderr
    assert "started" not in done.stdout + done.stderr and not (tmp_path / "runs").exists()
