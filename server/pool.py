"""The client pool: the one interface between the coordinator and its clients, and where traffic is counted.

The driver hands the pool each exchange an algorithm yields (`exchange(task)`).
One exchange is one communication round: the coordinator sends the task to every
client and every client answers. The pool returns the answers as `RoundAnswers`, one
row per client in client-index order; the algorithm aggregates them.

Two transports implement `_exchange`: LocalPool (in-process, for simulation and
tests) and GrpcPool (client processes over gRPC). Counting happens here, in
`exchange`, identically for both: the round's rules (who took part, weights,
divergence, its tally, the aggregate) are `settle`'s (server/settlement.py);
GrpcPool adds the bytes it really moved.

Counts are logical, per client: a round sends each client one message carrying
the task's vectors and receives one message back carrying its answer. A client
process that hosts several clients still counts one message per client (its real
gRPC traffic, in bytes, is counted apart).
"""

from __future__ import annotations

import abc
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common import dp, seeding
from fedsaddle.common.attacks import Attack, corrupt_round
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.numeric import Array, Precision, element_type, ordered_sum
from fedsaddle.common.problems import Problem, ProblemSpec, make_problem
from fedsaddle.common.secagg import SecAggError, SecAggSettings
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.tasks import Answer, ComputeTask, GradientTask, Task
from fedsaddle.server.aggregation import Rule, round_rule
from fedsaddle.server.algorithms.base import RoundAnswers
from fedsaddle.server.config import Weighting
from fedsaddle.server.fold import OrderedFold
from fedsaddle.server.secure import MaskedRound, SecureRounds
from fedsaddle.server.settlement import RoundTally, round_traffic, settle

# algorithm: the algorithm's own exchanges (the documented formulas); evaluation: held-out metrics;
# retransmission: what was sent again to clients that rejoined (never in the formulas);
# privacy: secure aggregation's own exchanges (key agreement, unmasking), only in runs that use it.
Category = Literal["algorithm", "evaluation", "retransmission", "privacy"]
CATEGORIES: tuple[Category, ...] = ("algorithm", "evaluation", "retransmission")


class ClientView(NamedTuple):
    """What an operator may see of one client: never its data or its vectors."""

    client: int  # its index
    address: str  # where its process connects from ("in-process" for a LocalPool)
    state: str  # joined, lost (may rejoin), refused (a session that claimed it was), waiting, left (after the end)
    latency_s: float | None  # from the last round's task sent to its answer in (None: none yet)


class RoundObserver(Protocol):
    """Told of each round as it ends (the monitor, server/monitor): nothing is asked of it."""

    def round_done(self, category: Category, seconds: float) -> None: ...

    def secure_round(self, dropped: int, recovered: int) -> None: ...


class PoolError(RuntimeError):
    """The federation cannot complete a round (a client died, timed out, misbehaved)."""


class ClientLost(PoolError):
    """A client process disconnected or stopped answering; the message names it."""

    def __init__(self, message: str, client_indices: tuple[int, ...]) -> None:
        super().__init__(message)
        self.client_indices = client_indices


class Diverged(RuntimeError):
    """Clients reported non-finite local results, or (secure aggregation) values outside the fixed-point
    bound: the run diverged (step too large)."""

    def __init__(self, round_id: int, client_indices: tuple[int, ...], reason: str = "") -> None:
        super().__init__(f"round {round_id}: clients {list(client_indices)} {reason or 'produced non-finite values'}")
        self.round_id = round_id
        self.client_indices = client_indices


