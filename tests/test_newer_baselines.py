"""The newer federated minimax baselines, each against a property its paper proves (or its definition
implies) that a wrong implementation would fail; and the framework's guarantees for a COMPUTE task."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import config

from fedsaddle.common import computations
from fedsaddle.common.problems import make_shards, stack_shards
from fedsaddle.common.tasks import ComputeTask
from fedsaddle.common.worker import Worker
from fedsaddle.server.algorithms import RoundAnswers, build, load_state, save_state
from fedsaddle.server.batch import BatchRun, run_batch
from fedsaddle.server.driver import run_algorithm, run_all
from fedsaddle.server.transport.local_pool import LocalPool

GAME = {"name": "quadratic_game", "num_clients": 5, "dim": 4, "heterogeneity": 0.5}
ONE_CLIENT = {**GAME, "num_clients": 1}
NEWER: list[dict[str, Any]] = [
    {"name": "fedgda_gt", "eta": 0.05},
    {"name": "local_extragradient", "gamma": 0.05},
    {"name": "local_sgda_plus", "eta_x": 0.05, "snapshot_every": 2},
]


def test_fedgda_gt_reaches_the_exact_saddle_point_under_heterogeneity_where_fedavg_s_stalls() -> None:
    # Sun and Wei, Theorem 1: with gradient tracking and a constant step the iterates converge
    # linearly to z* itself, whatever the heterogeneity; FedAvg-S's constant-step fixed point is biased.
    algorithms = [{"name": "fedgda_gt", "eta": 0.05}, {"name": "fedavg_s", "gamma_local": 0.05, "decay": "constant"}]
    run = config(problem=GAME, algorithms=algorithms, rounds=400, sync={"kind": "fixed", "tau": 5})
    gda_gt, fedavg = run_all(run, LocalPool())
    assert gda_gt.status == fedavg.status == "ok"
    assert gda_gt.dist_z < 1e-8
    assert fedavg.dist_z > 1e-3  # the heterogeneity floor
    # Linear: every step contracts the distance by at least a fixed factor, until round-off.
    distances = [r["dist_z"] for r in gda_gt.records if r["dist_z"] > 1e-13]
    assert len(distances) > 5
    assert max(b / a for a, b in pairwise(distances)) < 0.9


def test_local_extragradient_with_one_local_step_is_mirror_prox_step_for_step() -> None:
    # tau = 1 and one client: extrapolate with G(z), step from z with G(z_half): the extragradient step.
    sync = {"kind": "fixed", "tau": 1}
    mirror = config(problem=ONE_CLIENT, algorithms=[{"name": "mirror_prox", "gamma": 0.1}], rounds=60, sync=sync)
    local = config(problem=ONE_CLIENT, algorithms=[{"name": "local_extragradient", "gamma": 0.1}], rounds=30, sync=sync)
    (mp,) = run_all(mirror, LocalPool())
    (eg,) = run_all(local, LocalPool())
    assert len(mp.records) == len(eg.records) == 31  # the start and 30 steps each
    assert [r["dist_z"] for r in mp.records] == [r["dist_z"] for r in eg.records]
    assert mp.z_sha256 == eg.z_sha256
    # ... at half the exchanges: one per step against Mirror-prox's two.
    assert eg.traffic["algorithm"]["rounds"] * 2 == mp.traffic["algorithm"]["rounds"] == 60


def test_local_extragradient_converges_on_homogeneous_clients_and_drifts_on_heterogeneous_ones() -> None:
    sync = {"kind": "fixed", "tau": 5}
    algorithm = [{"name": "local_extragradient", "gamma": 0.05}]
    (same,) = run_all(
        config(problem={**GAME, "heterogeneity": 0.0}, algorithms=algorithm, rounds=300, sync=sync), LocalPool()
    )
    (drifting,) = run_all(config(problem=GAME, algorithms=algorithm, rounds=300, sync=sync), LocalPool())
    assert same.dist_z < 1e-8
    assert drifting.dist_z > 1e-4  # local steps on different G_i: client drift, as for FedAvg-S


def test_local_sgda_plus_with_a_snapshot_every_step_is_gradient_descent_ascent_bit_for_bit() -> None:
    # tau = 1, S = tau, eta_x = eta_y: every ascent looks at x~ = x, so a sync is one GDA step on G.
    sync = {"kind": "fixed", "tau": 1}
    algorithms = [
        {"name": "local_sgda_plus", "eta_x": 0.1, "snapshot_every": 1},
        {"name": "minibatch_md", "gamma": 0.1},
    ]
    sgda, gda = run_all(config(problem=GAME, algorithms=algorithms, rounds=50, sync=sync), LocalPool())
    assert [r["dist_z"] for r in sgda.records] == [r["dist_z"] for r in gda.records]
    assert sgda.z_sha256 == gda.z_sha256


def test_local_sgda_plus_converges_with_a_lagging_snapshot_and_the_snapshot_changes_the_path() -> None:
    sync = {"kind": "fixed", "tau": 5}
    homogeneous = {**GAME, "heterogeneity": 0.0}
    algorithms = [
        {"name": "local_sgda_plus", "eta_x": 0.05, "snapshot_every": 3, "label": "lagging"},
        {"name": "local_sgda_plus", "eta_x": 0.05, "snapshot_every": 1, "label": "fresh"},
    ]
    lagging, fresh = run_all(config(problem=homogeneous, algorithms=algorithms, rounds=400, sync=sync), LocalPool())
    assert lagging.dist_z < 1e-8 and fresh.dist_z < 1e-8
    assert lagging.records[5]["dist_z"] != fresh.records[5]["dist_z"]


def drive(exchanges: Any, worker: Worker, rounds: list[int]) -> Any:
    """Run an init or step generator against a worker holding every client; its returned state."""
    try:
        task = exchanges.send(None)
        while True:
            rounds[0] += 1
            reply = worker.execute(task, rounds[0])
            task = exchanges.send(RoundAnswers(reply.vectors, reply.objective))
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("algorithm", NEWER, ids=lambda a: a["name"])
def test_a_state_saved_after_any_step_goes_on_to_the_same_bits(algorithm: dict[str, Any], tmp_path: Path) -> None:
    run = config(problem=GAME, algorithms=[algorithm], rounds=10, gradient_noise=0.2, seed=3)
    algo = build(run.algorithms[0], run.sync, dim_x=4)
    worker = Worker(make_shards(run.problem, run.seed, range(5)), run.seed, 0.2)
    rounds = [0]
    state = drive(algo.init(np.ones(8), run.seed), worker, rounds)
    for _ in range(3):
        state = drive(algo.step(state), worker, rounds)
    save_state(state, tmp_path / "state.npz")
    restored = load_state(algo.state_type, tmp_path / "state.npz")
    again = [rounds[0]]
    for _ in range(3):
        state = drive(algo.step(state), worker, rounds)
        restored = drive(algo.step(restored), worker, again)
    assert np.array_equal(algo.iterate(state), algo.iterate(restored))
    assert not np.array_equal(algo.iterate(state), np.ones(8))


@pytest.mark.parametrize("algorithm", NEWER, ids=lambda a: a["name"])
def test_a_batch_of_runs_gives_each_run_the_bits_it_gets_alone(algorithm: dict[str, Any]) -> None:
    runs = [
        config(problem={**GAME, "heterogeneity": s}, algorithms=[algorithm], rounds=20, seed=seed, gradient_noise=0.1)
        for s, seed in ((0.0, 1), (0.5, 2), (1.0, 3))
    ]
    batched = run_batch([BatchRun(run, run.algorithms[0]) for run in runs])
    for run, result in zip(runs, batched, strict=True):
        alone = run_algorithm(run.algorithms[0], run, LocalPool())
        assert result.z_sha256 == alone.z_sha256
        assert result.traffic["algorithm"] == alone.traffic["algorithm"]


def _fresh_gradients(oracle: Any, z: np.ndarray, *, steps: float) -> np.ndarray:
    total = np.zeros(z.shape)
    for _ in range(int(steps)):
        total += oracle.stochastic_gradient(z - total) - oracle.gradient(z + total)
    return total


def _kept_gradients(oracle: Any, z: np.ndarray, *, steps: float) -> np.ndarray:
    total, g, h = np.zeros(z.shape), np.empty(z.shape), np.empty(z.shape)
    for _ in range(int(steps)):
        assert oracle.stochastic_gradient(z - total, out=g) is g
        assert oracle.gradient(z + total, out=h) is h
        total += g - h
    return total


def test_the_oracle_writes_gradients_into_a_computations_own_arrays_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = config(problem=GAME, algorithms=[NEWER[0]], seed=4)
    z = np.linspace(-1.0, 1.0, 8)
    answers = {}
    for name, computation in (("fresh", _fresh_gradients), ("kept", _kept_gradients)):
        monkeypatch.setitem(computations._REGISTERED, name, computation)
        worker = Worker(make_shards(run.problem, run.seed, range(5)), run.seed, 0.3)  # noise: each call draws
        answers[name] = worker.execute(ComputeTask(name, z, params=(("steps", 3.0),)), 7).vectors
    assert answers["fresh"].shape == (5, 8) and np.abs(answers["fresh"]).max() > 0
    assert np.array_equal(answers["fresh"], answers["kept"])
    # An array the gradient cannot go into is refused, saying why, before anything is written.
    worker = Worker(make_shards(run.problem, run.seed, range(5)), run.seed)
    for out, says in (
        (lambda z: np.empty(z.shape[0]), r"float64 array of z's shape \(8, 5\), got an array of shape \(8,\)"),
        (lambda z: np.empty(z.shape, np.float32), "got an array of shape \\(8, 5\\) and dtype float32"),
        (lambda z: [0.0] * 8, "got list"),
        (lambda z: z, "must not share memory with z"),
    ):
        monkeypatch.setitem(computations._REGISTERED, "bad", lambda oracle, z, out=out: oracle.gradient(z, out=out(z)))
        with pytest.raises(ValueError, match=says):
            worker.execute(ComputeTask("bad", z), 1)


PAPER = {"name": "paper_regression", "num_clients": 3, "dim": 4, "s": 2.0}


def _whole_rows(oracle: Any, z: np.ndarray, *, steps: float) -> np.ndarray:
    """Each step's rows taken from whole gradients: x's at z_i, y's at 2 z_i, then rows 3..5 at -z_i."""
    total, g, h = np.zeros(z.shape), np.empty(z.shape), np.empty(z.shape)
    half = z.shape[0] // 2
    for _ in range(int(steps)):
        z_i = z - total
        g[:half] = oracle.stochastic_gradient(z_i, out=h)[:half]
        g[half:] = oracle.stochastic_gradient(2 * z_i, out=h)[half:]
        g[3:5] = oracle.gradient(-z_i, out=h)[3:5]
        total += g
    return total


