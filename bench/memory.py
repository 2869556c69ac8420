"""Memory of a federation: `fedsaddle local` at d = 1e6 with SCAFFOLD-S, every process sampled.

Starts `fedsaddle local` (a coordinator and client processes, forked from it) and
samples every process of the tree every 50 ms until it ends. For each federation it
prints the coordinator's peak resident set (VmHWM), the client processes' peaks,
the peak of their summed RSS (RSS counts pages the forked processes share once per
process) and of their proportional sum (PSS: shared pages split between the
processes that share them; the federation's real footprint).

    python bench/memory.py                        # the table: 5, 10, 20 clients (1 per process), 50 (5 per process)
    python bench/memory.py --clients 10           # one federation
    python bench/memory.py --hosted 1,5,10        # client processes hosting k clients each (10 clients in all)
    python bench/memory.py --plot docs/figures/memory.png
    python bench/memory.py --clients 10 --receive-window-mib 0   # gRPC's own receive window (bench/README.md)
    python bench/memory.py --secure               # the same table with secure aggregation (docs/privacy.md)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import yaml
from procfs import field_mib  # bench/procfs.py

from fedsaddle.common import wire

TABLE = ((5, 1), (10, 1), (20, 1), (50, 5))  # (clients, clients per process)


class Measured(NamedTuple):
    clients: int
    per_process: int
    coordinator: int  # peak RSS, MiB
    client_peaks: list[int]  # each client process's peak RSS, largest first
    total_rss: int  # peak of the summed RSS
    total_pss: int  # peak of the summed PSS


def _children(pid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def measure(args: argparse.Namespace, clients: int, per_process: int) -> Measured:
    """Run one federation of `clients` clients, `per_process` to a process, and sample it until it ends."""
    limits: dict[str, float] = {"receive_window_mib": args.receive_window_mib}
    if args.reorder_mib is not None:
        limits["reorder_mib"] = args.reorder_mib
    config = {
        "name": "memory",
        "problem": {"name": "paper_regression", "num_clients": clients, "dim": int(args.dim), "s": 1.0},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
        "sync": {"kind": "fixed", "tau": 5},
        "rounds": args.rounds,
        "output": {"plot": False},
        "transport": {"chunk_bytes": args.chunk_bytes, "limits": limits},
    }
    if args.secure:
        config["privacy"] = {"secure_aggregation": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", tmp, "--quiet-clients"]
        command += ["--clients-per-process", str(per_process)]
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
    client_peaks = sorted((peaks[p] for p in peaks if roles[p] == "client"), reverse=True)
    return Measured(clients, per_process, peaks.get(local.pid, 0), client_peaks, peak_rss, peak_pss)


def interpreter_mib() -> int:
    """The coordinator's interpreter with its modules loaded, before any vector: the floor under its peak."""
    code = (
        "import fedsaddle.cli, fedsaddle.server.transport.grpc_pool, fedsaddle.server.driver\n"
        "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(found) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=float, default=1e6, help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=None, help="one federation of this many clients")
    parser.add_argument("--per-process", type=int, default=1, help="clients hosted by each client process")
    parser.add_argument("--hosted", default=None, help="k,k,...: 10 clients hosted k to a process, for each k")
    parser.add_argument("--rounds", type=int, default=10, help="communication rounds")
    parser.add_argument("--chunk-bytes", type=int, default=wire.DEFAULT_CHUNK_BYTES, help="transport.chunk_bytes")
    parser.add_argument(
        "--receive-window-mib", type=float, default=1.0, help="transport.limits.receive_window_mib (0: gRPC's own)"
    )
    parser.add_argument("--reorder-mib", type=float, default=None, help="transport.limits.reorder_mib")
    parser.add_argument("--plot", type=Path, default=None, help="draw the coordinator's peak against n here")
    parser.add_argument("--secure", action="store_true", help="with secure aggregation (privacy.secure_aggregation)")
    args = parser.parse_args()
    if args.hosted:
        setups = [(10, int(k)) for k in args.hosted.split(",")]
    elif args.clients is not None:
        setups = [(args.clients, args.per_process)]
    else:
        setups = list(TABLE)
    vector = 2 * args.dim * 8 / (1 << 20)
    print(
        f"memory, fedsaddle local, SCAFFOLD-S, d = {args.dim:g} ({vector:.1f} MiB a vector), {args.rounds} rounds, "
        f"{args.chunk_bytes} B chunks, receive window {args.receive_window_mib:g} MiB (0: gRPC's own), "
        f"{'secure aggregation' if args.secure else 'plain answers'}, MiB"
    )
    print("| clients | per process | coordinator peak RSS | client peak RSS | total RSS | total PSS |")
    print("|---|---|---|---|---|---|")
    rows = []
    for clients, per_process in setups:
        m = measure(args, clients, per_process)
        rows.append(m)
        span = f"{min(m.client_peaks)}-{max(m.client_peaks)}" if m.client_peaks else "-"
        print(f"| {clients} | {per_process} | {m.coordinator} | {span} | {m.total_rss} | {m.total_pss} |", flush=True)
    base = interpreter_mib()
    low = min(m.coordinator for m in rows)
    print(
        f"coordinator: {base} MiB is the interpreter with numpy, grpc and pydantic loaded; the rest of its "
        f"peak ({low - base}-{max(m.coordinator for m in rows) - base} MiB, {(low - base) / vector:.1f} vectors "
        "and up) is the algorithm's vectors, the task as sent, the running sum and what gRPC holds of the streams"
    )
    if args.plot is not None:
        plot(rows, args.plot, args.dim)


def plot(rows: list[Measured], path: Path, dim: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ns = [m.clients for m in rows]
    ax.plot(ns, [m.coordinator for m in rows], "o-", label="coordinator peak RSS")
    ax.plot(ns, [max(m.client_peaks) for m in rows], "s--", label="largest client process peak RSS")
    ax.axhline(300, color="grey", linewidth=0.8, linestyle=":", label="300 MiB")
    for m in rows:
        if m.per_process > 1:
            ax.annotate(
                f"{m.per_process} per process",
                (m.clients, m.coordinator),
                textcoords="offset points",
                xytext=(-60, 8),
                fontsize=8,
            )
    ax.set_xlabel("clients")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Peak memory, SCAFFOLD-S, d = {dim:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
