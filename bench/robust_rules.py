"""Robust aggregation's cost: each rule's time per round against the mean, at d = 10 and d = 1e6.

In-process (the coordinator's work alone, no transport), n = 10 clients of the paper's
problem. For each d, blocks of rounds alternate between the rules (the mean first in
every cycle), so that every rule sees the same machine; a round is `LocalPool.exchange`
of a gradient task and the algorithm's `mean()` of its answers: the clients' work, the
settlement, and the rule. Printed: median [q1, q3] ms per round over the blocks' rounds,
the ratio of medians to the mean's, and the rule's own time on the round's rows (the
rest of the round is the same for every rule).

    python bench/robust_rules.py                      # d = 10 and d = 1e6
    python bench/robust_rules.py --dims 10 --rounds 200
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.common.tasks import GradientTask
from fedsaddle.server.aggregation import (
    Bucketing,
    CenteredClipping,
    GeometricMedian,
    Krum,
    Median,
    Rule,
    TrimmedMean,
)
from fedsaddle.server.algorithms.base import RoundAnswers
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.local_pool import LocalPool

RULES: dict[str, Rule | None] = {
    "mean": None,
    "median": Median(),
    "trimmed_mean (beta 0.2)": TrimmedMean(0.2),
    "krum (f 2)": Krum(2),
    "multi-krum (f 2, m 5)": Krum(2, 5),
    "geometric_median (100 it.)": GeometricMedian(),
    "centered_clipping (3 it.)": CenteredClipping(1.0, 3),
    "median, bucketing s=2": Bucketing(Median(), 2),
}


def median_iqr(times: list[float]) -> tuple[float, str]:
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return median, f"{1e3 * median:.3f} [{1e3 * q1:.3f}, {1e3 * q3:.3f}]"


def bench(d: int, n: int, rounds: int, cycles: int) -> None:
    # One pool (one copy of the clients' data, which at d = 1e6 is large); each rule's run info in turn.
    pool = LocalPool()
    info = RunInfo(f"bench-{d}", PaperRegressionSpec(num_clients=n, dim=d, s=1.0), 0)
    pool.start_run(info)
    infos = {name: dataclasses.replace(info, rule=rule) for name, rule in RULES.items()}
    z = np.ones(info.dimension)  # z = (x, y): D = 2d entries
    per_round: dict[str, list[float]] = {name: [] for name in RULES}
    alone: dict[str, list[float]] = {name: [] for name in RULES}
    for _ in range(cycles):
        for name in RULES:
            pool.run = infos[name]
            for _ in range(rounds):
                started = time.perf_counter()
                answers = pool.exchange(GradientTask(z))
                answers.mean()
                per_round[name].append(time.perf_counter() - started)
            rows = pool.exchange(GradientTask(z))
            rule = RULES[name]
            vectors = rows.vectors if rows.vectors is not None else np.ones((n, z.size))
            generator = np.random.default_rng(0)
            for _ in range(rounds):
                started = time.perf_counter()
                if rule is None:
                    RoundAnswers(vectors).mean()
                else:
                    rule.aggregate(vectors, None, generator)
                alone[name].append(time.perf_counter() - started)
    base, _ = median_iqr(per_round["mean"])
    print(f"\nd = {d:g} (D = {2 * d:g}), n = {n}: {cycles} cycles x {rounds} rounds per rule, ms per round")
    print(f"{'rule':30} {'round: median [q1, q3]':>32} {'/ mean':>8} {'rule alone (median)':>20}")
    for name in RULES:
        median, text = median_iqr(per_round[name])
        own, _ = median_iqr(alone[name])
        print(f"{name:30} {text:>32} {median / base:8.2f} {1e3 * own:17.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=float, nargs="+", default=[10, 1e6])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=0, help="rounds per block (default: 100 at d <= 1e4, else 2)")
    parser.add_argument("--cycles", type=int, default=5, help="blocks of each rule, alternating")
    args = parser.parse_args()
    for d in args.dims:
        rounds = args.rounds or (100 if d <= 1e4 else 2)
        bench(int(d), args.clients, rounds, args.cycles)


if __name__ == "__main__":
    main()
