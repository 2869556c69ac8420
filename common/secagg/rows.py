"""What a client masks for each task, and what the coordinator reads back from the unmasked sum.

Every aggregate fedsaddle needs is sum_i w_i v_i / sum_i w_i, so each client sends
the row [w_i v_i, (w_i f_i), w_i]: its answer v_i scaled by its weight w_i, its
objective f_i when the task asks for it, and the weight itself. The weight is 1
under uniform weighting, the client's sample count under 'samples' weighting,
and its held-out rows for an evaluation. The coordinator learns sum_i w_i (the
total weight of the round), never any w_i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from fedsaddle.common import dp
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.numeric import Array
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


def row_pieces(vector: Array, weight: float, objective: float | None = None) -> tuple[Array, ...]:
    """[w v, (w f), w] in pieces, as Party.mask encodes them (one after another, never joined: at d = 1e6 a
    joined row would be one more 16 MB copy per client and round)."""
    pieces = [weight * vector] if weight != 1.0 else [vector]
    if objective is not None:
        pieces.append(np.array([weight * objective]))
    pieces.append(np.array([weight]))
    return tuple(pieces)


def build_row(vector: Array, weight: float, objective: float | None = None) -> Array:
    """[w v, (w f), w] in one array."""
    return np.concatenate(row_pieces(vector, weight, objective))


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
        row = row_pieces(vector, weight, objective)
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
    """The aggregate of a round from the unmasked sum of its rows.

    The sums are read as signed integers in units of 2^-s, converted to float64 once, and divided in place
    by the weight's integer: decoding scales by a power of two, exactly, so (x 2^-s) / (w 2^-s) and x / w
    are the same quotient, rounded once (fixedpoint.decode then a division give the same bits, with two
    more passes over the row)."""
    sums = np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64)
    units = float(sums[-1])
    weight = math.ldexp(units, -scale_bits)
    length = len(task.metric_names) if isinstance(task, EvaluateTask) else dimension
    with_objective = len(sums) == length + 2
    if units == 0:  # no weight at all (no held-out rows): NaN, as in plain
        return Aggregate(np.full(length, np.nan), float("nan") if with_objective else None, weight)
    np.divide(sums, units, out=sums)
    return Aggregate(sums[:length], float(sums[length]) if with_objective else None, weight)
