"""What both sides tell gRPC: the service's and the session method's names, the chunk sizes a coordinator
may set, the message limits and keepalive that follow from them, and a fixed receive window."""

from __future__ import annotations

from google.protobuf.message import Message

from fedsaddle.proto import fedsaddle_pb2 as pb

# The gRPC names both sides use, as the generated descriptor spells them.
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # fedsaddle.v2.Coordinator
SESSION_METHOD = f"/{SERVICE}/Session"
MESSAGE_OVERHEAD = 1 << 20  # room for headers beside a full chunk


def serialized(message: Message | bytes) -> bytes:
    """gRPC's serializer on both sides: messages queued already serialized (tasks, answers,
    chunks: codecs.py, chunking.py) pass through; any other is serialized by protobuf."""
    return message if isinstance(message, bytes) else message.SerializeToString()


# The chunk sizes a coordinator may set (transport.chunk_bytes) and a client accepts in a Welcome.
DEFAULT_CHUNK_BYTES = 2 << 20
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 64 << 20


def check_chunk_bytes(chunk_bytes: int) -> int:
    """`chunk_bytes` if it is an allowed chunk size; ValueError naming the range if not."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"chunk_bytes must be between {MIN_CHUNK_BYTES} (1 KiB) and {MAX_CHUNK_BYTES} (64 MiB), got {chunk_bytes}"
        )
    return chunk_bytes


MIN_PIECE_BYTES = 4 << 10


def min_piece(chunk_bytes: int) -> int:
    """The least data a Chunk other than a payload's last may carry: 4 KiB, or the session's
    chunk size if that is smaller. Every message costs its receiver a fixed amount of work, so a
    payload cut into tiny chunks would cost it many times what the bytes do (at one byte per
    chunk, a d = 1e4 answer cost the coordinator 13.7 s a round: bench/chunk_flood.py)."""
    return min(chunk_bytes, MIN_PIECE_BYTES)


def message_limit(chunk_bytes: int) -> int:
    """The gRPC send/receive limit both sides set: a chunk plus headroom.

    Payloads of any size travel in chunks, so no message needs more: with the default
    2 MiB chunks the limit is 3 MiB, below gRPC's own 4 MiB, and larger chunks raise it.
    """
    return chunk_bytes + MESSAGE_OVERHEAD


def grpc_options(chunk_bytes: int, server: bool = False) -> list[tuple[str, int]]:
    """The channel or server options both sides use: message limits and keepalive.

    Keepalive pings notice a dead peer on a quiet link within seconds (a cut
    cable sends no reset); the server lets clients ping while idle.
    """
    limit = message_limit(chunk_bytes)
    options = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if server:
        options += [
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # A second coordinator on the same port must fail, not silently share it.
            ("grpc.so_reuseport", 0),
        ]
    return options


def window_options(window_bytes: int) -> list[tuple[str, int]]:
    """A fixed HTTP/2 receive window per stream, or none (0: gRPC's own).

    gRPC grows its window with the link's bandwidth-delay product, so that on loopback it takes in
    whole messages of a million entries (answers on the coordinator, a task's chunks on a client)
    before the event loop reads them, and holds them in its buffers; a fixed window keeps that to one
    window per stream, and caps the peer's sending at one window per round trip."""
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)] if window_bytes else []
