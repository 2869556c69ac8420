"""Client indices as people write them ('3', '0,2,5', '0-4') and as logs show them (bounded)."""

from __future__ import annotations

from collections.abc import Iterable

MAX_INDICES = 1_000_000  # no federation here has more clients; bounds what a typo can allocate
INDEX_LIMIT = 2**32 - 1  # n travels as a uint32 (Welcome.num_clients): every index is below it


def parse_indices(text: str) -> tuple[int, ...]:
    """'3', '0,2,5' or '0-4' (ranges inclusive) -> sorted unique indices; ValueError naming the text."""
    indices: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                low, high = (int(v) for v in part.split("-", 1))
                if low > high:
                    raise ValueError
                if high - low >= MAX_INDICES:
                    raise OverflowError
                indices.update(range(low, high + 1))
            else:
                indices.add(int(part))
            if len(indices) > MAX_INDICES:
                raise OverflowError
    except OverflowError:
        raise ValueError(f"client indices {text!r} name more than {MAX_INDICES} clients") from None
    except ValueError:
        raise ValueError(f"client indices must look like '3', '0,2,5' or '0-4', got {text!r}") from None
    if any(i < 0 for i in indices):
        raise ValueError(f"client indices must be >= 0, got {text!r}")
    if any(i >= INDEX_LIMIT for i in indices):
        raise ValueError(f"client indices must be below {INDEX_LIMIT} (n is a uint32 on the wire), got {text!r}")
    return tuple(sorted(indices))


def some(indices: Iterable[int], limit: int = 8) -> str:
    """A bounded description of a set of indices: '[3, 4]' or '[0, 1, 2, ... and 9997 more]'."""
    listed = sorted(indices)
    if len(listed) <= limit:
        return str(listed)
    return "[" + ", ".join(str(i) for i in listed[:limit]) + f", ... and {len(listed) - limit} more]"
