"""Round latency: one gradient round (Minibatch MD's exchange) over gRPC vs in-process.

Starts a federation of client processes on 127.0.0.1, times `rounds` gradient
rounds for each dimension, and prints the median, quartiles and the transport's
cost per round (gRPC median minus in-process median), beside the bytes moved.

    python bench/round_latency.py                      # d = 10 and d = 1e6, 10 processes
    python bench/round_latency.py --dims 10 --rounds 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.launch import reap, start_clients
from fedsaddle.server.local_pool import LocalPool
from fedsaddle.server.pool import ClientPool, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool


def time_rounds(pool: ClientPool, run: RunInfo, rounds: int, warmup: int = 3) -> list[float]:
    pool.start_run(run)
    z = np.ones(run.dimension)
    for _ in range(warmup):
        pool.gradients(z)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pool.gradients(z)
        times.append(time.perf_counter() - start)
    return times


def quartiles(times: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(times, n=4)
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=float, nargs="+", default=[10, 1e6], help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=10, help="clients, one process each")
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds per dimension (median over them)")
    args = parser.parse_args()

    n = args.clients
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600)
    processes = start_clients(pool.address, [str(i) for i in range(n)], capture=False)
    try:
        pool.wait_for_clients(120)
        print(f"{n} client processes on 127.0.0.1, {args.rounds} rounds each (median [q1, q3])")
        header = f"{'d':>9} {'vector MB':>9} {'gRPC ms':>24} {'in-process ms':>24} {'transport ms':>12} {'MB/round':>9}"
        print(header)
        print("-" * len(header))
        for d in (int(v) for v in args.dims):
            run = RunInfo(f"bench-{d}", PaperRegressionSpec(num_clients=n, dim=d, s=1.0), 0, 0.0)
            remote = time_rounds(pool, run, args.rounds)
            moved = (pool.traffic["algorithm"].bytes_down + pool.traffic["algorithm"].bytes_up) / pool.round_id
            local = time_rounds(LocalPool(), run, args.rounds)
            (rq1, rmed, rq3), (lq1, lmed, lq3) = quartiles(remote), quartiles(local)
            print(
                f"{d:>9} {16 * d / 1e6:>9.3f} "
                f"{f'{1e3 * rmed:.3f} [{1e3 * rq1:.3f}, {1e3 * rq3:.3f}]':>24} "
                f"{f'{1e3 * lmed:.3f} [{1e3 * lq1:.3f}, {1e3 * lq3:.3f}]':>24} "
                f"{1e3 * (rmed - lmed):>12.3f} {moved / 1e6:>9.2f}",
                flush=True,
            )
    finally:
        pool.close()
        reap(processes)


if __name__ == "__main__":
    main()
