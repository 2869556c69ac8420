"""Memory of a federation: `fedsaddle local` at d = 1e6 with SCAFFOLD-S, every process sampled.

Starts `fedsaddle local` (a coordinator and one process per client, forked from it)
and samples every process of the tree every 50 ms until it ends. Prints each
process's peak resident set (VmHWM), the peak of their sum (RSS counts pages the
forked processes share once per process), and the peak of their proportional
sum (PSS: shared pages split between the processes that share them; the
federation's real footprint).

    python bench/memory.py                 # d = 1e6, 10 clients, 10 rounds
    python bench/memory.py --dim 100000
    python bench/memory.py --chunk-bytes 4194304   # memory against chunk size (bench/README.md)
    python bench/memory.py --receive-window-mib 1  # a fixed receive window at the coordinator (bench/README.md)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from procfs import field_mib  # bench/procfs.py

from fedsaddle.common import wire


def _children(pid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=float, default=1e6, help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=10, help="clients, one process each")
    parser.add_argument("--per-process", type=int, default=1, help="clients hosted by each client process")
    parser.add_argument("--reorder-mib", type=float, default=None, help="transport.limits.reorder_mib")
    parser.add_argument("--rounds", type=int, default=10, help="communication rounds")
    parser.add_argument("--chunk-bytes", type=int, default=wire.DEFAULT_CHUNK_BYTES, help="transport.chunk_bytes")
    parser.add_argument(
        "--receive-window-mib", type=float, default=0.0, help="transport.limits.receive_window_mib (0: gRPC's own)"
    )
    args = parser.parse_args()
    config = {
        "name": "memory",
        "problem": {"name": "paper_regression", "num_clients": args.clients, "dim": int(args.dim), "s": 1.0},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
        "sync": {"kind": "fixed", "tau": 5},
        "rounds": args.rounds,
        "output": {"plot": False},
        "transport": {"chunk_bytes": args.chunk_bytes, "limits": {"receive_window_mib": args.receive_window_mib}},
    }
    if args.reorder_mib is not None:
        config["transport"]["limits"]["reorder_mib"] = args.reorder_mib  # type: ignore[index]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", tmp, "--quiet-clients"]
        command += ["--clients-per-process", str(args.per_process)]
        local = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peaks: dict[int, int] = {}
        roles: dict[int, str] = {local.pid: "coordinator"}
        peak_rss = peak_pss = 0
        while local.poll() is None:
            tree = [local.pid, *_children(local.pid)]
            rss = pss = 0
            for pid in tree:
                roles.setdefault(pid, "client")
                hwm = field_mib(f"/proc/{pid}/status", "VmHWM")
                if hwm is not None:
                    peaks[pid] = hwm
                    rss += field_mib(f"/proc/{pid}/status", "VmRSS") or 0
                    pss += field_mib(f"/proc/{pid}/smaps_rollup", "Pss") or 0
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.05)
        err = local.stderr.read() if local.stderr else ""
    if local.returncode != 0:
        sys.exit(f"fedsaddle local failed ({local.returncode}):\n{err[-2000:]}")
    clients = sorted((peaks[p] for p in peaks if roles[p] == "client"), reverse=True)
    print(
        f"memory, fedsaddle local, SCAFFOLD-S, d = {args.dim:g}, {args.clients} client processes, "
        f"{args.chunk_bytes} B chunks, receive window {args.receive_window_mib:g} MiB (0: gRPC's own), MiB"
    )
    print(f"  coordinator peak RSS        {peaks.get(local.pid, 0):>6}")
    print(f"  client peak RSS             {' '.join(str(c) for c in clients)}")
    print(f"  total RSS, peak of the sum  {peak_rss:>6}   (shared pages counted in every process)")
    print(f"  total PSS, peak of the sum  {peak_pss:>6}   (shared pages split: the real footprint)")


if __name__ == "__main__":
    main()
