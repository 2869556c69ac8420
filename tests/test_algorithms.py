"""The algorithms through the in-process transport: convergence, counts, determinism, state."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import config
from formulas import expected_traffic

from fedsaddle.common.problems import make_shards
from fedsaddle.server.algorithms import FedAvgS, ScaffoldS, SyncSchedule, build, load_state, save_state
from fedsaddle.server.algorithms.fedavg_s import FedAvgState
from fedsaddle.server.algorithms.scaffold_s import ScaffoldState
from fedsaddle.server.driver import run_algorithm, run_all
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.local_pool import LocalPool

GAME = {"name": "quadratic_game", "num_clients": 5, "dim": 4, "heterogeneity": 0.5}
GAME_HOMOGENEOUS = {**GAME, "heterogeneity": 0.0}
ALL_FIVE: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.1},
    {"name": "mirror_prox", "gamma": 0.15},
    {"name": "fedavg_s", "gamma_local": 0.05, "decay": "constant"},
    {"name": "scaffold_s", "gamma_local": 0.05},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.05, "theta": 1.0},
]


@pytest.mark.parametrize("algorithm", ALL_FIVE, ids=lambda a: a["name"])
def test_converges_on_the_quadratic_game(algorithm: dict[str, Any]) -> None:
    # FedAvg-S's constant-step fixed point is biased by client drift, so it gets
    # homogeneous clients; the others face heterogeneity 0.5.
    problem = GAME_HOMOGENEOUS if algorithm["name"] == "fedavg_s" else GAME
    run = config(problem=problem, algorithms=[algorithm], rounds=400, sync={"kind": "fixed", "tau": 5})
    (result,) = run_all(run, LocalPool())
    assert result.status == "ok"
    assert result.dist_z < 1e-8


@pytest.mark.parametrize(
    "stop",
    [{"rule": "gradient", "rtol": 0.1}, {"rule": "fixed", "inner_syncs": 5}, {"rule": "objective", "rtol": 1e-3}],
    ids=lambda s: s["rule"],
)
def test_catalyst_converges_with_every_inner_stop_rule(stop: dict[str, Any]) -> None:
    algorithm = {"name": "scaffold_catalyst_s", "gamma_local": 0.05, "theta": 1.0, "stop": stop}
    run = config(problem=GAME, algorithms=[algorithm], rounds=600, sync={"kind": "fixed", "tau": 5})
    (result,) = run_all(run, LocalPool())
    assert result.dist_z < 1e-8
    assert result.extra["meta_iterations"] >= 2
    if stop["rule"] == "fixed":
        assert result.extra["meta_iterations"] == result.extra["syncs"] // 5


def test_fedavg_stalls_under_heterogeneity_where_scaffold_does_not() -> None:
    algorithms = [
        {"name": "fedavg_s", "gamma_local": 0.05, "decay": "constant"},
        {"name": "scaffold_s", "gamma_local": 0.05},
    ]
    run = config(problem=GAME, algorithms=algorithms, rounds=400, sync={"kind": "fixed", "tau": 5})
    fedavg, scaffold = run_all(run, LocalPool())
    assert fedavg.dist_z > 1e-3  # client drift: a biased fixed point
    assert scaffold.dist_z < 1e-10


PAPER_S0 = [
    {"name": "minibatch_md", "gamma": 0.1},
    {"name": "mirror_prox", "gamma": 0.5},
    {"name": "fedavg_s", "gamma_local": 0.1, "decay": "constant"},
    {"name": "scaffold_s", "gamma_local": 0.1},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.1, "theta": 1.0},
]


@pytest.mark.parametrize("algorithm", PAPER_S0, ids=lambda a: a["name"])
def test_converges_on_the_papers_problem_at_s_0(algorithm: dict[str, Any]) -> None:
    run = config(problem={"name": "paper_regression", "s": 0.0}, algorithms=[algorithm], rounds=500)
    (result,) = run_all(run, LocalPool())
    assert result.dist_z < 1e-8


@pytest.mark.parametrize("convention", ["exchanges", "paper"])
@pytest.mark.parametrize("algorithm", ALL_FIVE, ids=lambda a: a["name"])
def test_counts_follow_the_documented_formula(algorithm: dict[str, Any], convention: str) -> None:
    run = config(problem=GAME, algorithms=[algorithm], rounds=37, round_convention=convention)
    (result,) = run_all(run, LocalPool())
    counts = result.traffic["algorithm"]
    expected = expected_traffic(run, algorithm["name"])
    assert {k: counts[k] for k in expected} == expected
    n = run.problem.num_clients
    assert counts["per_client_floats_down"] == [expected["floats_down"] // n] * n
    assert result.traffic["evaluation"]["rounds"] == 0


def test_objective_stop_rule_adds_one_float_per_gradient_round() -> None:
    algorithm = {"name": "scaffold_catalyst_s", "gamma_local": 0.05, "stop": {"rule": "objective"}}
    run = config(problem=GAME, algorithms=[algorithm], rounds=21)
    (result,) = run_all(run, LocalPool())
    base = expected_traffic(run, "scaffold_catalyst_s")
    gradient_rounds = 1 + (21 - 1) // 2
    assert result.traffic["algorithm"]["floats_up"] == base["floats_up"] + 5 * gradient_rounds


def test_evaluation_traffic_is_counted_apart() -> None:
    run = config(problem=GAME, algorithms=[ALL_FIVE[0]], rounds=3)
    pool = LocalPool()
    run_algorithm(run.algorithms[0], run, pool)
    pool.gradients(np.zeros(8), category="evaluation")
    assert pool.traffic["algorithm"].rounds == 3
    assert pool.traffic["evaluation"].rounds == 1
    assert pool.traffic["evaluation"].floats_up == 5 * 8


def test_random_synchronization_reproduces_exactly_and_depends_on_the_seed() -> None:
    fields: dict[str, Any] = dict(problem=GAME, algorithms=[ALL_FIVE[3]], rounds=41, sync={"kind": "random", "p": 0.2})
    first = run_all(config(seed=3, **fields), LocalPool())[0]
    again = run_all(config(seed=3, **fields), LocalPool())[0]
    other = run_all(config(seed=4, **fields), LocalPool())[0]
    assert first.z_sha256 == again.z_sha256
    assert [r["dist_z"] for r in first.records] == [r["dist_z"] for r in again.records]
    assert first.z_sha256 != other.z_sha256


def test_random_sync_intervals_are_geometric_with_mean_one_over_p() -> None:
    schedule = SyncSchedule(p=0.05)
    clock = schedule.start(seed=0)
    draws = []
    for _ in range(20000):
        tau, clock = schedule.next_interval(clock)
        draws.append(tau)
    assert min(draws) >= 1
    assert np.mean(draws) == pytest.approx(20.0, rel=0.03)
    assert SyncSchedule(tau=20).minibatch == SyncSchedule(p=0.05).minibatch == 20  # MD's deterministic tau


def test_stochastic_gradients_are_seeded_and_change_the_iterates() -> None:
    fields: dict[str, Any] = dict(problem=GAME, algorithms=[ALL_FIVE[0]], rounds=200)
    noisy = run_all(config(gradient_noise=0.5, **fields), LocalPool())[0]
    noisy_again = run_all(config(gradient_noise=0.5, **fields), LocalPool())[0]
    exact = run_all(config(**fields), LocalPool())[0]
    assert noisy.z_sha256 == noisy_again.z_sha256
    assert noisy.dist_z > 1e3 * exact.dist_z  # the noise floor


def test_a_too_large_step_is_reported_as_diverged() -> None:
    run = config(problem=GAME, algorithms=[{"name": "scaffold_s", "gamma_local": 5.0}], rounds=200)
    (result,) = run_all(run, LocalPool())
    assert result.status == "diverged"
    assert "grew from" in result.detail or "non-finite" in result.detail  # whichever comes first


def drive(exchanges: Any, pool: LocalPool) -> Any:
    """Run an algorithm's init or step generator against a pool; its returned state."""
    try:
        task = next(exchanges)
        while True:
            task = exchanges.send(pool.exchange(task))
    except StopIteration as done:
        return done.value


