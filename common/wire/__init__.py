"""numpy <-> protobuf: tasks and answers, vectors as raw float64 bytes, chunking.

A payload is the concatenation of float64 vectors (little-endian; float32 in a run
whose RunSpec says so: every codec here takes the run's element type). If it fits in
`chunk_bytes` it travels inline in the Task or Answer; otherwise the header goes
with an empty payload and Chunk messages carry it in order. Every decoder here
checks what it reads and raises WireError with a message that says what is wrong.

The coordinator serializes a round's Task once (`encode_task` returns the
serialized Instructions) and sends the same bytes to every session.

One module per job, all of it read through this package (`from fedsaddle.common import wire`):

* `channel`: the gRPC names, chunk sizes, message limits, keepalive and receive windows;
* `payload`: vectors as bytes of the run's element type, and back; `WireError`;
* `codecs`: tasks and answers as messages, and back;
* `chunking`: a payload cut into Chunks, and assembled from them;
* `by_hand`: the large messages (a Chunk, a large inline payload) written and read by hand,
  as protobuf writes and reads them, without its copies;
* `faults`: why protobuf refused a message, by field and byte.
"""

from fedsaddle.common.wire.by_hand import (
    BY_HAND_ABOVE,
    CHUNK_TAG,
    InlineTask,
    RawChunk,
    chunk_message,
    read_chunk,
    read_inline_answer,
    read_inline_task,
    varint,
    with_payload,
)
from fedsaddle.common.wire.channel import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MESSAGE_OVERHEAD,
    MIN_CHUNK_BYTES,
    MIN_PIECE_BYTES,
    SERVICE,
    SESSION_METHOD,
    check_chunk_bytes,
    grpc_options,
    message_limit,
    min_piece,
    serialized,
    window_options,
)
from fedsaddle.common.wire.chunking import Assembler, chunks
from fedsaddle.common.wire.codecs import (
    AnswerWriter,
    answer_with_payload,
    check_inline,
    compute_message,
    decode_answer,
    decode_compute,
    decode_task,
    encode_answer,
    encode_task,
    task_message,
)
from fedsaddle.common.wire.faults import wire_fault
from fedsaddle.common.wire.payload import FLOAT32, FLOAT64, Element, WireError, chunk_entries, from_bytes, to_bytes

__all__ = [
    "BY_HAND_ABOVE",
    "CHUNK_TAG",
    "DEFAULT_CHUNK_BYTES",
    "FLOAT32",
    "FLOAT64",
    "MAX_CHUNK_BYTES",
    "MESSAGE_OVERHEAD",
    "MIN_CHUNK_BYTES",
    "MIN_PIECE_BYTES",
    "SERVICE",
    "SESSION_METHOD",
    "AnswerWriter",
    "Assembler",
    "Element",
    "InlineTask",
    "RawChunk",
    "WireError",
    "answer_with_payload",
    "check_chunk_bytes",
    "check_inline",
    "chunk_entries",
    "chunk_message",
    "chunks",
    "compute_message",
    "decode_answer",
    "decode_compute",
    "decode_task",
    "encode_answer",
    "encode_task",
    "from_bytes",
    "grpc_options",
    "message_limit",
    "min_piece",
    "read_chunk",
    "read_inline_answer",
    "read_inline_task",
    "serialized",
    "task_message",
    "to_bytes",
    "varint",
    "window_options",
    "wire_fault",
    "with_payload",
]
