"""Soak: a long federation, to see that the coordinator leaks nothing.

200 clients in 10 client processes on 127.0.0.1, 1000 rounds (five runs of 200
gradient rounds, so run starts are exercised too), d = 10. This process is the
coordinator. Prints its RSS every 100 rounds, the growth after warm-up, round
latency quartiles, and file descriptors, asyncio tasks and threads before and
after the rounds.

    python bench/soak.py [--clients 200] [--processes 10] [--rounds 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import numpy as np
from procfs import rss_mib  # bench/procfs.py

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.launch import index_groups, reap, start_clients
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def loop_tasks(pool: GrpcPool) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())

    return pool._call(count())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5, help="the rounds are split over this many runs")
    args = parser.parse_args()
    n = args.clients
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=120)
    processes = start_clients(pool.address, index_groups(n, -(-n // args.processes)), capture=False)
    try:
        pool.wait_for_clients(120)
        spec = PaperRegressionSpec(num_clients=n, dim=10, s=1.0)
        z = np.ones(20)
        pool.start_run(RunInfo("warm-up", spec, 0))
        for _ in range(20):
            pool.gradients(z)
        before = {"fds": open_fds(), "tasks": loop_tasks(pool), "threads": threading.active_count()}
        samples: list[tuple[int, float]] = [(0, rss_mib())]
        times: list[float] = []
        per_run = args.rounds // args.runs
        for r in range(args.runs):
            pool.start_run(RunInfo(f"soak-{r}", spec, r))
            for _ in range(per_run):
                started = time.perf_counter()
                pool.gradients(z)
                times.append(time.perf_counter() - started)
                if len(times) % 100 == 0:
                    samples.append((len(times), rss_mib()))
        after = {"fds": open_fds(), "tasks": loop_tasks(pool), "threads": threading.active_count()}
    finally:
        pool.close()
        codes = reap(processes)
    q1, median, q3 = statistics.quantiles(times, n=4)
    print(f"soak: {n} clients in {len(processes)} processes, {len(times)} rounds in {args.runs} runs, d = 10")
    print(f"round latency: median {1e3 * median:.2f} ms [{1e3 * q1:.2f}, {1e3 * q3:.2f}]")
    print("coordinator RSS (MiB) by round: " + ", ".join(f"{k}: {v:.1f}" for k, v in samples))
    warm = [v for k, v in samples if k >= len(times) // 5]  # after the first fifth
    print(f"RSS after warm-up: min {min(warm):.1f}, max {max(warm):.1f}, growth {warm[-1] - warm[0]:+.1f} MiB")
    print(
        "before -> after the rounds: "
        + ", ".join(f"{key} {before[key]} -> {after[key]}" for key in ("fds", "tasks", "threads"))
    )
    print(f"client exit codes: {sorted(set(codes))}")


if __name__ == "__main__":
    main()
