"""Time the paper's sweep through the in-process transport, batched over runs.

16 values of s x 3 step sizes x 5 algorithms x 5 seeds = 1200 runs of 500 rounds
(n = 10, d = 10, tau = 20). Prints the time per algorithm and in total, as the
median over --repeats sweeps, and the same for one run at a time on a sample
(extrapolated) so that the batching's effect is visible.

    python bench/paper_sweep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fedsaddle.common.problems import Shards
from fedsaddle.server.coordinator import run_algorithm
from fedsaddle.server.experiment import PAPER_FIVE, Grid
from fedsaddle.server.local_pool import LocalPool
from fedsaddle.server.sweep import run_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", type=int, default=12, help="runs per algorithm timed one at a time")
    args = parser.parse_args()
    grid = Grid(algorithms=PAPER_FIVE)
    members = {a: [m for _, m in grid.members(a)] for a in PAPER_FIVE}
    totals: list[float] = []
    per_algorithm: dict[str, list[float]] = {a: [] for a in PAPER_FIVE}
    for _ in range(args.repeats):
        data: dict[tuple[str, int], Shards] = {}  # shards are built inside the timing
        started = time.perf_counter()
        for algorithm in PAPER_FIVE:
            t = time.perf_counter()
            run_batch(members[algorithm], data)
            per_algorithm[algorithm].append(time.perf_counter() - t)
        totals.append(time.perf_counter() - started)
    runs = sum(len(m) for m in members.values())
    print(f"paper sweep: {runs} runs x {grid.rounds} rounds, batched per algorithm, median of {args.repeats}")
    for algorithm in PAPER_FIVE:
        alone = members[algorithm][:: max(1, len(members[algorithm]) // args.sample)][: args.sample]
        t = time.perf_counter()
        for member in alone:
            run_algorithm(member.spec, member.config, LocalPool())
        one_at_a_time = (time.perf_counter() - t) / len(alone) * len(members[algorithm])
        print(
            f"  {algorithm:<22} {statistics.median(per_algorithm[algorithm]):6.2f} s batched"
            f"   ~{one_at_a_time:6.1f} s one run at a time (from {len(alone)} runs)"
        )
    print(f"total: {statistics.median(totals):.2f} s (min {min(totals):.2f}, max {max(totals):.2f})")


if __name__ == "__main__":
    main()