def _only_rows(oracle: Any, z: np.ndarray, *, steps: float) -> np.ndarray:
    """`_whole_rows` through the oracle's rows=: only the rows asked for are written."""
    total, g = np.zeros(z.shape), np.empty(z.shape)
    half = z.shape[0] // 2
    for _ in range(int(steps)):
        z_i = z - total
        assert oracle.stochastic_gradient(z_i, out=g, rows=slice(0, half)) is g
        oracle.stochastic_gradient(2 * z_i, out=g, rows=slice(half, None))
        before = g.copy()
        oracle.gradient(-z_i, out=g, rows=slice(3, 5))
        assert np.array_equal(g[:3], before[:3]) and np.array_equal(g[5:], before[5:])  # the rest as it was
        total += g
    return total


@pytest.mark.parametrize(
    "problem",
    [PAPER, {**PAPER, "dim": 65539}, GAME],  # the rows computed alone; in two blocks of rows; the whole gradient's
    ids=["paper", "paper-blocks", "quadratic-game"],
)
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_the_oracle_gives_rows_of_a_gradient_with_the_bits_of_the_whole_gradients_rows(
    monkeypatch: pytest.MonkeyPatch, problem: dict[str, Any], noise: float
) -> None:
    run = config(problem=problem, algorithms=[NEWER[0]], seed=4)
    clients = range(run.problem.num_clients)
    dimension = 2 * problem["dim"]
    z = np.linspace(-1.0, 1.0, dimension)
    answers = {}
    for name, computation in (("whole", _whole_rows), ("rows", _only_rows)):
        monkeypatch.setitem(computations._REGISTERED, name, computation)
        worker = Worker(make_shards(run.problem, run.seed, clients), run.seed, noise)  # noise: each call draws
        answers[name] = worker.execute(ComputeTask(name, z, params=(("steps", 2.0),)), 7).vectors
    assert np.abs(answers["whole"]).max() > 0
    assert np.array_equal(answers["whole"], answers["rows"])
    # Rows that are not consecutive, or without an array to go into, are refused, saying why.
    worker = Worker(make_shards(run.problem, run.seed, clients), run.seed)
    for rows, out, says in (
        (slice(0, 4, 2), True, r"slice of consecutive rows \(step 1\), got slice\(0, 4, 2\)"),
        ([0, 1], True, r"slice of consecutive rows \(step 1\), got \[0, 1\]"),
        (slice(0.5, 2), True, "slice of consecutive rows"),
        (slice(0, 2), False, "give out= with rows="),
    ):

        def bad(oracle: Any, z: np.ndarray, rows: Any = rows, out: bool = out) -> np.ndarray:
            return oracle.gradient(z, out=np.empty(z.shape) if out else None, rows=rows)

        monkeypatch.setitem(computations._REGISTERED, "bad", bad)
        with pytest.raises(ValueError, match=says):
            worker.execute(ComputeTask("bad", z), 1)


