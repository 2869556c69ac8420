"""The documented communication formulas (docs/reference/traffic.md, "Communication accounting"), written
independently of the implementation so that tests can hold it to them."""

from __future__ import annotations

from fedsaddle.server.config import RunConfig


def expected_traffic(config: RunConfig, algorithm: str, syncs: int | None = None) -> dict[str, int]:
    """Rounds, messages and float64 entries per direction for a run of `algorithm`.

    B is the budget; D = 2 * dim; n clients. For random synchronization the
    number of syncs is what the budget allows, as for fixed (each sync costs the
    same whatever its interval).
    """
    budget, n, dim = config.rounds, config.problem.num_clients, 2 * config.problem.dim
    paper = config.round_convention == "paper"
    if algorithm == "minibatch_md":
        rounds = budget
        down, up = rounds * dim, rounds * dim
    elif algorithm == "mirror_prox":
        rounds = 2 * (budget // 2)
        down, up = rounds * dim, rounds * dim
    elif algorithm == "fedavg_s":
        rounds = budget
        down, up = rounds * dim, rounds * dim
    elif algorithm in ("scaffold_s", "scaffold_catalyst_s"):
        r = budget if paper else (budget - 1) // 2  # syncs
        rounds = 1 + 2 * r
        # initial gather: z down, G_i up; per sync: (z~, control) down + sum up, then z~ down + G_i up
        down = dim + r * (2 * dim + dim)
        up = rounds * dim
    else:
        raise ValueError(algorithm)
    return {
        "rounds": rounds,
        "messages_down": n * rounds,
        "messages_up": n * rounds,
        "floats_down": n * down,
        "floats_up": n * up,
    }
