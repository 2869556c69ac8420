"""The coordinator's side of secure aggregation, over any transport: keys, masked rounds, unmasking.

The protocol itself (masks, shares, the clients' side) is common/secagg. Here:

* `KeyEpochs`: the clients' public keys through one run. Each client's key rides on
  its Ready (the run's start); the key directory of epoch 0 is sent from them. A
  client process that restarts and rejoins comes back with new keys: they replace
  its old ones, and before the next round every session is sent the directory of the
  next epoch, so every client agrees anew (the stream keeps the order: directory,
  then task). Each such re-agreement is counted (`rekeys`) as a round of the privacy
  category.
* `KeyDirectory`: what is sent of those keys.
* `MaskedRound` collects one round's masked rows (each checked: a client of the
  round, once, the run's length, a sealed share for every other client of the
  round). When the round closes, the clients whose rows arrived are A, the others
  D; each client of A is asked for b-shares of A and its seeds with D. From the
  replies the sum of A's rows is unmasked:

      sum_{i in A} x_i = sum_{i in A} y_i - sum_{i in A} PRG(b_i) - sum_{j in A, i in D} sign(j, i) PRG(m_ij)

  with sign(j, i) = +1 when i > j (j added that mask) and -1 when i < j. The result
  is the sum of the clients' fixed-point rows exactly, mod 2^64. Under SecAgg+
  (common/secagg/graph.py) each client's shares and seeds concern its neighbours
  in the round's graph only.
* `SecureRounds` is driven by the pool (server/pool.py): the transport brings the
  clients' public keys, masked rows (added to the round's sum as they come) and
  unmask replies; it checks them, asks for the unmasking, and turns the unmasked
  sum into the round's aggregate. It never sees a single client's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.secagg import SecAggSettings, crypto, graph, messages, shamir
from fedsaddle.common.secagg.fixedpoint import Ring
from fedsaddle.common.secagg.messages import SEALED_SHARE_BYTES
from fedsaddle.common.secagg.party import MaskedRow, UnmaskReply, UnmaskRequest, self_mask_key
from fedsaddle.common.secagg.rows import Aggregate, MaskedAnswer, read_sum, row_length
from fedsaddle.common.secagg.settings import SecAggError, round_threshold
from fedsaddle.common.tasks import EvaluateTask, Task

log = logging.getLogger("fedsaddle.coordinator")


class KeyEpochs:
    """The clients' public keys in one run, the epoch of the last key directory sent, and the re-agreements."""

    def __init__(self) -> None:
        self.public_keys: dict[int, bytes] = {}  # client index -> its key now
        self.epoch = 0
        self._rekeyed: set[int] = set()  # the clients that came back with new keys since the last directory
        self._rekeys: list[tuple[tuple[int, ...], int]] = []  # (clients with new keys, bytes sent), not yet taken

    def keep(self, order: Sequence[int], keys: Sequence[bytes]) -> None:
        """A session's Ready at the run's start: the keys of its clients, in its Hello's order."""
        for index, public_key in zip(order, keys, strict=False):
            self.public_keys[index] = public_key

    def problem_with(
        self, who: str, indices: tuple[int, ...], keys: Sequence[bytes], run_id: str, rejoins: bool
    ) -> str | None:
        """Why a session's keys (`who`, holding `indices`) do not let the run go on, or None. `rejoins`: the run
        waits for lost clients to come back."""
        if len(keys) != len(indices):
            return (
                f"{who} sent {len(keys)} public keys for {len(indices)} clients; run {run_id} uses secure aggregation"
            )
        if self.public_keys and any(self.public_keys.get(i) for i in indices):
            # A process that restarted has new keys: every client agrees anew before the next round.
            if not rejoins:
                return (
                    f"{who} rejoined run {run_id} with new keys, and the run takes no rejoins "
                    "(transport.rejoin_timeout_s)"
                )
            if len(set(keys)) != len(keys) or any(key in self.public_keys.values() for key in keys):
                return f"{who} rejoined run {run_id} with public keys already in use"
        return None

    def rejoined(self, order: Sequence[int], keys: Sequence[bytes]) -> None:
        """A rejoining session's Ready (its keys checked by `problem_with`): everyone agrees anew before the
        next round."""
        self.keep(order, keys)
        self._rekeyed.update(order)

    @property
    def due(self) -> bool:
        """Whether clients came back with new keys since the last directory."""
        return bool(self._rekeyed)

    def agree_anew(self, run_id: str, recipients: int) -> bytes:
        """The key directory of the next epoch, to be sent to each of `recipients` sessions before the round's
        task; the re-agreement is counted."""
        self.epoch += 1
        directory = messages.key_directory(run_id, self.epoch, dict(self.public_keys))
        clients = sorted(self._rekeyed)
        self._rekeys.append((tuple(clients), len(directory) * recipients))
        log.info(
            "run %s: clients %s rejoined with new keys; key directory of epoch %d sent to every client",
            run_id,
            some(clients),
            self.epoch,
        )
        self._rekeyed = set()
        return directory

    def take_rekeys(self) -> list[tuple[tuple[int, ...], int]]:
        """The re-agreements since the last call: the clients with new keys, and the bytes of directories sent."""
        rekeys, self._rekeys = self._rekeys, []
        return rekeys