@pytest.mark.parametrize("sync", [{"kind": "fixed", "tau": 3}, {"kind": "random", "p": 0.3}], ids=["fixed", "random"])
@pytest.mark.parametrize("algorithm", ALL_FIVE, ids=lambda a: a["name"])
def test_a_saved_state_resumes_with_the_same_bits(
    algorithm: dict[str, Any], sync: dict[str, Any], tmp_path: Any
) -> None:
    run = config(problem=GAME, algorithms=[algorithm], sync=sync, seed=4)
    pool = LocalPool()
    pool.start_run(RunInfo("r", run.problem, run.seed, 0.0))
    solver = build(run.algorithms[0], run.sync)
    state = drive(solver.init(np.ones(8), run.seed), pool)
    for _ in range(3):
        state = drive(solver.step(state), pool)
    save_state(state, tmp_path / "state.npz")
    loaded = load_state(type(state), tmp_path / "state.npz")
    # The state holds everything, the synchronization clock included: the same next steps, bit for bit.
    ahead, again = state, loaded
    for _ in range(4):
        ahead, again = drive(solver.step(ahead), pool), drive(solver.step(again), pool)
    assert np.array_equal(solver.iterate(ahead), solver.iterate(again))
    assert repr(ahead) == repr(again)
    other = ScaffoldState if type(state) is not ScaffoldState else FedAvgState
    with pytest.raises(ValueError, match=f"holds a {type(state).__name__}, not a {other.__name__}"):
        load_state(other, tmp_path / "state.npz")


