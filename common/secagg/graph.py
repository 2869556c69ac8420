"""SecAgg+'s sparse masking graph (Bell et al., CCS 2020): each client masks with k neighbours, not all others.

The graph of a round is the Harary graph H(k, m) on its m clients taken in
increasing index order: the client at position p is a neighbour of those at
positions p +- 1, ..., p +- k/2 (mod m), a circulant graph of degree k (k even).
Every client and the coordinator compute it from the round's clients and k
alone, so nobody has to send or agree on it.

What it keeps: H(k, m) is k-connected (Harary 1962), so removing fewer than k
clients (dropped, or colluding with the coordinator) leaves the rest connected.
The coordinator learns the sum of each connected part of the survivors' graph
(pairwise masks cancel only inside a part), so that the sum is over all of a
round's survivors exactly when their graph is connected. Beyond k - 1 dropouts it
may not be, and then the clients refuse to unmask (`connected` below) and the
round fails, naming the split: a partial sum is never released.

k = 0 (or k >= m - 1) is the all-pairs graph of Bonawitz et al.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from fedsaddle.common.secagg.settings import default_threshold

ALL_PAIRS = 0


def default_neighbours(num_clients: int) -> int:
    """k for a federation of n clients: the smallest even k >= 3 log2(n), or all pairs (0) when that is n - 1
    or more (n <= 13). O(log n), Bell et al.'s choice; the factor 3 keeps the graph k-connected with room for
    a few dropouts and colluders at every n (k = 16 at n = 30, 20 at n = 100, 30 at n = 1000)."""
    if num_clients <= 2:
        return ALL_PAIRS
    k = math.ceil(3 * math.log2(num_clients))
    k += k % 2
    return ALL_PAIRS if k >= num_clients - 1 else k


def check_neighbours(neighbours: int) -> None:
    """ValueError unless k is 0 (all pairs) or an even number >= 2 (a circulant graph of even degree)."""
    if neighbours == ALL_PAIRS:
        return
    if neighbours < 2 or neighbours % 2:
        raise ValueError(
            f"neighbours must be 0 (all pairs) or an even number >= 2 (each client masks with k/2 clients on "
            f"either side of it), got {neighbours}"
        )


def neighbours_of(index: int, clients: Sequence[int], neighbours: int) -> tuple[int, ...]:
    """The neighbours of `index` (one of `clients`, increasing) in the round's graph, increasing."""
    m = len(clients)
    if neighbours == ALL_PAIRS or neighbours >= m - 1:
        return tuple(j for j in clients if j != index)
    position = clients.index(index)
    half = neighbours // 2
    around = {clients[(position + step) % m] for step in range(-half, half + 1) if step != 0}
    return tuple(sorted(around))


def connected(nodes: Iterable[int], clients: Sequence[int], neighbours: int) -> bool:
    """Whether the round's graph restricted to `nodes` (a subset of `clients`) is connected."""
    members = set(nodes)
    m = len(clients)
    if len(members) <= 1 or neighbours == ALL_PAIRS or neighbours >= m - 1 or m - len(members) < neighbours:
        return True  # H(k, m) is k-connected: fewer than k removed leave it connected
    position = {client: p for p, client in enumerate(clients)}
    present = [client in members for client in clients]
    half = neighbours // 2
    start = position[min(members)]
    seen, frontier = {start}, [start]
    while frontier:
        p = frontier.pop()
        for step in range(-half, half + 1):
            q = (p + step) % m
            if present[q] and q not in seen:
                seen.add(q)
                frontier.append(q)
    return len(seen) == len(members)


def neighbourhood_threshold(size: int) -> int:
    """Shares of a client's self-mask seed needed to rebuild it: a majority of one more than its neighbourhood
    (itself and its neighbours, `size` clients), so that no two groups of them that share only the client
    itself could each give what unmasks it (the same rule as a round's: settings.default_threshold)."""
    return default_threshold(size)
