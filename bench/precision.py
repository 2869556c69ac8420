"""Bytes and time per round, float64 against float32, in one federation.

One coordinator and --clients client processes on 127.0.0.1; the paper's problem at
D = --entries (z = (x, y), dim = D / 2), SCAFFOLD-S for --rounds rounds a run (every
round carries z~, the control and an answer of D entries). The two precisions
alternate, --repeats runs each, on the same processes; prints each precision's
median bytes per round each way (on the wire: the serialized messages), its median
wall time per round, and the ratios float32 / float64 of the two medians.

    python bench/precision.py                      # D = 1e5, 10 clients, 21 rounds, 5 runs each
    python bench/precision.py --entries 1e6 --clients 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from fedsaddle.launch import reap, start_clients
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport.grpc_pool import GrpcPool

PRECISIONS = ("float64", "float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=float, default=1e5, help="D, the length of z (default 1e5)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dim = int(args.entries) // 2
    configs = {
        precision: parse_config(
            {
                "problem": {"name": "paper_regression", "num_clients": args.clients, "dim": dim, "s": 5.0},
                "algorithms": [{"name": "scaffold_s", "gamma_local": 0.02}],
                "rounds": args.rounds,
                "precision": precision,
            }
        )
        for precision in PRECISIONS
    }
    seen: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PRECISIONS}
    counts: dict[str, dict[str, int]] = {}
    with GrpcPool(args.clients, "127.0.0.1:0") as pool:
        processes = start_clients(pool.address, [str(i) for i in range(args.clients)])
        try:
            pool.wait_for_clients(120)
            for _ in range(args.repeats):
                for precision in PRECISIONS:  # alternating: load drifts alike for both
                    config = configs[precision]
                    started = time.perf_counter()
                    result = run_algorithm(config.algorithms[0], config, pool)
                    wall = time.perf_counter() - started
                    traffic = result.traffic["algorithm"]
                    rounds = traffic["rounds"]
                    counts[precision] = {k: traffic[k] for k in ("rounds", "messages_up", "floats_down", "floats_up")}
                    seen[precision].append(
                        (traffic["bytes_down"] / rounds, traffic["bytes_up"] / rounds, wall / rounds)
                    )
        finally:
            pool.close()
            reap(processes, 10)
    assert counts["float64"] == counts["float32"], counts  # the same exchanges and entries
    print(
        f"D = {2 * dim}, {args.clients} clients, SCAFFOLD-S, {counts['float64']['rounds']} rounds a run, "
        f"{args.repeats} runs each, alternating; counts identical: {counts['float64']}"
    )
    print(f"{'precision':<10} {'bytes down/round':>17} {'bytes up/round':>15} {'ms/round':>9}")
    medians = {}
    for precision in PRECISIONS:
        down, up, wall = (statistics.median(v[k] for v in seen[precision]) for k in range(3))
        medians[precision] = (down, up, wall)
        print(f"{precision:<10} {down:>17,.0f} {up:>15,.0f} {1000 * wall:>9.2f}")
    narrow, wide = medians["float32"], medians["float64"]
    print(
        f"float32 / float64: bytes down {narrow[0] / wide[0]:.4f}, bytes up {narrow[1] / wide[1]:.4f}, "
        f"time per round {narrow[2] / wide[2]:.3f}"
    )


if __name__ == "__main__":
    main()