@computations.per_run("gamma")
def _extragradient_as_written(oracle: Any, z: np.ndarray, *, steps: float, gamma: Any) -> np.ndarray:
    """Local Extragradient's steps with the formulas as written: whole gradients, new arrays, gamma as it comes."""
    z_i, total = z.copy(), np.zeros(z.shape)
    for _ in range(int(steps)):
        g_half = oracle.stochastic_gradient(z_i - gamma * oracle.stochastic_gradient(z_i))
        total = total + g_half
        z_i = z_i - gamma * g_half
    return total


@computations.per_run("gamma_x", "gamma_y")
def _sgda_plus_as_written(
    oracle: Any, z: np.ndarray, *, x_snapshot: np.ndarray, steps: float, gamma_x: Any, gamma_y: Any
) -> np.ndarray:
    """Local SGDA+'s steps as written: the whole gradient at (x_i, y_i) and the whole one at (x~, y_i)."""
    d = x_snapshot.shape[0]
    z_i, total = z.copy(), np.zeros(z.shape)
    for _ in range(int(steps)):
        at_snapshot = np.concatenate([np.broadcast_to(x_snapshot, z_i[:d].shape), z_i[d:]])
        direction = np.concatenate([oracle.stochastic_gradient(z_i)[:d], oracle.stochastic_gradient(at_snapshot)[d:]])
        total = total + direction
        z_i = z_i - np.concatenate([gamma_x * direction[:d], gamma_y * direction[d:]])
    return total


