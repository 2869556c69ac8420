"""Secure aggregation in `simulate` (the in-process pool): only masked rows reach the pool, every
algorithm runs, the sum is exact, the privacy traffic has its own category, bad settings are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import fedsaddle, simulate_stopped_at_a_checkpoint

from fedsaddle.common.secagg import fixedpoint
from fedsaddle.common.secagg.rows import MaskedAnswer, build_row
from fedsaddle.common.tasks import EvaluateTask, Task
from fedsaddle.experiments.datasets import split
from fedsaddle.server.algorithms.base import RoundAnswers
from fedsaddle.server.config import ConfigError, RunConfig, parse_config
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import Category
from fedsaddle.server.transport.local_pool import LocalPool

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLIENTS = 10


def paper(rounds: int, secure: bool, **fields: Any) -> RunConfig:
    data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    data.update(rounds=rounds, privacy={"secure_aggregation": secure}, **fields)
    return parse_config(data)


def run(config: RunConfig, pool: LocalPool | None = None, which: int = 0) -> AlgorithmResult:
    return run_algorithm(config.algorithms[which], config, pool or LocalPool(), run_id="privacy-test")


class Spy(LocalPool):
    """The in-process pool, recording what its clients computed (before masking) and what it received."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.true_rows: list[dict[int, np.ndarray]] = []  # per round: client -> its unmasked row
        self.received: list[MaskedAnswer] = []
        self.means: list[tuple[Task, RoundAnswers]] = []

    def _exchange(self, *args: Any) -> Any:
        raise AssertionError("a secure run never takes plain answers")

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None, rows: Any
    ) -> list[MaskedAnswer]:
        assert self._worker is not None
        answer = self._worker.execute(task, round_id, participants)
        true_rows = {}
        for k, index in enumerate(answer.indices):
            if isinstance(task, EvaluateTask):
                assert answer.counts is not None
                weight = float(answer.counts[k])
            else:
                weight = 1.0 if self._sample_counts is None else self._sample_counts[index]
            objective = None if answer.objective is None else float(answer.objective[k])
            true_rows[index] = build_row(answer.vectors[k], weight, objective)
        self.true_rows.append(true_rows)
        masked = super()._exchange_masked(task, round_id, category, participants, rows)
        self.received.extend(masked)
        return masked

    def exchange(self, task: Task, category: Category = "algorithm") -> RoundAnswers:
        answers = super().exchange(task, category)
        self.means.append((task, answers))
        return answers


def test_every_algorithm_runs_and_lands_where_the_plain_run_does() -> None:
    plain, secure = paper(200, False), paper(200, True)
    for which, spec in enumerate(secure.algorithms):
        alone, masked = run(plain, which=which), run(secure, which=which)
        assert masked.status == "ok", (spec.display_name, masked.detail)
        # Fixed point moves each answer by at most 2^-41: the iterates agree far below the distances reached.
        assert abs(masked.dist_z - alone.dist_z) <= 1e-9 * max(alone.dist_z, 1e-3), spec.display_name
        np.testing.assert_allclose(masked.final_z, alone.final_z, rtol=0, atol=1e-9)
        # The algorithm's own counts are the documented formulas, unchanged.
        assert masked.traffic["algorithm"] == alone.traffic["algorithm"]
        assert "privacy" not in alone.traffic
        rounds = alone.traffic["algorithm"]["rounds"]
        privacy = masked.traffic["privacy"]
        # Key agreement (one round: keys up, the directory down), then one unmask round per round.
        assert privacy["rounds"] == 1 + rounds
        assert privacy["messages_up"] == privacy["messages_down"] == CLIENTS * (1 + rounds)
        assert privacy["floats_up"] == CLIENTS * rounds  # the weight each masked row carries
        assert privacy["per_client_floats_up"] == [rounds] * CLIENTS


def test_the_pool_sees_only_masked_rows_and_their_sum_is_the_exact_fixed_point_sum() -> None:
    spy = Spy()
    result = run(paper(30, True), spy, which=3)  # SCAFFOLD-S: gradient and local-step rounds
    assert result.status == "ok"
    assert len(spy.true_rows) == len(spy.means) == result.traffic["algorithm"]["rounds"]
    for rows, answer, (_, answers) in zip(spy.true_rows, spy.received, spy.means, strict=True):
        assert answers.vectors is None and answers.objective is None  # no client's row is kept
        for masked_row in answer.rows:
            true = fixedpoint.encode(rows[masked_row.client], 40, 1e9, 0)
            assert not np.isin(masked_row.masked, true).any()
            # Read as values, a masked row is noise across the whole ring, not a gradient of size ~10.
            assert np.median(np.abs(fixedpoint.decode(masked_row.masked, 40))) > 1e4
        total = np.zeros(len(next(iter(rows.values()))), dtype=np.uint64)
        for index in sorted(rows):
            total += fixedpoint.encode(rows[index], 40, 1e9, 0)
        sums = fixedpoint.decode(total, 40)
        assert np.array_equal(answers.mean(), sums[:-1] / sums[-1])
        assert sums[-1] == CLIENTS  # uniform weights: the count of clients that answered
        assert answers.weights is None


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("diabetes")
    split("diabetes", CLIENTS, "label-skew", seed=1, out=folder)
    return folder


