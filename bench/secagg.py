"""Secure aggregation's cost: secure against plain gradient rounds in the same run, setup, growth with n.

1. Round latency over gRPC, one client process per client (10 by default): the
   same pool and processes alternate blocks of plain rounds and of secure rounds
   (each block announces its run again, so both see the same machine), median
   [q1, q3] per round and the ratio secure/plain. Each block's first round is not
   counted: from its second round on, a secure run is in its steady state (each
   round's masks made ahead, during the round before it).
2. Setup: the start of a run and its first round (under secure aggregation: the key
   agreement, keys up, the directory down, each client deriving n - 1 pairwise keys),
   plain and secure, over gRPC for n = 10 (10 processes) and n = 100 (10 processes
   of 10 clients each).
   Secure rounds are timed with all pairs and with SecAgg+ neighbour graphs (--graphs).
3. Growth with n, in-process (the cryptographic work alone, no transport): a secure
   gradient round at d = 10 for several n against a plain one, and the key agreement,
   with all pairs and with the default neighbour graph of each n (privacy.neighbours).
   (Part 1 prints the bytes of the unmask sub-exchange per round over gRPC.)

    python bench/secagg.py                       # all three
    python bench/secagg.py --dims 10 --rounds 200 --skip-setup --skip-growth
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np
from procfs import cpu_seconds
from round_latency import time_rounds  # bench/round_latency.py: the same timing, one round at a time

from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.common.secagg import SecAggSettings
from fedsaddle.common.secagg.graph import default_neighbours
from fedsaddle.common.secagg.settings import default_bound
from fedsaddle.launch import index_groups, reap, start_clients
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool


def run_info(name: str, n: int, d: int, secure: bool, neighbours: int = 0) -> RunInfo:
    """A run of the paper's problem; secure: all pairs (neighbours = 0) or SecAgg+ with k neighbours."""
    settings = SecAggSettings(0, 40, default_bound(n), neighbours) if secure else None
    return RunInfo(name, PaperRegressionSpec(num_clients=n, dim=d, s=1.0), 0, 0.0, secure=settings)


def graph_name(k: int) -> str:
    return "all pairs" if k == 0 else f"k = {k}"


def quartiles(times: list[float]) -> str:
    if len(times) < 2:
        return f"{1e3 * times[0]:.2f}"
    q1, median, q3 = statistics.quantiles(times, n=4)
    return f"{1e3 * median:.2f} [{1e3 * q1:.2f}, {1e3 * q3:.2f}]"


def latency(n: int, dims: list[int], rounds: int, blocks: int, graphs: list[int]) -> None:
    """Plain rounds, and secure rounds under each graph (0: all pairs, k: SecAgg+), alternating in blocks."""
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600)
    processes = start_clients(pool.address, [str(i) for i in range(n)], capture=False)
    kinds: list[int | None] = [None, *graphs]  # None: plain
    rows = []
    try:
        pool.wait_for_clients(120)
        for d in dims:
            times: dict[int | None, list[float]] = {kind: [] for kind in kinds}
            cpu: dict[int | None, float] = {kind: 0.0 for kind in kinds}  # CPU s of every process, timed rounds
            extra: dict[int, float] = {}
            z = np.ones(2 * d)
            per_block = max(1, rounds // blocks)
            for block in range(blocks + 1):  # block 0 warms every kind up and is not timed
                for kind in kinds:
                    pool.start_run(run_info(f"bench-{d}-{kind}-{block}", n, d, kind is not None, kind or 0))
                    # A round first, not counted: a run's first secure round makes its masks in the task, and every
                    # round's unmasking has the clients make the next round's masks ahead (privacy.md, "Cost"), so a
                    # block of rounds would otherwise count one set of masks more than it has rounds (the last,
                    # made for a round that does not come). Counted from the second round on, the block's CPU
                    # holds one set per round, as a long run's rounds do (the masks still being made when the
                    # clock is read are as many at the start of the count as at its end).
                    time_rounds(pool, z, 1)
                    before = all_cpu(processes)
                    timed = time_rounds(pool, z, per_block if block else 2)
                    if block:
                        times[kind] += timed
                        cpu[kind] += all_cpu(processes) - before
                    if kind is not None:
                        extra[kind] = pool.traffic["privacy"].bytes_up / pool.traffic["algorithm"].rounds
            rows.append((d, times, {k: c / max(1, len(times[k])) for k, c in cpu.items()}, extra))
    finally:
        pool.close()
        reap(processes)
    print(f"1. gradient rounds over gRPC, {n} client processes on 127.0.0.1; ms per round, median [q1, q3]")
    print("   (CPU: user + system time of the coordinator and every client process per round, mean; it is what")
    print("   the round costs the machine, and depends less than the latency on what else runs on it)")
    header = (
        f"{'d':>9} {'aggregation':>12} {'ms per round':>26} {'ratio':>6} {'CPU ms/round':>13} {'ratio':>6} "
        f"{'privacy bytes up/round':>23}"
    )
    print(header)
    print("-" * len(header))
    for d, times, cpu, extra in rows:
        plain, plain_cpu = statistics.median(times[None]), cpu[None]
        print(
            f"{d:>9} {'plain':>12} {quartiles(times[None]):>26} {1.0:>6.2f} {1e3 * plain_cpu:>13.1f} {1.0:>6.2f} "
            f"{'':>23}"
        )
        for kind in graphs:
            ratio = statistics.median(times[kind]) / plain
            print(
                f"{d:>9} {graph_name(kind):>12} {quartiles(times[kind]):>26} {ratio:>6.2f} {1e3 * cpu[kind]:>13.1f} "
                f"{cpu[kind] / plain_cpu:>6.2f} {extra[kind]:>23.0f}"
            )
    print(flush=True)


def all_cpu(processes: list[subprocess.Popen[bytes]]) -> float:
    """CPU seconds used so far by this process (the coordinator) and the client processes."""
    return cpu_seconds() + sum(cpu_seconds(process.pid) for process in processes)


def setup(sizes: list[int], d: int, repeats: int) -> None:
    print(f"\n2. run start and its first round over gRPC, d = {d}; ms, median of {repeats}")
    print("   (secure - plain: the key agreement, the clients' key derivations included, and one round's masking)")
    header = f"{'n':>5} {'processes':>9} {'plain':>9} {'secure':>9} {'secure - plain':>15}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        groups = index_groups(n, max(1, n // 10))
        pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600)
        processes = start_clients(pool.address, groups, capture=False)
        try:
            pool.wait_for_clients(300)
            spent: dict[bool, list[float]] = {False: [], True: []}
            for k in range(repeats + 1):
                for secure in (False, True):
                    start = time.perf_counter()
                    pool.start_run(run_info(f"setup-{n}-{k}-{secure}", n, d, secure))
                    pool.gradients(np.ones(2 * d))  # the clients derive their pairwise keys before they answer
                    if k:  # the first announces the data for the first time: not timed
                        spent[secure].append(time.perf_counter() - start)
        finally:
            pool.close()
            reap(processes)
        plain, secure = statistics.median(spent[False]), statistics.median(spent[True])
        print(f"{n:>5} {len(groups):>9} {1e3 * plain:>9.1f} {1e3 * secure:>9.1f} {1e3 * (secure - plain):>15.1f}")


