"""What the monitor costs a round: the d = 10 gradient round of round_latency.py, run with and without it.

Minibatch MD on paper_regression (d = 10, x and y each in R^10), 10 client processes on
127.0.0.1, each block a real run (`run_config`, as the coordinator runs it) of `--rounds`
rounds. Blocks alternate: without the monitor, then with it on (the pool's round
observer, the step hook, /metrics scraped every `--scrape-s`, and one dashboard viewer
reading /events all along), and so on. A round's time is the difference of consecutive
records' time_s (Minibatch MD: one round per step); the figure is the median over all of a
side's rounds, and the ratio of the two medians, measured in this one run.

    python bench/monitor_cost.py                       # 10 blocks a side of 500 rounds
    python bench/monitor_cost.py --blocks 4 --rounds 300
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from fedsaddle.launch import reap, start_clients
from fedsaddle.server.config import MonitorSpec, parse_config
from fedsaddle.server.monitor import Monitor
from fedsaddle.server.runs import run_config
from fedsaddle.server.transport.grpc_pool import GrpcPool


def round_times(outcome: Any) -> list[float]:
    times = [record["time_s"] for record in outcome.results[0].records][1:]  # (from the first step: init left out)
    return [later - earlier for earlier, later in itertools.pairwise(times)]


class Viewer:
    """One dashboard: reads /events as a browser would, until stopped; and a scraper of /metrics."""

    def __init__(self, url: str, scrape_s: float) -> None:
        self.url, self.scrape_s = url, scrape_s
        self.events = self.scrapes = 0
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._view, daemon=True),
            threading.Thread(target=self._scrape, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _view(self) -> None:
        with urllib.request.urlopen(self.url + "events", timeout=30) as stream:
            while not self.stopping.is_set():
                line = stream.readline()
                if not line:
                    return
                self.events += line.startswith(b"data: ")

    def _scrape(self) -> None:
        while not self.stopping.wait(self.scrape_s):
            with urllib.request.urlopen(self.url + "metrics", timeout=30) as reply:
                reply.read()
            self.scrapes += 1

    def stop(self) -> None:
        self.stopping.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10, help="clients, one process each")
    parser.add_argument("--rounds", type=int, default=500, help="rounds per block")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per side, alternating")
    parser.add_argument("--scrape-s", type=float, default=1.0, help="/metrics is scraped this often while on")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="monitor-cost-"))
    config = parse_config(
        {
            "name": "monitor-cost",
            "problem": {"name": "paper_regression", "num_clients": args.clients, "dim": 10, "s": 1.0},
            "rounds": args.rounds,
            "algorithms": [{"name": "minibatch_md", "gamma": 0.01}],
            "output": {"dir": str(out), "plot": False, "accuracies": []},
        }
    )
    pool = GrpcPool(args.clients, "127.0.0.1:0", round_timeout_s=600)
    processes = start_clients(pool.address, [str(i) for i in range(args.clients)], capture=False)
    sides: dict[str, list[float]] = {"off": [], "on": []}
    viewed = [0, 0]
    try:
        pool.wait_for_clients(120)
        run_config(config, pool, {"kind": "grpc"})  # warm-up
        for _ in range(args.blocks):
            sides["off"] += round_times(run_config(config, pool, {"kind": "grpc"}))
            monitor = Monitor(config, MonitorSpec(listen="127.0.0.1:0"))
            monitor.attach(pool)
            viewer = Viewer(monitor.url, args.scrape_s)
            time.sleep(0.2)  # (the viewer is connected)
            try:
                outcome = run_config(config, pool, {"kind": "grpc"}, on_step=monitor.on_step)
                monitor.finish(outcome)
                sides["on"] += round_times(outcome)
            finally:
                viewer.stop()
                viewed[0] += viewer.events
                viewed[1] += viewer.scrapes
                monitor.close()
    finally:
        pool.close()
        reap(processes)
    off, on = statistics.median(sides["off"]), statistics.median(sides["on"])
    print(
        f"{args.clients} client processes on 127.0.0.1, d = 10, {args.blocks} alternating blocks of {args.rounds} "
        f"rounds a side; ms per round, median [q1, q3]"
    )
    for side, times in sides.items():
        q1, median, q3 = statistics.quantiles(times, n=4)
        print(f"  monitor {side:>3}: {1e3 * median:.3f} [{1e3 * q1:.3f}, {1e3 * q3:.3f}] over {len(times)} rounds")
    print(f"  on / off: {on / off:.3f} (the viewer read {viewed[0]} events, /metrics was scraped {viewed[1]} times)")


if __name__ == "__main__":
    main()
