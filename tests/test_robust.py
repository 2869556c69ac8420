"""Robust aggregation rules and simulated Byzantine clients: the rules' values, the config's checks,
the same bits in every transport, and real client processes that lie."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import config, federation, fedsaddle, simulate_stopped_at_a_checkpoint

from fedsaddle.common.attacks import Attack, alie_z, corrupt_answer, corrupt_round, flip_labels, parse_own_attack
from fedsaddle.common.problems.data import ClientData, DataError
from fedsaddle.common.tasks import Answer, GradientTask
from fedsaddle.launch import loopback_federation, reap, start_clients
from fedsaddle.server.aggregation import (
    Bucketing,
    CenteredClipping,
    GeometricMedian,
    Krum,
    Mean,
    Median,
    TrimmedMean,
    round_rule,
)
from fedsaddle.server.algorithms.base import RoundAnswers
from fedsaddle.server.batch import BatchRun, run_batch
from fedsaddle.server.config import ConfigError, load_config
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.settlement import settle
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

RNG = np.random.default_rng(0)
PAPER = {"name": "paper_regression", "num_clients": 5, "dim": 3, "s": 0.0}
EVERY: list[dict[str, Any]] = [
    {"name": "minibatch_md", "gamma": 0.5},
    {"name": "mirror_prox", "gamma": 0.5},
    {"name": "fedavg_s", "gamma_local": 0.01},
    {"name": "scaffold_s", "gamma_local": 0.01},
    {"name": "scaffold_catalyst_s", "gamma_local": 0.01, "stop": {"rule": "objective", "rtol": 1e-2}},
    {"name": "fedgda_gt", "eta": 0.05},
    {"name": "local_extragradient", "gamma": 0.05},
    {"name": "local_sgda_plus", "eta_x": 0.05, "snapshot_every": 2},
]


def rows(*values: list[float]) -> np.ndarray:
    return np.array(values, dtype=float)


ROBUST_SETTINGS: list[dict[str, Any]] = [
    {"aggregation": {"rule": "median", "bucketing": 2}, "attack": {"kind": "gaussian", "clients": [4], "sigma": 2}},
    {"aggregation": {"rule": "krum", "f": 1, "m": 2}, "attack": {"kind": "alie", "clients": [1], "omniscient": True}},
    {"aggregation": {"rule": "geometric_median"}, "attack": {"kind": "false_diverged", "clients": [0]}},
    {"aggregation": {"rule": "centered_clipping", "tau": 0.5}, "attack": {"kind": "ipm", "clients": [2, 3]}},
    {"aggregation": {"rule": "trimmed_mean", "beta": 0.2}},
    {"attack": {"kind": "scale", "clients": [1], "factor": 3.0}},
]


# -- the rules -------------------------------------------------------------------------------


def test_median_and_trimmed_mean_take_each_entry_alone() -> None:
    x = rows([1, 10], [2, -50], [3, 20], [100, 30], [4, 40])
    assert Median().aggregate(x, None, RNG).tolist() == [3.0, 20.0]
    for m in (4, 5, 10):  # numpy's median, bit for bit
        many = np.random.default_rng(m).standard_normal((m, 1000))
        assert np.array_equal(Median().aggregate(many, None, RNG), np.median(many, axis=0))
    # beta 0.2 of 5 cuts one at each end: entry 0 keeps 2, 3, 4; entry 1 keeps 10, 20, 30
    assert TrimmedMean(0.2).aggregate(x, None, RNG).tolist() == [3.0, 20.0]
    assert TrimmedMean(0.0).aggregate(x, None, RNG).tolist() == Mean().aggregate(x, None, RNG).tolist()
    assert TrimmedMean(0.2).tolerates(5) == 1 and TrimmedMean(0.4).tolerates(5) == 2
    with pytest.raises(ValueError, match=r"beta must be in \[0, 0.5\)"):
        TrimmedMean(0.5)


def test_krum_picks_the_row_closest_to_its_neighbours() -> None:
    honest = rows([0, 0], [0.1, 0], [0, 0.1], [0.1, 0.1], [0.05, 0.02])
    x = np.vstack([honest, rows([50, 50])])
    chosen = Krum(f=1).aggregate(x, None, RNG)
    assert chosen.tolist() in honest.tolist()
    # scores: the sum of squared distances to the m - f - 2 = 3 nearest; row 4 sits in the middle
    assert chosen.tolist() == [0.05, 0.02]
    multi = Krum(f=1, select=4).aggregate(x, None, RNG)
    assert np.linalg.norm(multi) < 0.2  # four honest rows, never the outlier
    with pytest.raises(ValueError, match=r"krum with f=2 needs more than 2f \+ 2 = 6 answers, got 6"):
        Krum(f=2).check(6)
    # a round left with too few answers takes the largest f its rows allow: here f = 1, as above
    assert Krum(f=2).aggregate(x, None, RNG).tolist() == [0.05, 0.02]


def test_geometric_median_solves_weiszfeld_and_ignores_a_far_outlier() -> None:
    square = rows([0, 0], [2, 0], [0, 2], [2, 2])
    assert np.allclose(GeometricMedian().aggregate(square, None, RNG), [1, 1])
    x = np.vstack([square, rows([1e6, -1e6])])
    found = GeometricMedian(iterations=200).aggregate(x, None, RNG)
    assert np.linalg.norm(found - [1, 1]) < 1.5  # within the honest square (the mean is 2.8e5 away)
    objective = np.linalg.norm(x - found, axis=1).sum()
    for shift in ([1e-3, 0], [0, 1e-3], [-1e-3, 0], [0, -1e-3]):
        assert objective <= np.linalg.norm(x - (found + shift), axis=1).sum() + 1e-9


def test_centered_clipping_moves_at_most_tau_per_outlier() -> None:
    honest = np.zeros((4, 3))
    x = np.vstack([honest, np.full((1, 3), 1e3)])
    found = CenteredClipping(tau=0.5, iterations=1).aggregate(x, None, RNG)
    assert np.isclose(np.linalg.norm(found), 0.5 / 5)  # the median is 0; one row clipped to 0.5, over m = 5
    assert np.allclose(CenteredClipping(tau=10, iterations=5).aggregate(honest + 1, None, RNG), 1)


def test_bucketing_averages_random_buckets_before_the_rule() -> None:
    x = np.arange(12, dtype=float).reshape(6, 2)
    rule = Bucketing(Median(), 2)
    first = rule.aggregate(x, None, np.random.default_rng(5))
    order = np.random.default_rng(5).permutation(6)
    means = [x[np.sort(order[k : k + 2])].mean(axis=0) for k in (0, 2, 4)]
    assert first.tolist() == np.median(means, axis=0).tolist()
    assert rule.buckets(7) == 4 and rule.tolerates(10) == 2  # 5 buckets: the median tolerates 2
    apply = round_rule(rule, 3, 8)
    assert apply(x, None).tolist() == apply(x, None).tolist()  # a round's draw is named, not consumed


def test_a_robust_rule_reaches_the_algorithm_through_round_answers() -> None:
    replies = [Answer((0, 1, 2), rows([1, 1], [2, 2], [90, 90]), np.array([1.0, 2.0, 90.0]))]
    task = GradientTask(np.zeros(2), want_objective=True)
    settled = settle(task, 3, 2, None, replies, rule=round_rule(Median(), 0, 1))
    assert settled.answers is not None
    assert settled.answers.mean().tolist() == [2.0, 2.0] and settled.answers.mean_objective() == 2.0
    plain = settle(task, 3, 2, None, replies)
    assert plain.answers is not None and plain.answers.mean().tolist() == [31.0, 31.0]
    assert RoundAnswers(rows([1, 1], [3, 3])).mean().tolist() == [2.0, 2.0]


def test_a_minority_reporting_divergence_is_left_out_under_a_robust_rule() -> None:
    replies = [
        Answer((0, 1), rows([1, 1], [2, 2])),
        Answer((2,), rows([np.nan, np.nan]), None, True),
        Answer((3,), rows([3, 3])),
    ]
    task = GradientTask(np.zeros(2))
    robust = settle(task, 4, 2, None, replies, rule=round_rule(Median(), 0, 1))
    assert robust.faulty == (2,) and robust.answers is not None
    assert robust.answers.indices == (0, 1, 3) and robust.answers.mean().tolist() == [2.0, 2.0]
    assert robust.tally.answered is None  # the round is counted as before: client 2 did answer
    assert settle(task, 4, 2, None, replies).answers is None  # the mean: the round diverged, as before
    half = [Answer((0, 1), rows([1, 1], [2, 2]), None, True), Answer((2, 3), rows([1, 1], [2, 2]))]
    assert settle(task, 4, 2, None, half, rule=round_rule(Median(), 0, 1)).answers is None


# -- attacks ---------------------------------------------------------------------------------


def test_attacks_replace_the_byzantine_rows() -> None:
    x = rows([1, 2], [3, 4], [5, 6], [7, 8])
    replies = [Answer((0, 1, 2, 3), x)]

    def sent(attack: Attack) -> np.ndarray:
        return np.vstack([a.vectors for a in corrupt_round(attack, replies, 0, 1)])

    assert sent(Attack("sign_flip", (1,))).tolist() == [[1, 2], [-3, -4], [5, 6], [7, 8]]
    assert sent(Attack("scale", (0, 3), factor=-10)).tolist() == [[-10, -20], [3, 4], [5, 6], [-70, -80]]
    noisy = sent(Attack("gaussian", (2,), sigma=0.5))
    assert noisy[[0, 1, 3]].tolist() == x[[0, 1, 3]].tolist() and not np.array_equal(noisy[2], x[2])
    assert np.array_equal(noisy, sent(Attack("gaussian", (2,), sigma=0.5)))  # seeded by (seed, client, round)
    honest_mean = x[[0, 1]].mean(axis=0)
    assert sent(Attack("ipm", (2, 3), epsilon=0.5, omniscient=True))[2].tolist() == (-0.5 * honest_mean).tolist()
    assert sent(Attack("ipm", (2, 3), epsilon=0.5))[3].tolist() == (-0.5 * x[[2, 3]].mean(axis=0)).tolist()
    alie = sent(Attack("alie", (2, 3), z=1.0, omniscient=True))
    assert np.allclose(alie[2], honest_mean - x[[0, 1]].std(axis=0)) and alie[2].tolist() == alie[3].tolist()
    assert alie_z(10, 2) == pytest.approx(0.2533, abs=1e-4)  # Phi^-1((10 - 4) / 10), s = floor(6) - 2
    flagged = corrupt_round(Attack("false_diverged", (1,)), replies, 0, 1)
    assert [a.diverged for a in flagged] == [False, True, False, False]


def test_a_client_process_attack_is_parsed_and_applied_to_its_own_rows() -> None:
    attack = parse_own_attack("scale:-3", (4, 5))
    answer = corrupt_answer(attack, Answer((4, 5), rows([1, 1], [2, 2])), 0, 1)
    assert answer.vectors.tolist() == [[-3, -3], [-6, -6]]
    assert corrupt_answer(parse_own_attack("false_diverged", (4,)), Answer((4,), rows([1, 1])), 0, 1).diverged
    for bad, why in [("alie", "can make the attacks"), ("scale:x", "must be a number"), ("sign_flip:2", "no value")]:
        with pytest.raises(ValueError, match=why):
            parse_own_attack(bad, (1,))


def test_a_client_process_refuses_an_attack_it_cannot_make() -> None:
    done = fedsaddle("client", "--coordinator", "127.0.0.1:1", "--clients", "0", "--attack", "alie", timeout=60)
    assert done.returncode == 2
    assert "--attack: a client process can make the attacks sign_flip, scale, gaussian, false_diverged" in done.stderr


# -- the config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"aggregation": {"rule": "trimmed_mean", "beta": 0.5}}, "aggregation.beta: Input should be less than 0.5"),
        ({"aggregation": {"rule": "krum", "f": 2}}, r"krum with f=2 needs more than 2f \+ 2 = 6 answers, got 5"),
        ({"aggregation": {"rule": "krum"}}, "krum needs f"),
        ({"aggregation": {"rule": "median", "tau": 1.0}}, "median takes no tau"),
        (
            {"aggregation": {"rule": "median"}, "attack": {"kind": "sign_flip", "clients": [1, 2, 3]}},
            "3 Byzantine clients, more than the 2 that median tolerates among 5 clients",
        ),
        (
            {"aggregation": {"rule": "median", "bucketing": 2}, "attack": {"kind": "sign_flip", "clients": [1, 2]}},
            "more than the 1 that median after bucketing s=2 tolerates",
        ),
        ({"attack": {"kind": "sign_flip", "clients": [5]}}, "attack.clients: client 5 does not exist"),
        ({"attack": {"kind": "sign_flip", "clients": [1, 1]}}, "distinct"),
        (
            {"attack": {"kind": "label_flip", "clients": [1]}},
            "attack.kind: label_flip swaps the labels of clients' data files, and problem paper_regression has none",
        ),
        (
            {"aggregation": {"rule": "median"}, "privacy": {"secure_aggregation": True}},
            "secure aggregation shows the coordinator only their sum",
        ),
        (
            {"aggregation": {"rule": "median"}, "privacy": {"dp": {"clip": 1.0, "noise_multiplier": 1.0}}},
            "differential privacy's noise is calibrated to the clipped mean",
        ),
        ({"aggregation": {"rule": "plugin", "path": "no_such_module:Rule"}}, "cannot import 'no_such_module'"),
        (
            {"aggregation": {"rule": "median", "max_rows_mib": 1e-5}},
            r"aggregation.max_rows_mib: a round's rows would hold 5 x 6 float64",
        ),
    ],
)
def test_bad_aggregation_and_attack_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(problem=PAPER, algorithms=EVERY[:1], **fields)


@pytest.mark.parametrize("settings", [{}, *ROBUST_SETTINGS], ids=lambda s: str(s.get("aggregation", {}).get("rule")))
def test_a_run_directory_s_config_json_reads_back_as_the_same_config(settings: dict[str, Any]) -> None:
    run = config(problem=PAPER, algorithms=EVERY[:1], **settings)
    written = json.loads(run.model_dump_json())  # what a run directory holds, every field written (resume reads it)
    assert config(**written) == run


def test_a_plugin_rule_is_made_from_its_path_and_params() -> None:
    run = config(
        problem=PAPER,
        algorithms=EVERY[:1],
        aggregation={"rule": "plugin", "path": "fedsaddle.server.aggregation:TrimmedMean", "params": {"beta": 0.2}},
    )
    rule = run.aggregation.build()
    assert isinstance(rule, TrimmedMean) and rule.beta == 0.2
    with pytest.raises(ConfigError, match="beta must be in"):
        config(
            problem=PAPER,
            algorithms=EVERY[:1],
            aggregation={"rule": "plugin", "path": "fedsaddle.server.aggregation:TrimmedMean", "params": {"beta": 2}},
        )


def test_a_plugin_rule_beside_its_config_is_found_as_a_problem_plugin_is(tmp_path: Path) -> None:
    package = tmp_path / "site_rules"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text(
        "import numpy as np\n"
        "from fedsaddle.server.aggregation import Rule\n\n\n"
        "class Winsorized(Rule):\n"
        "    name = 'winsorized'\n\n"
        "    def __init__(self, q: float = 0.1) -> None:\n"
        "        self.q = q\n\n"
        "    def aggregate(self, rows, weights, rng):\n"
        "        low, high = np.quantile(rows, [self.q, 1 - self.q], axis=0)\n"
        "        return np.clip(rows, low, high).mean(axis=0)\n"
    )
    path = tmp_path / "run.yaml"
    aggregation = {"rule": "plugin", "path": "site_rules.rules:Winsorized", "params": {"q": 0.2}}
    path.write_text(yaml.safe_dump({"problem": PAPER, "algorithms": EVERY[:1], "aggregation": aggregation}))
    rule = load_config(path).aggregation.build()
    assert type(rule).__name__ == "Winsorized" and rule.q == 0.2
    rows = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    assert rule.aggregate(rows, np.full(5, 0.2), None)[0] == pytest.approx(np.clip(rows, 0.8, 22.4).mean())


# -- every transport, the same bits ------------------------------------------------------------


def robust_run(algorithm: dict[str, Any], **fields: Any) -> Any:
    problem = {**PAPER, "s": 1.0}
    return config(problem=problem, algorithms=[algorithm], rounds=24, seed=3, gradient_noise=0.05, **fields)


def test_robust_runs_are_bit_identical_in_process_and_over_grpc_with_the_same_counts() -> None:
    with federation(5, groups=["0-1", "2", "3-4"]) as pool:
        for k, algorithm in enumerate(EVERY):
            settings = ROBUST_SETTINGS[k % len(ROBUST_SETTINGS)]
            run = robust_run(algorithm, **settings)
            remote = run_algorithm(run.algorithms[0], run, pool)
            local = run_algorithm(run.algorithms[0], run, LocalPool())
            assert remote.status == local.status == "ok", (algorithm["name"], local.detail)
            assert remote.z_sha256 == local.z_sha256, (algorithm["name"], settings)
            assert remote.extra == local.extra
            counts = {k: v for k, v in local.traffic["algorithm"].items() if not k.startswith("bytes")}
            assert {k: v for k, v in remote.traffic["algorithm"].items() if not k.startswith("bytes")} == counts
            plain = run_algorithm(run.algorithms[0], robust_run(algorithm), LocalPool())
            assert plain.traffic["algorithm"] == local.traffic["algorithm"]  # a rule or an attack costs no traffic
            if "attack" in settings:  # the attack changed what the algorithm saw
                assert plain.z_sha256 != local.z_sha256


def test_a_batched_run_with_a_rule_and_an_attack_gives_a_run_alone_s_bits() -> None:
    members = [
        BatchRun(robust_run(algorithm, **ROBUST_SETTINGS[k]), robust_run(algorithm).algorithms[0])
        for k, algorithm in enumerate(EVERY[:4])
    ]
    members = [BatchRun(m.config, m.config.algorithms[0]) for m in members]
    for member, batched in zip(members, run_batch(members), strict=True):
        alone = run_algorithm(member.spec, member.config, LocalPool())
        assert batched.z_sha256 == alone.z_sha256 and batched.status == alone.status
        assert batched.traffic["algorithm"] == alone.traffic["algorithm"] and batched.extra == alone.extra


def test_the_mean_is_untouched_by_default() -> None:
    run = robust_run(EVERY[0])
    explicit = robust_run(EVERY[0], aggregation={"rule": "mean"})
    a, b = (run_algorithm(r.algorithms[0], r, LocalPool()) for r in (run, explicit))
    assert a.z_sha256 == b.z_sha256 and "aggregation" not in a.extra and "aggregation" not in b.extra
    assert run.aggregation.build() is None


# -- real client processes that lie --------------------------------------------------------------


def distance_after(pool: GrpcPool | LocalPool, **fields: Any) -> Any:
    run = config(problem=PAPER, algorithms=[EVERY[0]], rounds=80, seed=1, **fields)
    return run_algorithm(run.algorithms[0], run, pool)


def test_two_lying_client_processes_steer_the_mean_but_not_the_median() -> None:
    pool = GrpcPool(5, "127.0.0.1:0")
    honest = start_clients(pool.address, ["0-2"])
    liars = start_clients(pool.address, ["3", "4"], extra=["--attack", "gaussian:1"])
    try:
        pool.wait_for_clients(60)
        mean = distance_after(pool)
        median = distance_after(pool, aggregation={"rule": "median"})
        trimmed = distance_after(pool, aggregation={"rule": "trimmed_mean", "beta": 0.4})
    finally:
        pool.close()
        reap([*honest, *liars], 10)
    clean = distance_after(LocalPool())  # the same run with no liar
    assert clean.dist_z < 1e-6
    assert mean.status == "ok" and mean.dist_z > 0.05  # nothing in the run noticed; z* is far
    # s = 0: the honest clients agree, and two of five liars move neither rule off their answer
    assert median.status == trimmed.status == "ok"
    assert median.dist_z <= 1.01 * clean.dist_z and trimmed.dist_z <= 1.01 * clean.dist_z


def test_a_false_diverged_report_ends_a_run_only_under_the_mean() -> None:
    pool = GrpcPool(5, "127.0.0.1:0")
    honest = start_clients(pool.address, ["0-3"])
    liar = start_clients(pool.address, ["4"], extra=["--attack", "false_diverged"])
    try:
        pool.wait_for_clients(60)
        mean = distance_after(pool)
        median = distance_after(pool, aggregation={"rule": "median"})
    finally:
        pool.close()
        reap([*honest, *liar], 10)
    clean = distance_after(LocalPool())
    assert mean.status == "diverged" and "clients [4]" in mean.detail
    assert median.status == "ok" and median.dist_z <= 1.01 * clean.dist_z < 1e-6
    rounds = median.traffic["algorithm"]["rounds"]
    assert rounds == 80
    assert median.extra["aggregation"]["diverged_reports"] == {"4": rounds}
    assert median.extra["aggregation"]["rounds_with_diverged_reports"] == rounds
    assert median.traffic["algorithm"]["messages_up"] == 5 * rounds  # client 4 answered: it is counted


# -- label flipping: a lie in the data ------------------------------------------------------------


def auc_files(folder: Path, clients: int = 5, flip: tuple[int, ...] = ()) -> dict[int, str]:
    """Clients' .npz files for the AUC problem; the labels of `flip` swapped by hand, as an independent check."""
    rng = np.random.default_rng(4)
    folder.mkdir()
    files = {}
    for i in range(clients):
        X, X_test = rng.normal(size=(40, 3)), rng.normal(size=(20, 3))
        y, y_test = ((X[:, 0] + 0.5 * rng.normal(size=len(X)) > 0).astype(float) for X in (X, X_test))
        path = folder / f"client-{i:03d}.npz"
        np.savez(path, X=X, y=1.0 - y if i in flip else y, X_test=X_test, y_test=y_test)
        files[i] = str(path)
    return files


