"""One client's side of secure aggregation: keys, masked rows, and the unmasking it agrees to.

Per round r (and attempt a) of a run, client i with the round's clients P sends

    y_i = enc(x_i) + PRG(b_i) + sum_{j in P, j > i} PRG(m_ij) - sum_{j in P, j < i} PRG(m_ij)   (mod 2^64)

where m_ij is derived from the pairwise key of i and j and (run, r, a), and b_i is a
fresh random seed whose Shamir shares travel with y_i, each sealed to its holder.
(Under SecAgg+, common/secagg/graph.py, the sums over j run over i's neighbours in the round's graph
only, and b_i is shared among them.) The pairwise masks cancel in the sum over P. Then the coordinator asks each client
that answered for the unmasking: b-shares of the clients that answered (A), and
this client's own round seeds m_ij with the clients that dropped (D). For a client
that answered, the coordinator so gets b_i (t shares) but never its seeds; for a
dropped one its seeds but never b_i: it cannot unmask a single answer.

Every refusal raises SecAggError naming the round, before any state changes.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.secagg import crypto, fixedpoint, graph, shamir
from fedsaddle.common.secagg.fixedpoint import Ring
from fedsaddle.common.secagg.settings import SecAggError, SecAggSettings, round_threshold

if TYPE_CHECKING:  # (`cryptography` loads when a run uses secure aggregation: crypto.py)
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

SELF_MASK_BYTES = 16  # b_i: a 128-bit seed, an element of the sharing field


class MaskedRow(NamedTuple):
    """What one client sends for a round: its masked row and its b-shares sealed to each other client."""

    client: int
    masked: Ring
    shares: dict[int, bytes]  # holder index -> sealed share of b_i


class UnmaskRequest(NamedTuple):
    """The coordinator's request to one client after a round: who answered, who dropped, and the
    shares the answering clients sealed to this one (sender index, sealed share)."""

    round_id: int
    attempt: int
    answered: tuple[int, ...]
    dropped: tuple[int, ...]
    shares: tuple[tuple[int, bytes], ...]


class UnmaskReply(NamedTuple):
    """A client's unmasking: its share of b_i for each i that answered, its seed m_ij for each j that dropped."""

    client: int
    b_shares: dict[int, bytes]
    seeds: dict[int, bytes]


class _Prepared(NamedTuple):
    """A round's masks made ahead of its task (Party.prepare): the key of the round they fit, and them."""

    round_id: int
    attempt: int
    participants: tuple[int, ...]
    length: int
    threshold: int
    neighbours: tuple[int, ...]
    share_threshold: int
    own_share: int
    sealed: dict[int, bytes]
    pad: Ring  # PRG(b_i) + sum_j +-PRG(m_ij): y_i is enc(x_i) + pad


class _Answered(NamedTuple):
    attempt: int
    participants: tuple[int, ...]
    threshold: int  # of the round: the least number of its clients that must answer
    neighbours: tuple[int, ...]  # this client's neighbours in the round's graph (all the others: all pairs)
    share_threshold: int  # shares that rebuild a self-mask seed (the round's threshold under all pairs)
    own_share: int  # this client's share of its own b_i


def combine_masks(
    index: int, participants: Sequence[int], seeds: Mapping[int, bytes], length: int, into: Ring | None = None
) -> Ring:
    """sum_{j > i} PRG(m_ij) - sum_{j < i} PRG(m_ij) over the round's other clients (the pairwise part of y_i);
    `seeds` has a seed for each of them (its neighbours under SecAgg+), `participants` may list more."""
    total = np.zeros(length, dtype=np.uint64) if into is None else into
    crypto.add_masks(total, [(seeds[j], 1 if j > index else -1) for j in participants if j != index and j in seeds])
    return total