def diabetes_config(secure: bool, rounds: int = 301) -> RunConfig:
    return parse_config(
        {
            "name": "diabetes",
            "problem": {"name": "linear_regression", "features": 10, "lam": 0.1, "num_clients": CLIENTS},
            "weighting": "samples",
            "rounds": rounds,
            "evaluate_every": 100,
            "sync": {"kind": "fixed", "tau": 10},
            "algorithms": [{"name": "scaffold_s", "gamma_local": 0.2}],
            "privacy": {"secure_aggregation": secure},
            "output": {"plot": False},
        }
    )


def test_weighted_means_and_metrics_go_through_the_masked_sum_exactly(diabetes: Path) -> None:
    data = {i: diabetes / f"client-{i:03d}.npz" for i in range(CLIENTS)}
    spy = Spy(data=data)
    masked = run(diabetes_config(True), spy)
    alone = run(diabetes_config(False), LocalPool(data=data))
    assert masked.status == alone.status == "ok"
    assert spy.weights is None  # the coordinator never learned a sample count
    counts = [int(n) for n in spy._sample_counts.values()] if spy._sample_counts else []
    assert len(set(counts)) > 1  # (the label-skewed split gives clients different sizes: weights matter)
    for rows, (task, answers) in zip(spy.true_rows, spy.means, strict=True):
        total = np.zeros(len(rows[0]), dtype=np.uint64)
        for index in sorted(rows):
            total += fixedpoint.encode(rows[index], 40, 1e9, 0)
        sums = fixedpoint.decode(total, 40)
        # sum_i m_i v_i / sum_i m_i, from the masked sum bit for bit (weights and metrics included)
        assert np.array_equal(answers.mean(), sums[:-1] / sums[-1]), task
        expected_weight = sum(counts) if not isinstance(task, EvaluateTask) else sums[-1]
        assert sums[-1] == expected_weight
    np.testing.assert_allclose(masked.final_z, alone.final_z, rtol=0, atol=1e-9)
    evaluated = [r for r in masked.records if "test_mse" in r]
    assert [r["step"] for r in evaluated] == [r["step"] for r in alone.records if "test_mse" in r]
    for ours, theirs in zip(evaluated, [r for r in alone.records if "test_mse" in r], strict=True):
        assert ours["test_mse"] == pytest.approx(theirs["test_mse"], rel=1e-10)
    assert masked.traffic["evaluation"] == alone.traffic["evaluation"]


def test_sampled_rounds_sum_only_their_clients() -> None:
    sampled = {"participation": {"fraction": 0.5}}
    alone, masked = run(paper(100, False, **sampled), which=3), run(paper(100, True, **sampled), which=3)
    assert masked.status == "ok"
    np.testing.assert_allclose(masked.final_z, alone.final_z, rtol=0, atol=1e-9)
    assert masked.traffic["algorithm"] == alone.traffic["algorithm"]
    assert masked.traffic["privacy"]["messages_up"] == CLIENTS + alone.traffic["algorithm"]["messages_up"]


def test_a_value_beyond_the_bound_stops_the_run_as_diverged_naming_round_entry_and_bound() -> None:
    config = paper(10, True)
    config = config.model_copy(update={"privacy": config.privacy.model_copy(update={"bound": 1e-3})})
    result = run(config)
    assert result.status == "diverged"
    assert "round 1: clients [0]" in result.detail and "entry 0 is" in result.detail and "+-0.001" in result.detail


