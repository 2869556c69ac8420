"""Client-level differential privacy: each client's answer clipped, Gaussian noise on the round's sum.

A round releases sum_i clip(v_i) + N(0, sigma^2 I) with sigma = noise_multiplier * clip:
one Gaussian mechanism of sensitivity `clip` per round (adding or removing one client
changes the sum by at most `clip` in L2). The noise is added

* by the clients, under secure aggregation ("distributed DP"): each of a round's k
  clients adds N(0, sigma^2 / k), so the masked sum carries N(0, sigma^2) and no one
  ever sees a client's answer with less than its own share of the noise. A client that
  drops out takes its share with it: a round with k' < k answers carries
  sigma^2 k'/k (the accountant assumes all k; docs/privacy.md);
* by the coordinator otherwise ("central DP": the coordinator is trusted with each answer).

Client noise comes from the operating system's entropy, never from a seed the coordinator
knows (which would let it subtract the noise): such runs are not reproducible bit for bit.
The coordinator's central noise is drawn from the run's seed.

(epsilon, delta) is accounted by Google's `dp-accounting` (the `privacy` extra): the
RDP accountant of the sampled Gaussian mechanism composed over the rounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from fedsaddle.common.numeric import Array


class DpSettings(NamedTuple):
    """clip: C, the L2 bound of one client's answer row; noise_multiplier: z, with sigma = z C."""

    clip: float
    noise_multiplier: float

    @property
    def sigma(self) -> float:
        return self.noise_multiplier * self.clip


def clip(row: Array, bound: float) -> Array:
    """The row scaled to L2 norm at most `bound` (unchanged if it is within)."""
    norm = float(np.linalg.norm(row))
    if norm <= bound or norm == 0.0:
        return row
    clipped: Array = row * (bound / norm)
    return clipped


def client_share(row: Array, settings: DpSettings, clients: int, rng: np.random.Generator) -> Array:
    """A client's row under distributed DP: clipped, plus its 1/clients share of the round's noise variance."""
    noisy: Array = clip(row, settings.clip) + rng.normal(0.0, settings.sigma / math.sqrt(clients), row.shape)
    return noisy


def private_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (no seed anyone else knows)."""
    return np.random.default_rng()


def epsilon(settings: DpSettings, sampling: float, rounds: int, delta: float) -> float:
    """epsilon at `delta` after `rounds` releases, each a Gaussian mechanism of noise multiplier z on a
    fraction `sampling` of the clients (treated as Poisson sampling), by dp-accounting's RDP accountant."""
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError:  # (the extra is optional: only runs with differential privacy need it)
        raise RuntimeError("differential privacy needs dp-accounting: pip install 'fedsaddle[privacy]'") from None
    if rounds == 0:
        return 0.0
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling, dp_accounting.GaussianDpEvent(settings.noise_multiplier)),
        rounds,
    )
    accountant = rdp.RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))
