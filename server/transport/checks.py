"""Checks of what a client process sends: pure functions, each refusing with a precise status.

Nothing here touches a socket or the coordinator's state; the servicer calls
these before anything a message carries is used.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.indices import some
from fedsaddle.common.secagg import graph, messages
from fedsaddle.common.tasks import Answer
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.transport.refusal import Refusal, Status

INVALID = Status.INVALID_ARGUMENT


def hello_indices(hello: pb.Hello, num_clients: int) -> tuple[int, ...]:
    """The indices a Hello asks for, in its order; Refusal(INVALID_ARGUMENT) naming what is wrong."""
    if hello.protocol_version != pb.PROTOCOL_VERSION_2:
        raise Refusal(
            INVALID, f"protocol version {hello.protocol_version} is not supported (this coordinator speaks 2)"
        )
    if len(hello.client_indices) > num_clients:  # (before reading them: a hostile Hello may list millions)
        raise Refusal(INVALID, f"{len(hello.client_indices)} client indices given; the federation has {num_clients}")
    indices = tuple(int(i) for i in hello.client_indices)
    if not indices:
        raise Refusal(INVALID, "no client indices given")
    if len(set(indices)) != len(indices):
        repeated = {i for i in indices if indices.count(i) > 1} if len(indices) < 10_000 else set()
        raise Refusal(INVALID, f"client indices repeat: {some(repeated)}" if repeated else "client indices repeat")
    outside = [i for i in indices if i >= num_clients]
    if outside:
        raise Refusal(INVALID, f"client indices {some(outside)} are outside [0, {num_clients})")
    return indices


def in_order(indices: tuple[int, ...], limit: int = 8) -> str:
    """Indices as listed (`some` sorts them), bounded: '[3, 1]' or '[9, 8, 7, ... and 97 more]'."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return f"[{shown}, ... and {len(indices) - limit} more]" if len(indices) > limit else f"[{shown}]"


class Expectation(NamedTuple):
    """What the open round expects from one session."""

    run_id: str
    round_id: int
    indices: tuple[int, ...]  # the session's clients taking part, in index order
    entries: int  # entries per client in the payload (float64, or the run's element type)
    want_objective: bool
    want_counts: int = 0  # an evaluation answer: its row counts per client (1, or one per metric); 0: none
    # The session's clients in the order its Hello listed them, when that is not index order and
    # the task names none of them (all take part): an answer may list them so, too.
    listed: tuple[int, ...] | None = None
    masked: bool = False  # secure aggregation: masked rows of `entries` ring elements, with sealed shares
    round_clients: tuple[int, ...] = ()  # secure aggregation: the round's clients (each row's share holders)
    neighbours: int = 0  # SecAgg+: k, a row's shares go to its k neighbours among round_clients (0: all pairs)
    element: wire.Element = wire.FLOAT64  # the run's element type (masked rows are 8-byte ring elements)

    @property
    def entry_bytes(self) -> int:
        """Bytes per payload entry."""
        return 8 if self.masked else self.element.itemsize


def answer_header(
    header: pb.Answer, session_indices: tuple[int, ...], expected: Expectation | None, answered: bool
) -> int:
    """Whether an Answer header can be this session's answer to the open round: the payload's
    byte length if so, else Refusal with the status that says why."""
    claimed = tuple(header.client_indices)
    # The usual case first: exactly the expected clients, which are this session's own.
    if expected is not None and claimed != expected.indices and claimed == expected.listed:
        claimed = expected.indices  # the Hello's order: rows are put in index order (`answer`)
    if expected is None or claimed != expected.indices:
        foreign = sorted(set(claimed) - set(session_indices))
        if foreign:
            raise Refusal(Status.PERMISSION_DENIED, f"this session may not answer for clients {some(foreign)}")
    if expected is None:
        raise Refusal(
            Status.FAILED_PRECONDITION,
            f"answer to round {header.round_id} of run {header.run_id[:64]!r}, but no round is open",
        )
    if header.run_id != expected.run_id:
        raise Refusal(
            Status.FAILED_PRECONDITION,
            f"answer for run {header.run_id[:64]!r}, but the open round belongs to run {expected.run_id!r}",
        )
    if header.round_id != expected.round_id:
        raise Refusal(
            Status.FAILED_PRECONDITION,
            f"stale answer for round {header.round_id}; the coordinator is waiting on round {expected.round_id}",
        )
    if answered:
        raise Refusal(Status.ALREADY_EXISTS, f"this session already answered round {expected.round_id}")
    if claimed != expected.indices:
        raise Refusal(
            INVALID,
            f"an answer to round {expected.round_id} must list clients {some(expected.indices)} in order, "
            f"got {in_order(claimed)}"
            + (f" (or as the Hello listed them: {in_order(expected.listed)})" if expected.listed else ""),
        )
    entries = 0 if header.diverged else len(claimed) * expected.entries
    if header.payload_length != entries:
        raise Refusal(
            INVALID,
            f"answer has {header.payload_length} {expected.element.name} entries, expected {entries} "
            f"({len(claimed)} client(s) x {expected.entries})",
        )
    return expected.entry_bytes * entries


def answer(header: pb.Answer, payload: bytes | memoryview, expected: Expectation) -> Answer:
    """The answer's vectors, checked (length, finiteness, objective); Refusal(INVALID_ARGUMENT) if bad.
    Call it only on a header that passed `answer_header`."""
    listed = expected.listed is not None and tuple(header.client_indices) == expected.listed
    if expected.masked:
        if listed:
            raise Refusal(INVALID, f"masked rows must list clients {some(expected.indices)} in index order")
        try:
            masked = messages.read_masked_answer(header, payload, expected.entries)
        except wire.WireError as exc:
            raise Refusal(INVALID, str(exc)) from None
        for client, shares in zip(masked.indices, masked.shares or (), strict=False):
            others = list(graph.neighbours_of(client, expected.round_clients, expected.neighbours))
            if client not in expected.round_clients or sorted(shares) != others:
                raise Refusal(
                    INVALID,
                    f"client {client}: sealed shares for clients {some(list(shares))}, expected one for each "
                    f"{'neighbour' if len(others) < len(expected.round_clients) - 1 else 'other client'} "
                    f"of it in round {expected.round_id} ({some(others)})",
                )
        return masked
    try:
        # answer_header found the header's clients to be expected.indices, or those in the Hello's order
        answer = wire.decode_answer(
            header,
            payload,
            expected.entries,
            expected.want_objective,
            expected.want_counts,
            expected.listed if listed else expected.indices,
            expected.element,
        )
    except wire.WireError as exc:
        raise Refusal(INVALID, str(exc)) from None
    return in_index_order(answer) if listed else answer


def in_index_order(answer: Answer) -> Answer:
    """An answer whose clients came in another order, its rows (and per-client values) in index order."""
    order = np.argsort(answer.indices, kind="stable")
    indices = tuple(answer.indices[k] for k in order)
    if answer.diverged:
        return Answer(indices, answer.vectors, None, diverged=True)
    objective = None if answer.objective is None else answer.objective[order]
    counts = None if answer.counts is None else answer.counts[order]
    return Answer(indices, answer.vectors[order], objective, counts=counts)
