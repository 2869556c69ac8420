"""The settlement of one round: the rules of a round, written once.

Given the task, the clients that were asked and the replies that came back,
`settle` decides who took part, whether the round diverged, what it cost
(`RoundTally`, counted whatever happened) and what the algorithm receives
(`RoundAnswers`: the rows in client-index order with their weights, or the
aggregate alone). It is pure: it holds no counters and does no I/O, so the pool
(server/pool.py: one run over any transport) and the batched driver
(server/batch.py: many runs, one worker call) settle their rounds alike.

A reply may already be aggregated (`aggregated`): the batched driver computes
every run's mean in one call, and a round whose vectors are too long to stack
is summed from the replies in place. The algorithm sees only `RoundAnswers.mean()`
either way, which is what lets a transport answer with a sum alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from fedsaddle.common.numeric import SUMMED_BY_LOOP_ABOVE, Array
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, Task
from fedsaddle.server.algorithms.base import RoundAnswers, aggregate_rows
from fedsaddle.server.fold import OrderedFold


class RoundTally(NamedTuple):
    """What one round adds to the traffic counts: who was sent the task and who answered, and
    the vector entries (float64, or a float32 run's) each received and sent. `sent`/`answered` None: every
    client 0..n-1."""

    num_clients: int
    floats_down: int  # per client: the task's vectors
    floats_up: int  # per client: its answer vector, plus f_i(z) when asked
    sent: tuple[int, ...] | None = None
    answered: tuple[int, ...] | None = None


def round_traffic(
    task: Task,
    num_clients: int,
    dimension: int,
    sent: tuple[int, ...] | None = None,
    answered: tuple[int, ...] | None = None,
) -> RoundTally:
    """The traffic of one round of `task`: the single definition of what a round costs."""
    down = 0
    for vector in task.payload():  # a loop, not sum(): this runs once per run and round of a sweep
        down += vector.shape[-1]
    if isinstance(task, EvaluateTask):
        metrics = len(task.metric_names)  # the metrics, and the counts of the rows they are on
        return RoundTally(num_clients, down, metrics + (metrics if task.counts_per_metric else 1), sent, answered)
    up = dimension + (1 if isinstance(task, GradientTask) and task.want_objective else 0)
    return RoundTally(num_clients, down, up, sent, answered)


class Settlement(NamedTuple):
    """A settled round. `answers` is None when clients reported non-finite results (`diverged`).

    Under a robust rule a minority of clients reporting non-finite results does not end the run: they are
    left out of the round, as a straggler is, and named in `faulty` (and `answers` is the others')."""

    tally: RoundTally
    answers: RoundAnswers | None
    diverged: tuple[int, ...] = ()  # the clients whose results were not finite, in index order
    faulty: tuple[int, ...] = ()  # robust rule: clients that reported non-finite results and were left out


def settle(
    task: Task,
    num_clients: int,
    dimension: int,
    participants: tuple[int, ...] | None,
    replies: Sequence[Answer],
    weights: Array | None = None,
    aggregated: tuple[Array, float | None] | None = None,
    folded: OrderedFold | None = None,
    rule: Callable[[Array, Array | None], Array] | None = None,
) -> Settlement:
    """Settle one round of `task` among `num_clients` clients.

    participants: the clients the task was sent to (None: all of them);
    replies: what came back, one `Answer` per replying process, each for one or more clients;
    weights: the run's weight per client (sample counts), None for the paper's uniform 1/n;
    aggregated: the round's (mean, mean objective), when the caller computed them by the same rule;
    folded: the replies' vectors added up as they came, in index order (server/fold.py); the replies
        then carry who answered, their objectives and divergence, and no vectors;
    rule: the round's robust rule (server/aggregation.py), for an algorithm round of a run that has one:
        the rows are kept for it, and clients that report non-finite results are left out unless they are
        at least half of those that answered (then the round diverged, as under the mean).

    The answering clients are the ones the replies speak for: fewer than were asked
    when a straggler deadline closed the round. Evaluation rounds weigh each client's
    metrics by the rows they are on (the replies' `counts`, one per client or one per client
    and metric), whatever the run's weights.
    """
    evaluation = isinstance(task, EvaluateTask)
    if rule is not None and not evaluation:
        return _settle_robust(task, num_clients, dimension, participants, replies, weights, rule)
    if aggregated is not None and participants is None and len(replies) == 1 and not evaluation:
        # The caller aggregated already (the batched driver, for all its runs at once): when its one
        # reply is every client's, its rows are the round's, in order, and are not summed again.
        reply = replies[0]
        if len(reply.indices) == num_clients and not reply.diverged:
            tally = round_traffic(task, num_clients, dimension)
            return Settlement(tally, RoundAnswers(reply.vectors, reply.objective, weights, None, aggregated))
    want_objective = isinstance(task, GradientTask) and task.want_objective
    everyone = False
    if participants is None:
        replied = 0
        for reply in replies:
            replied += len(reply.indices)
        everyone = replied == num_clients
    answered: Sequence[int] = range(num_clients) if everyone else sorted(i for reply in replies for i in reply.indices)
    indices = None if everyone else tuple(answered)
    tally = round_traffic(task, num_clients, dimension, participants, indices)
    run_weights = weights if everyone or weights is None else weights[list(answered)]
    if folded is not None and not evaluation:
        if folded.diverged:
            return Settlement(tally, None, tuple(sorted(folded.diverged)))
        mean = folded.mean(answered, run_weights)
        objective = folded.objective(answered) if want_objective else None
        return Settlement(tally, RoundAnswers(None, objective, run_weights, indices, aggregated=(mean, None)))
    large = aggregated is None and not evaluation and dimension > SUMMED_BY_LOOP_ABOVE
    if large and not any(reply.diverged for reply in replies):
        # Large vectors are not stacked into one (clients, D) array: the mean is added up
        # from the replies as they are, in client-index order, with the same arithmetic.
        return Settlement(tally, _summed_in_place(replies, answered, want_objective, run_weights, indices))
    position = None if everyone else {index: row for row, index in enumerate(answered)}
    vectors = np.empty((len(answered), len(task.metric_names) if isinstance(task, EvaluateTask) else dimension))
    objective = np.empty(len(answered)) if want_objective else None
    counts = None
    if isinstance(task, EvaluateTask):
        counts = np.zeros((len(answered), len(task.metric_names)) if task.counts_per_metric else len(answered))
    diverged: list[int] = []
    for reply in replies:
        if reply.diverged:
            diverged.extend(reply.indices)
            continue
        rows = _rows(reply.indices, position)
        vectors[rows] = reply.vectors
        if objective is not None and reply.objective is not None:
            objective[rows] = reply.objective
        if counts is not None and reply.counts is not None:
            counts[rows] = reply.counts
    if diverged:  # the round happened (it is counted), but nothing of it reaches the algorithm
        return Settlement(tally, None, tuple(sorted(diverged)))
    answers = RoundAnswers(vectors, objective, counts if counts is not None else run_weights, indices, aggregated)
    return Settlement(tally, answers)


def settle_everyone(
    task: Task,
    num_clients: int,
    dimension: int,
    vectors: Array,
    objective: Array | None,
    weights: Array | None,
    means: Array,
    objective_means: Sequence[float] | None,
    diverged: Sequence[bool],
) -> tuple[RoundTally, list[RoundAnswers | None]]:
    """Settle the same round of several runs at once, as `settle` settles each alone.

    For runs whose every client was asked and answered, without a robust rule, whose tasks cost the
    same (one batched worker call: equal kinds and payload shapes) and whose rows the caller aggregated:
    vectors (R, n, D), objective (R, n) or None, means (R, D) and objective_means (R,) by `aggregate`'s
    rule, diverged: each run's rows not all finite. One tally serves every run (a round's cost depends
    on none of its numbers); a run that diverged gets None, as `settle` gives it.
    """
    tally = round_traffic(task, num_clients, dimension)
    answers: list[RoundAnswers | None] = []
    for i, bad in enumerate(diverged):
        if bad:
            answers.append(None)
            continue
        mean_objective = None if objective_means is None else objective_means[i]
        rows = None if objective is None else objective[i]
        answers.append(RoundAnswers(vectors[i], rows, weights, None, (means[i], mean_objective)))
    return tally, answers


def _rows(indices: tuple[int, ...], position: dict[int, int] | None) -> slice | Sequence[int]:
    """Where a reply's clients go among the round's rows (a slice when they are consecutive).

    A reply's indices increase, and so do their rows: they are consecutive exactly
    when the last is as far from the first as their count says."""
    rows: Sequence[int] = indices if position is None else [position[i] for i in indices]
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return list(rows)


def _summed_in_place(
    replies: Sequence[Answer],
    answered: Sequence[int],
    want_objective: bool,
    weights: Array | None,
    indices: tuple[int, ...] | None,
) -> RoundAnswers:
    """Answers whose mean is summed from each client's row where it lies (`aggregate_rows`)."""
    rows = sorted(
        ((index, reply.vectors[k]) for reply in replies for k, index in enumerate(reply.indices)),
        key=lambda row: row[0],
    )
    objective = np.empty(len(answered)) if want_objective else None
    if objective is not None:
        row_of = {index: row for row, index in enumerate(answered)}
        for reply in replies:
            if reply.objective is not None:
                objective[[row_of[i] for i in reply.indices]] = reply.objective
    mean = aggregate_rows([vector for _, vector in rows], weights)
    return RoundAnswers(None, objective, weights, indices, aggregated=(mean, None))


def _settle_robust(
    task: Task,
    num_clients: int,
    dimension: int,
    participants: tuple[int, ...] | None,
    replies: Sequence[Answer],
    weights: Array | None,
    rule: Callable[[Array, Array | None], Array],
) -> Settlement:
    """An algorithm round under a robust rule: every answering client's row kept, in index order, for the
    rule; a minority that reports non-finite results left out (and named), as stragglers are."""
    answered = sorted(i for reply in replies for i in reply.indices)
    everyone = participants is None and len(answered) == num_clients
    tally = round_traffic(task, num_clients, dimension, participants, None if everyone else tuple(answered))
    faulty = sorted(i for reply in replies if reply.diverged for i in reply.indices)
    if faulty and 2 * len(faulty) >= len(answered):  # no rule outvotes half: the round diverged
        return Settlement(tally, None, tuple(faulty))
    kept = [i for i in answered if i not in set(faulty)] if faulty else answered
    position = {index: row for row, index in enumerate(kept)}
    vectors = np.empty((len(kept), dimension))
    want_objective = isinstance(task, GradientTask) and task.want_objective
    objective = np.empty(len(kept)) if want_objective else None
    for reply in replies:
        if reply.diverged:
            continue
        rows = [position[i] for i in reply.indices]
        vectors[rows] = reply.vectors
        if objective is not None and reply.objective is not None:
            objective[rows] = reply.objective
    indices = None if everyone and not faulty else tuple(kept)
    run_weights = None if weights is None else weights[kept]
    answers = RoundAnswers(vectors, objective, run_weights, indices, rule=rule)
    return Settlement(tally, answers, faulty=tuple(faulty))
