"""Per-client results (output.per_client): each client's evaluation metrics and training objective.

At every evaluated step the coordinator keeps, besides the metrics averaged over
the clients, each client's own values: its metrics on its held-out rows (the rows
of the evaluation round, which are never folded into a sum) and its training
objective f_i(z) (an exact gradient round that also asks for f_i(z), counted as
evaluation). A step's record then holds

    "clients": {"objective": {"values": [f_0, ..., f_{n-1}], "worst": ..., "worst_client": i,
                              "best": ..., "best_client": j, "spread": |worst - best|},
                "test_mse": {...}, ...}

with null for a client that gave no value (one whose metric is not defined on its
held-out rows, as AUC on rows of one class, or one that did not answer). The worst
is the highest value of a loss and of the objective, the lowest of a metric the
problem lists in `higher_is_better`.

Secure aggregation never lets the coordinator see one client's value, so a config
with both is refused (server/config_checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedsaddle.server.algorithms import RoundAnswers

OBJECTIVE = "objective"  # the name of the training objective f_i(z) among a record's per-client entries


def spread(values: Sequence[float | None], higher_is_better: bool) -> dict[str, Any]:
    """The values by client, with the worst and best client (the lowest index on a tie) and their spread."""
    known = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    entry: dict[str, Any] = {"values": list(values)}
    if not known:
        return {**entry, "worst": None, "worst_client": None, "best": None, "best_client": None, "spread": None}
    low = min(known, key=lambda item: (item[1], item[0]))
    high = max(known, key=lambda item: (item[1], -item[0]))
    worst, best = (low, high) if higher_is_better else (high, low)
    return {
        **entry,
        "worst": worst[1],
        "worst_client": worst[0],
        "best": best[1],
        "best_client": best[0],
        "spread": abs(worst[1] - best[1]),
    }


def by_client(answers: RoundAnswers, column: np.ndarray, num_clients: int, defined: np.ndarray) -> list[float | None]:
    """A round's per-client values (one per answering row) placed at their clients' indices (None: none)."""
    indices = answers.indices if answers.indices is not None else tuple(range(num_clients))
    values: list[float | None] = [None] * num_clients
    for index, value, ok in zip(indices, column.tolist(), defined.tolist(), strict=True):
        values[index] = float(value) if ok else None
    return values


def metrics_by_client(
    evaluated: RoundAnswers, names: Sequence[str], higher_is_better: Sequence[str], num_clients: int
) -> dict[str, dict[str, Any]]:
    """Each metric's per-client entry from an evaluation round (a client with no rows to weigh it gave none)."""
    assert evaluated.vectors is not None  # (evaluation rounds are never summed on arrival)
    weights = evaluated.weights if evaluated.weights is not None else np.ones(len(evaluated.vectors))
    defined = np.asarray(weights) > 0
    if defined.ndim == 1:  # one count per client, for every metric
        defined = np.repeat(defined[:, None], len(names), axis=1)
    return {
        name: spread(by_client(evaluated, column, num_clients, defined[:, k]), name in higher_is_better)
        for k, (name, column) in enumerate(zip(names, evaluated.vectors.T, strict=True))
    }


def objective_by_client(answers: RoundAnswers, num_clients: int) -> dict[str, Any]:
    """The training objective's per-client entry from an exact gradient round that asked for f_i(z)."""
    assert answers.objective is not None
    objective = np.asarray(answers.objective, dtype=float)
    return spread(by_client(answers, objective, num_clients, np.ones(objective.size, dtype=bool)), False)


def clients_of(record: Mapping[str, object]) -> dict[str, Any] | None:
    """A step record's per-client entries, None when the step has none (not evaluated, or not per client)."""
    clients = record.get("clients")
    return clients if isinstance(clients, dict) else None


def summary_of(records: Sequence[Mapping[str, object]]) -> dict[str, Any]:
    """The last evaluated step's per-client entries (a result's summary), {} without any."""
    for record in reversed(records):
        clients = clients_of(record)
        if clients is not None:
            return clients
    return {}


def progress_note(clients: dict[str, Any]) -> str:
    """What a progress line says of the per-client results: each entry's worst client and the spread."""
    notes = []
    for name, entry in clients.items():
        if entry.get("worst") is not None:
            notes.append(
                f"worst {name} {entry['worst']:.4g} (client {entry['worst_client']}, spread {entry['spread']:.3g})"
            )
    return "  ".join(notes)
