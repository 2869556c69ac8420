"""A round's answers added up as they arrive, in client-index order: the mean without keeping every answer.

The aggregation rule (`RoundAnswers.mean`, `aggregate`, `aggregate_rows`) adds the
clients' vectors one after another in client-index order, and that order is what
makes an in-process run and a run over gRPC agree bit for bit. A coordinator that
kept every answer until its round closed held n vectors; `OrderedFold` holds one
running sum and the answers that came before their turn (a reorder buffer):

* an answer whose clients are next in index order is added at once, and its
  vectors are let go;
* an answer that comes early waits until every client before it has been added
  (or is known not to answer: `mean` is given the round's answering clients);
* the transport bounds how much may wait (server/transport/protocol.py stops
  reading the streams whose turn has not come, and HTTP/2 flow control holds
  their bytes back on the clients, which keep their answers anyway).

The additions are the rule's own, entry by entry: the first row copied, then
`total += v_i` (or `total += m_i * v_i` with sample weights) for each client in
index order, the mean `total / len(answered)` (or `/ sum_i m_i`, added in index
order). Short vectors are added by one cumulative sum over the rows in hand,
which adds in the same order (see common/numeric.py). The sum is float64 in a run
of precision float32 too: its float32 rows are widened (exactly) as they are added,
as the in-process rule widens them, and the mean is rounded to float32 once, by
`RoundAnswers.mean`.

It is pure: no I/O, no clock. `held_bytes` and `peak_held_bytes` count the
vectors waiting for their turn; tests read them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsaddle.common.numeric import SUMMED_BY_LOOP_ABOVE, Array, all_finite
from fedsaddle.common.tasks import Answer
from fedsaddle.common.wire import WireError, chunk_entries
from fedsaddle.server.algorithms.base import weight_total


@dataclass
class _Stream:
    """An answer being added chunk by chunk: its clients, their entries, the sum before it."""

    clients: tuple[int, ...]
    entries: int
    backup: Array | None
    fresh: bool = False  # the sum started with this answer (its first row is copied, not added)
    carry: bytes = b""  # the bytes of an entry split between two chunks


class OrderedFold:
    """The running sum of one round's answers, added in the order of `clients` (increasing indices).

    clients: every client the round waits on, in index order;
    weights: each client's weight by client index (all n of them), or None for uniform weights.
    """

    def __init__(self, clients: Sequence[int], weights: Array | None, num_clients: int, element: str = "<f8") -> None:
        self.clients = list(clients)
        self.element = element  # the answers' entries on the wire: "<f8", or "<f4" (precision float32)
        self.weights = weights
        self._next = 0  # position in `clients` of the next client to add
        self._range = not self.clients or self.clients[-1] == len(self.clients) - 1  # (increasing: 0..n-1)
        self._blocks: dict[int, Answer] = {}  # position of its first client -> an answer not yet added
        self._waiting: dict[int, tuple[Answer, int]] = {}  # client -> (its answer, its row) not yet added
        self._rows_left: dict[int, int] = {}  # id(answer) -> its rows still waiting
        self._skipped: set[int] = set()  # clients known not to be added (diverged)
        self._objective = np.empty(num_clients)
        self._objective.fill(np.nan)  # (np.full's Python wrapper costs more than the two calls, once a round)
        self.total: Array | None = None
        self.diverged: list[int] = []
        self.held_bytes = 0  # bytes of vectors waiting for their turn
        self.peak_held_bytes = 0
        self.early = 0  # answers that came before an earlier client's (held, not added at once)
        self.added = 0  # clients added so far
        self.streamed = 0  # answers added chunk by chunk as they were read
        self._stream: _Stream | None = None  # the answer being added chunk by chunk, if one is

    @property
    def next_client(self) -> int | None:
        """The client whose answer the sum waits on (None: every client is in)."""
        return self.clients[self._next] if self._next < len(self.clients) else None

    # -- an answer added chunk by chunk, as it is read ------------------------------------------

    def begin_stream(self, clients: tuple[int, ...], entries: int) -> bool:
        """Start adding an answer whose rows (clients, in index order, `entries` each) come as chunks, if
        its clients are the next ones due: then no row of it is ever held whole. False if they are not."""
        start = self._next
        if self._stream is not None or tuple(self.clients[start : start + len(clients)]) != clients:
            return False
        # What the sum was before this answer: a payload refused half-way leaves the sum as it found it.
        backup = None if self.total is None else self.total.copy()
        self._stream = _Stream(clients, entries, backup)
        return True

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    def stream_chunk(self, offset: int, data: bytes | memoryview) -> None:
        """Add a chunk of the streamed answer's payload (its bytes from `offset`, checked by the
        assembler: in order, no gap, no overrun); WireError (the sum untouched) on a non-finite entry."""
        stream = self._stream
        assert stream is not None
        values, first, stream.carry = chunk_entries(stream.carry, offset, data, self.element)
        while values.size:
            row, column = divmod(first, stream.entries)
            piece = values[: stream.entries - column]
            if not all_finite(piece):
                bad = column + int(np.argmax(~np.isfinite(piece)))
                self.abort_stream()
                raise WireError(
                    f"client {stream.clients[row]}: entry {bad} is {piece[bad - column]} "
                    "(non-finite values are refused)"
                )
            client = stream.clients[row]
            part = piece if self.weights is None else self.weights[client] * piece
            span = slice(column, column + piece.size)
            if self.total is None:
                self.total = np.empty(stream.entries)
                stream.fresh = True
            if row == 0 and stream.fresh:  # the first row of the round: copied, as running_sum copies v_0
                self.total[span] = part
            else:
                self.total[span] += part
            first += piece.size
            values = values[piece.size :]

    def end_stream(self, objective: Array | None) -> None:
        """The streamed answer is complete and accepted: its clients count as added."""
        stream = self._stream
        assert stream is not None
        self._stream = None
        if objective is not None:
            self._objective[list(stream.clients)] = objective
        self._next += len(stream.clients)
        self.added += len(stream.clients)
        self.streamed += 1
        self._advance(stop_at_missing=True)

    def abort_stream(self) -> None:
        """The streamed answer will not be accepted: the sum is put back as it was before it."""
        stream = self._stream
        if stream is None:
            return
        self._stream = None
        self.total = stream.backup

    def skip(self, clients: Sequence[int]) -> None:
        """These clients will not answer this round (they sit it out): the sum goes on past them."""
        self._skipped.update(clients)
        self._advance(stop_at_missing=True)

    def waits_on(self, clients: Sequence[int]) -> bool:
        """Whether any of these clients' vectors came and wait for their turn."""
        position = self._position(clients[0]) if clients else None
        return (position is not None and position in self._blocks) or any(c in self._waiting for c in clients)

    def _position(self, client: int) -> int | None:
        """Where a client stands in the order of the sum (None: not among its clients)."""
        if self._range:
            return client if 0 <= client < len(self.clients) else None
        position = bisect.bisect_left(self.clients, client)
        return position if position < len(self.clients) and self.clients[position] == client else None

    def offer(self, answer: Answer) -> None:
        """Take a checked answer (one process's, for one or more clients) and add what is due."""
        indices = answer.indices
        if answer.diverged:
            self.diverged.extend(indices)
            self._skipped.update(indices)
            self._advance(stop_at_missing=True)
            return
        if answer.objective is not None:
            self._objective[np.asarray(indices)] = answer.objective
        position = self._position(indices[0])
        end = self._next + len(indices)
        if position == self._next and end <= len(self.clients) and self.clients[end - 1] == indices[-1]:
            # Its clients are the next ones in the sum's order (the usual case): added now, as _advance would.
            self._add_block(answer)
            self._next = end
            if self._blocks or self._waiting or self._skipped:  # what waited on it, or clients it may pass
                self._advance(stop_at_missing=True)
            return
        self.held_bytes += answer.vectors.nbytes
        last = None if position is None else position + len(indices) - 1
        if last is not None and last < len(self.clients) and self.clients[last] == indices[-1]:
            # Its clients follow one another in the sum's order (the usual case): added as one block.
            self._blocks[position] = answer  # type: ignore[index]
            early = position != self._next
        else:  # clients of other processes come between them: each row waits for its own turn
            for row, client in enumerate(indices):
                self._waiting[client] = (answer, row)
            self._rows_left[id(answer)] = len(indices)
            early = True
        self._advance(stop_at_missing=True)
        if early and (position in self._blocks or id(answer) in self._rows_left):
            self.early += 1  # some of its rows wait for an earlier client's
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _advance(self, stop_at_missing: bool) -> None:
        """Add the rows that are due, in order; past a client not heard from only when not `stop_at_missing`."""
        due: list[tuple[int, Array]] = []
        while self._next < len(self.clients):
            block = self._blocks.pop(self._next, None)
            if block is not None:
                self._add(due)
                due = []
                self._add_block(block)
                self.held_bytes -= block.vectors.nbytes
                self._next += len(block.indices)
                continue
            client = self.clients[self._next]
            if client in self._waiting:
                answer, row = self._waiting.pop(client)
                due.append((client, answer.vectors[row]))
                self._release(answer)
            elif stop_at_missing and client not in self._skipped:
                break  # its answer has not come: the ones after it wait
            self._next += 1
            if len(due) >= 64:  # (bounded: a long run of short rows is added in slices)
                self._add(due)
                due = []
        self._add(due)

    def _release(self, answer: Answer) -> None:
        key = id(answer)
        self._rows_left[key] -= 1
        if self._rows_left[key] == 0:
            del self._rows_left[key]
            self.held_bytes -= answer.vectors.nbytes

    def _add_block(self, answer: Answer) -> None:
        """Add an answer's rows, which are next in order, as `aggregate` adds them: short ones by one
        cumulative sum (the same additions, in order), long ones one after another."""
        vectors = answer.vectors
        self.added += len(answer.indices)
        if vectors.shape[1] > SUMMED_BY_LOOP_ABOVE:
            self._add(list(zip(answer.indices, vectors, strict=True)))
            self.added -= len(answer.indices)  # (counted once)
            return
        rows = vectors if self.weights is None else self.weights[np.asarray(answer.indices)][:, None] * vectors
        if len(rows) == 1:  # one client per process (the usual case): the cumulative sum's one addition, or a copy
            if self.total is None:
                self.total = np.array(rows[0], dtype=np.float64)  # (float32 rows: widened, the sum is float64)
            else:
                self.total += rows[0]  # (the sum is the fold's own array: added in place, the same bits)
            return
        stacked = rows if self.total is None else np.concatenate([self.total[None], rows])
        self.total = np.cumsum(stacked, axis=0, dtype=np.float64)[-1]

    def _add(self, due: list[tuple[int, Array]]) -> None:
        if not due:
            return
        self.added += len(due)
        rows = [row if self.weights is None else self.weights[client] * row for client, row in due]
        if rows[0].size <= SUMMED_BY_LOOP_ABOVE:  # one cumulative sum: the same additions, in order
            stacked = np.array(rows if self.total is None else [self.total, *rows])
            self.total = np.cumsum(stacked, axis=0, dtype=np.float64)[-1]
            return
        each = iter(rows)
        if self.total is None:
            self.total = np.array(next(each), dtype=np.float64, copy=True)
        for row in each:
            self.total += row

    def mean(self, answered: Sequence[int], weights: Array | None) -> Array:
        """The round's mean over the clients that answered (in index order), by the aggregation rule.

        answered: the answering clients, in index order (a straggler deadline may have left some out);
        weights: their weights in that order (None: uniform)."""
        self.abort_stream()  # (an answer still being read when a straggler deadline closed the round is out)
        self._advance(stop_at_missing=False)  # whoever has not answered now never will in this round
        summed, self.total = self.total, None  # (asked once: the sum is not kept beside the mean)
        assert summed is not None, "a round with no answer has no mean"
        # In place: the same division, entry by entry, without a second vector beside the sum.
        if weights is None:
            summed /= len(answered)
            return summed
        total = weight_total(weights)
        if total == 0:
            return np.full(summed.shape, np.nan)
        summed /= total
        return summed

    def objective(self, answered: Sequence[int]) -> Array:
        """f_i(z) of the answering clients, in index order."""
        values: Array = self._objective[list(answered)]
        return values
