"""Time the paper's sweep through the in-process transport, batched over runs.

16 values of s x 3 step sizes x 5 algorithms x 5 seeds = 1200 runs of 500 rounds
(n = 10, d = 10, tau = 20), as `fedsaddle experiment paper` runs them: one batch
per algorithm, spread over one process per core. Prints the median over
--repeats sweeps, the same on one process, and one run at a time on a sample
(extrapolated), so that each layer's effect is visible.

    python bench/paper_sweep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from fedsaddle.experiments.grid import PAPER_FIVE, STEP_SCALES, Grid
from fedsaddle.server.batch import run_batch, run_batches
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport.local_pool import LocalPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", type=int, default=4, help="runs per algorithm timed one at a time")
    args = parser.parse_args()
    grid = Grid(algorithms=PAPER_FIVE, step_scales=STEP_SCALES, variants={})  # the paper's own grid
    members = {a: [m for _, m in grid.members(a)] for a in PAPER_FIVE}
    batches = [members[a] for a in PAPER_FIVE]
    runs = sum(len(m) for m in batches)
    cores = os.cpu_count() or 1

    def timed(action: object) -> float:
        started = time.perf_counter()
        action()  # type: ignore[operator]
        return time.perf_counter() - started

    parallel = [timed(lambda: run_batches(batches)) for _ in range(args.repeats)]
    serial = [timed(lambda: run_batches(batches, workers=1)) for _ in range(args.repeats)]
    print(f"paper sweep: {runs} runs x {grid.rounds} rounds, one batch per algorithm, median of {args.repeats}")
    print(
        f"  {cores} processes (the default): {statistics.median(parallel):6.2f} s"
        f" (min {min(parallel):.2f}, max {max(parallel):.2f})"
    )
    print(
        f"  1 process:                {statistics.median(serial):6.2f} s (min {min(serial):.2f}, max {max(serial):.2f})"
    )
    for algorithm in PAPER_FIVE:
        batched = timed(lambda algorithm=algorithm: run_batch(members[algorithm]))
        alone = members[algorithm][:: max(1, len(members[algorithm]) // args.sample)][: args.sample]
        started = time.perf_counter()
        for member in alone:
            run_algorithm(member.spec, member.config, LocalPool())
        one_at_a_time = (time.perf_counter() - started) / len(alone) * len(members[algorithm])
        print(
            f"    {algorithm:<22} {batched:6.2f} s batched on 1 process"
            f"   ~{one_at_a_time:6.1f} s one run at a time (from {len(alone)} runs)"
        )


if __name__ == "__main__":
    main()