def auc_run(**fields: Any) -> Any:
    problem = {"name": "auc", "num_clients": 5, "features": 3, "positive_rate": 0.445}
    return config(
        problem=problem,
        algorithms=[{"name": "minibatch_md", "gamma": 0.5}],
        rounds=30,
        seed=2,
        evaluate_every=30,
        **fields,
    )


def test_flip_labels_swaps_binary_training_labels_and_refuses_others() -> None:
    X = np.zeros((3, 1))
    zero_one = ClientData("a.npz", X, np.array([0.0, 1.0, 1.0]), X_test=X, y_test=np.array([1.0, 0.0, 1.0]))
    flipped = flip_labels(zero_one)
    assert flipped.y.tolist() == [1.0, 0.0, 0.0] and flipped.y_test.tolist() == [1.0, 0.0, 1.0]  # held out: kept
    assert flip_labels(ClientData("b.npz", X, np.array([-1.0, 1.0, -1.0]))).y.tolist() == [1.0, -1.0, 1.0]
    with pytest.raises(
        DataError, match=r"c.npz: label_flip needs binary labels, \{0, 1\} or \{-1, 1\}; y holds 0, 0.5, 2"
    ):
        flip_labels(ClientData("c.npz", X, np.array([0.0, 0.5, 2.0])))


