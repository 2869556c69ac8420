"""Shamir's t-of-k secret sharing over the prime field GF(2^130 - 5).

A secret s (here a 128-bit seed) is the value at 0 of a random polynomial of
degree t - 1; holder j receives its value at x = j + 1. Any t shares determine
the polynomial (Lagrange interpolation at 0); fewer reveal nothing about s,
because every secret fits them equally well. The field is larger than any
128-bit secret, and its elements are written in 17 bytes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence

PRIME = 2**130 - 5
SHARE_BYTES = 17


def split(
    secret: int, threshold: int, holders: Sequence[int], randbelow: Callable[[int], int] = secrets.randbelow
) -> dict[int, int]:
    """The share of each holder (an index >= 0; its point is index + 1) of `secret`, any `threshold` of
    which rebuild it."""
    if not 0 <= secret < PRIME:
        raise ValueError("the secret must be an element of the field")
    if len(set(holders)) != len(holders) or any(h < 0 or h + 1 >= PRIME for h in holders):
        raise ValueError("holders must be distinct indices >= 0")
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be within 1..{len(holders)} (the holders)")
    coefficients = [secret] + [randbelow(PRIME) for _ in range(threshold - 1)]
    return {holder: _evaluate(coefficients, holder + 1) for holder in holders}


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    value = 0
    for coefficient in reversed(coefficients):  # Horner
        value = (value * x + coefficient) % PRIME
    return value


def combine(shares: Mapping[int, int]) -> int:
    """The secret whose polynomial passes through the shares (holder index -> value): Lagrange at 0.

    Given at least t shares of a degree t - 1 polynomial, any t of them give its secret;
    the caller decides which shares to use (all of them here)."""
    if not shares:
        raise ValueError("no shares to combine")
    return combine_with(coefficients(list(shares)), shares)


def coefficients(holders: Sequence[int]) -> dict[int, int]:
    """The Lagrange coefficients at 0 of the holders' points: the secret is sum_j c_j * share_j.

    They depend on the holders only, so a round that rebuilds many secrets from the same holders
    computes them once (one modular inverse per holder instead of one per holder and secret)."""
    points = [holder + 1 for holder in holders]
    if len(set(points)) != len(points):
        raise ValueError("holders must be distinct")
    result: dict[int, int] = {}
    for holder, x_k in zip(holders, points, strict=True):
        numerator = denominator = 1
        for x_m in points:
            if x_m != x_k:
                numerator = numerator * (-x_m) % PRIME
                denominator = denominator * (x_k - x_m) % PRIME
        result[holder] = numerator * pow(denominator, -1, PRIME) % PRIME
    return result


def combine_with(weights: Mapping[int, int], shares: Mapping[int, int]) -> int:
    """sum_j weights[j] * shares[j] over the holders of `weights` (from `coefficients`)."""
    return sum(weight * (shares[holder] % PRIME) for holder, weight in weights.items()) % PRIME


def to_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "little")


def from_bytes(data: bytes) -> int:
    """A share's value, or ValueError if the bytes are not one field element."""
    if len(data) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "little")
    if value >= PRIME:
        raise ValueError("a share is not an element of the field")
    return value