@pytest.mark.parametrize(
    ("privacy", "fields", "message"),
    [
        ({"threshold": 5}, {}, "privacy: threshold 5 is unsafe for 10 clients per round"),
        ({"threshold": 11}, {}, "privacy: threshold 11 is unsafe for 10 clients per round"),
        ({}, {"participation": {"fraction": 0.1}}, "privacy: secure aggregation needs at least 2 clients per round"),
        ({"bound": 1e6}, {}, "privacy: a bound of 1e\\+06 .* lets 10 clients' sum overflow the 64-bit ring"),
        ({"scale_bits": 60}, {}, "privacy.scale_bits: Input should be less than or equal to 52"),
        (
            {},
            {"participation": {"straggler_deadline_s": 1, "min_clients": 3}},
            "participation.min_clients: 3 is fewer than the 6 clients secure aggregation needs",
        ),
        ({"neighbours": 3}, {}, "privacy: neighbours must be 0 \\(all pairs\\) or an even number >= 2"),
        (
            {"neighbours": 2},
            {"participation": {"straggler_deadline_s": 1, "min_clients": 7}},
            "participation.min_clients: 7 lets 3 of a round's 10 clients drop, more than the 0 a neighbour graph",
        ),
    ],
)
def test_unsafe_settings_are_refused_naming_the_field(
    privacy: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    data.update(privacy={"secure_aggregation": True, **privacy}, **fields)
    with pytest.raises(ConfigError, match=message):
        parse_config(data)
    data["privacy"]["secure_aggregation"] = False  # the same fields are harmless when it is off
    if "scale_bits" not in privacy:
        parse_config(data)


def test_the_default_neighbours_widen_to_what_a_straggler_quorum_lets_drop() -> None:
    def neighbours(num_clients: int, **fields: Any) -> int:
        data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
        data["problem"]["num_clients"] = num_clients
        data.update(privacy={"secure_aggregation": True}, **fields)
        return parse_config(data).secure_settings().neighbours

    assert neighbours(100) == 20 and neighbours(10) == 0  # the log rule; all pairs for small n
    quorum = {"participation": {"straggler_deadline_s": 1, "min_clients": 60}}
    assert neighbours(100, **quorum) == 82  # 40 may drop: k = 82 keeps every such round unmaskable (k/2 - 1 >= 40)
    assert neighbours(100, participation={"straggler_deadline_s": 1, "min_clients": 92}) == 20


def test_secagg_plus_gives_the_same_iterates_bit_for_bit_as_all_pairs() -> None:
    """Masks cancel exactly whichever graph they come from: the sums, and so every iterate, are the same."""
    all_pairs = run(paper(40, True))
    config = paper(40, True)
    sparse = run(config.model_copy(update={"privacy": config.privacy.model_copy(update={"neighbours": 4})}))
    assert all_pairs.status == sparse.status == "ok"
    assert all_pairs.final_z.tobytes() == sparse.final_z.tobytes()
    assert all_pairs.traffic["algorithm"] == sparse.traffic["algorithm"]
    assert all_pairs.traffic["privacy"]["rounds"] == sparse.traffic["privacy"]["rounds"]


def test_a_stopped_secure_run_resumes_bit_identical_with_a_new_key_agreement(tmp_path: Path) -> None:
    config = {
        "name": "secure-resumed",
        "problem": {"name": "paper_regression", "num_clients": 3, "dim": 10, "s": 3.0},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.02}],
        "rounds": 301,
        "privacy": {"secure_aggregation": True},
        "output": {"plot": False, "checkpoint_every": 25},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    whole = fedsaddle("simulate", "--config", str(path), "--out", str(tmp_path / "whole"), timeout=600)
    assert whole.returncode == 0, whole.stderr
    (expected,) = (tmp_path / "whole").iterdir()
    # Stopped while writing its second checkpoint (each write pauses then), so a short run does not end first.
    run_dir, _ = simulate_stopped_at_a_checkpoint(tmp_path, "--config", str(path), timeout=120, past_round=25)
    done = fedsaddle("simulate", "--resume", str(run_dir), timeout=600)
    assert done.returncode == 0, done.stderr
    (a,) = json.loads((expected / "summary.json").read_text())["algorithms"]
    (b,) = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert a["z_sha256"] == b["z_sha256"]
    assert a["traffic"]["algorithm"] == b["traffic"]["algorithm"]
    # The resumed run agreed on new keys: one more key agreement round, three more messages each way.
    privacy_a, privacy_b = a["traffic"]["privacy"], b["traffic"]["privacy"]
    assert privacy_b["rounds"] == privacy_a["rounds"] + 1
    assert privacy_b["messages_up"] == privacy_a["messages_up"] + 3


def test_masks_that_do_not_cancel_fail_the_round_by_name_instead_of_releasing_a_random_sum() -> None:
    """Under uniform weights every row carries the weight 1, so the unmasked weights must sum to the rows summed.
    A client whose self mask is not the one the coordinator removes (here derived for another round, as a
    client of another fedsaddle version would make its masks otherwise) fails the round, naming it."""
    from fedsaddle.common.secagg.party import Party
    from fedsaddle.server.driver import RunStopped

    class OddClient(LocalPool):
        def _public_keys(self) -> dict[int, bytes]:
            keys = super()._public_keys()
            odd: Party = self._parties[3]
            honest = odd._self_key
            odd._self_key = lambda seed, round_id, attempt: honest(seed, round_id + 1000, attempt)  # type: ignore[method-assign]
            return keys

    with pytest.raises(
        RunStopped, match=r"round 1: the unmasked weights sum to .*, not to the 10 clients .*did not cancel"
    ):
        run(paper(5, True), OddClient())
    assert run(paper(5, True)).status == "ok"  # (the honest federation runs)
