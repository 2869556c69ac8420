"""Time a large `fedsaddle experiment compare` on one Ray node against two, and on local processes.

The Ray nodes are network namespaces on this machine (a head at 10.77.0.1, a worker at 10.77.0.2,
built as tests/test_ray_cluster.py builds them), each given --cpus CPUs: on a 2-core machine the
"two nodes" share the same two cores, so the figures show what Ray's placement costs and how the
work spreads, not what a second machine would add. Every timing is the whole command (Ray's driver
joining the cluster included, the cluster's start not), and each checks that runs.csv has the same
bytes as the local run's. Needs root, iproute2 and the ray extra.

    sudo .venv/bin/python bench/compare_ray.py [--seeds 5] [--rounds 500] [--cpus 1]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the namespaces and Ray nodes

from test_ray_cluster import HEAD, PORT, ray_cluster

from fedsaddle.launch import CLIENT_ENV

ALGORITHMS = ["minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s"]


def timed(command: list[str], env: dict[str, str], out: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([*command, "--out", str(out)], env=env, capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--s", type=float, nargs="+", default=[float(s) for s in range(0, 16, 3)])
    parser.add_argument("--cpus", type=int, default=1, help="CPUs each Ray node offers")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces)")
    # A SIGTERM (a timeout, an impatient operator) unwinds like Ctrl-C: the Ray nodes and namespaces go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    grid = ["--algorithms", *ALGORITHMS, "--problems", "paper", "linear_regression"]
    grid += ["--s", *(f"{s:g}" for s in args.s), "--seeds", str(args.seeds), "--rounds", str(args.rounds)]
    compare = [sys.executable, "-m", "fedsaddle", "experiment", "compare", *grid]
    with tempfile.TemporaryDirectory(prefix="fedsaddle-bench-") as scratch:
        folder = Path(scratch)
        local = timed(compare, CLIENT_ENV, folder / "local")
        expected = (folder / "local" / "runs.csv").read_bytes()
        runs = len(expected.splitlines()) - 1
        figures = {}
        for nodes in (1, 2):
            with ray_cluster(nodes, args.cpus) as cluster:
                out = folder / f"ray{nodes}"
                command = [*cluster.net.run_in("head"), *compare, "--ray", f"{HEAD}:{PORT}"]
                figures[nodes] = timed(command, cluster.env, out)
                if (out / "runs.csv").read_bytes() != expected:
                    raise SystemExit(f"runs.csv on {nodes} Ray node(s) differs from the local run's")
    cores = os.cpu_count() or 1
    print(f"compare: {runs} runs ({' '.join(grid)}), runs.csv identical in all three")
    print(f"  local processes ({cores}, one per core): {local:7.1f} s")
    for nodes, seconds in figures.items():
        print(f"  Ray, {nodes} node(s) x {args.cpus} CPU:        {seconds:7.1f} s")
    print(f"  ({cores} cores on this machine: the Ray nodes are namespaces sharing them)")


if __name__ == "__main__":
    main()