class TimedLocalPool(LocalPool):
    """The in-process pool, timing its key agreement (every client's keys, the directory, the derivations)."""

    agreement = 0.0

    def _agree_keys(self, run: RunInfo, settings: SecAggSettings) -> None:
        start = time.perf_counter()
        super()._agree_keys(run, settings)
        self.agreement = time.perf_counter() - start


def growth(sizes: list[int], d: int, rounds: int) -> None:
    print(f"\n3. growth with n, in-process (the cryptography alone), d = {d}; ms per gradient round, median")
    print("   (secure - plain, per round and per client; key agreement: every client's keys and derivations)")
    header = f"{'n':>5} {'graph':>10} {'plain':>9} {'secure':>9} {'secure - plain':>15} {'per client':>11} {'keys':>9}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        for k in sorted({0, default_neighbours(n)}):
            spent = {}
            agreement = 0.0
            for secure in (False, True):
                pool = TimedLocalPool()
                pool.start_run(run_info(f"growth-{n}-{k}-{secure}", n, d, secure, k))
                agreement = max(agreement, pool.agreement)
                z = np.ones(2 * d)
                time_rounds(pool, z, 2)
                spent[secure] = statistics.median(time_rounds(pool, z, rounds))
            plain, secure_round = spent[False], spent[True]
            extra = secure_round - plain
            print(
                f"{n:>5} {graph_name(k):>10} {1e3 * plain:>9.2f} {1e3 * secure_round:>9.2f} {1e3 * extra:>15.2f} "
                f"{1e3 * extra / n:>11.3f} {1e3 * agreement:>9.1f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=float, nargs="+", default=[10, 1e6], help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=10, help="clients in part 1, one process each")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds per dimension and kind (part 1)")
    parser.add_argument("--large-rounds", type=int, default=10, help="timed rounds at d >= 1e5 (part 1)")
    parser.add_argument("--blocks", type=int, default=5, help="plain and secure alternate in this many blocks")
    parser.add_argument("--setup-sizes", type=int, nargs="+", default=[10, 100], help="n in part 2")
    parser.add_argument("--growth-sizes", type=int, nargs="+", default=[10, 30, 100], help="n in part 3")
    parser.add_argument(
        "--graphs",
        type=int,
        nargs="+",
        default=[0, 4],
        help="part 1's secure rounds: 0 all pairs, k SecAgg+ with k neighbours (even)",
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-setup", action="store_true")
    parser.add_argument("--skip-growth", action="store_true")
    args = parser.parse_args()
    dims = [int(v) for v in args.dims]
    if not args.skip_latency:
        for d in dims:
            latency(args.clients, [d], args.large_rounds if d >= 100_000 else args.rounds, args.blocks, args.graphs)
    if not args.skip_setup:
        setup(args.setup_sizes, 10, 3)
    if not args.skip_growth:
        growth(args.growth_sizes, 10, 10)


if __name__ == "__main__":
    main()