def test_label_flip_in_process_equals_flipped_files_and_client_processes_that_flip(tmp_path: Path) -> None:
    files, by_hand = auc_files(tmp_path / "honest"), auc_files(tmp_path / "by-hand", flip=(1, 3))
    attacked = auc_run(attack={"kind": "label_flip", "clients": [1, 3]})
    simulated = run_algorithm(attacked.algorithms[0], attacked, LocalPool(data=files))
    plain = auc_run()
    honest = run_algorithm(plain.algorithms[0], plain, LocalPool(data=files))
    flipped = run_algorithm(plain.algorithms[0], plain, LocalPool(data=by_hand))
    assert simulated.status == honest.status == "ok"
    assert simulated.z_sha256 == flipped.z_sha256 != honest.z_sha256
    assert simulated.records[-1]["test_auc"] < honest.records[-1]["test_auc"]  # the liars' data pulled it off
    assert simulated.traffic["algorithm"] == honest.traffic["algorithm"]
    # `fedsaddle local`'s way: the config's attack reaches the processes that host clients 1 and 3
    with loopback_federation(attacked, per_process=2, data=files) as (pool, _children):
        local = run_algorithm(attacked.algorithms[0], attacked, pool)
    assert local.z_sha256 == simulated.z_sha256
    # clients of their own: processes started with --attack label_flip, under a coordinator told nothing
    pool = GrpcPool(5, "127.0.0.1:0")
    honest_clients = start_clients(pool.address, ["0", "2", "4"], data=files)
    liars = start_clients(pool.address, ["1", "3"], extra=["--attack", "label_flip"], data=files)
    try:
        pool.wait_for_clients(60)
        remote = run_algorithm(plain.algorithms[0], plain, pool)
    finally:
        pool.close()
        reap([*honest_clients, *liars], 10)
    assert remote.z_sha256 == simulated.z_sha256


