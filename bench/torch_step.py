"""What a PyTorch problem costs: a client's local step against a plain PyTorch loop, and a federation's rounds.

    python bench/torch_step.py steps [--params 1e6] [--steps 20] [--pairs 7] [--control]
    python bench/torch_step.py rounds [--sizes 1e6,1e7] [--rounds 4]
    python bench/torch_step.py coordinator [--params 1e6] [--rounds 3] [--clients 10,20,40]

`steps`: one client of the built-in deep_auc problem (the CNN widened to about --params parameters,
minibatches of --batch rows), running the local steps of a FedAvg-S task as a client process runs them
(common/worker.py's Worker over the problem's TorchShards), once with each `local_iterate`: float64 (z copied
into the network, G_i by autograd, widened to float64, the float64 step and the projection of alpha >= 0) and
players (the parameters stepped in place, alpha clamped), against a plain PyTorch loop in the same process
doing the same steps: the same network, the same rows of the same minibatches, the same loss,
torch.autograd.grad and an in-place SGD step on the parameters (descent on the network, a and b; ascent on
alpha, clamped at 0). The three alternate, --pairs times each, in one process with one torch thread; the
figures are medians of the CPU time per step, and each ratio is of those medians. With --control the tasks are
SCAFFOLD-S's, with a control variate c, and the plain loop keeps c - G_i(z~) (G_i(z~) on all the client's rows at
the task's start, timed with the steps) and adds it to each step's gradient.

`rounds`: `fedsaddle local` with 10 client processes (one client each) on deep_auc widened to each size,
FedAvg-S, tau = 1, --rounds rounds; every process of the tree sampled every 50 ms: the coordinator's and the
client processes' peak resident sets (VmHWM), the time per round and the bytes each way on the wire (from the
run's summary.json).

`coordinator`: `fedsaddle coordinator` on 127.0.0.1 for deep_auc widened to --params, with one client process
hosting the n clients (each n of --clients in turn), FedAvg-S, --rounds rounds; the coordinator's peak resident
set (VmHWM) and whether PyTorch's libraries were ever in its memory maps, sampled every 50 ms. A coordinator
only folds vectors: it should never import torch, and its memory should not grow with n (it adds each answer
to the round's sum as it arrives).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from procfs import field_mib  # bench/procfs.py

# The widened CNN of each size: (channels, hidden). deep_auc's parameters are 10c + 18c^2 + 2c + (8c + 1) h
# + h + 1 + 3; its spec allows c <= 256 and h <= 4096, so the largest is 9.6M.
SHAPES = {1e6: (32, 3880), 1e7: (256, 4096)}


def shape_for(params: float) -> tuple[int, int]:
    if params not in SHAPES:
        raise SystemExit(f"--params {params:g}: choose from {', '.join(f'{p:g}' for p in SHAPES)}")
    return SHAPES[params]


def problem_entry(params: float, batch: int, clients: int) -> dict[str, Any]:
    channels, hidden = shape_for(params)
    return {
        "name": "deep_auc",
        "num_clients": clients,
        "channels": channels,
        "hidden": hidden,
        "batch_size": batch,
        "skew_alpha": 5.0,  # mild skew: every client holds enough rows for a minibatch
    }


# -- a client's local step against a plain loop ------------------------------------------------------------


def bench_steps(args: argparse.Namespace) -> None:
    import torch

    from fedsaddle.common.problems.base import client_context
    from fedsaddle.common.problems.deep_auc import DeepAuc, DeepAucSpec, split_digits
    from fedsaddle.common.problems.pytorch import Batch
    from fedsaddle.common.problems.shards import minibatch_rows
    from fedsaddle.common.tasks import LocalStepsTask
    from fedsaddle.common.worker import Worker

    spec = DeepAucSpec(**problem_entry(args.params, args.batch, 10))
    problem = DeepAuc(spec)
    seed, client, gamma = 0, 0, 0.01
    z0 = problem.initial_point(seed)
    task_z = np.empty_like(z0)
    # --control: SCAFFOLD-S's tasks, with a control variate c (any fixed vector will do for the cost)
    control = np.random.default_rng(1).standard_normal(z0.size) * 1e-3 if args.control else None

    def client_round(iterate: str) -> Callable[[int], float]:
        own = DeepAuc(spec.model_copy(update={"local_iterate": iterate}))
        worker = Worker(own.shards(seed, [client]), seed, reuse_answers=True, scratch_tasks=True)

        def run(round_id: int) -> float:
            np.copyto(task_z, z0)
            task = LocalStepsTask(task_z, args.steps, gamma, control=control)
            started = time.process_time()
            worker.execute(task, round_id)
            return (time.process_time() - started) / args.steps

        return run

    clients = {iterate: client_round(iterate) for iterate in ("float64", "players")}

    # The plain loop: what a PyTorch user writes for the same steps.
    x, y = problem.build("cpu", seed)
    data = split_digits(spec)[client]
    inputs = problem.inputs(torch.as_tensor(data.X, dtype=torch.float32))
    targets = torch.as_tensor(data.y, dtype=torch.float32)
    context = client_context(client, spec.num_clients, data.samples)
    start = [p.detach().clone() for p in (*x.parameters, *y.parameters)]
    descent, ascent = x.parameters, y.parameters

    everything = (*descent, *ascent)
    c_pieces = None
    if control is not None:  # c cut into the parameters' shapes, as a plain SCAFFOLD loop keeps it
        flat_c = torch.as_tensor(control, dtype=torch.float32)
        sizes = [int(p.numel()) for p in everything]
        c_pieces = [piece.view_as(p) for piece, p in zip(torch.split(flat_c, sizes), everything, strict=True)]

    def plain_round(round_id: int) -> float:
        with torch.no_grad():
            for p, p0 in zip(everything, start, strict=True):
                p.copy_(p0)
        started = time.process_time()
        shifts = None
        if c_pieces is not None:  # c - G_i(z~): the gradient on all the client's rows at the task's start
            full = problem.loss(x.value, y.value, Batch(inputs, targets), client=context)
            g0 = torch.autograd.grad(full, list(everything))
            shifts = [c - g for c, g in zip(c_pieces[: len(descent)], g0, strict=False)]
            shifts += [c + g for c, g in zip(c_pieces[len(descent) :], g0[len(descent) :], strict=True)]
        for call in range(args.steps):
            rows = torch.from_numpy(minibatch_rows(seed, client, round_id, call, data.samples, args.batch))
            loss = problem.loss(x.value, y.value, Batch(inputs[rows], targets[rows]), client=context)
            grads = torch.autograd.grad(loss, list(everything))
            with torch.no_grad():
                if shifts is not None:
                    grads = tuple(
                        g + s if k < len(descent) else g - s for k, (g, s) in enumerate(zip(grads, shifts, strict=True))
                    )
                for p, g in zip(descent, grads, strict=False):
                    p.sub_(g, alpha=gamma)
                for p, g in zip(ascent, grads[len(descent) :], strict=True):
                    p.add_(g, alpha=gamma).clamp_(min=0.0)
        return (time.process_time() - started) / args.steps

    for run in (*clients.values(), plain_round):  # warm each
        run(0)
    times: dict[str, list[float]] = {iterate: [] for iterate in clients}
    plain = []
    for k in range(args.pairs):
        for iterate, run in clients.items():
            times[iterate].append(run(k + 1))
        plain.append(plain_round(k + 1))
    p = statistics.median(plain)
    print(
        f"deep_auc widened to {problem.dimension:,} parameters (channels {spec.channels}, hidden {spec.hidden}), "
        f"minibatches of {args.batch}, {args.steps} local steps a task, {args.pairs} alternating rounds of the three, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread"
    )
    print("| | ms per local step (median) | ratio |")
    print("|---|---|---|")
    for iterate, measured in times.items():
        f = statistics.median(measured)
        kind = "SCAFFOLD-S task, with a control" if control is not None else "FedAvg-S task"
        print(f"| fedsaddle client, local_iterate: {iterate} (Worker, {kind}) | {1e3 * f:.2f} | {f / p:.3f} |")
    print(f"| plain PyTorch loop | {1e3 * p:.2f} | 1 |")


# -- a federation of 10 client processes ------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def federation(params: float, rounds: int, batch: int) -> dict[str, Any]:
    config = {
        "name": "torch-rounds",
        "problem": problem_entry(params, batch, 10),
        "init": "problem",
        "algorithms": [{"name": "fedavg_s", "gamma_local": 0.01, "decay": "constant"}],
        "sync": {"kind": "fixed", "tau": 1},
        "rounds": rounds,
        "output": {"plot": False},
        # A client's first task builds the network and checks the loss: minutes for ten processes on a busy machine.
        "transport": {"round_timeout_s": 1800.0, "join_timeout_s": 1800.0},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rounds.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(path), "--out", tmp, "--quiet-clients"]
        local = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peaks: dict[int, int] = {}
        while local.poll() is None:
            for pid in [local.pid, *_children(local.pid)]:
                hwm = field_mib(f"/proc/{pid}/status", "VmHWM")
                if hwm is not None:
                    peaks[pid] = hwm
            time.sleep(0.05)
        err = local.stderr.read() if local.stderr else ""
        if local.returncode != 0:
            sys.exit(f"fedsaddle local failed ({local.returncode}):\n{err[-2000:]}")
        (summary_path,) = Path(tmp).glob("*/summary.json")
        summary = json.loads(summary_path.read_text())
        lines = (summary_path.parent / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(line)["time_s"] for line in lines]
    (algorithm,) = summary["algorithms"]
    wire = algorithm["traffic"]["algorithm"]
    clients = sorted((v for k, v in peaks.items() if k != local.pid), reverse=True)
    return {
        # the first round also builds every client's network: the rounds after it
        "round_s": statistics.median(np.diff(times[1:])),
        "first_round_s": times[1] - times[0],
        "bytes_down": wire.get("bytes_down"),
        "bytes_up": wire.get("bytes_up"),
        "rounds": algorithm["rounds"],
        "coordinator_mib": peaks.get(local.pid, 0),
        "client_mib": (min(clients), max(clients)) if clients else (0, 0),
    }


def bench_rounds(args: argparse.Namespace) -> None:
    sizes = [float(s) for s in args.sizes.split(",")]
    print(
        f"fedsaddle local, deep_auc widened, 10 client processes (1 client each), FedAvg-S, tau = 1, "
        f"minibatches of {args.batch}, {args.rounds} rounds"
    )
    print(
        "| parameters | s per round (median after the first) | first round s | MB per round down / up (wire) "
        "| coordinator peak RSS MiB | client peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|")
    for size in sizes:
        m = federation(size, args.rounds, args.batch)
        down = m["bytes_down"] / m["rounds"] / 1e6 if m["bytes_down"] else float("nan")
        up = m["bytes_up"] / m["rounds"] / 1e6 if m["bytes_up"] else float("nan")
        low, high = m["client_mib"]
        print(
            f"| {size:g} | {m['round_s']:.2f} | {m['first_round_s']:.1f} | {down:.1f} / {up:.1f} "
            f"| {m['coordinator_mib']} | {low}-{high} |",
            flush=True,
        )


# -- a coordinator alone ---------------------------------------------------------------------------------------


def bench_coordinator(args: argparse.Namespace) -> None:
    for text in args.clients.split(","):
        coordinator_alone(args, int(text))


def coordinator_alone(args: argparse.Namespace, n: int) -> None:
    config = {
        "name": "torch-coordinator",
        "problem": problem_entry(args.params, args.batch, n),
        "init": "problem",
        "algorithms": [{"name": "fedavg_s", "gamma_local": 0.01, "decay": "constant"}],
        "sync": {"kind": "fixed", "tau": 1},
        "rounds": args.rounds,
        "output": {"plot": False},
        "transport": {"round_timeout_s": 1800.0, "join_timeout_s": 1800.0},
    }
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "coordinator.yaml"
        path.write_text(yaml.safe_dump(config))
        fedsaddle = [sys.executable, "-m", "fedsaddle"]
        coordinator = subprocess.Popen(
            [*fedsaddle, "coordinator", "--config", str(path), "--out", tmp, "--listen", address],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = subprocess.Popen(
            [*fedsaddle, "client", "--coordinator", address, "--clients", f"0-{n - 1}", "--quiet"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        peak, mapped = 0, False
        while coordinator.poll() is None:
            with contextlib.suppress(OSError):
                mapped |= "libtorch" in Path(f"/proc/{coordinator.pid}/maps").read_text()
                peak = field_mib(f"/proc/{coordinator.pid}/status", "VmHWM") or peak
            time.sleep(0.05)
        client.wait(timeout=600)
    if coordinator.returncode != 0:
        sys.exit(f"fedsaddle coordinator failed ({coordinator.returncode})")
    print(
        f"fedsaddle coordinator, deep_auc widened (channels {config['problem']['channels']}, hidden "
        f"{config['problem']['hidden']}), {n} clients in one client process, FedAvg-S, {args.rounds} rounds: "
        f"peak RSS {peak} MiB, PyTorch's libraries mapped: {'yes' if mapped else 'no'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    steps = sub.add_parser("steps", help="a client's local step against a plain PyTorch loop")
    steps.add_argument("--params", type=float, default=1e6, help="model size: 1e6 or 1e7")
    steps.add_argument("--steps", type=int, default=20, help="local steps per task")
    steps.add_argument("--pairs", type=int, default=7, help="alternating (float64, players, plain) rounds")
    steps.add_argument("--batch", type=int, default=16, help="minibatch rows")
    steps.add_argument("--control", action="store_true", help="SCAFFOLD-S's corrected steps (a control variate)")
    rounds = sub.add_parser("rounds", help="round time, bytes and peak RSS of a 10-client federation")
    rounds.add_argument("--sizes", default="1e6,1e7", help="model sizes (1e6, 1e7)")
    rounds.add_argument("--rounds", type=int, default=5, help="communication rounds (at least 3)")
    rounds.add_argument("--batch", type=int, default=16, help="minibatch rows")
    alone = sub.add_parser("coordinator", help="a coordinator process's peak RSS, and whether it maps PyTorch")
    alone.add_argument("--params", type=float, default=1e6, help="model size: 1e6 or 1e7")
    alone.add_argument("--rounds", type=int, default=3, help="communication rounds")
    alone.add_argument("--batch", type=int, default=16, help="minibatch rows")
    alone.add_argument("--clients", default="10", help="the numbers of clients n, in turn (e.g. 10,20,40)")
    args = parser.parse_args()
    if args.which == "steps":
        bench_steps(args)
    elif args.which == "rounds":
        bench_rounds(args)
    else:
        bench_coordinator(args)


if __name__ == "__main__":
    main()
