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
_BLOCK = 32_768  # entries converted at a time: no second 8 MB array at d = 1e6 (fresh pages cost more than the work)


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
    """round(values * 2^scale_bits) in Z/2^64, after checking every |value| <= bound.

    One new array, converted in place: the scaling (exact, by a power of two, so |v| <= B exactly when
    |v 2^s| <= B 2^s) is checked through its minimum and maximum (NaN fails both), rounded in place,
    and converted to integers."""
    values = np.asarray(values, dtype=np.float64)
    scaled = np.ldexp(values, scale_bits)
    limit = np.ldexp(bound, scale_bits)
    if scaled.size and not (scaled.min() >= -limit and scaled.max() <= limit):
        outside = ~(np.abs(values) <= bound)  # only on the way to the error: which entry
        entry = int(np.argmax(outside))
        raise FixedPointOverflow(round_id, entry, float(values[entry]), bound)
    np.rint(scaled, out=scaled)
    as_integers = scaled.view(np.int64)
    for start in range(0, len(scaled), _BLOCK):  # to int64 in place, a cache-sized block at a time
        as_integers[start : start + _BLOCK] = scaled[start : start + _BLOCK]
    encoded: Ring = as_integers.view(np.uint64)
    return encoded


def decode(total: Ring, scale_bits: int) -> Array:
    """The real sum an integer sum stands for: read as signed, scaled by 2^-scale_bits."""
    decoded: Array = np.ldexp(np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64), -scale_bits)
    return decoded
