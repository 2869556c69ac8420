"""The coordinator's half of secure aggregation over any transport: key agreement, then per round the
masked rows, the unmask sub-exchange and the sum (common/secagg holds the protocol itself).

`SecureRounds` is driven by the pool (server/pool.py): the transport brings the
clients' public keys, masked rows (added to the round's sum as they come) and
unmask replies; this module checks them, asks for the unmasking, and turns the
unmasked sum into the round's aggregate. It never sees a single client's answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from fedsaddle.common.secagg import SecAggSettings
from fedsaddle.common.secagg.aggregator import KeyDirectory, MaskedRound
from fedsaddle.common.secagg.party import UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import Aggregate, MaskedAnswer, read_sum, row_length
from fedsaddle.common.secagg.settings import SecAggError, round_threshold
from fedsaddle.common.tasks import EvaluateTask, Task

Unmask = Callable[[dict[int, UnmaskRequest]], dict[int, UnmaskReply]]


class SecureOutcome(NamedTuple):
    """A round as secure aggregation closed it."""

    aggregate: Aggregate | None  # None when some client could not encode its values (diverged)
    answered: tuple[int, ...]  # the clients that answered (a masked row, or a report that they diverged)
    unmasked_by: tuple[int, ...]  # the clients that gave their unmasking
    diverged: tuple[int, ...] = ()
    reason: str = ""


class SecureRounds:
    """A run's secure aggregation on the coordinator: its key directory and its rounds."""

    def __init__(
        self, run_id: str, settings: SecAggSettings, num_clients: int, dimension: int, uniform: bool = False
    ) -> None:
        self.run_id, self.settings = run_id, settings
        self.num_clients, self.dimension = num_clients, dimension
        self.uniform = uniform  # every algorithm row carries the weight 1: their sum is known (see `aggregate`)
        self.directory = KeyDirectory()

    def open(self, task: Task, round_id: int, attempt: int, participants: Sequence[int] | None) -> MaskedRound:
        """A round's masked rows: the transport adds each to it as it comes (MaskedRound.add)."""
        clients = tuple(range(self.num_clients)) if participants is None else tuple(participants)
        threshold = round_threshold(self.settings, len(clients))
        length = row_length(task, self.dimension)
        return MaskedRound(self.run_id, round_id, attempt, clients, threshold, length, self.settings.neighbours)

    def aggregate(
        self, task: Task, masked: MaskedRound, answers: Sequence[MaskedAnswer], unmask: Unmask
    ) -> SecureOutcome:
        """Close a round: add the rows `answers` still carry to `masked` (a transport that receives rows one by
        one added them as they came), run the unmask sub-exchange through `unmask`, read the sum."""
        round_id = masked.round_id
        diverged: list[int] = []
        reason = ""
        for answer in answers:
            for row in answer.rows:
                masked.add(row)
            diverged.extend(answer.diverged)
            reason = reason or answer.reason
        answered = tuple(sorted([*masked.shares, *diverged]))
        if diverged:  # the run is over: nothing is unmasked
            return SecureOutcome(None, answered, (), tuple(sorted(diverged)), reason)
        replies = unmask(masked.close())
        total = masked.finish(replies)
        aggregate = read_sum(total, task, self.dimension, self.settings.scale_bits)
        summed = len(masked.shares)
        if self.uniform and not isinstance(task, EvaluateTask) and aggregate.total_weight != summed:
            # Each row's weight is 1, so the weights must sum to the rows summed, exactly: masks that did not
            # cancel (a client whose masks differ, e.g. of an older fedsaddle) leave a random sum instead.
            raise SecAggError(
                f"round {round_id}: the unmasked weights sum to {aggregate.total_weight:.17g}, not to the {summed} "
                "clients whose rows were summed: the masks did not cancel (are the clients and the coordinator "
                "the same fedsaddle version?)"
            )
        return SecureOutcome(aggregate, answered, tuple(sorted(replies)))
