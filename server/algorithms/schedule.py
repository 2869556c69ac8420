"""When clients synchronize: a fixed number of local steps, or the paper's coin.

The paper (Framework, Algorithm 1) flips a coin with probability p after every
local step and synchronizes on heads. The number of local steps up to and
including the first heads is Geometric(p), so the coordinator draws it once per
sync and sends it with the task: the same distribution, one draw, and clients
need no randomness of their own to agree on it.

The random stream is part of the algorithm's state (`SyncClock`), so a state
saved after any step resumes with the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fedsaddle.common import seeding


class SyncClock(NamedTuple):
    """The position of the synchronization stream: PCG64's state, as plain integers.

    None fields mean a fixed schedule, which needs no randomness.
    """

    state: int | None = None
    increment: int | None = None
    has_uint32: int = 0
    uinteger: int = 0


@dataclass(frozen=True)
class SyncSchedule:
    """Exactly `tau` local steps per sync, or Geometric(p) of them: one of the two is given (the config's
    `sync`, FixedSync or RandomSync, declares their defaults)."""

    tau: int | None = None
    p: float | None = None

    def __post_init__(self) -> None:
        if (self.tau is None) == (self.p is None):
            raise ValueError(f"a sync schedule has either tau or p, got tau={self.tau}, p={self.p}")
        if self.tau is not None and self.tau < 1:
            raise ValueError(f"synchronization period tau must be >= 1, got {self.tau}")
        if self.p is not None and not 0 < self.p <= 1:
            raise ValueError(f"synchronization probability p must be in (0, 1], got {self.p}")

    @property
    def minibatch(self) -> int:
        """Gradient estimates per client and round for the minibatch methods.

        The paper's Minibatch Mirror Descent and Mirror-prox take a deterministic
        tau; under random synchronization they use tau = round(1 / p), the paper's
        correspondence p = 1 / tau.
        """
        if self.tau is not None:
            return self.tau
        assert self.p is not None
        return max(1, round(1 / self.p))

    def start(self, seed: int) -> SyncClock:
        """The clock of a run with this seed (its own stream, named by the seed)."""
        if self.p is None:
            return SyncClock()
        return _clock(seeding.rng(seed, seeding.SYNC))

    def next_interval(self, clock: SyncClock) -> tuple[int, SyncClock]:
        """tau_k, the local steps before the next sync, and the clock after drawing it."""
        if self.tau is not None:
            return self.tau, clock
        assert self.p is not None
        generator = np.random.Generator(np.random.PCG64())
        generator.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": clock.state, "inc": clock.increment},
            "has_uint32": clock.has_uint32,
            "uinteger": clock.uinteger,
        }
        tau_k = int(generator.geometric(self.p))
        return tau_k, _clock(generator)


def _clock(generator: np.random.Generator) -> SyncClock:
    state = generator.bit_generator.state
    return SyncClock(
        state=int(state["state"]["state"]),
        increment=int(state["state"]["inc"]),
        has_uint32=int(state["has_uint32"]),
        uinteger=int(state["uinteger"]),
    )
