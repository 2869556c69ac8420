"""Secure aggregation's messages on the wire (proto/fedsaddle.proto), both ways, checked when read.

Each reader refuses (WireError, naming what is wrong) anything malformed before
any of it is used: repeated or unknown clients, values of the wrong length.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.secagg import crypto, graph, shamir
from fedsaddle.common.secagg.party import MaskedRow, UnmaskReply, UnmaskRequest
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.secagg.settings import SecAggSettings
from fedsaddle.common.tasks import Answer
from fedsaddle.proto import fedsaddle_pb2 as pb

WireError = wire.WireError
SEALED_SHARE_BYTES = crypto.NONCE_BYTES + shamir.SHARE_BYTES + crypto.TAG_BYTES  # a share, sealed for its holder


def settings_message(settings: SecAggSettings, weigh_by_samples: bool) -> pb.SecureAggregation:
    return pb.SecureAggregation(
        threshold=settings.threshold,
        scale_bits=settings.scale_bits,
        bound=settings.bound,
        weigh_by_samples=weigh_by_samples,
        neighbours=settings.neighbours,
    )


def read_settings(message: pb.SecureAggregation) -> SecAggSettings:
    """The settings as sent; ValueError if the neighbour graph is not one a client can mask with."""
    neighbours = int(message.neighbours)
    graph.check_neighbours(neighbours)
    return SecAggSettings(int(message.threshold), int(message.scale_bits), float(message.bound), neighbours)


def _values(entries: Sequence[pb.ClientValue], size: int, what: str) -> dict[int, bytes]:
    values: dict[int, bytes] = {}
    for entry in entries:
        if entry.client in values:
            raise WireError(f"{what}: client {entry.client} appears twice")
        if len(entry.value) != size:
            raise WireError(f"{what}: client {entry.client}'s value is {len(entry.value)} bytes, not {size}")
        values[entry.client] = entry.value
    return values


def _entries(values: dict[int, bytes]) -> list[pb.ClientValue]:
    return [pb.ClientValue(client=client, value=value) for client, value in sorted(values.items())]


# -- key directory ------------------------------------------------------------------------


def key_directory(run_id: str, epoch: int, keys: dict[int, bytes]) -> bytes:
    return pb.Instruction(keys=pb.KeyDirectory(run_id=run_id, epoch=epoch, keys=_entries(keys))).SerializeToString()


def read_key_directory(message: pb.KeyDirectory) -> dict[int, bytes]:
    return _values(message.keys, crypto.PUBLIC_KEY_BYTES, f"key directory of epoch {message.epoch}")


# -- masked answers -----------------------------------------------------------------------


def masked_answer(run_id: str, round_id: int, answer: MaskedAnswer, chunk_bytes: int) -> Iterator[bytes]:
    """The Answer (and its Chunks) carrying masked rows, in client-index order."""
    header = pb.Answer(run_id=run_id, round_id=round_id, masked=True)
    if answer.diverged:
        header.client_indices.extend(answer.diverged)
        header.diverged, header.diverged_reason = True, answer.reason[:1024]
        return iter([pb.ClientMessage(answer=header).SerializeToString()])
    rows = sorted(answer.rows, key=lambda row: row.client)
    header.client_indices.extend(row.client for row in rows)
    for row in rows:
        holders = sorted(row.shares)
        header.shares.add(holders=holders, sealed=[row.shares[j] for j in holders])
    # One row (a process hosting one client) goes as it is: joining would copy it.
    masked = rows[0].masked if len(rows) == 1 else np.concatenate([row.masked for row in rows])
    masked = masked.astype("<u8", copy=False)
    header.payload_length = masked.size
    if 8 * masked.size > chunk_bytes:
        parts = [masked.data.cast("B")]
        return itertools.chain([pb.ClientMessage(answer=header).SerializeToString()], wire.chunks(parts, chunk_bytes))
    if 8 * masked.size < wire.BY_HAND_ABOVE:
        header.payload = masked.tobytes()
        return iter([pb.ClientMessage(answer=header).SerializeToString()])
    # Large, but inline: written by hand (protobuf would copy the rows into the message, then into its bytes).
    back = pb.Answer(masked=True, shares=header.shares)  # (fields 9 and 10)
    return iter([wire.answer_with_payload(header, [masked.data.cast("B")], back)])


def read_masked_answer(header: pb.Answer, payload: bytes | memoryview, row_length: int) -> Answer:
    """A masked answer as an `Answer` whose vectors hold the rows' bits and whose `shares` are each
    row's sealed shares; WireError if malformed. The caller has checked the clients and the length."""
    indices = tuple(int(i) for i in header.client_indices)
    if header.diverged:
        return Answer(indices, np.empty((len(indices), 0)), None, diverged=True, reason=header.diverged_reason[:1024])
    if not header.masked:
        raise WireError("an unmasked answer in a round under secure aggregation")
    if len(header.shares) != len(indices):
        raise WireError(f"shares for {len(header.shares)} clients in an answer for {len(indices)}")
    shares: list[dict[int, bytes]] = []
    for client, sealed in zip(indices, header.shares, strict=True):
        if len(sealed.holders) != len(sealed.sealed) or len(set(sealed.holders)) != len(sealed.holders):
            raise WireError(f"client {client}'s shares name their holders wrongly (missing or repeated)")
        if any(len(s) != SEALED_SHARE_BYTES for s in sealed.sealed):
            raise WireError(f"client {client}'s sealed shares are not {SEALED_SHARE_BYTES} bytes each")
        shares.append(dict(zip((int(h) for h in sealed.holders), sealed.sealed, strict=True)))
    if len(payload) != 8 * len(indices) * row_length:
        raise WireError(f"masked rows of {len(payload)} bytes, expected {8 * len(indices) * row_length}")
    # A view of the payload, not a copy (16 MB per row at d = 1e6): it is only read, and added to the round's
    # sum. The rows' bits travel in the Answer's float64 array untouched (never used as numbers): as_masked
    # views them back as ring elements.
    rows = np.frombuffer(payload, dtype="<u8").astype(np.uint64, copy=False).reshape(len(indices), row_length)
    return Answer(indices, rows.view(np.float64), None, shares=tuple(shares))


