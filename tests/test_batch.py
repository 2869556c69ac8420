"""Batches of runs: every run of a batch equals the same run alone, bit for bit; the paper command."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLIENT_ENV, config
from fedsaddle_fedprox_gda import FEDPROX_GDA

from fedsaddle.common import computations
from fedsaddle.common.problems import make_shards, stack_shards
from fedsaddle.common.worker import ShardCache
from fedsaddle.experiments.datasets import split
from fedsaddle.experiments.grid import Grid, best_steps, quartiles, run_grid
from fedsaddle.server.algorithms import register, unregister
from fedsaddle.server.batch import BatchRun, run_batch, run_batches
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool

ALGORITHMS: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.1},
    {"name": "mirror_prox", "gamma": 0.1},
    {"name": "fedavg_s", "gamma_local": 0.1, "decay": "inverse_sqrt"},
    {"name": "scaffold_s", "gamma_local": 0.1},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.1, "stop": {"rule": "objective", "rtol": 1e-3}},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.1, "stop": {"rule": "gradient", "rtol": 0.1}},
]


def same(batched: AlgorithmResult, alone: AlgorithmResult) -> bool:
    return (
        batched.z_sha256 == alone.z_sha256
        and batched.status == alone.status
        and [r["dist_x"] for r in batched.records] == [r["dist_x"] for r in alone.records]
        and [r["rounds"] for r in batched.records] == [r["rounds"] for r in alone.records]
        and batched.traffic == alone.traffic
        and batched.extra == alone.extra
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a["name"] + "-" + a.get("stop", {}).get("rule", ""))
def test_each_run_of_a_batch_equals_the_run_alone(algorithm: dict[str, Any]) -> None:
    members = []
    for s in (0.0, 4.0, 12.0):
        for scale in (0.1, 0.01, 1e12):  # so large a step overflows: flagged per run
            for seed in (0, 1):
                step = {k: v * scale / max(s, 1) if k.startswith("gamma") else v for k, v in algorithm.items()}
                run = config(seed=seed, problem={"name": "paper_regression", "s": s}, rounds=45, algorithms=[step])
                members.append(BatchRun(run, run.algorithms[0]))
    batched = run_batch(members)
    statuses = set()
    for member, result in zip(members, batched, strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool())
        assert same(result, alone), (member.config.problem.s, member.spec)
        statuses.add(result.status)
    assert statuses == {"ok", "diverged"}  # the batch mixed converging and diverging runs


def test_paper_runs_whose_lam_differ_or_agree_batch_with_the_bits_of_the_runs_alone() -> None:
    # Stacked paper runs with one lam keep it a number, runs whose lam differ an array (B,) along the runs' axis:
    # each run gets its bits either way, diverging runs (their batch goes on without them) included.
    algorithms: list[dict[str, Any]] = [
        {"name": "fedavg_s", "gamma_local": 0.01},
        {"name": "local_extragradient", "gamma": 0.01},
        {"name": "local_sgda_plus", "eta_x": 0.01, "snapshot_every": 2},
        {"name": "minibatch_md", "gamma": 1e6},  # diverges
    ]
    for lams in ((1e-5, 1e-5), (1e-5, 0.3)):
        members = []
        for lam in lams:
            for algorithm in algorithms:
                run = config(seed=1, problem={"name": "paper_regression", "s": 4.0, "lam": lam}, rounds=25,
                             algorithms=[algorithm])  # fmt: skip
                members.append(BatchRun(run, run.algorithms[0]))
        shards = [make_shards(m.config.problem, m.config.seed, range(10)) for m in members]
        assert isinstance(stack_shards(shards).lam, float) == (lams[0] == lams[1])  # type: ignore[attr-defined]
        results = run_batch(members)
        assert {r.status for r in results} == {"ok", "diverged"}
        for member, result in zip(members, results, strict=True):
            assert same(result, run_algorithm(member.spec, member.config, LocalPool())), (lams, member.spec)


def test_a_batch_with_gradient_noise_and_random_sync_equals_the_runs_alone() -> None:
    members = []
    for gamma in (0.05, 0.02):
        run = config(
            seed=3,
            problem={"name": "quadratic_game", "num_clients": 4, "dim": 3},
            sync={"kind": "random", "p": 0.3},
            gradient_noise=0.5,
            rounds=31,
            algorithms=[{"name": "scaffold_catalyst_s", "gamma_local": gamma}],
        )
        members.append(BatchRun(run, run.algorithms[0]))
    for member, result in zip(members, run_batch(members), strict=True):
        assert same(result, run_algorithm(member.spec, member.config, LocalPool()))


def test_a_batch_may_mix_algorithms_schedules_budgets_and_seeds() -> None:
    # Each run is its own generator; only runs whose pending exchanges have the same shape share a worker call.
    members = []
    for index, algorithm in enumerate(ALGORITHMS):
        for seed in (0, 1):
            run = config(
                seed=seed,
                problem={"name": "paper_regression", "s": 3.0},
                sync={"kind": "random", "p": 0.25} if index % 2 else {"kind": "fixed", "tau": 5},
                rounds=21 + 4 * index + seed,
                algorithms=[algorithm],
            )
            members.append(BatchRun(run, run.algorithms[0]))
    for member, result in zip(members, run_batch(members), strict=True):
        assert same(result, run_algorithm(member.spec, member.config, LocalPool()))


def test_runs_that_share_a_round_with_sampled_attacked_or_ruled_runs_equal_the_runs_alone() -> None:
    # Rounds in which every client of every run took part are settled for the whole group at once; a group
    # that holds a run with sampled clients, an attack or a robust rule settles run by run. Either way, and
    # with runs that diverge partway, each run gets the bits and counts of the run alone.
    unusual: list[dict[str, Any]] = [
        {},
        {"participation": {"fraction": 0.5}},
        {"attack": {"kind": "scale", "clients": [1], "factor": 3.0}},
        {"aggregation": {"rule": "median"}},
    ]
    for together in (unusual[:1], unusual):
        members = []
        for fields in together:
            for algorithm in (ALGORITHMS[0], ALGORITHMS[3]):  # gradient rounds; local-steps and gradient rounds
                for scale in (1.0, 30.0):  # 30 times the step diverges partway
                    step = {k: v * scale if k.startswith("gamma") else v for k, v in algorithm.items()}
                    problem = {"name": "paper_regression", "s": 2.0}
                    run = config(seed=2, problem=problem, rounds=30, algorithms=[step], **fields)
                    members.append(BatchRun(run, run.algorithms[0]))
        statuses = []
        for member, result in zip(members, run_batch(members), strict=True):
            alone = run_algorithm(member.spec, member.config, LocalPool())
            assert same(result, alone), (member.spec, member.config.participation, member.config.attack)
            statuses.append(result.status)
        assert "ok" in statuses and "diverged" in statuses


def test_batches_over_worker_processes_equal_one_process() -> None:
    batches = [
        [BatchRun(c, c.algorithms[0]) for c in (config(seed=seed, algorithms=[a], rounds=25) for seed in range(5))]
        for a in ALGORITHMS[2:4]
    ]
    parallel, serial = run_batches(batches, workers=2), run_batches(batches, workers=1)
    assert [[r.z_sha256 for r in b] for b in parallel] == [[r.z_sha256 for r in b] for b in serial]
    assert all(same(a, b) for pa, sa in zip(parallel, serial, strict=True) for a, b in zip(pa, sa, strict=True))


def test_a_batch_refuses_runs_that_cannot_share_a_worker() -> None:
    runs = [config(gradient_noise=noise, algorithms=[ALGORITHMS[0]]) for noise in (0.0, 0.1)]
    with pytest.raises(ValueError, match="one gradient_noise"):
        run_batch([BatchRun(r, r.algorithms[0]) for r in runs])


def test_the_grid_keeps_the_best_step_per_algorithm_and_s() -> None:
    grid = Grid(s_values=(0.0, 6.0), seeds=(0, 1), rounds=40, algorithms=("minibatch_md", "scaffold_catalyst_s"))
    rows = run_grid(grid)
    assert len(rows) == 2 * 2 * (len(grid.scales("minibatch_md")) + 4 * len(grid.scales("scaffold_catalyst_s")))
    best = best_steps(rows)
    for (algorithm, s), chosen in best.items():
        others = [r for r in rows if r.key["algorithm"] == algorithm and r.key["s"] == s]
        options = {(r.key["step_scale"], r.key["variant"]) for r in others}
        scores = [
            best_steps([r for r in others if (r.key["step_scale"], r.key["variant"]) == option])[(algorithm, s)].score()
            for option in options
        ]
        assert chosen.score() == min(scores)  # the best (step, variant) of the grid
        assert len(chosen.rows) == 2  # one per seed
        scales = grid.scales(algorithm)
        assert chosen.edge == (chosen.step_scale in (min(scales), max(scales)))


def test_rounds_to_an_accuracy_are_counted_in_the_grids_convention() -> None:
    # Under the paper's convention SCAFFOLD-S spends 1 round per sync, 2 exchanges (+1 at the start).
    # The accuracy tables used to count exchanges under both conventions.
    grids = {
        c: Grid(s_values=(1.0,), seeds=(0,), rounds=120, convention=c, algorithms=("scaffold_s",))
        for c in ("exchanges", "paper")
    }
    rows = {c: {r.key["step_scale"]: r for r in run_grid(g)} for c, g in grids.items()}
    checked = 0
    for scale, paper in rows["paper"].items():
        exchanges = rows["exchanges"][scale]
        for accuracy in (1e-2, 1e-6):
            first = next((r for r in paper.result.records if r["dist_x"] <= accuracy), None)
            assert paper.rounds_to(accuracy) == (None if first is None else first["paper_rounds"])
            reached = exchanges.rounds_to(accuracy)
            if reached is not None and paper.rounds_to(accuracy) is not None:
                assert reached == 1 + 2 * paper.rounds_to(accuracy)  # the same step, counted both ways
                checked += 1
    assert checked >= 2


def test_quartiles_count_a_diverged_run_as_worse_than_any() -> None:
    q1, median, q3 = quartiles([1.0, 2.0, 3.0])
    assert median == 2.0 and 1.0 <= q1 < 2.0 < q3 <= 3.0
    q1, median, q3 = quartiles([1e-3, 1e-2, float("nan"), float("inf")])
    assert median == float("inf") and q3 == float("inf") and 1e-3 <= q1 <= 1e-2


def test_paper_experiment_over_grpc_matches_the_in_process_batch(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsaddle",
            "experiment",
            "paper",
            "--transport",
            "grpc",
            "--s",
            "7",
            "--rounds",
            "15",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=CLIENT_ENV,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # One value of s: the time goes to the runs (each a RunSpec to 10 client processes), and a second s would
    # run the same code on other numbers.
    assert "gRPC (10 client processes) vs in-process batch: 30/30 runs identical bit for bit" in done.stdout
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 10  # the paper's three steps, every variant (the newer baselines too)
    assert {r["s"] for r in rows} == {"7.0"}
    assert {r["algorithm"] for r in rows} >= {"minibatch_md", "scaffold_catalyst_s", "catalyst_ours", "local_sgda_plus"}
    for name in ("figure1_curves.png", "figure2_final_vs_s.png", "table.md"):
        assert (out / name).stat().st_size > 0
    assert "every exchange counted" in (out / "table.md").read_text()


def test_a_batch_on_real_data_weighted_by_samples_equals_the_runs_alone(tmp_path: Path) -> None:
    split("diabetes", 5, "label-skew", seed=1, out=tmp_path)
    data = {i: str(tmp_path / f"client-{i:03d}.npz") for i in range(5)}
    members = []
    for weighting in ("samples", "uniform"):
        for algorithm in ALGORITHMS[2:5]:
            run = config(
                problem={"name": "linear_regression", "num_clients": 5, "features": 10},
                weighting=weighting,
                rounds=31,
                algorithms=[algorithm],
            )
            members.append(BatchRun(run, run.algorithms[0], reference=np.zeros(20)))
    batched = run_batch(members, ShardCache(size=2, data=data))
    for member, result in zip(members, batched, strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool(data=data), reference=np.zeros(20))
        assert same(result, alone), (member.config.weighting, member.spec.name)
    assert batched[0].z_sha256 != batched[3].z_sha256  # the weighting matters


# The algorithms whose clients run a named computation (COMPUTE tasks), each with the field of its step.
COMPUTING: list[tuple[dict[str, Any], str]] = [
    ({"name": "local_extragradient"}, "gamma"),
    ({"name": "local_sgda_plus", "snapshot_every": 2}, "eta_x"),
]


def counted(monkeypatch: pytest.MonkeyPatch, name: str, declared: bool = True) -> list[int]:
    """Count the calls of built-in computation `name`: one per worker call, whatever the runs it serves.
    Not `declared`: the same computation as a plug-in that declares no per-run parameters."""
    original = computations.BUILT_IN[name]
    calls: list[int] = []

    def computation(oracle: Any, z: Any, **named: Any) -> Any:
        calls.append(z.shape[-1])
        return original(oracle, z, **named)

    wrapped = computations.per_run(*computations.per_run_names(original))(computation) if declared else computation
    monkeypatch.setitem(computations.BUILT_IN, name, wrapped)
    return calls


@pytest.mark.parametrize(("entry", "step"), COMPUTING, ids=lambda a: a["name"] if isinstance(a, dict) else "")
def test_runs_of_a_computation_with_different_steps_share_each_call_and_equal_the_runs_alone(
    entry: dict[str, Any], step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = []
    for s in (0.0, 6.0):
        for scale in (0.05, 0.01, 1e12):  # so large a step overflows: flagged per run
            for seed in (0, 1):
                algorithm = {**entry, step: scale / max(s, 1)}
                if entry["name"] == "local_sgda_plus" and seed:
                    algorithm["eta_y"] = scale / 2  # both of its steps differing between runs
                run = config(seed=seed, problem={"name": "paper_regression", "s": s}, rounds=20, algorithms=[algorithm])
                members.append(BatchRun(run, run.algorithms[0]))
    calls = counted(monkeypatch, entry["name"])
    batched = run_batch(members)
    assert len(calls) == 20 and calls[0] == len(members)  # one call per round for every run still going
    statuses = set()
    for member, result in zip(members, batched, strict=True):
        assert same(result, run_algorithm(member.spec, member.config, LocalPool())), member.spec
        statuses.add(result.status)
    assert statuses == {"ok", "diverged"}
    for small, smaller in zip(batched[::6] + batched[1::6], batched[2::6] + batched[3::6], strict=True):
        assert small.status == smaller.status == "ok" and small.z_sha256 != smaller.z_sha256  # each its own step


@pytest.mark.parametrize(("entry", "step"), COMPUTING, ids=lambda a: a["name"] if isinstance(a, dict) else "")
def test_a_computation_that_declares_nothing_shares_calls_only_between_equal_parameters(
    entry: dict[str, Any], step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plug-in's computation written for one run at a time is still batched, over the runs of equal steps.
    members = []
    for gamma in (0.02, 0.05, 0.02):
        for seed in (0, 1):
            run = config(
                seed=seed,
                problem={"name": "quadratic_game", "num_clients": 4, "dim": 3},
                gradient_noise=0.3,
                sync={"kind": "random", "p": 0.3},
                rounds=12,
                algorithms=[{**entry, step: gamma}],
            )
            members.append(BatchRun(run, run.algorithms[0]))
    calls = counted(monkeypatch, entry["name"], declared=False)
    batched = run_batch(members)
    assert max(calls) <= 4 and sum(calls) == 12 * len(members)  # no call mixes steps (nor sync intervals)
    monkeypatch.undo()
    together = run_batch(members)  # the declared computation: the same bits
    for member, alone_in_batch, result in zip(members, batched, together, strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool())
        assert same(alone_in_batch, alone) and same(result, alone)


def test_computations_on_a_constrained_problem_batch_with_the_bits_of_the_runs_alone(tmp_path: Path) -> None:
    split("breast_cancer", 4, "label-skew", seed=2, out=tmp_path)
    data = {i: str(tmp_path / f"client-{i:03d}.npz") for i in range(4)}
    reference = np.concatenate([np.zeros(31), np.full(4, 0.25)])  # (any point of the domain)
    members = []
    for entry, step in COMPUTING:
        for gamma in (0.5, 0.1, 0.02):
            run = config(
                problem={"name": "agnostic", "num_clients": 4, "features": 30, "lam": 0.2, "nu": 0.2},
                rounds=15,
                algorithms=[{**entry, step: gamma}],
            )
            members.append(BatchRun(run, run.algorithms[0], reference=reference))
    batched = run_batch(members, ShardCache(size=2, data=data))
    for member, result in zip(members, batched, strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool(data=data), reference=reference)
        assert same(result, alone), member.spec
        weights = result.final_z[31:]
        assert np.all(weights >= 0) and abs(weights.sum() - 1) < 1e-12  # kept on the simplex


def test_a_plugin_computation_declared_per_run_batches_over_its_steps_with_the_bits_of_the_runs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register(FEDPROX_GDA)  # examples/algorithm-plugin: its computation declares gamma per run
    try:
        calls: list[int] = []
        original = computations.find_computation("fedprox_gda_steps")
        assert original is not None and computations.per_run_names(original) == {"gamma"}

        def counting(oracle: Any, z: Any, **named: Any) -> Any:
            calls.append(z.shape[-1])
            return original(oracle, z, **named)

        monkeypatch.setitem(computations._REGISTERED, "fedprox_gda_steps", computations.per_run("gamma")(counting))
        members = []
        for gamma in (0.08, 0.05, 0.02):
            for mu in (0.0, 0.3):
                run = config(
                    seed=4,
                    problem={"name": "quadratic_game", "num_clients": 5, "dim": 4, "heterogeneity": 0.5},
                    gradient_noise=0.2,
                    rounds=10,
                    algorithms=[{"name": "fedprox_gda", "gamma_local": gamma, "mu": mu}],
                )
                members.append(BatchRun(run, run.algorithms[0]))
        batched = run_batch(members)
        assert sorted(calls) == [3] * 20  # per round, one call for each mu, over the three steps
        monkeypatch.undo()
        for member, result in zip(members, batched, strict=True):
            assert same(result, run_algorithm(member.spec, member.config, LocalPool()))
    finally:
        unregister("fedprox_gda")
