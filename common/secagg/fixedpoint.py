"""Fixed point in the ring Z/2^64: real vectors as integers whose sums are exact and order-free.

A value v is sent as round(v * 2^s) mod 2^64 (numpy's uint64 wraps for free); a
sum of such integers, read back as a signed 64-bit number and scaled by 2^-s, is
the sum of the rounded values exactly, whatever order it was added in. Values
must lie within a bound B fixed for the run, with k * B * 2^s <= 2^62 for the k
clients of a round, so that the sum cannot wrap: a value outside it is refused
before it is encoded (FixedPointOverflow), never wrapped silently.

Precision: each value moves by at most 2^-(s+1) when it is rounded (s = 40:
4.5e-13 absolute); the decoded sum is exact up to float64's rounding of the
final integer.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common.numeric import Array
from fedsaddle.common.secagg.settings import SecAggError

Ring = NDArray[np.uint64]
_BLOCK = 32_768  # entries encoded at a time (256 KiB): the block stays in the CPU's cache from scaling to adding


class FixedPointOverflow(SecAggError):
    """A value outside the run's fixed-point bound (or not finite): it cannot be encoded without wrapping."""

    def __init__(self, round_id: int, entry: int, value: float, bound: float) -> None:
        super().__init__(
            f"round {round_id}: entry {entry} is {value:.17g}, outside the fixed-point bound +-{bound:g}; "
            "it cannot be summed securely without wrapping (lower the step size, or raise privacy.bound "
            "within what the number of clients allows)"
        )
        self.round_id, self.entry, self.value, self.bound = round_id, entry, value, bound


def encode(values: Array, scale_bits: int, bound: float, round_id: int) -> Ring:
    """round(values * 2^scale_bits) in Z/2^64, after checking every |value| <= bound."""
    values = np.asarray(values, dtype=np.float64)
    encoded: Ring = np.zeros(len(values), dtype=np.uint64)
    add_encoded(encoded, values, scale_bits, bound, round_id)
    return encoded


def add_encoded(total: Ring, values: Array, scale_bits: int, bound: float, round_id: int, offset: int = 0) -> None:
    """total[offset:offset + len(values)] += encode(values) (mod 2^64), in place.

    A cache-sized block at a time: each block is scaled (exact, by a power of two, so |v| <= B exactly when
    |v 2^s| <= B 2^s), checked through its minimum and maximum (NaN fails both), rounded, converted to
    integers and added while it is in cache, so that a client's row and its masks meet in one pass over
    memory. FixedPointOverflow names the first value outside the bound (entries counted from `offset`);
    `total` may then hold the blocks before it, and the caller drops it."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or offset < 0 or offset + len(values) > len(total):
        raise ValueError(f"{values.shape} values do not fit a row of {len(total)} entries from entry {offset}")
    limit, factor = np.ldexp(bound, scale_bits), np.ldexp(1.0, scale_bits)
    size = min(_BLOCK, len(values))
    scaled, integers = np.empty(size), np.empty(size, dtype=np.int64)
    for start in range(0, len(values), _BLOCK):
        part = values[start : start + _BLOCK]
        block, as_integers = scaled[: len(part)], integers[: len(part)]
        np.multiply(part, factor, out=block)  # as ldexp's, bit for bit (a power of two), and faster
        if not (block.min() >= -limit and block.max() <= limit):
            outside = ~(np.abs(part) <= bound)  # only on the way to the error: which entry
            entry = start + int(np.argmax(outside))
            raise FixedPointOverflow(round_id, offset + entry, float(values[entry]), bound)
        np.rint(block, out=block)
        as_integers[...] = block  # exact: integers within +-2^62
        target = total[offset + start : offset + start + len(part)]
        np.add(target, as_integers.view(np.uint64), out=target)


def decode(total: Ring, scale_bits: int) -> Array:
    """The real sum an integer sum stands for: read as signed, scaled by 2^-scale_bits."""
    decoded: Array = np.ldexp(np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64), -scale_bits)
    return decoded