@dataclass(frozen=True)
class RunInfo:
    """What clients need to know about a run. Never data: each client loads its own
    (only a synthetic problem's clients generate theirs, from `seed`)."""

    run_id: str
    problem: ProblemSpec
    seed: int  # seeds the gradient noise, and a synthetic problem's data
    gradient_noise: float = 0.0
    weighting: Weighting = "uniform"
    fraction: float = 1.0  # clients sampled per round (from the coordinator's seed); 1: all
    secure: SecAggSettings | None = None  # secure aggregation (its bound resolved), or None: plain answers
    dp: DpSettings | None = None  # differential privacy: clipping and noise on every algorithm round's sum
    computations: tuple[str, ...] = ()  # the local computations the algorithm's tasks name (a client needs each)
    precision: Precision = "float64"  # the element type of tasks, answers and the algorithm's state
    # The coordinator's own, never sent to clients: a robust aggregation rule (None: the mean), and a simulated
    # attack (common/attacks.py). Either makes the coordinator keep each round's rows (server/aggregation.py).
    rule: Rule | None = None
    attack: Attack | None = None

    @property
    def element(self) -> np.dtype[np.floating]:
        return element_type(self.precision)

    @property
    def keeps_rows(self) -> bool:
        """Whether each client's row must reach the settlement (no running fold of the answers)."""
        return self.rule is not None or self.attack is not None

    @cached_property
    def problem_object(self) -> Problem:
        """The Problem that `problem` (its spec) describes: dimensions, oracles, metrics."""
        return make_problem(self.problem)

    @property
    def dimension(self) -> int:
        return self.problem_object.dimension

    @property
    def num_clients(self) -> int:
        return self.problem.num_clients


