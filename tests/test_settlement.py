"""The rules of one round (server/settlement.py), pure: who took part, weights, divergence, tally, aggregate."""

from __future__ import annotations

import numpy as np
import pytest

from fedsaddle.common.numeric import SUMMED_BY_LOOP_ABOVE
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, LocalStepsTask
from fedsaddle.server.algorithms.base import RoundAnswers, aggregate
from fedsaddle.server.settlement import RoundTally, settle, settle_everyone

ROWS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])


def test_replies_of_several_processes_are_rows_in_client_order() -> None:
    task = GradientTask(np.zeros(2), want_objective=True)
    replies = [
        Answer((1, 3), ROWS[[1, 3]], np.array([10.0, 30.0])),
        Answer((0, 2), ROWS[[0, 2]], np.array([0.0, 20.0])),
    ]
    settled = settle(task, 4, 2, None, replies)
    assert settled.diverged == ()
    assert settled.tally == RoundTally(4, 2, 3, None, None)  # z down; G_i(z) and f_i(z) up
    answers = settled.answers
    assert answers is not None and answers.indices is None and answers.weights is None
    assert np.array_equal(answers.vectors, ROWS)  # type: ignore[arg-type]
    assert np.array_equal(answers.mean(), [4.0, 5.0])
    assert answers.mean_objective() == 15.0


def test_a_sampled_round_keeps_the_sampled_clients_and_their_weights() -> None:
    task = LocalStepsTask(np.zeros(2), steps=3, gamma_local=0.1, control=np.zeros(2))
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    settled = settle(task, 4, 2, (1, 3), [Answer((1, 3), ROWS[[1, 3]])], weights)
    assert settled.tally == RoundTally(4, 4, 2, (1, 3), (1, 3))  # z_start and the control down
    answers = settled.answers
    assert answers is not None and answers.indices == (1, 3)
    assert np.array_equal(answers.weights, [2.0, 4.0])  # type: ignore[arg-type]
    assert np.allclose(answers.mean(), (2 * ROWS[1] + 4 * ROWS[3]) / 6)


def test_a_round_closed_early_counts_only_the_clients_that_answered() -> None:
    task = GradientTask(np.zeros(2))
    settled = settle(task, 4, 2, None, [Answer((0, 1), ROWS[:2]), Answer((3,), ROWS[3:])])
    assert settled.tally == RoundTally(4, 2, 2, None, (0, 1, 3))  # sent to all, three answered
    assert settled.answers is not None and settled.answers.indices == (0, 1, 3)
    assert np.array_equal(settled.answers.mean(), (ROWS[0] + ROWS[1] + ROWS[3]) / 3)


def test_non_finite_replies_settle_as_diverged_and_are_still_counted() -> None:
    task = GradientTask(np.zeros(2))
    replies = [Answer((0, 1), ROWS[:2]), Answer((2, 3), np.empty((2, 0)), diverged=True)]
    settled = settle(task, 4, 2, None, replies)
    assert settled.answers is None
    assert settled.diverged == (2, 3)
    assert settled.tally == RoundTally(4, 2, 2, None, None)


def test_evaluation_weighs_each_clients_metrics_by_its_held_out_rows() -> None:
    task = EvaluateTask(np.zeros(2), ("accuracy",))
    replies = [Answer((0, 1), np.array([[0.5], [1.0]]), counts=np.array([1.0, 3.0]))]
    settled = settle(task, 2, 2, None, replies, weights=np.array([100.0, 1.0]))  # not the run's weights
    assert settled.tally == RoundTally(2, 2, 2, None, None)  # z down; the metric and the row count up
    assert settled.answers is not None
    assert settled.answers.mean().tolist() == [0.875]


def test_an_aggregate_passed_in_is_what_the_algorithm_receives() -> None:
    task = GradientTask(np.zeros(2))
    mean = np.array([-1.0, -2.0])
    settled = settle(task, 4, 2, None, [Answer((0, 1, 2, 3), ROWS)], aggregated=(mean, None))
    assert settled.answers is not None
    assert settled.answers.mean() is mean


@pytest.mark.parametrize("weighted", [False, True])
def test_the_rounds_of_several_runs_settle_at_once_as_each_alone(weighted: bool) -> None:
    task = GradientTask(np.zeros(2), want_objective=True)
    vectors = np.stack([ROWS, 2 * ROWS, ROWS + 0.5])  # three runs of four clients
    vectors[1, 2, 0] = np.inf  # the second run's round diverged
    objective = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0]])
    weights = np.array([1.0, 2.0, 3.0, 4.0]) if weighted else None
    with np.errstate(invalid="ignore"):
        means = aggregate(vectors, weights)
    objective_means = aggregate(objective[:, :, None], weights)[:, 0].tolist()
    diverged = [not bool(np.isfinite(v).all()) for v in vectors]
    tally, together = settle_everyone(task, 4, 2, vectors, objective, weights, means, objective_means, diverged)
    for i, answers in enumerate(together):
        reply = Answer((0, 1, 2, 3), vectors[i], objective[i], diverged[i])
        alone = settle(task, 4, 2, None, [reply], weights, (means[i], objective_means[i]))
        assert alone.tally == tally == RoundTally(4, 2, 3, None, None)
        if alone.answers is None:
            assert answers is None and i == 1
            continue
        assert answers is not None and answers.indices is None and answers.weights is weights
        assert np.array_equal(answers.vectors, vectors[i])  # type: ignore[arg-type]
        assert answers.mean().tobytes() == alone.answers.mean().tobytes()
        # (the group's means are what each run's rows give alone, unaggregated)
        assert answers.mean().tobytes() == RoundAnswers(vectors[i], objective[i], weights).mean().tobytes()
        assert answers.mean_objective() == alone.answers.mean_objective() == objective_means[i]
    assert [a is None for a in together] == [False, True, False]


@pytest.mark.parametrize("weighted", [False, True])
def test_long_vectors_are_summed_in_place_with_the_same_bits_as_stacked(weighted: bool) -> None:
    dimension = SUMMED_BY_LOOP_ABOVE + 3
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((3, dimension)) * 10.0 ** rng.integers(-8, 8, size=(3, dimension))
    weights = np.array([3.0, 1.0, 7.0]) if weighted else None
    task = GradientTask(np.zeros(dimension))
    replies = [Answer((2,), rows[2:]), Answer((0, 1), rows[:2])]
    settled = settle(task, 3, dimension, None, replies, weights)
    assert settled.answers is not None and settled.answers.vectors is None  # never stacked
    stacked = settle(task, 3, 4, None, [Answer((0, 1, 2), rows[:, :4])], weights)  # short: stacked
    assert stacked.answers is not None and stacked.answers.vectors is not None
    assert np.array_equal(settled.answers.mean()[:4], stacked.answers.mean())