def as_masked(answer: Answer) -> MaskedAnswer:
    """What `read_masked_answer` read, as the rows secure aggregation adds up (none if they were added up
    already: the transport then keeps the answer with no entries, where a row has at least its weight)."""
    if answer.diverged:
        return MaskedAnswer((), tuple(answer.indices), answer.reason or "produced non-finite values")
    assert answer.shares is not None
    if not answer.vectors.size:
        return MaskedAnswer(())
    rows = tuple(
        MaskedRow(index, answer.vectors[k].view(np.uint64), answer.shares[k]) for k, index in enumerate(answer.indices)
    )
    return MaskedAnswer(rows)


# -- unmasking ----------------------------------------------------------------------------


_UNMASK_TAG = bytes(((pb.Instruction.DESCRIPTOR.fields_by_name["unmask"].number << 3) | 2,))  # 0x42
_CLIENT_TAG, _SHARE_TAG = b"\x18", b"\x32"  # UnmaskRequest.client (3, varint), .shares (6, length-delimited)
_VALUE_CLIENT_TAG, _VALUE_TAG = b"\x08", b"\x12"  # ClientValue.client (1, varint), .value (2, length-delimited)


def unmask_requests(run_id: str, requests: Mapping[int, UnmaskRequest]) -> dict[int, bytes]:
    """The serialized UnmaskRequest instruction for each client, byte for byte what protobuf writes
    (tests/test_secagg.py).

    Written by hand: a round sends one to every client that answered, and they differ only in `client` and
    the shares; building each as protobuf messages (a ClientValue per share) cost the coordinator more
    than the unmasking's arithmetic at d = 10. The fields shared by a round's requests (run, round,
    answered, dropped) are serialized once; all are written in field-number order, as protobuf does,
    with proto3's defaults (0, empty) left out."""
    varint = wire.varint
    shared: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[bytes, bytes]] = {}
    serialized = {}
    senders: dict[int, bytes] = {}  # ClientValue.client as written, per sender
    for client, request in requests.items():
        key = (request.round_id, tuple(request.answered), tuple(request.dropped))
        pieces = shared.get(key)
        if pieces is None:
            head = pb.UnmaskRequest(run_id=run_id, round_id=request.round_id).SerializeToString()
            groups = pb.UnmaskRequest(answered=request.answered, dropped=request.dropped).SerializeToString()
            pieces = shared[key] = (head, groups)
        head, groups = pieces
        parts = [head, _CLIENT_TAG + varint(client) if client else b"", groups]
        for sender, sealed in request.shares:
            front = senders.get(sender)
            if front is None:
                front = senders[sender] = _VALUE_CLIENT_TAG + varint(sender) if sender else b""
            size = len(sealed)
            if size:
                value = _VALUE_TAG + varint(size)
                parts += (_SHARE_TAG, varint(len(front) + len(value) + size), front, value, sealed)
            else:
                parts += (_SHARE_TAG, varint(len(front)), front)
        body = b"".join(parts)
        serialized[client] = _UNMASK_TAG + varint(len(body)) + body
    return serialized


def read_unmask_request(message: pb.UnmaskRequest) -> UnmaskRequest:
    """The request as the party checks it (its own checks name the round); duplicates are kept for it to refuse."""
    shares = tuple((int(entry.client), bytes(entry.value)) for entry in message.shares)
    answered, dropped = tuple(int(i) for i in message.answered), tuple(int(i) for i in message.dropped)
    return UnmaskRequest(int(message.round_id), 0, answered, dropped, shares)


def unmask_reply(run_id: str, round_id: int, client: int, reply: UnmaskReply | None, error: str = "") -> bytes:
    message = pb.UnmaskReply(run_id=run_id, round_id=round_id, client=client, error=error[:1024])
    if reply is not None:
        message.self_mask_shares.extend(_entries(reply.b_shares))
        message.pairwise_seeds.extend(_entries(reply.seeds))
    return pb.ClientMessage(unmasked=message).SerializeToString()


def read_unmask_reply(message: pb.UnmaskReply) -> UnmaskReply:
    """A client's unmasking; WireError if malformed (the aggregator checks what it covers)."""
    where = f"round {message.round_id}: client {message.client}'s unmasking"
    return UnmaskReply(
        int(message.client),
        _values(message.self_mask_shares, shamir.SHARE_BYTES, where),
        _values(message.pairwise_seeds, crypto.SEED_BYTES, where),
    )
