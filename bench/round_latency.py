"""Round latency: one gradient round (Minibatch MD's exchange) over gRPC, against the bare-gRPC floor.

In one run: the anchor (bench/anchor.py: raw bytes through grpc.aio bidi
streams, nothing computed), fedsaddle's gradient round with a client process
per client, and the same round in-process. fedsaddle's transport cost is its
gRPC round minus the in-process round (the gradient work); the ratio to the
anchor is what fedsaddle adds to moving the same bytes. The anchor's server runs in
this process, so it shares the coordinator's malloc settings (and GLIBC_TUNABLES,
if set).

    python bench/round_latency.py                      # d = 10 (3000 rounds) and d = 1e6 (100), 10 processes
    python bench/round_latency.py --dims 10 --rounds 500
    python bench/round_latency.py --dims 1e6 --rounds 20 --chunk-bytes 4194304
    python bench/round_latency.py --dims 1e6 --rounds 20 --receive-window-mib 1
    python bench/round_latency.py --dims 1e6 --rounds 20 --client-window-mib 0   # the clients' window: gRPC's own
    python bench/round_latency.py --dims 10 --anchor-loop uvloop   # the anchor on uvloop too
    FEDSADDLE_EVENT_LOOP=asyncio python bench/round_latency.py --dims 10   # fedsaddle on asyncio's own loop

fedsaddle's processes run on uvloop where it is installed (common/eventloop.py);
the anchor's on asyncio's own loop unless --anchor-loop says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchor import LOOPS, Floor
from procfs import thread_cpu_seconds

from fedsaddle.common import eventloop, wire
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.launch import reap, start_clients
from fedsaddle.server.pool import ClientPool, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.sessions import Limits


def default_rounds(d: int) -> int:
    """Timed rounds per side when --rounds is not given: at small d a round is a few milliseconds, and
    100 of them in blocks of 20 moved the ratio by 0.2 from run to run (bench/README.md)."""
    return 3000 if d <= 10_000 else 100


def time_rounds(pool: ClientPool, z: Array, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pool.gradients(z)
        times.append(time.perf_counter() - start)
    return times


def quartiles(times: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(times, n=4)
    return f"{1e3 * median:.3f} [{1e3 * q1:.3f}, {1e3 * q3:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=float, nargs="+", default=[10, 1e6], help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=10, help="clients, one process each")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per dimension, median over them (default: 3000 up to d = 1e4, where a round takes "
        "milliseconds and a short run reads mostly noise; 100 above)",
    )
    parser.add_argument(
        "--blocks", type=int, default=5, help="the rounds alternate between the three in this many blocks"
    )
    parser.add_argument("--chunk-bytes", type=int, default=wire.DEFAULT_CHUNK_BYTES, help="transport.chunk_bytes")
    parser.add_argument(
        "--receive-window-mib",
        type=float,
        default=Limits().receive_window_mib,
        help="transport.limits.receive_window_mib (0: gRPC's own)",
    )
    parser.add_argument(
        "--client-window-mib",
        type=float,
        default=None,
        help="the clients' own receive window (fedsaddle client --receive-window-mib; 0: gRPC's own)",
    )
    parser.add_argument("--anchor-loop", choices=LOOPS, default="asyncio", help="the anchor's event loops")
    args = parser.parse_args()
    try:  # before any process starts
        wire.check_chunk_bytes(args.chunk_bytes)
    except ValueError as exc:
        parser.error(f"--chunk-bytes: {exc}")
    n, dims = args.clients, [int(v) for v in args.dims]
    floor = Floor(n, args.anchor_loop)
    window = Limits(receive_window_mib=args.receive_window_mib)
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600, chunk_bytes=args.chunk_bytes, limits=window)
    client_window = [] if args.client_window_mib is None else ["--receive-window-mib", str(args.client_window_mib)]
    processes = start_clients(pool.address, [str(i) for i in range(n)], capture=False, extra=client_window)
    local = LocalPool()
    rows = []
    cpu_rows: list[tuple[int, dict[str, list[float]]]] = []
    try:
        pool.wait_for_clients(120)
        for d in dims:
            run = RunInfo(f"bench-{d}", PaperRegressionSpec(num_clients=n, dim=d, s=1.0), 0, 0.0)
            pool.start_run(run)
            local.start_run(run)
            z = np.ones(run.dimension)
            size = 8 * run.dimension
            for _ in range(3):  # warm-up
                floor.rounds(size, 1), pool.gradients(z), local.gradients(z)
            start_round, moved_before = pool.round_id, _moved(pool)
            remote: list[float] = []
            in_process: list[float] = []
            bare: list[float] = []
            per_block = max(1, (args.rounds or default_rounds(d)) // args.blocks)
            # seconds: server, clients; then the same for the main threads alone
            cpu = {"fedsaddle": [0.0, 0.0, 0.0, 0.0], "bare": [0.0, 0.0, 0.0, 0.0]}
            for _ in range(args.blocks):  # alternate, so that the three see the same machine
                with CpuTime(cpu["bare"], [p.pid for p in floor.processes]):
                    bare += floor.rounds(size, per_block)
                with CpuTime(cpu["fedsaddle"], [p.pid for p in processes]):
                    remote += time_rounds(pool, z, per_block)
                in_process += time_rounds(local, z, per_block)
            moved = (_moved(pool) - moved_before) / (pool.round_id - start_round)
            rows.append((d, remote, in_process, bare, moved))
            cpu_rows.append((d, {k: [v / len(bare) for v in pair] for k, pair in cpu.items()}))
    finally:
        pool.close()
        reap(processes)
        floor.close()
    counts = ", ".join(f"{len(remote)} at d = {d:g}" for d, remote, *_ in rows)
    print(f"{n} client processes on 127.0.0.1, rounds timed on each side: {counts}; ms, median [q1, q3]")
    print(f"event loops: fedsaddle {eventloop.chosen()}, bare gRPC {floor.kind}")
    header = (
        f"{'d':>9} {'fedsaddle gRPC':>26} {'in-process':>24} {'transport':>10} {'bare gRPC':>24} "
        f"{'ratio':>6} {'MB/round':>9}"
    )
    print(header)
    print("-" * len(header))
    for d, remote, in_process, bare, moved in rows:
        transport = statistics.median(remote) - statistics.median(in_process)
        ratio = transport / statistics.median(bare)
        print(
            f"{d:>9} {quartiles(remote):>26} {quartiles(in_process):>24} {1e3 * transport:>10.3f} "
            f"{quartiles(bare):>24} {ratio:>6.2f} {moved / 1e6:>9.2f}",
            flush=True,
        )
    # On a machine with fewer cores than processes, a round's wall time follows the CPU all
    # processes spend on it: this says on which side fedsaddle's overhead lies.
    # The main threads run the Python (and the calls into gRPC made from it); the other threads are gRPC's own.
    print("\nCPU per round, ms (all threads, and in brackets the main threads alone; the clients summed over their")
    print("processes)")
    print(f"{'d':>9} {'coordinator':>18} {'clients':>18} {'bare server':>18} {'bare clients':>18}")
    for d, cpu in cpu_rows:
        cells = [
            f"{1e3 * cpu[side][i]:.3f} [{1e3 * cpu[side][i + 2]:.3f}]" for side in ("fedsaddle", "bare") for i in (0, 1)
        ]
        print(f"{d:>9} " + " ".join(f"{cell:>18}" for cell in cells))


class CpuTime:
    """Adds the CPU seconds this process (the server side) and the client processes use within the
    block to `into` = [server, clients, server's main thread, clients' main threads]."""

    def __init__(self, into: list[float], clients: list[int]) -> None:
        self.into, self.clients = into, clients

    def _now(self) -> list[float]:
        server_main, server = thread_cpu_seconds()
        clients = [thread_cpu_seconds(pid) for pid in self.clients]
        return [server, sum(t for _, t in clients), server_main, sum(m for m, _ in clients)]

    def __enter__(self) -> None:
        self.before = self._now()

    def __exit__(self, *exc: object) -> None:
        for i, (after, before) in enumerate(zip(self._now(), self.before, strict=True)):
            self.into[i] += after - before


def _moved(pool: GrpcPool) -> int:
    traffic = pool.traffic["algorithm"]
    return traffic.bytes_down + traffic.bytes_up


if __name__ == "__main__":
    main()