@pytest.mark.parametrize("problem", [PAPER, GAME], ids=["paper", "quadratic-game"])
def test_the_built_in_computations_have_the_bits_of_their_formulas_alone_and_in_a_batch(
    monkeypatch: pytest.MonkeyPatch, problem: dict[str, Any]
) -> None:
    # The built-in computations write into arrays kept from step to step, take rows of gradients (Local SGDA+) and
    # spread a batch's steps over z's shape (Local Extragradient): the same operations on the same numbers.
    run = config(problem=problem, algorithms=[NEWER[0]])
    n, dimension, seeds = run.problem.num_clients, 2 * problem["dim"], (3, 4, 5)
    stacked = stack_shards([make_shards(run.problem, seed, range(n)) for seed in seeds])
    z = np.random.default_rng(0).normal(size=(len(seeds), dimension))
    snapshot = np.random.default_rng(1).normal(size=(len(seeds), dimension // 2))
    steps = np.array([[0.02], [0.05], [0.1]])
    monkeypatch.setitem(computations._REGISTERED, "local_extragradient_written", _extragradient_as_written)
    monkeypatch.setitem(computations._REGISTERED, "local_sgda_plus_written", _sgda_plus_as_written)
    cases = [
        ("local_extragradient", (), (("steps", 4.0),), (("gamma", steps),)),
        (
            "local_sgda_plus",
            (("x_snapshot", snapshot),),
            (("steps", 4.0),),
            (("gamma_x", steps), ("gamma_y", steps / 3)),
        ),
    ]
    for noise in (0.0, 0.3):
        for name, arrays, params, per_run in cases:
            answers = {}
            for computation in (name, f"{name}_written"):
                batched = Worker(stacked, list(seeds), noise).execute(
                    ComputeTask(computation, z, arrays, params, per_run), 2
                )
                alone = []
                for b, seed in enumerate(seeds):  # each run alone, its steps as floats
                    task = ComputeTask(
                        computation,
                        z[b],
                        tuple((key, array[b]) for key, array in arrays),
                        params + tuple((key, float(column[b, 0])) for key, column in per_run),
                    )
                    alone.append(Worker(make_shards(run.problem, seed, range(n)), seed, noise).execute(task, 2).vectors)
                assert np.array_equal(batched.vectors, np.stack(alone)), computation
                answers[computation] = batched.vectors
            assert np.abs(answers[name]).max() > 0
            assert np.array_equal(answers[name], answers[f"{name}_written"]), (name, noise)
