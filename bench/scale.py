"""Scale: one gradient round at d = 10 as the number of clients grows, clients grouped into processes.

For each n, a coordinator and P client processes (n / P clients each) on
127.0.0.1; the median of `--rounds` gradient rounds, and checks that speed did
not change the answer: the mean gradient equals the in-process one bit for bit,
and every client's counts are exact (one message and d floats each way per
round). Prints a table; `--plot FILE` draws latency against n.

    python bench/scale.py                                  # n = 10, 100, 1000 (10 processes), 10 000, 100 000 (20)
    python bench/scale.py --min-clients 100000 --rounds 10 # only the largest
    python bench/scale.py --plot docs/figures/scale.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.launch import index_groups, reap, start_clients
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

SETUPS = ((10, 10), (100, 10), (1000, 10), (10_000, 20), (100_000, 20))  # (clients, processes)


def measure(n: int, processes: int, dim: int, rounds: int) -> tuple[float, float, float]:
    """Median, q1, q3 of one round in seconds; raises AssertionError if an answer or a count is off."""
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600)
    children = start_clients(pool.address, index_groups(n, -(-n // processes)), capture=False)
    try:
        pool.wait_for_clients(300)
        run = RunInfo(f"scale-{n}", PaperRegressionSpec(num_clients=n, dim=dim, s=1.0), 0, 0.0)
        pool.start_run(run)
        local = LocalPool()
        local.start_run(run)
        z = np.linspace(-1.0, 1.0, run.dimension)
        for _ in range(3):  # warm-up
            pool.gradients(z)
        before = pool.traffic["algorithm"].rounds
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            answers = pool.gradients(z)
            times.append(time.perf_counter() - start)
        assert np.array_equal(answers.mean(), local.gradients(z).mean()), "the gRPC mean differs from in-process"
        counts = pool.traffic["algorithm"]
        total = counts.rounds
        assert total == before + rounds
        assert counts.messages_down == counts.messages_up == total * n
        assert set(counts.per_client_floats_down) == set(counts.per_client_floats_up) == {total * run.dimension}
    finally:
        pool.close()
        reap(children)
    q1, median, q3 = statistics.quantiles(times, n=4)
    return median, q1, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50, help="timed rounds per n (median over them)")
    parser.add_argument("--dim", type=int, default=10, help="d: x and y each in R^d")
    parser.add_argument("--max-clients", type=int, default=100_000, help="skip larger federations")
    parser.add_argument("--min-clients", type=int, default=0, help="skip smaller federations")
    parser.add_argument("--plot", type=Path, help="draw round latency against n into this file")
    args = parser.parse_args()
    rows = []
    print(f"one gradient round at d = {args.dim}, clients grouped into processes on 127.0.0.1; ms")
    print(f"{'clients':>8} {'processes':>10} {'median':>9} {'q1':>9} {'q3':>9} {'per client (us)':>16}  checks")
    for n, processes in SETUPS:
        if not args.min_clients <= n <= args.max_clients:
            continue
        median, q1, q3 = measure(n, processes, args.dim, args.rounds)
        rows.append((n, processes, median, q1, q3))
        print(
            f"{n:>8} {processes:>10} {1e3 * median:>9.2f} {1e3 * q1:>9.2f} {1e3 * q3:>9.2f} {1e6 * median / n:>16.1f}"
            "  mean bit-identical, counts exact",
            flush=True,
        )
    base = rows[0][2]
    for n, processes, median, _, _ in rows[1:]:
        print(f"{n} clients in {processes} processes: {median / base:.2f}x the {rows[0][0]}-client round")
    if args.plot:
        _plot(rows, args.dim, args.plot)
        print(f"plot: {args.plot}")


def _plot(rows: list[tuple[int, int, float, float, float]], dim: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ns = [row[0] for row in rows]
    medians = [1e3 * row[2] for row in rows]
    spread = [[1e3 * (row[2] - row[3]) for row in rows], [1e3 * (row[4] - row[2]) for row in rows]]
    ax.errorbar(ns, medians, yerr=spread, fmt="o-", capsize=3, label="fedsaddle, gradient round (median, IQR)")
    for n, processes, median, _, _ in rows:
        ax.annotate(f"{processes} proc.", (n, 1e3 * median), textcoords="offset points", xytext=(-14, 8), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="both", labelsize=8)
    ax.set_xlim(min(ns) / 2, max(ns) * 2)
    ax.set_xlabel("clients $n$")
    ax.set_ylabel("round latency (ms)")
    ax.set_title(f"Round latency against $n$ ($d = {dim}$, 2-core machine, loopback)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