def test_invalid_steps_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="gamma_local must be > 0, got -1"):
        FedAvgS(gamma_local=-1.0, gamma_global=None, decay="constant", schedule=SyncSchedule(tau=1))
    with pytest.raises(ValueError, match="gamma_global must be > 0"):
        ScaffoldS(gamma_local=0.0, gamma_global=None, schedule=SyncSchedule(tau=1))


def test_estimated_theta_is_a_secant_monotonicity_of_the_mean_operator() -> None:
    # On the game, G(z) = M (z - z*): every secant <G(z') - G(z), z' - z> / ||z' - z||^2 lies between
    # the extreme eigenvalues of M's symmetric part, so the estimated theta (c = 1) must too.
    run = config(problem=GAME, rounds=201, algorithms=[{"name": "scaffold_catalyst_s", "gamma_local": 0.05}])
    (result,) = run_all(run, LocalPool())
    assert result.extra["meta_iterations"] >= 2
    shards = make_shards(run.problem, run.seed, range(run.problem.num_clients))
    mean_operator = shards.m.mean(axis=0)  # type: ignore[attr-defined]
    low, high = np.linalg.eigvalsh((mean_operator + mean_operator.T) / 2)[[0, -1]]
    assert low <= result.extra["theta"] <= high
    assert result.extra["theta"] != 1.0  # it moved from its starting value
    fixed = run_all(
        config(problem=GAME, rounds=201, algorithms=[{**run.algorithms[0].model_dump(), "theta_rule": "fixed"}]),
        LocalPool(),
    )[0]
    assert fixed.extra["theta"] == 1.0


def test_the_sync_clock_is_a_value_that_replays_the_same_draws() -> None:
    # The coordinator's coin is part of a run's state: a checkpoint must restore it exactly.
    schedule = SyncSchedule(p=0.1)
    clock = schedule.start(seed=7)
    for _ in range(3):
        _, clock = schedule.next_interval(clock)
    saved = clock
    ahead = []
    for _ in range(5):
        tau, clock = schedule.next_interval(clock)
        ahead.append(tau)
    replay, clock = [], saved
    for _ in range(5):
        tau, clock = schedule.next_interval(clock)
        replay.append(tau)
    assert replay == ahead


def test_a_minibatch_of_noisy_gradients_has_the_bits_of_the_whole_draw_in_bounded_memory() -> None:
    # Minibatch MD's estimate averages tau noisy gradients. The tau x D draws were made at once:
    # at tau = 20 and d = 1e6 that is 320 MB per client and round. They now come a block at a time.
    import tracemalloc

    from fedsaddle.common import seeding
    from fedsaddle.common.problems import PaperRegressionSpec
    from fedsaddle.common.tasks import GradientTask
    from fedsaddle.common.worker import Worker

    spec = PaperRegressionSpec(num_clients=3, dim=1000, s=2.0)
    shards = make_shards(spec, 5, [0, 2])
    worker = Worker(shards, seed=11, gradient_noise=0.5)
    z = np.random.default_rng(1).standard_normal(2000)
    batch = 5000  # the whole draw: 5000 x 2000 float64 = 80 MB per client
    tracemalloc.start()
    try:
        answer = worker.execute(GradientTask(z, batch=batch), round_id=7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    exact = shards.gradient(np.ascontiguousarray(np.broadcast_to(z[:, None], (2000, 2)))).T
    for row, client in enumerate((0, 2)):
        draws = seeding.rng(11, seeding.NOISE, client, 7).standard_normal((batch, 2000))
        expected = exact[row] + (0.5 / np.sqrt(2000)) * draws.mean(axis=0)
        assert answer.vectors[row].tobytes() == expected.tobytes()
