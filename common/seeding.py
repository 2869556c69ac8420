"""Seeded random streams. Every random number in a run comes from one of these.

A stream is named by the run seed, a purpose tag and the ids below it (client
index, round id), so the same run draws the same numbers in any process and in
any transport.
"""

from __future__ import annotations

import numpy as np

DATA = 1  # a client's data (own stream per client index)
SHIFT = 2  # public per-client draws every client needs (e.g. centering terms)
NOISE = 3  # stochastic gradient noise, per client and round
SYNC = 4  # the coordinator's synchronization intervals
SOLUTION = 5  # a problem's planted solution
INIT = 6  # a random starting point
SAMPLING = 7  # the coordinator's choice of the clients that take part in a round
DP_NOISE = 8  # the coordinator's noise on a round's sum (central differential privacy)
MINIBATCH = 9  # the training rows of a stochastic oracle call, per client, round and call
ATTACK = 10  # a simulated Byzantine client's noise (gaussian attack), per client and round
BUCKETS = 11  # the coordinator's draw of a robust rule's buckets, per round
SHARED = 2**32 - 1  # "client index" of data shared by all clients


def rng(seed: int, tag: int, *ids: int) -> np.random.Generator:
    """A generator for (seed, tag, *ids); distinct names give independent streams."""
    return np.random.default_rng([seed, tag, *ids])