@dataclass
class TrafficCounts:
    """Traffic of one category. `floats` counts vector entries (float64, or float32 in a float32 run: the
    same counts either way)."""

    num_clients: int
    rounds: int = 0
    messages_down: int = 0
    messages_up: int = 0
    floats_down: int = 0
    floats_up: int = 0
    bytes_down: int = 0  # on the wire (gRPC only; 0 in-process)
    bytes_up: int = 0
    # Per client, as arrays (lists in as_dict): one addition per round, whatever n is.
    per_client_floats_down: NDArray[np.int64] = field(init=False)
    per_client_floats_up: NDArray[np.int64] = field(init=False)

    def __post_init__(self) -> None:
        self.per_client_floats_down = np.zeros(self.num_clients, dtype=np.int64)
        self.per_client_floats_up = np.zeros(self.num_clients, dtype=np.int64)

    @classmethod
    def from_dict(cls, num_clients: int, counts: Mapping[str, Any]) -> TrafficCounts:
        """Counts as `as_dict` wrote them (a checkpoint), for a federation of num_clients."""
        names = ("per_client_floats_down", "per_client_floats_up")
        restored = cls(num_clients, **{k: v for k, v in counts.items() if k not in names})
        for name in names:
            values = counts[name]
            if len(values) != num_clients:
                raise ValueError(f"{name} has {len(values)} entries for {num_clients} clients")
            setattr(restored, name, np.array(values, dtype=np.int64))
        return restored

    def add(self, traffic: RoundTally, times: int = 1) -> None:
        """Count `times` rounds of the given traffic: only the clients that took part."""
        n = traffic.num_clients
        sent = n if traffic.sent is None else len(traffic.sent)
        answered = n if traffic.answered is None else len(traffic.answered)
        self.rounds += times
        self.messages_down += sent * times
        self.messages_up += answered * times
        self.floats_down += sent * traffic.floats_down * times
        self.floats_up += answered * traffic.floats_up * times
        everyone = slice(None)
        self.per_client_floats_down[everyone if traffic.sent is None else list(traffic.sent)] += (
            traffic.floats_down * times
        )
        self.per_client_floats_up[everyone if traffic.answered is None else list(traffic.answered)] += (
            traffic.floats_up * times
        )

    def merge(self, other: TrafficCounts) -> None:
        """Add another count of the same category (of the same federation) to this one."""
        for name in ("rounds", "messages_down", "messages_up", "floats_down", "floats_up", "bytes_down", "bytes_up"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.per_client_floats_down += other.per_client_floats_down
        self.per_client_floats_up += other.per_client_floats_up

    def add_entries(self, clients: Sequence[int], floats_up: int) -> None:
        """Count entries that rode in other messages (secure aggregation's weight column): no round, no message."""
        self.floats_up += len(clients) * floats_up
        self.per_client_floats_up[list(clients)] += floats_up

    def as_dict(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "messages_down": self.messages_down,
            "messages_up": self.messages_up,
            "floats_down": self.floats_down,
            "floats_up": self.floats_up,
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "per_client_floats_down": self.per_client_floats_down.tolist(),
            "per_client_floats_up": self.per_client_floats_up.tolist(),
        }


def sample_clients(seed: int, fraction: float, num_clients: int, round_id: int) -> tuple[int, ...] | None:
    """The clients drawn for a round when only a fraction takes part (None: all of them).

    A stream of its own, named by (seed, round id): every transport draws the same clients.
    """
    if fraction >= 1:
        return None
    k = max(1, round(fraction * num_clients))
    drawn = seeding.rng(seed, seeding.SAMPLING, round_id).choice(num_clients, k, replace=False)
    return tuple(sorted(int(i) for i in drawn))


def fresh_traffic(num_clients: int, privacy: bool = False) -> dict[Category, TrafficCounts]:
    categories: tuple[Category, ...] = (*CATEGORIES, "privacy") if privacy else CATEGORIES
    return {category: TrafficCounts(num_clients) for category in categories}


class ClientPool(abc.ABC):
    """A federation of n clients that the coordinator can exchange with."""

    def __init__(self) -> None:
        self.run: RunInfo | None = None
        self.round_id = 0
        self.traffic: dict[Category, TrafficCounts] = {}
        self.weights: Array | None = None  # the clients' sample counts, when the run weights by samples
        self.failure: str | None = None  # why the runs on this pool failed, if they did (told to clients at close)
        self.farewell = "the run is over"  # what clients are told at close when nothing failed
        self.secure: SecureRounds | None = None  # the run's secure aggregation, when it has it
        # Robust rule: how often each client reported non-finite results and was left out of a round (a false
        # "diverged" report, or a real one from a minority), and in how many rounds that happened.
        self.faulty_reports: Counter[int] = Counter()
        self.faulty_rounds = 0
        self.observer: RoundObserver | None = None  # told of every round's end (a monitor), when set

    def start_run(self, run: RunInfo) -> None:
        """Announce a run (clients load their data for it); counters and round ids start afresh."""
        self.run = run
        self.round_id = 0
        self.traffic = fresh_traffic(run.num_clients, privacy=run.secure is not None)
        self.weights = None
        self.secure = None
        self.faulty_reports, self.faulty_rounds = Counter(), 0
        counts = self._announce(run)
        if run.secure is not None:  # the clients weight their own rows: the coordinator never learns a count
            self._agree_keys(run, run.secure)
        elif run.weighting == "samples":
            if counts is None or len(counts) != run.num_clients:
                raise PoolError("the run weights clients by samples, but their sample counts are not known")
            if min(counts) <= 0:
                raise PoolError(f"client {int(np.argmin(counts))} reports no samples")
            self.weights = np.asarray(counts, dtype=np.float64)

    def participants(self, round_id: int, category: Category) -> tuple[int, ...] | None:
        """The clients that take part in a round: all (None), or a sample drawn from the run's seed."""
        run = self._require_run()
        return None if category != "algorithm" else sample_clients(run.seed, run.fraction, run.num_clients, round_id)

    def exchange(self, task: Task, category: Category = "algorithm") -> RoundAnswers:
        """One round: send the task to the round's clients and return their answers in client-index order.

        The round is counted even when clients report non-finite results (then
        Diverged is raised): it happened. Under partial participation (sampling,
        or a straggler deadline that closed the round), the answers say which
        clients they come from.
        """
        observer = self.observer
        if observer is None:
            return self._counted_round(task, category)
        started = time.perf_counter()
        try:
            return self._counted_round(task, category)
        finally:
            observer.round_done(category, time.perf_counter() - started)

    def _counted_round(self, task: Task, category: Category) -> RoundAnswers:
        run = self._require_run()
        if isinstance(task, ComputeTask):
            if task.name not in run.computations:  # the clients were told which to expect, and checked those
                raise PoolError(
                    f"run {run.run_id}: the algorithm asked for the local computation {task.name[:64]!r}, "
                    f"which its AlgorithmDef does not declare (its computations: {list(run.computations)}): name it in "
                    "AlgorithmDef(..., computations={...})"
                )
            if (too_large := task.oversized()) is not None:
                raise PoolError(f"the algorithm asked for more than a client takes: {too_large}")
        self.round_id += 1
        participants = self.participants(self.round_id, category)
        if self.secure is not None:
            return self._secure_exchange(task, category, participants)
        replies = self._exchange(task, self.round_id, category, participants)
        algorithm = category == "algorithm"
        if run.attack is not None and algorithm:
            replies = corrupt_round(run.attack, replies, run.seed, self.round_id)
        folded = self._folded()
        rule = round_rule(run.rule, run.seed, self.round_id) if run.rule is not None and algorithm else None
        settlement = settle(
            task, run.num_clients, run.dimension, participants, replies, self.weights, folded=folded, rule=rule
        )
        self.traffic[category].add(settlement.tally)
        if settlement.faulty:
            self.faulty_reports.update(settlement.faulty)
            self.faulty_rounds += 1
        if settlement.answers is None:
            raise Diverged(self.round_id, settlement.diverged)
        if run.dp is not None and category == "algorithm":
            return self._central_dp(run.dp, task, replies, settlement.answers.indices)
        if run.precision != "float64":
            settlement.answers.element = run.element
        return settlement.answers

    def _folded(self) -> OrderedFold | None:
        """The last exchange's answers added up as they came (server/fold.py), when the transport did so."""
        return None

    def _central_dp(
        self, settings: DpSettings, task: Task, replies: list[Answer], indices: tuple[int, ...] | None
    ) -> RoundAnswers:
        """Central DP: each client's row [v_i, (f_i)] clipped, N(0, sigma^2) added to the sum by the coordinator
        (from the run's seed: a trusted coordinator's own randomness), then averaged. The rows are added in
        client-index order."""
        run = self._require_run()
        want_objective = isinstance(task, GradientTask) and task.want_objective
        rows: list[tuple[int, Array]] = []
        for reply in replies:
            for k, index in enumerate(reply.indices):
                row = reply.vectors[k]
                if want_objective and reply.objective is not None:
                    row = np.append(row, reply.objective[k])
                rows.append((index, dp.clip(row, settings.clip)))
        rows.sort(key=lambda pair: pair[0])
        total = ordered_sum(np.array([row for _, row in rows]))
        noise = seeding.rng(run.seed, seeding.DP_NOISE, self.round_id).normal(0.0, settings.sigma, total.shape)
        mean = (total + noise) / len(rows)
        dim = run.dimension
        mean_objective = float(mean[dim]) if want_objective else None
        return RoundAnswers(None, None, None, indices, aggregated=(mean[:dim], mean_objective))

    # -- secure aggregation ----------------------------------------------------------------

    def _agree_keys(self, run: RunInfo, settings: SecAggSettings) -> None:
        """Key agreement, once per run: one round of the privacy category (keys up, the directory down)."""
        uniform = run.weighting != "samples"
        self.secure = SecureRounds(run.run_id, settings, run.num_clients, run.dimension, uniform=uniform)
        try:
            for index, key in sorted(self._public_keys().items()):
                self.secure.directory.announce(index, key)
        except SecAggError as exc:
            raise PoolError(f"key agreement for run {run.run_id}: {exc}") from None
        self._send_directory(self.secure.directory.epoch, dict(self.secure.directory.keys))
        self.traffic["privacy"].add(RoundTally(run.num_clients, 0, 0))

    def _secure_exchange(self, task: Task, category: Category, participants: tuple[int, ...] | None) -> RoundAnswers:
        """One round under secure aggregation: masked answers, the unmask sub-exchange, only the sum kept."""
        run, secure = self._require_run(), self.secure
        assert secure is not None
        n, dim = run.num_clients, run.dimension
        rows = secure.open(task, self.round_id, 0, participants)
        try:
            answers = self._exchange_masked(task, self.round_id, category, participants, rows)
            outcome = secure.aggregate(task, rows, answers, self._unmask)
        except SecAggError as exc:
            raise PoolError(str(exc)) from None
        answered = outcome.answered
        everyone = participants is None and len(answered) == n
        if self.observer is not None:  # secure aggregation's dropouts, and those whose masks were recovered
            dropped = (n if participants is None else len(participants)) - len(answered)
            self.observer.secure_round(dropped, dropped if outcome.aggregate is not None else 0)
        self.traffic[category].add(round_traffic(task, n, dim, participants, None if everyone else answered))
        if outcome.aggregate is None:
            raise Diverged(self.round_id, outcome.diverged, outcome.reason)
        unmasked = tuple(sorted(set(answered) - set(outcome.diverged)))
        self.traffic["privacy"].add(RoundTally(n, 0, 0, unmasked, outcome.unmasked_by))
        self.traffic["privacy"].add_entries(unmasked, 1)  # the weight each masked row carries
        mean, objective = outcome.aggregate.mean, outcome.aggregate.objective
        return RoundAnswers(None, None, None, None if everyone else answered, aggregated=(mean, objective))

    def _public_keys(self) -> dict[int, bytes]:
        """Every client's public key for the run (secure aggregation's transports provide this)."""
        raise PoolError(f"{type(self).__name__} does not offer secure aggregation")

    def _send_directory(self, epoch: int, keys: dict[int, bytes]) -> None:
        """Send every client the key directory (index -> public key) of an epoch."""
        raise PoolError(f"{type(self).__name__} does not offer secure aggregation")

    def _exchange_masked(
        self,
        task: Task,
        round_id: int,
        category: Category,
        participants: tuple[int, ...] | None,
        rows: MaskedRound,
    ) -> list[MaskedAnswer]:
        """Send the task; the masked answers (one per process). A transport that receives the rows one by one
        adds each to `rows` (the round's sum) as it comes, and returns the answers without them."""
        raise PoolError(f"{type(self).__name__} does not offer secure aggregation")

    def _unmask(self, requests: dict[int, UnmaskRequest]) -> dict[int, UnmaskReply]:
        """The unmask sub-exchange: each request to its client, the replies of those that gave one."""
        raise PoolError(f"{type(self).__name__} does not offer secure aggregation")

    def restore(
        self,
        round_id: int,
        traffic: dict[str, dict[str, object]],
        faulty_reports: Mapping[int, int] | None = None,
        faulty_rounds: int = 0,
    ) -> None:
        """Go on from a checkpoint: the round counter and the counts as they were."""
        self.round_id = round_id
        self.faulty_reports, self.faulty_rounds = Counter(faulty_reports or {}), faulty_rounds
        for category, counts in traffic.items():
            if category in self.traffic:
                restored = TrafficCounts.from_dict(self.traffic[category].num_clients, counts)
                if category == "privacy":  # this start's key agreement happened: it is added, not forgotten
                    restored.merge(self.traffic["privacy"])
                self.traffic[category] = restored

    def gradients(self, z: Array, *, exact: bool = False, category: Category = "algorithm") -> RoundAnswers:
        """One round of G_i(z) from every client (a convenience over `exchange`)."""
        return self.exchange(GradientTask(z, exact=exact), category)

    @property
    def num_clients(self) -> int:
        return self._require_run().num_clients

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport (end sessions, stop servers)."""

    def numeric_stacks(self) -> dict[str, list[int]]:
        """What the client processes reported computing with, and which clients each (none in-process)."""
        return {}

    def connections_closed(self) -> dict[str, int]:
        """Connections the transport closed for carrying nothing, by reason (none in-process)."""
        return {}

    def refusals(self) -> dict[str, int]:
        """Streams the transport ended with an error status, by the status's name (none in-process)."""
        return {}

    def client_view(self) -> list[ClientView]:
        """Each client's liveness, where it connects from and its last answer's latency (safe to call from
        another thread: it reads, and copies what it reads)."""
        size = self.run.num_clients if self.run is not None else 0
        return [ClientView(index, "in-process", "joined", None) for index in range(size)]

    def _require_run(self) -> RunInfo:
        if self.run is None:
            raise RuntimeError("start_run() must be called before exchanging with clients")
        return self.run

    # -- what a transport provides -------------------------------------------------------

    @abc.abstractmethod
    def _announce(self, run: RunInfo) -> Sequence[int] | None:
        """Tell every client about the run (they load their data); their sample counts, when asked."""

    @abc.abstractmethod
    def _exchange(
        self, task: Task, round_id: int, category: Category, participants: tuple[int, ...] | None
    ) -> list[Answer]:
        """Send the task to the participating clients (None: all) and return their answers (one per process)."""
