"""A payload larger than one chunk: cut into Chunk messages on the way out, assembled on the way in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from fedsaddle.common.wire.by_hand import RawChunk, chunk_message
from fedsaddle.common.wire.payload import WireError
from fedsaddle.proto import fedsaddle_pb2 as pb


def chunks(parts: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """The payload (the concatenation of `parts`) as serialized Chunk messages of `chunk_bytes` data
    (the last may be shorter), each made when asked for; a chunk may span two parts.

    ValueError, raised here and not at the first chunk, if `chunk_bytes` is not positive: a chunk of
    no data would never get through the payload, and the chunks would never end."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return _chunks(parts, chunk_bytes)


def _chunks(parts: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    offset, pending, room = 0, [], chunk_bytes
    for part in parts:
        start = 0
        while start < len(part):
            take = part[start : start + room]
            pending.append(take)
            start, room = start + len(take), room - len(take)
            if room == 0:
                yield chunk_message(offset, pending)
                offset, pending, room = offset + chunk_bytes, [], chunk_bytes
    if pending:
        yield chunk_message(offset, pending)


class Assembler:
    """Collects a chunked payload of known size, refusing gaps, overlaps and overruns.

    The payload's buffer is taken at the first chunk, at its full size but untouched:
    memory pages are committed as chunks fill them, so a peer that announces a large
    payload and sends little costs little. One buffer of the final size, instead of one
    grown chunk by chunk, leaves no holes of every intermediate size in the heap. A client
    process may pass its own buffer (`into`) and reuse it from task to task.

    Every chunk but the last must carry at least `min_piece` bytes (see min_piece). With
    `keep=False` the chunks are checked and counted, but not kept: the chunks of a refused
    answer, read to their end.
    """

    def __init__(
        self, total_bytes: int, into: bytearray | memoryview | None = None, min_piece: int = 0, keep: bool = True
    ) -> None:
        if into is not None and len(into) < total_bytes:
            raise ValueError(f"a buffer of {len(into)} bytes cannot hold {total_bytes}")
        self.total = total_bytes
        self.filled = 0
        self.min_piece = min_piece
        self.keep = keep
        self._into = None if into is None else memoryview(into)[:total_bytes]

    @property
    def done(self) -> bool:
        return self.filled == self.total

    def add(self, chunk: pb.Chunk | RawChunk) -> None:
        if chunk.offset != self.filled:
            raise WireError(f"chunk at byte {chunk.offset}, expected byte {self.filled}")
        end = self.filled + len(chunk.data)
        if end > self.total:
            raise WireError(f"chunks overrun the payload: {end} bytes of {self.total}")
        if not chunk.data:
            raise WireError("empty chunk")
        size = len(chunk.data)
        if end < self.total and size < self.min_piece:
            raise WireError(
                f"a chunk of {size} byte{'s' * (size != 1)} before the payload's last: "
                f"every chunk but the last carries at least {self.min_piece} bytes"
            )
        if not self.keep:
            self.filled = end
            return
        if self._into is None:
            try:
                self._into = memoryview(np.empty(self.total, dtype=np.uint8))  # type: ignore[arg-type]
            except MemoryError:
                raise WireError(f"no memory for a payload of {self.total} bytes") from None
        self._into[self.filled : end] = chunk.data
        self.filled = end

    def payload(self) -> memoryview:
        """The whole payload (call when done)."""
        assert self._into is not None  # a payload of 0 bytes travels inline, never in chunks
        return self._into
