"""Arithmetic whose result must not depend on how vectors are grouped.

Bit identity between transports (one process, many processes, a batch of runs)
rests on every sum being taken in the same order. These helpers fix that order:

* `ordered_sum` adds vectors one after another in index order, never pairwise
  and never in arrival order;
* `norm` and `dot` reduce over the last, contiguous axis, which numpy does the
  same way for one vector alone and for each row of a stack of vectors.

The sums are taken in float64 whatever the vectors' type: a float32 run's rows
(precision float32) are widened, exactly, as they are added, so every path adds
the same float64 values in the same order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]

# A run's element type (the config's `precision`): what its vectors are stored and sent as.
# float64 is the default and every documented result's; float32 halves the bytes
# (docs/explanation/numerics.md says where the arithmetic stays in float64).
Precision = Literal["float64", "float32"]
_ELEMENT_TYPES: dict[str, np.dtype[np.floating]] = {"float64": np.dtype("<f8"), "float32": np.dtype("<f4")}


def element_type(precision: Precision) -> np.dtype[np.floating]:
    """The little-endian dtype of a precision."""
    return _ELEMENT_TYPES[precision]


# Below this many entries per vector, one cumulative sum beats a Python loop;
# both add in index order, so they give the same bits.
_SMALL = 4096
SUMMED_BY_LOOP_ABOVE = _SMALL  # vectors longer than this are summed one by one (server/settlement.py relies on it)

# Elementwise work on long vectors goes block by block: the same operations on the same
# elements, with a scratch block that stays in cache instead of a scratch vector.
BLOCK = 1 << 14  # rows per block (128 KiB of float64)


def blocks(rows: int, size: int = BLOCK) -> Iterator[slice]:
    """Consecutive slices of at most `size` rows that cover range(rows)."""
    return (slice(start, min(start + size, rows)) for start in range(0, rows, size))


def ordered_sum(vectors: Array) -> Array:
    """v_0 + v_1 + ... + v_{m-1} over axis 0, added strictly in index order."""
    if vectors.shape[0] == 1:
        return np.array(vectors[0], dtype=np.float64, copy=True)
    if vectors[0].size <= _SMALL:
        result: Array = np.cumsum(vectors, axis=0, dtype=np.float64)[-1]
        return result
    return running_sum(vectors)


def running_sum(vectors: Iterable[Array]) -> Array:
    """v_0 + v_1 + ... one vector at a time, in order, into a copy of v_0 (nothing stacked)."""
    each = iter(vectors)
    total = np.array(next(each), dtype=np.float64, copy=True)
    for vector in each:
        total += vector
    return total


def all_finite(values: Array) -> bool:
    """Whether no entry is inf or nan.

    The sum of the squares (one BLAS call) is finite only if every entry is, and for a
    short vector it is cheaper than a finiteness test of each entry; only when it is not
    (a non-finite entry, or squares that overflow) is each entry tested. Long vectors
    are tested entry by entry: BLAS would split their sum over threads that then spin,
    taking the cores the other processes need (the d = 1e6 round took 1.6x as long).
    """
    if values.size <= _SMALL:
        # (one row as it is, else a view in memory order, or a copy of a few entries for a strided layout)
        flat = values if values.ndim == 1 else values.ravel(order="K")
        if math.isfinite(flat.dot(flat)):  # (the method: np.dot adds a Python-level dispatch)
            return True
    return bool(np.logical_and.reduce(np.isfinite(values), axis=None))


def norm(v: Array) -> float:
    """The Euclidean norm of one vector."""
    return float(np.sqrt(np.sum(v * v)))


def row_norms(v: Array) -> Array:
    """The Euclidean norm of every row of a stack of vectors: row b equals norm(v[b])."""
    result: Array = np.sqrt(np.sum(v * v, axis=-1))
    return result


def dot(a: Array, b: Array) -> float:
    """<a, b>, summed as `norm` sums (not by BLAS, whose order depends on the build)."""
    return float(np.sum(a * b))


def sha256(z: Array) -> str:
    """SHA-256 of a vector's little-endian bytes (float32 for a float32 vector, else float64): equal
    hashes, equal bits."""
    dtype = "<f4" if np.asarray(z).dtype == np.float32 else "<f8"
    return hashlib.sha256(np.ascontiguousarray(z, dtype=dtype).tobytes()).hexdigest()
