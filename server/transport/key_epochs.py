"""Secure aggregation's key agreement as the coordinator keeps it through one run.

Each client's public key rides on its Ready (the run's start); the key directory of
epoch 0 is sent from them (server/secure.py). A client process that restarts and
rejoins comes back with new keys: they replace its old ones, and before the next
round every session is sent the directory of the next epoch, so every client agrees
anew (the stream keeps the order: directory, then task). Each such re-agreement is
counted (`rekeys`) as a round of the privacy category.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fedsaddle.common.indices import some
from fedsaddle.common.secagg import messages

log = logging.getLogger("fedsaddle.coordinator")


class KeyEpochs:
    """The clients' public keys in one run, the epoch of the last key directory sent, and the re-agreements."""

    def __init__(self) -> None:
        self.public_keys: dict[int, bytes] = {}  # client index -> its key now
        self.epoch = 0
        self._rekeyed: set[int] = set()  # the clients that came back with new keys since the last directory
        self._rekeys: list[tuple[tuple[int, ...], int]] = []  # (clients with new keys, bytes sent), not yet taken

    def keep(self, order: Sequence[int], keys: Sequence[bytes]) -> None:
        """A session's Ready at the run's start: the keys of its clients, in its Hello's order."""
        for index, public_key in zip(order, keys, strict=False):
            self.public_keys[index] = public_key

    def problem_with(
        self, who: str, indices: tuple[int, ...], keys: Sequence[bytes], run_id: str, rejoins: bool
    ) -> str | None:
        """Why a session's keys (`who`, holding `indices`) do not let the run go on, or None. `rejoins`: the run
        waits for lost clients to come back."""
        if len(keys) != len(indices):
            return (
                f"{who} sent {len(keys)} public keys for {len(indices)} clients; run {run_id} uses secure aggregation"
            )
        if self.public_keys and any(self.public_keys.get(i) for i in indices):
            # A process that restarted has new keys: every client agrees anew before the next round.
            if not rejoins:
                return (
                    f"{who} rejoined run {run_id} with new keys, and the run takes no rejoins "
                    "(transport.rejoin_timeout_s)"
                )
            if len(set(keys)) != len(keys) or any(key in self.public_keys.values() for key in keys):
                return f"{who} rejoined run {run_id} with public keys already in use"
        return None

    def rejoined(self, order: Sequence[int], keys: Sequence[bytes]) -> None:
        """A rejoining session's Ready (its keys checked by `problem_with`): everyone agrees anew before the
        next round."""
        self.keep(order, keys)
        self._rekeyed.update(order)

    @property
    def due(self) -> bool:
        """Whether clients came back with new keys since the last directory."""
        return bool(self._rekeyed)

    def agree_anew(self, run_id: str, recipients: int) -> bytes:
        """The key directory of the next epoch, to be sent to each of `recipients` sessions before the round's
        task; the re-agreement is counted."""
        self.epoch += 1
        directory = messages.key_directory(run_id, self.epoch, dict(self.public_keys))
        clients = sorted(self._rekeyed)
        self._rekeys.append((tuple(clients), len(directory) * recipients))
        log.info(
            "run %s: clients %s rejoined with new keys; key directory of epoch %d sent to every client",
            run_id,
            some(clients),
            self.epoch,
        )
        self._rekeyed = set()
        return directory

    def take_rekeys(self) -> list[tuple[tuple[int, ...], int]]:
        """The re-agreements since the last call: the clients with new keys, and the bytes of directories sent."""
        rekeys, self._rekeys = self._rekeys, []
        return rekeys