def test_a_coordinator_refuses_a_label_flip_it_cannot_make(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(auc_run(attack={"kind": "label_flip", "clients": [1]}).model_dump(mode="json")))
    done = fedsaddle("coordinator", "--config", str(path), "--listen", "127.0.0.1:0")
    assert done.returncode == 2
    assert "start those clients with `fedsaddle client --attack label_flip`" in done.stderr


def test_the_counts_of_false_diverged_reports_go_on_across_a_resume(tmp_path: Path) -> None:
    fields: dict[str, Any] = {
        "name": "liar",
        "problem": PAPER,
        "algorithms": [EVERY[0]],
        "rounds": 1001,
        "aggregation": {"rule": "median"},
        "attack": {"kind": "false_diverged", "clients": [4]},
        "output": {"plot": False, "checkpoint_every": 25},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(fields))
    whole = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    (expected,) = (tmp_path / "whole").iterdir()
    run_dir, log = simulate_stopped_at_a_checkpoint(tmp_path, "--config", str(path), past_round=100)
    assert "stopped by SIGTERM" in log  # (cut short: the resumed run has rounds left to do)
    stopped_at = max(int(r) for r in re.findall(r"writing checkpoint at round (\d+)", log))
    assert 100 < stopped_at < 1001
    done = fedsaddle("simulate", "--resume", str(run_dir))
    assert done.returncode == 0, done.stderr
    (a,) = json.loads((expected / "summary.json").read_text())["algorithms"]
    (b,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert a["z_sha256"] == b["z_sha256"]
    assert a["aggregation"]["diverged_reports"] == b["aggregation"]["diverged_reports"] == {"4": 1001}
    assert b["aggregation"]["rounds_with_diverged_reports"] == 1001