class Party:
    """One client of a federation, as a party to secure aggregation (a process hosting several clients
    holds one Party per client: each has its own keys and masked row)."""

    def __init__(self, index: int, run_id: str, settings: SecAggSettings) -> None:
        self.index, self.run_id, self.settings = index, run_id, settings
        self._private = crypto.new_private_key()
        self.public_key = crypto.public_bytes(self._private)
        self.epoch = -1  # the key directory's epoch this party has agreed to (-1: none yet)
        self._directory: dict[int, bytes] = {}  # the agreed directory: pairwise keys not yet derived come from it
        self._pairwise: dict[int, bytes] = {}
        self._envelopes: dict[int, ChaCha20Poly1305] = {}  # per peer: the AEAD its shares travel in
        self._answered: dict[int, _Answered] = {}  # round id -> what this party sent in it
        self._unmasked: set[int] = set()  # rounds whose unmasking this party has given
        # The latest round this party masked: round ids only grow within a run, and an earlier round that came
        # again would be masked a second time under its pairwise seeds once its record here had gone (-1: none).
        self._latest = -1
        self._prepared: _Prepared | None = None  # the next round's masks, made while the client waited

    # -- keys --------------------------------------------------------------------------

    def agree(self, epoch: int, directory: Mapping[int, bytes]) -> None:
        """Derive the pairwise keys from the coordinator's key directory (index -> public key).

        A directory of an epoch this party has already seen (a replay), one that does not carry
        this party's own key as it sent it, or one that gives two clients the same key is refused.
        Under SecAgg+ only the keys with this client's neighbours among all the clients are derived
        now; a round that samples other neighbours derives theirs when it first needs them."""
        if epoch <= self.epoch:
            raise SecAggError(
                f"run {self.run_id!r}: key directory of epoch {epoch} refused: this client already agreed "
                f"to epoch {self.epoch} (a replayed or stale key message)"
            )
        if directory.get(self.index) != self.public_key:
            raise SecAggError(
                f"run {self.run_id!r}: the key directory of epoch {epoch} does not carry this client's "
                f"(client {self.index}) own public key"
            )
        keys = list(directory.values())
        if len(set(keys)) != len(keys):
            raise SecAggError(f"run {self.run_id!r}: the key directory of epoch {epoch} gives two clients the same key")
        negative = [j for j in directory if j < 0]
        if negative:
            raise SecAggError(f"run {self.run_id!r}: the key directory names client {negative[0]}")
        everyone = sorted(directory)
        pairwise: dict[int, bytes] = {}
        for j in graph.neighbours_of(self.index, everyone, self.settings.neighbours):
            pairwise[j] = self._derive(j, directory[j], f"key directory of epoch {epoch}")
        self._directory, self._pairwise, self.epoch = dict(directory), pairwise, epoch
        self._envelopes = {j: crypto.envelope(key) for j, key in pairwise.items()}
        self._prepared = None  # made with the keys of the last epoch

    def _derive(self, peer: int, public_key: bytes, where: str) -> bytes:
        try:
            return crypto.pairwise_key(self._private, self.index, public_key, peer, self.run_id)
        except crypto.KeyRejected as exc:
            raise SecAggError(f"run {self.run_id!r}: {where}: {exc}") from None

    def _keys_with(self, peers: Sequence[int], where: str) -> None:
        """Derive the pairwise keys (and share envelopes) with `peers` not derived yet, or SecAggError."""
        unknown = [j for j in peers if j not in self._pairwise and j not in self._directory]
        if unknown:
            raise SecAggError(f"{where}: no agreed key with clients {unknown[:5]}")
        derived = {j: self._derive(j, self._directory[j], where) for j in peers if j not in self._pairwise}
        self._pairwise.update(derived)
        self._envelopes.update({j: crypto.envelope(key) for j, key in derived.items()})

    # -- a round -------------------------------------------------------------------------

    def mask(self, round_id: int, attempt: int, participants: Sequence[int], row: Array | Sequence[Array]) -> MaskedRow:
        """y_i for a round among `participants` (increasing client indices, this one among them). `row` may come
        in pieces (the answer, its objective, its weight), encoded one after another without joining them."""
        clients = self._check_round(round_id, attempt, participants)
        pieces = [row] if isinstance(row, np.ndarray) else list(row)
        length = sum(len(piece) for piece in pieces)
        prepared = self._prepared
        if prepared is not None and prepared[:4] == (round_id, attempt, clients, length):
            # The masks are ready: the row is encoded onto them, block by block, in one pass. (A value outside
            # the bound leaves them half-changed: they are dropped, as a prepared pad is in any case.)
            self._prepared = None
            masked = prepared.pad
            self._encode(pieces, round_id, masked)
        else:  # made now, straight into the encoded row
            masked = np.zeros(length, dtype=np.uint64)
            self._encode(pieces, round_id, masked)
            self._prepared = None
            prepared = self._make_masks(round_id, attempt, clients, length, into=masked)
        # Only the latest round can still be unmasked: older ones are forgotten (the pool finishes a round
        # before it starts the next, so a request for one of them is stale).
        self._latest = round_id
        self._answered = {
            round_id: _Answered(
                attempt, clients, prepared.threshold, prepared.neighbours, prepared.share_threshold, prepared.own_share
            )
        }
        return MaskedRow(self.index, masked, prepared.sealed)

    def _encode(self, pieces: Sequence[Array], round_id: int, into: Ring) -> None:
        offset = 0
        for piece in pieces:
            fixedpoint.add_encoded(into, piece, self.settings.scale_bits, self.settings.bound, round_id, offset)
            offset += len(piece)

    def prepare(self, round_id: int, attempt: int, participants: Sequence[int], length: int) -> bool:
        """Make a coming round's masks ahead of its task (while the client would wait for it), so that `mask`
        only adds them; False, and nothing made, if that round could not be masked. Masks made for a round
        that then comes otherwise (other clients, length or keys) are dropped unused: a self-mask seed is
        never used for two rounds, and what is made here is what `mask` would make then."""
        try:
            clients = self._check_round(round_id, attempt, participants)
            self._prepared = self._make_masks(round_id, attempt, clients, length)
        except SecAggError:
            return False
        return True

    def _check_round(self, round_id: int, attempt: int, participants: Sequence[int]) -> tuple[int, ...]:
        """The round's clients, or SecAggError if this party must not mask for it."""
        where = f"round {round_id}"
        clients = tuple(participants)
        if list(clients) != sorted(set(clients)):
            raise SecAggError(f"{where}: the round's clients are not distinct increasing indices")
        if self.index not in clients:
            raise SecAggError(f"{where}: the task's clients do not include this client ({self.index})")
        threshold = round_threshold(self.settings, len(clients))
        if len(clients) < 2 or len(clients) < threshold:
            raise SecAggError(
                f"{where}: {len(clients)} clients take part, fewer than 2 or than the threshold {threshold}: "
                "their sum would reveal too much"
            )
        if round_id < self._latest:
            raise SecAggError(
                f"{where}: this client already masked round {self._latest}, a later one (round ids only grow "
                "within a run: a replayed or reordered task would mask an earlier round again)"
            )
        before = self._answered.get(round_id)
        if round_id in self._unmasked or (before is not None and attempt <= before.attempt):
            raise SecAggError(f"{where}: this client already answered it (attempt {attempt} repeated)")
        return clients

    def _make_masks(
        self, round_id: int, attempt: int, clients: tuple[int, ...], length: int, into: Ring | None = None
    ) -> _Prepared:
        """A fresh self-mask seed b_i, its shares sealed to the neighbours, and the round's whole mask (added
        to `into` when given, which is then the pad)."""
        where = f"round {round_id}"
        threshold = round_threshold(self.settings, len(clients))
        neighbours = graph.neighbours_of(self.index, clients, self.settings.neighbours)
        self._keys_with(neighbours, where)
        # b_i is shared among this client and its neighbours; a majority of one more than them rebuilds it
        # (under all pairs the round's threshold; graph.neighbourhood_threshold says why one more).
        holders = tuple(sorted((*neighbours, self.index)))
        sparse = len(neighbours) < len(clients) - 1
        share_threshold = graph.neighbourhood_threshold(len(holders)) if sparse else threshold
        self_seed = secrets.token_bytes(SELF_MASK_BYTES)
        shares = shamir.split(int.from_bytes(self_seed, "little"), share_threshold, holders)
        sealed = {
            j: crypto.seal(self._envelopes[j], shamir.to_bytes(share), self.run_id, round_id, attempt, self.index, j)
            for j, share in shares.items()
            if j != self.index
        }
        pad = np.empty(length, dtype=np.uint64) if into is None else into
        masks = [(self._self_key(self_seed, round_id, attempt), 1)]
        masks += [(self._round_seed(j, round_id, attempt), 1 if j > self.index else -1) for j in neighbours]
        crypto.add_masks(pad, masks, fresh=into is None)  # all of them in one pass
        return _Prepared(
            round_id, attempt, clients, length, threshold, neighbours, share_threshold, shares[self.index], sealed, pad
        )

    def unmask(self, request: UnmaskRequest) -> UnmaskReply:
        """This client's part of unmasking a round it answered, or SecAggError naming why not."""
        round_id, where = request.round_id, f"round {request.round_id}"
        answered, dropped = tuple(request.answered), tuple(request.dropped)
        if round_id in self._unmasked:
            raise SecAggError(f"{where}: the unmasking was already given (a repeated request)")
        record = self._answered.get(round_id)
        if record is None or record.attempt != request.attempt:
            raise SecAggError(f"{where}: this client did not answer it (attempt {request.attempt})")
        for name, group in (("answered", answered), ("dropped", dropped)):
            if list(group) != sorted(set(group)):
                raise SecAggError(f"{where}: the {name} clients are not distinct increasing indices")
        if self.index in dropped:
            raise SecAggError(f"{where}: the coordinator lists this client ({self.index}) as dropped, but it answered")
        both = sorted(set(answered) & set(dropped))
        if both:
            raise SecAggError(f"{where}: clients {both[:5]} are listed both as answered and as dropped")
        if sorted(answered + dropped) != list(record.participants):
            raise SecAggError(f"{where}: answered and dropped clients are not the clients the round was sent to")
        if len(answered) < record.threshold:
            raise SecAggError(
                f"{where}: only {len(answered)} clients answered, fewer than the threshold {record.threshold}; "
                "unmasking now could reveal a single client's answer"
            )
        near = set(record.neighbours)
        answered_near = [i for i in answered if i in near or i == self.index]
        if len(answered_near) < record.share_threshold:
            raise SecAggError(
                f"{where}: only {len(answered_near)} of this client's neighbourhood answered, fewer than the "
                f"{record.share_threshold} that rebuild a self mask; unmasking now could reveal too much"
            )
        if not graph.connected(answered, record.participants, self.settings.neighbours):
            raise SecAggError(
                f"{where}: the clients that answered fall apart into groups with no neighbours in common "
                f"({len(dropped)} dropped); unmasking would reveal each group's sum"
            )
        b_shares = {self.index: shamir.to_bytes(record.own_share)}
        for sender, sealed in request.shares:
            if sender == self.index or sender not in answered or sender not in near:
                raise SecAggError(
                    f"{where}: a share from client {sender}, which is not among the neighbours that answered"
                )
            if sender in b_shares:
                raise SecAggError(f"{where}: two shares from client {sender}")
            try:
                plain = crypto.open_sealed(
                    self._envelopes[sender], sealed, self.run_id, round_id, request.attempt, sender, self.index
                )
                shamir.from_bytes(plain)
            except ValueError as exc:
                raise SecAggError(f"{where}: the share from client {sender} is refused: {exc}") from None
            b_shares[sender] = plain
        missing = [i for i in answered_near if i not in b_shares]
        if missing:
            raise SecAggError(f"{where}: no share from clients {missing[:5]}, which answered")
        seeds = {j: self._round_seed(j, round_id, request.attempt) for j in dropped if j in near}
        self._unmasked.add(round_id)
        del self._answered[round_id]
        return UnmaskReply(self.index, b_shares, seeds)

    def _round_seed(self, peer: int, round_id: int, attempt: int) -> bytes:
        return crypto.round_seed(self._pairwise[peer], "pairwise", self.run_id, round_id, attempt)

    def _self_key(self, self_seed: bytes, round_id: int, attempt: int) -> bytes:
        return self_mask_key(self_seed, self.run_id, round_id, attempt)


def self_mask_key(self_seed: bytes, run_id: str, round_id: int, attempt: int) -> bytes:
    """The PRG seed of a client's self mask for a round, from its b_i (the coordinator derives it alike)."""
    return crypto.round_seed(self_seed, "self", run_id, round_id, attempt)
