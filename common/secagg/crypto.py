"""The cryptographic primitives of secure aggregation, all from `cryptography` (none written here).

* key agreement: X25519; a pair of clients derives its pairwise key with HKDF-SHA256,
  bound to the run and to both indices and public keys;
* per-round seeds: HKDF of the pairwise key (or of a self-mask seed) with the run,
  round and attempt, so that revealing one round's seed reveals no other round's;
* mask expansion: the AES-256-CTR keystream of a seed (counter blocks from zero), read
  as little-endian uint64 (AES-CTR rather than ChaCha20: with AES instructions, as on
  every x86-64 and ARMv8 server, it expands a mask about 1.7x faster, and masks are most
  of the cost). The same keystream is computed through OpenSSL's AES-GCM code path, which
  is about twice as fast as its CTR path where the CPU has vector AES (see `Keystream`):
  the bits are those of AES-256-CTR, so the generator is unchanged;
* share envelopes: ChaCha20-Poly1305 under a key derived from the pairwise key, the
  run, round, attempt, sender and receiver as associated data (a share moved to
  another round or another pair fails authentication).
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from fedsaddle.common.secagg.fixedpoint import Ring

# `cryptography` is imported where a primitive is used, not with this module: every coordinator and
# client imports this module (its protocol knows secure aggregation's messages), and loading `cryptography`
# cost each process 9 MiB, which only a run with secure aggregation needs.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.ciphers import CipherContext
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

PUBLIC_KEY_BYTES = 32
SEED_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_ZERO_COUNTER = bytes(16)  # AES-CTR's initial counter block: each seed expands one stream only
_ZERO_IV = bytes(12)  # GCM's IV for the same stream: its counter blocks 0^96 || 2, 3, ... (Keystream)


class KeyRejected(ValueError):
    """A public key that is not a usable X25519 key (wrong length, or a low-order point)."""


def new_private_key() -> X25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class _PerRound(NamedTuple):
    """What a round's derivations, masks and envelopes call, ten to a hundred times per round and process."""

    hkdf: Callable[..., Any]  # cryptography's HKDF
    sha256: Any  # an instance of its SHA256 (stateless: shared by every derivation)
    cipher: Callable[..., Any]  # Cipher and AES: a mask's keystream
    aes: Callable[[bytes], Any]
    ctr_from_zero: Any  # CTR mode from counter block zero, for every seed (the mode keeps only its nonce)
    gcm_zero_iv: Any  # GCM under a zero 96-bit IV: the same stream from counter block 2 (Keystream)
    invalid_tag: type[Exception]


@functools.cache
def _per_round() -> _PerRound:
    """The primitives a round uses, imported on first use and kept: an import statement in the function
    that uses a primitive cost about as much as the primitive itself at d = 10 (a keystream's cipher 7 us,
    the import around it 7 more), and each client derives ten seeds and expands ten masks a round."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return _PerRound(
        HKDF, hashes.SHA256(), Cipher, algorithms.AES, modes.CTR(_ZERO_COUNTER), modes.GCM(_ZERO_IV), InvalidTag
    )


def _hkdf(secret: bytes, info: bytes, salt: bytes | None = None) -> bytes:
    lib = _per_round()
    return lib.hkdf(algorithm=lib.sha256, length=SEED_BYTES, salt=salt, info=info).derive(secret)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _field(text: str) -> bytes:
    """A length-prefixed string, so that concatenated fields cannot be confused. (Kept: the same run id and
    purpose are written into every seed's and envelope's context, tens of times a round.)"""
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def pairwise_key(own: X25519PrivateKey, own_index: int, peer_public: bytes, peer_index: int, run_id: str) -> bytes:
    """The secret a pair of clients shares for a run: the same from both sides."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    if len(peer_public) != PUBLIC_KEY_BYTES:
        raise KeyRejected(f"client {peer_index}'s public key is {len(peer_public)} bytes, not {PUBLIC_KEY_BYTES}")
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # cryptography refuses an all-zero result (a low-order point)
        raise KeyRejected(f"client {peer_index}'s public key is not a usable X25519 key") from None
    (low, low_key), (high, high_key) = sorted([(own_index, public_bytes(own)), (peer_index, peer_public)])
    info = b"fedsaddle secagg pairwise" + _field(run_id) + struct.pack("<QQ", low, high) + low_key + high_key
    return _hkdf(shared, info)


def round_seed(key: bytes, purpose: str, run_id: str, round_id: int, attempt: int) -> bytes:
    """A seed for one round (and attempt) of a run, derived from a pairwise key or a self-mask seed."""
    info = b"fedsaddle secagg round" + _field(purpose) + _field(run_id) + struct.pack("<QQ", round_id, attempt)
    return _hkdf(key, info)


def expand(seed: bytes, length: int) -> Ring:
    """`length` pseudo-random ring elements: the AES-256-CTR keystream of the seed."""
    mask = np.empty(length, dtype=np.uint64)
    add_masks(mask, [(seed, 1)], fresh=True)
    return mask


