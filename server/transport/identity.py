"""A client identity: the name its credentials proved (auth.py), and the client indices it may speak for."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fedsaddle.common.indices import some
from fedsaddle.server.transport.refusal import Refusal, Status


@dataclass(frozen=True)
class Identity:
    name: str
    indices: frozenset[int]

    def check_indices(self, indices: Iterable[int]) -> None:
        """Refusal(PERMISSION_DENIED) naming the indices asked for that this identity may not speak for."""
        foreign = sorted(set(indices) - self.indices)
        if foreign:
            raise Refusal(
                Status.PERMISSION_DENIED,
                f"identity {self.name!r} may not speak for clients {some(foreign)}",
            )
