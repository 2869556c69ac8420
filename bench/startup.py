"""Start-up: how soon `fedsaddle local` (10 client processes) has done its first round, and `--help`.

Each figure is the median over `--repeat` runs of the real command in a fresh
process. The first-round time is what the command itself prints ("first round
done X s after the command started", measured from the kernel's start time of
its process).

    python bench/startup.py
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median over them)")
    parser.add_argument("--clients", type=int, default=10, help="client processes")
    args = parser.parse_args()
    fedsaddle = [sys.executable, "-m", "fedsaddle"]
    help_times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        subprocess.run([*fedsaddle, "--help"], check=True, capture_output=True)
        help_times.append(time.perf_counter() - start)
    config = {
        "name": "startup",
        "problem": {"name": "paper_regression", "num_clients": args.clients, "dim": 10, "s": 1.0},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "rounds": 10,
        "output": {"plot": False},
    }
    first, whole = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "startup.yaml"
        path.write_text(yaml.safe_dump(config))
        for _ in range(args.repeat):
            start = time.perf_counter()
            done = subprocess.run(
                [*fedsaddle, "local", "--config", str(path), "--out", tmp, "--quiet-clients"],
                capture_output=True,
                text=True,
            )
            whole.append(time.perf_counter() - start)
            found = re.search(r"first round done (\d+\.\d+) s after the command started", done.stderr)
            if done.returncode != 0 or found is None:
                sys.exit(f"fedsaddle local failed ({done.returncode}):\n{done.stderr[-2000:]}")
            first.append(float(found.group(1)))
    print(f"start-up, medians over {args.repeat} runs; s")
    print(f"  fedsaddle --help                                     {statistics.median(help_times):.3f}")
    print(f"  fedsaddle local, {args.clients} clients: first round done          {statistics.median(first):.3f}")
    print(f"  fedsaddle local, {args.clients} clients, 10 rounds, whole command  {statistics.median(whole):.3f}")


if __name__ == "__main__":
    main()
