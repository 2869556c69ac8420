"""Secure aggregation: the coordinator learns the sum of a round's answers, never one client's.

A protocol of the SecAgg family (Bonawitz et al., CCS 2017), in pure modules that
do no I/O, shared by the client runtime, the in-process pool and the gRPC pool
(the coordinator's side, which checks masked rows, asks for the unmasking and sums,
is server/secure.py):

* `fixedpoint` - answers as integers in the ring Z/2^64, so that masks cancel exactly;
* `shamir`     - t-of-k secret sharing over a prime field (the self-mask seeds);
* `crypto`     - X25519 key agreement, HKDF, the AES-CTR mask generator and the
                 ChaCha20-Poly1305 envelope of shares (all from `cryptography`);
* `party`      - one client's side: masks its row, answers unmask requests or refuses;
* `messages`   - its messages on the wire, both ways, checked when read.

docs/privacy.md describes the protocol, its threat model and its numerics.
"""

from __future__ import annotations

from fedsaddle.common.secagg.settings import SecAggError, SecAggSettings

__all__ = ["SecAggError", "SecAggSettings"]