class Keystream:
    """The PRG of a seed: AES-256 under the 32-byte seed in CTR mode from counter block zero, read over
    zeros (`update_into(zeros, buffer)` writes the next len(buffer) bytes of the keystream), block after
    block.

    Computed through OpenSSL's AES-GCM, whose code path is about twice as fast as its CTR path on CPUs
    with vector AES (docs/privacy.md, "Cost"), with the same bits: GCM under a
    96-bit IV of zeros encrypts with the counter blocks 0^96 || c for c = 2, 3, ... (its 32-bit counter
    starts at 2), and these are CTR's counter blocks 2, 3, ... as long as c does not wrap, i.e. for the
    first 2^32 - 2 blocks (64 GiB). The keystream's first two blocks (32 bytes) come from a CTR context,
    and a stream shorter than GCM_FROM or longer than GCM's counter covers is CTR throughout. GCM's tag is
    never computed, and no message is encrypted: only the keystream over zeros is read, as from CTR mode."""

    HEAD = 32  # bytes of the first two counter blocks, which GCM under a zero IV does not produce
    GCM_FROM = 4096  # bytes: a shorter stream is CTR throughout (a second context costs more than it saves)
    GCM_LIMIT = 16 * ((1 << 32) - 2)  # bytes from HEAD on that GCM's 32-bit counter covers without wrapping

    __slots__ = ("_at", "_body", "_head")

    def __init__(self, seed: bytes, length: int) -> None:
        """A stream of which at most `length` bytes will be read."""
        lib = _per_round()
        key = lib.aes(seed)
        self._head: CipherContext = lib.cipher(key, lib.ctr_from_zero).encryptor()
        self._at = 0
        self._body: CipherContext | None = None
        if length >= self.GCM_FROM and length - self.HEAD <= self.GCM_LIMIT:
            self._body = lib.cipher(key, lib.gcm_zero_iv).encryptor()

    def update_into(self, zeros: memoryview, buffer: memoryview) -> None:
        """The keystream's next len(buffer) bytes into `buffer` (`zeros`: as many zero bytes)."""
        body, at, size = self._body, self._at, len(buffer)
        self._at = at + size
        if body is None:
            self._head.update_into(zeros, buffer)
            return
        if at < self.HEAD:
            first = min(self.HEAD - at, size)
            self._head.update_into(zeros[:first], buffer[:first])
            if first == size:
                return
            zeros, buffer = zeros[first:], buffer[first:]
        body.update_into(zeros, buffer)


MASK_BLOCK = 32_768  # ring entries (256 KiB) per step of add_masks: the scratch stays in the CPU's cache
_ZEROS = bytes(8 * MASK_BLOCK)  # the plaintext whose encryption is the keystream (read, never written)


def add_masks(total: Ring, masks: Sequence[tuple[bytes, int]], fresh: bool = False) -> None:
    """total += sum of sign * PRG(seed) over `masks` (mod 2^64, sign +1 or -1), in place; with `fresh`,
    total = that sum (whatever `total` held: an array from np.empty needs no clearing pass).

    Block by block: each seed's stream is carried on from block to block, and every block of every
    mask is written into one small scratch and added while it is still in cache. At d = 1e6 that
    touches `total` once instead of allocating, filling and adding an 8 MB mask per seed (main memory's
    bandwidth, not AES, was most of a mask's cost). The keystream is encrypted from a constant block of
    zeros straight into the scratch (no pass to clear it), or, for the first mask of a fresh total,
    straight into the total. The result is exactly expand(seed) added whole."""
    if fresh and not masks:
        total.fill(0)
    if not masks or not len(total):
        return
    streams = [(Keystream(seed, 8 * len(total)), sign) for seed, sign in masks]
    scratch = np.empty(min(MASK_BLOCK, len(total)), dtype=np.uint64)
    zeros = memoryview(_ZEROS)
    swap = sys.byteorder == "big"  # the masks, like the wire, are little-endian everywhere
    for start in range(0, len(total), MASK_BLOCK):
        part = total[start : start + MASK_BLOCK]
        block = scratch[: len(part)]
        buffer, source = block.data.cast("B"), zeros[: 8 * len(part)]
        for k, (stream, sign) in enumerate(streams):
            if fresh and k == 0:  # the first mask is the total's first value: written in place
                stream.update_into(source, part.data.cast("B"))
                if swap:
                    part.byteswap(inplace=True)
                if sign < 0:
                    np.negative(part, out=part)
                continue
            stream.update_into(source, buffer)  # the keystream (XOR zeros), straight into the scratch
            if swap:
                block.byteswap(inplace=True)
            if sign > 0:
                np.add(part, block, out=part)
            else:
                np.subtract(part, block, out=part)


def _share_context(run_id: str, round_id: int, attempt: int, sender: int, receiver: int) -> bytes:
    return b"fedsaddle secagg share" + _field(run_id) + struct.pack("<QQQQ", round_id, attempt, sender, receiver)


def envelope(pairwise: bytes) -> ChaCha20Poly1305:
    """The AEAD a pair seals its shares with, under a key derived from their pairwise key (once per run)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    return ChaCha20Poly1305(_hkdf(pairwise, b"fedsaddle secagg share key"))


def seal(
    aead: ChaCha20Poly1305, plaintext: bytes, run_id: str, round_id: int, attempt: int, sender: int, receiver: int
) -> bytes:
    """nonce || ChaCha20-Poly1305(plaintext), bound to the run, round, attempt and the pair (in order)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + aead.encrypt(nonce, plaintext, _share_context(run_id, round_id, attempt, sender, receiver))


def open_sealed(
    aead: ChaCha20Poly1305, sealed: bytes, run_id: str, round_id: int, attempt: int, sender: int, receiver: int
) -> bytes:
    """The plaintext of `seal`, or ValueError if it was altered or belongs elsewhere."""
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise ValueError(f"it is {len(sealed)} bytes, too short to be sealed")
    context = _share_context(run_id, round_id, attempt, sender, receiver)
    try:
        return aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], context)
    except _per_round().invalid_tag:
        raise ValueError("it fails authentication") from None
