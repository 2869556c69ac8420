"""The client pool: the one interface the algorithms talk to, and where traffic is counted.

An algorithm asks the pool for collective exchanges: `gradients(...)` or
`local_steps(...)`. Each call is one communication round: the coordinator sends
one task to every client and every client answers. The pool returns the clients'
answers stacked in client-index order; the algorithm aggregates them.

Two transports implement `_exchange`: LocalPool (in-process, for simulation and
tests) and GrpcPool (client processes over gRPC). Counting happens here, in
`_run_round`, identically for both; GrpcPool adds the bytes it really moved.

Counts are logical, per client: a round sends each participating client one
message carrying the task's vectors and receives one message back carrying its
answer vector. A client process that hosts several clients still counts one
message per client (its real gRPC traffic, in bytes, is counted apart).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedsaddle.common.problems import Array, PaperRegressionSpec, QuadraticGameSpec
from fedsaddle.common.tasks import Answer, GradientTask, LocalStepsTask, Task

Category = Literal["algorithm", "evaluation"]


class PoolError(RuntimeError):
    """The federation cannot complete a round (a client died, timed out, misbehaved)."""


class ClientLost(PoolError):
    """A client process disconnected or stopped answering; the message names it."""

    def __init__(self, message: str, client_indices: tuple[int, ...]) -> None:
        super().__init__(message)
        self.client_indices = client_indices


class Diverged(RuntimeError):
    """Clients reported non-finite local results: the run diverged (step too large)."""

    def __init__(self, round_id: int, client_indices: tuple[int, ...]) -> None:
        super().__init__(f"round {round_id}: clients {list(client_indices)} produced non-finite values")
        self.round_id = round_id
        self.client_indices = client_indices


@dataclass(frozen=True)
class RunInfo:
    """What clients need to know about a run: they build their shards from it."""

    run_id: str
    problem: PaperRegressionSpec | QuadraticGameSpec
    seed: int
    gradient_noise: float

    @property
    def dimension(self) -> int:
        return 2 * self.problem.dim

    @property
    def num_clients(self) -> int:
        return self.problem.num_clients


@dataclass
class TrafficCounts:
    """Traffic of one category. `floats` counts float64 vector entries."""

    num_clients: int
    rounds: int = 0
    messages_down: int = 0
    messages_up: int = 0
    floats_down: int = 0
    floats_up: int = 0
    bytes_down: int = 0  # on the wire (gRPC only; 0 in-process)
    bytes_up: int = 0
    per_client_floats_down: list[int] = field(default_factory=list)
    per_client_floats_up: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_client_floats_down = self.per_client_floats_down or [0] * self.num_clients
        self.per_client_floats_up = self.per_client_floats_up or [0] * self.num_clients

    def as_dict(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "messages_down": self.messages_down,
            "messages_up": self.messages_up,
            "floats_down": self.floats_down,
            "floats_up": self.floats_up,
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "per_client_floats_down": list(self.per_client_floats_down),
            "per_client_floats_up": list(self.per_client_floats_up),
        }


@dataclass
class GradientAnswers:
    """Per-client gradient mappings (n, D) and, when asked, objective values (n,)."""

    gradients: Array
    objective: Array | None

    def mean(self) -> Array:
        return mean_over_clients(self.gradients)

    def mean_objective(self) -> Array | None:
        """(1/n) sum_i f_i(z) with a trailing axis of 1 (shape (1,), or (B, 1) for a batch of runs)."""
        return None if self.objective is None else mean_over_clients(self.objective[..., None])


def mean_over_clients(per_client: Array) -> Array:
    """(1/n) sum_i v_i over axis -2 (the client axis), added one client at a time in index order.

    The explicit loop fixes the order of additions, so the result is the same bits
    whether or not a leading axis batches several runs together.
    """
    total = per_client[..., 0, :].copy()
    for i in range(1, per_client.shape[-2]):
        total += per_client[..., i, :]
    result: Array = total / per_client.shape[-2]
    return result


class ClientPool(abc.ABC):
    """A federation of n clients that the coordinator can exchange with."""

    def __init__(self) -> None:
        self.run: RunInfo | None = None
        self.round_id = 0
        self.traffic: dict[Category, TrafficCounts] = {}

    # -- the interface the algorithms use ------------------------------------------------

    def start_run(self, run: RunInfo) -> None:
        """Announce a run; counters and round ids start afresh."""
        self.run = run
        self.round_id = 0
        self.traffic = {c: TrafficCounts(run.num_clients) for c in ("algorithm", "evaluation")}
        self._announce(run)

    def gradients(
        self,
        z: Array,
        *,
        batch: int = 1,
        exact: bool = False,
        want_objective: bool = False,
        category: Category = "algorithm",
    ) -> GradientAnswers:
        """One round: every client answers G_i(z) (a minibatch of `batch` estimates)."""
        task = GradientTask(z=z, batch=batch, exact=exact, want_objective=want_objective)
        vectors, objective = self._run_round(task, category)
        return GradientAnswers(vectors, objective)

    def local_steps(
        self,
        z_start: Array,
        *,
        steps: int,
        gamma_local: float | Array,
        step_offset: int = 0,
        decay: Literal["constant", "inverse_sqrt"] = "constant",
        control: Array | None = None,
        theta: float | Array = 0.0,
    ) -> Array:
        """One round: every client runs local steps and answers its direction sum (n, D)."""
        task = LocalStepsTask(z_start, steps, gamma_local, step_offset, decay, control, theta)
        vectors, _ = self._run_round(task, "algorithm")
        return vectors

    @property
    def num_clients(self) -> int:
        return self._require_run().num_clients

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport (end sessions, stop servers)."""

    # -- counting: the one place ---------------------------------------------------------

    def _run_round(self, task: Task, category: Category) -> tuple[Array, Array | None]:
        run = self._require_run()
        self.round_id += 1
        answers = self._exchange(task, self.round_id, category)
        n, dim = run.num_clients, run.dimension
        runs = task.payload()[0].shape[:-1]  # () for one run, (B,) for a batch of runs
        vectors = np.empty((*runs, n, dim))
        objective = np.empty((*runs, n)) if isinstance(task, GradientTask) and task.want_objective else None
        diverged: list[int] = []
        for answer in answers:
            if answer.diverged:
                diverged.extend(answer.indices)
                continue
            vectors[..., list(answer.indices), :] = answer.vectors
            if objective is not None and answer.objective is not None:
                objective[..., list(answer.indices)] = answer.objective
        counts = self.traffic[category]
        counts.rounds += 1
        down = sum(v.shape[-1] for v in task.payload())  # per client and per run
        up = dim + (1 if objective is not None else 0)
        counts.messages_down += n
        counts.messages_up += n
        counts.floats_down += n * down
        counts.floats_up += n * up
        for i in range(n):
            counts.per_client_floats_down[i] += down
            counts.per_client_floats_up[i] += up
        if diverged:
            raise Diverged(self.round_id, tuple(sorted(diverged)))
        return vectors, objective

    def _require_run(self) -> RunInfo:
        if self.run is None:
            raise RuntimeError("start_run() must be called before exchanging with clients")
        return self.run

    # -- what a transport provides -------------------------------------------------------

    @abc.abstractmethod
    def _announce(self, run: RunInfo) -> None:
        """Tell every client about the run (they build their shards)."""

    @abc.abstractmethod
    def _exchange(self, task: Task, round_id: int, category: Category) -> list[Answer]:
        """Send the task to every client and return all answers (one per process)."""