class KeyDirectory:
    """The clients' public keys as they announced them, and the epoch of the directory sent to them.

    A client that comes back with a new key (a restarted process) replaces its entry; the
    directory is then sent again under the next epoch."""

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}
        self.epoch = 0

    def announce(self, index: int, public_key: bytes) -> None:
        if len(public_key) != crypto.PUBLIC_KEY_BYTES:
            raise SecAggError(f"client {index}'s public key is {len(public_key)} bytes, not {crypto.PUBLIC_KEY_BYTES}")
        if any(key == public_key for j, key in self.keys.items() if j != index):
            raise SecAggError(f"client {index} announced a public key another client already has")
        if index in self.keys and self.keys[index] != public_key:
            self.epoch += 1
        self.keys[index] = public_key


@dataclass
class _Stream:
    """An answer being added chunk by chunk: its clients, the sum before it (None: there was none)."""

    clients: tuple[int, ...]
    backup: Ring | None
    carry: bytes = b""  # the bytes of an entry split between two chunks


class MaskedRound:
    """One round's masked rows, and its unmasking. Each row is added to the round's sum as it comes (addition
    mod 2^64 gives the same bits in any order), and only its sealed shares are kept: the coordinator holds one
    row's worth of memory for the round, however many clients answer."""

    def __init__(
        self,
        run_id: str,
        round_id: int,
        attempt: int,
        participants: Sequence[int],
        threshold: int,
        length: int,
        neighbours: int = graph.ALL_PAIRS,
    ) -> None:
        self.run_id, self.round_id, self.attempt = run_id, round_id, attempt
        self.participants = tuple(participants)
        self.threshold, self.length, self.neighbours = threshold, length, neighbours
        self.shares: dict[int, dict[int, bytes]] = {}  # sender -> holder -> its sealed share
        self._sum: Ring | None = None  # the rows added so far (the round's own array), mod 2^64
        self._stream: _Stream | None = None  # the answer being added chunk by chunk, if one is
        self._requests: dict[int, UnmaskRequest] | None = None
        self._finished = False
        self._graph: dict[int, tuple[int, ...]] = {}  # client -> its neighbours, as they are asked for

    def neighbours_of(self, client: int) -> tuple[int, ...]:
        if client not in self._graph:
            self._graph[client] = graph.neighbours_of(client, self.participants, self.neighbours)
        return self._graph[client]

    def _share_threshold(self, client: int) -> int:
        """Shares that rebuild `client`'s self-mask seed (as Party.mask split it)."""
        around = self.neighbours_of(client)
        if len(around) == len(self.participants) - 1:
            return self.threshold
        return graph.neighbourhood_threshold(len(around) + 1)

    def add(self, row: MaskedRow) -> None:
        """Add a client's masked row to the round's sum and keep its shares, or SecAggError (naming the client
        and round) and change nothing. The row itself is not kept: the caller may reuse or free it. Another
        answer may be streaming meanwhile: the row goes into the sum it would be taken back out to as well."""
        stream = self._stream
        if stream is not None and row.client in stream.clients:
            raise SecAggError(f"round {self.round_id}: client {row.client} sent a second masked row")
        self._check(row)
        where = f"round {self.round_id}: client {row.client}"
        if row.masked.shape != (self.length,):
            raise SecAggError(f"{where}: masked row of shape {row.masked.shape}, expected ({self.length},)")
        if row.masked.dtype != np.uint64:
            raise SecAggError(f"{where}: masked row of {row.masked.dtype} entries, expected uint64")
        if self._sum is None:
            self._sum = row.masked.copy()
        else:
            np.add(self._sum, row.masked, out=self._sum)  # (wraps mod 2^64: numpy does not check uint64 arrays)
        if stream is not None:  # (the sum before the streaming answer, which aborting it restores, has it too)
            if stream.backup is None:
                stream.backup = row.masked.copy()
            else:
                np.add(stream.backup, row.masked, out=stream.backup)
        self.shares[row.client] = row.shares

    def _check(self, row: MaskedRow, *before: MaskedRow) -> None:
        """SecAggError unless `row` may join the round: a client of it, its first row, the round still open,
        a sealed share of the right size for each of its neighbours (and none for anyone else)."""
        where = f"round {self.round_id}: client {row.client}"
        if row.client not in self.participants:
            raise SecAggError(f"{where} is not one of the round's clients")
        if row.client in self.shares or any(other.client == row.client for other in before):
            raise SecAggError(f"{where} sent a second masked row")
        if self._requests is not None:
            raise SecAggError(f"{where}: its masked row came after the round closed")
        holders = sorted(row.shares)
        others = list(self.neighbours_of(row.client))
        if holders != others:
            raise SecAggError(
                f"{where}: sealed shares for clients {holders[:8]}, expected one for each of {others[:8]}"
            )
        short = [j for j, sealed in row.shares.items() if len(sealed) != SEALED_SHARE_BYTES]
        if short:
            raise SecAggError(f"{where}: sealed shares for clients {short[:5]} are not {SEALED_SHARE_BYTES} bytes")

    # -- an answer's rows added chunk by chunk, as the transport reads them --------------------------------

    def begin_stream(self, clients: tuple[int, ...], entries: int) -> bool:
        """Start adding an answer's rows (`clients` in order, `entries` ring elements each) chunk by chunk as
        they are read, so that none is ever held whole. False if one is being added so already (the answer is
        then read whole, and `add`ed), or its rows are not the round's length (`add` then names the problem).
        The sum is copied first: an answer refused, or lost, half-way is taken back out (`abort_stream`)."""
        if self._stream is not None or entries != self.length or self._requests is not None:
            return False
        if self._sum is None:
            self._stream = _Stream(clients, None)
            self._sum = np.zeros(self.length, dtype=np.uint64)
        else:
            self._stream = _Stream(clients, self._sum.copy())
        return True

    def stream_chunk(self, offset: int, data: bytes | memoryview) -> None:
        """Add the streamed answer's payload bytes from `offset` (the transport's assembler checked them: in
        order, no gap, no overrun). Row r's entry e is the payload's entry r * length + e."""
        stream, total = self._stream, self._sum
        assert stream is not None and total is not None
        values, first, stream.carry = wire.chunk_entries(stream.carry, offset, data, "<u8")
        while values.size:
            column = first % self.length
            piece = values[: self.length - column]
            part = total[column : column + piece.size]
            np.add(part, piece, out=part)
            first += piece.size
            values = values[piece.size :]

    def end_stream(self, shares: Sequence[dict[int, bytes]]) -> None:
        """The streamed answer is complete (its rows are in the sum): keep each row's sealed shares (in the
        answer's order), or SecAggError and the sum as it was before the answer."""
        stream = self._stream
        assert stream is not None
        empty = np.empty(0, dtype=np.uint64)
        rows = [MaskedRow(client, empty, sealed) for client, sealed in zip(stream.clients, shares, strict=False)]
        try:
            if len(shares) != len(stream.clients):
                raise SecAggError(
                    f"round {self.round_id}: shares for {len(shares)} clients with the rows of "
                    f"{list(stream.clients)[:8]}"
                )
            for k, row in enumerate(rows):
                self._check(row, *rows[:k])
        except SecAggError:
            self.abort_stream()
            raise
        self._stream = None
        for row in rows:
            self.shares[row.client] = row.shares

    def abort_stream(self) -> None:
        """The streamed answer will not be taken: the sum is put back as it was before it."""
        stream = self._stream
        if stream is None:
            return
        self._stream = None
        self._sum = stream.backup

    @property
    def total(self) -> Ring:
        """The sum of the rows added so far, mod 2^64 (the round's own array: `finish` unmasks it in place)."""
        if self._sum is None:
            self._sum = np.zeros(self.length, dtype=np.uint64)
        return self._sum

    def close(self) -> dict[int, UnmaskRequest]:
        """The unmask request for each client whose row arrived, or SecAggError if too few did (or, under
        SecAgg+, if they fall apart in the round's graph: their sum would be released group by group)."""
        answered = tuple(sorted(self.shares))
        if len(answered) < self.threshold:
            raise SecAggError(
                f"round {self.round_id}: only {len(answered)} clients answered; secure aggregation needs "
                f"{self.threshold} to unmask the sum"
            )
        if not graph.connected(answered, self.participants, self.neighbours):
            raise SecAggError(
                f"round {self.round_id}: the {len(answered)} clients that answered are not connected in the "
                f"round's neighbour graph (k = {self.neighbours}); unmasking would reveal partial sums"
            )
        dropped = tuple(j for j in self.participants if j not in self.shares)
        self._requests = {
            j: UnmaskRequest(
                self.round_id,
                self.attempt,
                answered,
                dropped,
                tuple((i, self.shares[i][j]) for i in answered if j in self.shares[i]),
            )
            for j in answered
        }
        return self._requests

    def finish(self, replies: Mapping[int, UnmaskReply]) -> Ring:
        """sum_{i in A} x_i mod 2^64 from the replies to `close`'s requests (enough of each answering client's
        neighbourhood to rebuild its self mask; every answering neighbour of a dropped client, whose masks
        with it only that neighbour can remove)."""
        if self._requests is None or self._finished:
            raise RuntimeError("close() the round before finishing it, and finish it once (it unmasks in place)")
        where = f"round {self.round_id}"
        answered = tuple(sorted(self.shares))
        dropped = self._requests[answered[0]].dropped
        replies = {j: reply for j, reply in replies.items() if j in self._requests}
        for j, reply in replies.items():
            near = set(self.neighbours_of(j))
            asked_b = [i for i in answered if i in near or i == j]
            asked_seeds = [i for i in dropped if i in near]
            if sorted(reply.b_shares) != asked_b or sorted(reply.seeds) != asked_seeds:
                raise SecAggError(f"{where}: client {j}'s unmasking does not cover the clients it was asked about")
            if any(len(seed) != crypto.SEED_BYTES for seed in reply.seeds.values()):
                raise SecAggError(f"{where}: client {j}'s unmasking carries a seed of the wrong length")
        if len(replies) < self.threshold:
            raise SecAggError(
                f"{where}: {len(replies)} clients gave their unmasking; {self.threshold} are needed to unmask the sum"
            )
        dropped_set = set(dropped)
        silent = [j for j in answered if j not in replies and dropped_set.intersection(self.neighbours_of(j))]
        if silent:
            raise SecAggError(
                f"{where}: clients {silent[:5]} answered but gave no unmasking, and only they can remove their "
                f"masks with the clients that dropped ({list(dropped[:5])})"
            )
        masks: list[tuple[bytes, int]] = []  # removed in one pass at the end, in place (once all is checked)
        weights: dict[tuple[int, ...], dict[int, int]] = {}  # Lagrange coefficients per set of holders
        for i in answered:
            neighbourhood = [j for j in (*self.neighbours_of(i), i) if j in replies]
            needed = self._share_threshold(i)
            if len(neighbourhood) < needed:
                raise SecAggError(
                    f"{where}: {len(neighbourhood)} of client {i}'s neighbourhood gave their unmasking; "
                    f"{needed} are needed to remove its self mask"
                )
            holders = tuple(sorted(neighbourhood)[:needed])  # the first t in index order: the same bits every time
            try:
                values = {j: shamir.from_bytes(replies[j].b_shares[i]) for j in holders}
            except ValueError as exc:
                raise SecAggError(f"{where}: a share of client {i}'s self mask is malformed: {exc}") from None
            if holders not in weights:
                weights[holders] = shamir.coefficients(holders)
            secret = shamir.combine_with(weights[holders], values)
            if secret >= 2 ** (8 * 16):
                raise SecAggError(f"{where}: the shares of client {i}'s self mask do not agree")
            seed = secret.to_bytes(16, "little")
            masks.append((self_mask_key(seed, self.run_id, self.round_id, self.attempt), -1))
        for j in sorted(replies):
            for i in sorted(replies[j].seeds):
                masks.append((replies[j].seeds[i], -1 if i > j else 1))
        total, self._finished = self.total, True
        crypto.add_masks(total, masks)
        return total


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
