"""What the coordinator asks of clients in one round, and what they answer.

These are transport-free values, immutable NamedTuples (a batch of runs makes
many of them, and every answer of every round is one): the in-process pool hands
them straight to a worker, the gRPC pool encodes them with `fedsaddle.common.wire`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from fedsaddle.common.numeric import Array

Decay = Literal["constant", "inverse_sqrt"]


class GradientTask(NamedTuple):
    """Evaluate G_i(z): the average of `batch` stochastic estimates, or exactly."""

    z: Array
    batch: int = 1
    exact: bool = False
    want_objective: bool = False

    def payload(self) -> list[Array]:
        return [self.z]


class LocalStepsTask(NamedTuple):
    """Run `steps` local steps from z_start; answer sum_l weight(k_l) * g_i^l.

    Step l (global index k_l = step_offset + l) moves z_i by
    -gamma_local * weight(k_l) * g_i^l. With control=None the direction is
    FedAvg-S's G_i^(z_i); with a control c it is SCAFFOLD-S's
    G_i^(z_i) - G_i^(z_start) + theta (z_i - z_start) + c.
    """

    z_start: Array
    steps: int
    gamma_local: float | Array  # an array: one per run of a batch (see server/batch.py)
    step_offset: int = 0
    decay: Decay = "constant"
    control: Array | None = None
    theta: float | Array = 0.0

    def payload(self) -> list[Array]:
        return [self.z_start] if self.control is None else [self.z_start, self.control]


class EvaluateTask(NamedTuple):
    """Compute the problem's evaluation metrics at z on each client's held-out rows (or training rows, for
    the metrics its problem declares so: common/problems/shards.py's `metric_rows`)."""

    z: Array
    metric_names: tuple[str, ...]
    # The answers carry one row count per client and metric, not one per client: the problem's metrics are
    # on different rows. Known to the coordinator from the problem (the wire does not carry it); it counts
    # the floats of the answers (server/settlement.py's round_traffic).
    counts_per_metric: bool = False

    def payload(self) -> list[Array]:
        return [self.z]


# A COMPUTE task carries at most this many times z's length in all (z and its named arrays): a bound the
# client checks on the wire, and the pool before it sends one, so an algorithm that asks for more fails at
# once, in-process and over gRPC alike.
COMPUTE_PAYLOAD_LIMIT = 4


class ComputeTask(NamedTuple):
    """Run the local computation called `name` (common/computations.py) from z on each client.

    The generic client half of an algorithm: `arrays` are named vectors the
    computation receives besides z (each of any length), `params` named numbers.
    The answer is one vector of z's length per client. Nothing of it is specific to
    an algorithm, so a plug-in's computation travels without a change to the wire.

    `per_run` exists only in a batch of runs (server/batch.py, in-process; never on
    the wire): the parameters that differ between the batch's runs, each a (B, 1)
    column, for a computation that declares it takes them so (common/computations.py's
    `per_run`).
    """

    name: str
    z: Array
    arrays: tuple[tuple[str, Array], ...] = ()
    params: tuple[tuple[str, float], ...] = ()
    per_run: tuple[tuple[str, Array], ...] = ()

    def payload(self) -> list[Array]:
        return [self.z, *(array for _, array in self.arrays)]

    def oversized(self) -> str | None:
        """Why this task is more than a client takes (COMPUTE_PAYLOAD_LIMIT), or None."""
        dimension = int(np.size(self.z))
        total = sum(int(np.size(array)) for array in self.payload())
        if total <= COMPUTE_PAYLOAD_LIMIT * dimension:
            return None
        return f"compute task {self.name!r}: {total} payload entries, at most {COMPUTE_PAYLOAD_LIMIT} x {dimension}"


Task = GradientTask | LocalStepsTask | EvaluateTask | ComputeTask


class Answer(NamedTuple):
    """One process's answer: a vector per hosted client, in the order of its indices."""

    indices: tuple[int, ...]  # increasing
    vectors: Array  # shape (len(indices), dimension); for evaluation (len(indices), metrics)
    objective: Array | None = None  # shape (len(indices),), when asked for
    diverged: bool = False
    counts: Array | None = None  # evaluation: each client's rows its metrics are on (k,), or per metric (k, m)
    # Secure aggregation (over gRPC): vectors are masked rows (uint64), and these each row's sealed shares.
    shares: tuple[dict[int, bytes], ...] | None = None
    reason: str = ""  # why the clients diverged, when they say (a value outside the fixed-point bound)


def step_weight(decay: Decay, k: int) -> float:
    """Weight of global local step k: 1, or the paper's 1 / (sqrt(k) + 1) decay."""
    if decay == "constant":
        return 1.0
    return 1.0 / (float(np.sqrt(k)) + 1.0)
