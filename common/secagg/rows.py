"""What a client masks for each task, and what the coordinator reads back from the unmasked sum.

Every aggregate fedsaddle needs is sum_i w_i v_i / sum_i w_i, so each client sends
the row [w_i v_i, (w_i f_i), w_i]: its answer v_i scaled by its weight w_i, its
objective f_i when the task asks for it, and the weight itself. The weight is 1
under uniform weighting, the client's sample count under 'samples' weighting,
and its held-out rows for an evaluation. The coordinator learns sum_i w_i (the
total weight of the round), never any w_i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from fedsaddle.common import dp
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.numeric import Array
from fedsaddle.common.secagg import fixedpoint
from fedsaddle.common.secagg.fixedpoint import FixedPointOverflow, Ring
from fedsaddle.common.secagg.party import MaskedRow, Party
from fedsaddle.common.tasks import Answer, EvaluateTask, GradientTask, Task


class MaskedAnswer(NamedTuple):
    """One process's masked answer: a row per answering client, and the clients whose values could not
    be encoded (not finite, or outside the bound: `reason` says which), which send no row."""

    rows: tuple[MaskedRow, ...]
    diverged: tuple[int, ...] = ()
    reason: str = ""


def row_length(task: Task, dimension: int) -> int:
    """Entries of a masked row: the answer, the objective when asked, the weight."""
    if isinstance(task, EvaluateTask):
        return len(task.metric_names) + 1
    return dimension + (2 if isinstance(task, GradientTask) and task.want_objective else 1)


def build_row(vector: Array, weight: float, objective: float | None = None) -> Array:
    """[w v, (w f), w]."""
    parts = [weight * vector] if weight != 1.0 else [vector]
    if objective is not None:
        parts.append(np.array([weight * objective]))
    parts.append(np.array([weight]))
    return np.concatenate(parts)


def mask_answer(
    parties: Mapping[int, Party],
    answer: Answer,
    task: Task,
    round_id: int,
    attempt: int,
    participants: Sequence[int],
    weights: Mapping[int, float] | None = None,
    private: DpSettings | None = None,
) -> MaskedAnswer:
    """Mask each answering client's row with its own Party (clients hosted together are not summed first).

    `private`: differential privacy; each client clips its answer (with its objective) and adds its share of
    the round's noise before masking (evaluation rounds are not private: the config refuses them)."""
    if answer.diverged:
        return MaskedAnswer((), tuple(answer.indices), "produced non-finite values")
    rows: list[MaskedRow] = []
    for k, index in enumerate(answer.indices):
        if isinstance(task, EvaluateTask):
            assert answer.counts is not None
            weight = float(answer.counts[k])
        else:
            weight = 1.0 if weights is None else float(weights[index])
        objective = None if answer.objective is None else float(answer.objective[k])
        vector = answer.vectors[k]
        if private is not None and not isinstance(task, EvaluateTask):
            values = vector if objective is None else np.append(vector, objective)
            values = dp.client_share(values, private, len(participants), dp.private_rng())
            vector, objective = values[: len(vector)], None if objective is None else float(values[-1])
        row = build_row(vector, weight, objective)
        try:
            rows.append(parties[index].mask(round_id, attempt, participants, row))
        except FixedPointOverflow as exc:
            return MaskedAnswer((), (index,), f"client {index}: {exc}")
    return MaskedAnswer(tuple(rows))


class Aggregate(NamedTuple):
    """What the coordinator learns of a round: the weighted mean, the mean objective, the total weight."""

    mean: Array
    objective: float | None
    total_weight: float


def read_sum(total: Ring, task: Task, dimension: int, scale_bits: int) -> Aggregate:
    """The aggregate of a round from the unmasked sum of its rows."""
    sums = fixedpoint.decode(total, scale_bits)
    weight = float(sums[-1])
    length = len(task.metric_names) if isinstance(task, EvaluateTask) else dimension
    with np.errstate(invalid="ignore", divide="ignore"):  # no weight at all (no held-out rows): NaN, as in plain
        mean = sums[:length] / weight if weight != 0 else np.full(length, np.nan)
        objective = float(sums[length]) / weight if len(sums) == length + 2 and weight != 0 else None
    if len(sums) == length + 2 and objective is None:
        objective = float("nan")
    return Aggregate(mean, objective, weight)
