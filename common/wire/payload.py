"""A payload: the concatenation of vectors as bytes of the run's element type (little-endian float64, or
float32), and back; WireError, what every decoder of the package raises."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from fedsaddle.common.numeric import Array

FLOAT64 = np.dtype("<f8")
FLOAT32 = np.dtype("<f4")
Element = np.dtype[np.floating]  # a run's element type on the wire: FLOAT64, or FLOAT32


class WireError(ValueError):
    """A message that does not decode to a valid task or answer."""


def to_bytes(vectors: Sequence[Array], dtype: Element = FLOAT64) -> bytes:
    return b"".join(payload_parts(vectors, dtype))


def payload_parts(vectors: Sequence[Array], dtype: Element = FLOAT64) -> list[memoryview]:
    """The vectors' entries as bytes of `dtype`, one view per vector (a copy only of a vector that is
    not contiguous of that type): the payload is their concatenation, never built as one buffer."""
    views = []
    for vector in vectors:
        values = np.ascontiguousarray(vector, dtype=dtype).reshape(-1)
        views.append(memoryview(values).cast("B"))  # type: ignore[arg-type]  # numpy arrays are buffers
    return views


def payload_pieces(vectors: Array, most: int, dtype: Element = FLOAT64) -> Iterator[memoryview]:
    """The entries of `vectors` (in C order) as bytes of `dtype`, in pieces of at most `most` bytes (whole,
    when contiguous), each made when asked for: the rows of a client process's answer are columns of its
    worker's buffer, and a contiguous copy of all of them (a vector per hosted client) is never made."""
    if vectors.dtype == dtype and vectors.flags.c_contiguous:
        yield memoryview(vectors.reshape(-1)).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        return
    rows = np.reshape(vectors, (-1, vectors.shape[-1])) if vectors.ndim > 1 else vectors[None]
    step = max(1, most // dtype.itemsize)
    for row in rows:
        for start in range(0, len(row), step):
            piece = np.ascontiguousarray(row[start : start + step], dtype=dtype)
            yield memoryview(piece).cast("B")  # type: ignore[arg-type]


def from_bytes(
    data: bytes | bytearray | memoryview, length: int, writable: bool = False, dtype: Element = FLOAT64
) -> Array:
    """A view of the bytes as `dtype` (no copy), of exactly `length` entries: read-only, unless
    `writable` and the bytes are."""
    size = dtype.itemsize
    if len(data) != size * length:
        raise WireError(f"payload has {len(data)} bytes, expected {size * length} ({length} {dtype.name} entries)")
    values = cast(Array, np.frombuffer(data, dtype=dtype))  # (Array: float64's, or a float32 run's)
    if not writable and not isinstance(data, bytes):  # over bytes it is read-only already
        values.flags.writeable = False
    return values


def chunk_entries(carry: bytes, offset: int, data: bytes | memoryview, dtype: str) -> tuple[np.ndarray, int, bytes]:
    """A payload chunk's whole entries (8 bytes each, 4 for float32), for a sum that adds them as they come: a
    chunk may end inside an entry, whose first bytes (`carry`, from the chunk before) wait for the next. (The
    entries as an array of `dtype`, the index of the first in the payload, the bytes to carry to the next chunk.)"""
    size = np.dtype(dtype).itemsize
    if carry:
        data = carry + bytes(data)
        offset -= len(carry)
    whole = len(data) - len(data) % size
    return np.frombuffer(data, dtype=dtype, count=whole // size), offset // size, bytes(data[whole:])
