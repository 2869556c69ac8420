"""Byzantine clients on the paper's problem: every algorithm under every aggregation rule and attack.

    python -m fedsaddle.experiments.robust [--seeds 10] [--rounds 200] [--out DIR] [--workers N]

The paper's problem (n = 10, d = 10, lambda = 1e-5, tau = 20, sigma = 0, x0 = y0 = 1) at
s = 0, 1, 10; f = 1, 2, 3 of the 10 clients Byzantine (clients 0..f-1), or none; each
attack of common/attacks.py that the coordinator simulates (ALIE and IPM omniscient:
they see the honest vectors of the round, as their papers assume); each rule of
server/aggregation.py; each algorithm at one step size (its best on the attack-free
sweep of docs/experiments/paper-exchanges, times 1/max(s, 1)). A rule that does not
tolerate f Byzantine clients (the config refuses it) leaves its cell empty ("-").

Every run is in-process and batched (server/batch.py), deterministic: runs.csv holds
each run's final ||z - z*|| and the SHA-256 of its final iterate. table.md gives, per
(s, f), the median [interquartile range] over seeds of ||z - z*|| after the budget;
a run that diverged counts as +inf ("diverged").
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsaddle.server.batch import BatchRun, run_batches
from fedsaddle.server.config import ConfigError, parse_config

from .grid import NAMES, quartiles
from .report import fmt

CLIENTS = 10
HETEROGENEITY = (0.0, 1.0, 10.0)
BYZANTINE = (1, 2, 3)
# Each algorithm's step (times 1/max(s, 1)): its best at s = 1 and 2 on the attack-free paper sweep.
ALGORITHMS: dict[str, tuple[dict[str, Any], str]] = {
    "minibatch_md": ({"name": "minibatch_md"}, "gamma"),
    "mirror_prox": ({"name": "mirror_prox"}, "gamma"),
    "fedavg_s": ({"name": "fedavg_s", "decay": "inverse_sqrt"}, "gamma_local"),
    "scaffold_s": ({"name": "scaffold_s"}, "gamma_local"),
    "catalyst_ours": (
        {
            "name": "scaffold_catalyst_s",
            "label": "catalyst_ours",
            "theta_rule": "estimated",
            "stop": {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50},
        },
        "gamma_local",
    ),
    "fedgda_gt": ({"name": "fedgda_gt"}, "eta"),
    "local_extragradient": ({"name": "local_extragradient"}, "gamma"),
    "local_sgda_plus": ({"name": "local_sgda_plus", "snapshot_every": 1}, "eta_x"),
}
STEPS = {
    "minibatch_md": 0.5,
    "mirror_prox": 2.0,
    "fedavg_s": 0.2,
    "scaffold_s": 0.2,
    "catalyst_ours": 0.2,
    "fedgda_gt": 0.2,
    "local_extragradient": 0.005,
    "local_sgda_plus": 0.005,
}
RULES: dict[str, dict[str, Any]] = {
    "mean": {"rule": "mean"},
    "median": {"rule": "median"},
    "trimmed_mean": {"rule": "trimmed_mean", "beta": 0.3},
    "krum": {"rule": "krum", "f": 3},
    "geometric_median": {"rule": "geometric_median"},
    "centered_clipping": {"rule": "centered_clipping", "tau": 1.0, "iterations": 3},
    "median_bucketing": {"rule": "median", "bucketing": 2},
    "geometric_median_bucketing": {"rule": "geometric_median", "bucketing": 2},
}
RULE_NAMES = {
    "mean": "mean",
    "median": "median",
    "trimmed_mean": "trimmed mean (beta 0.3)",
    "krum": "Krum (f 3)",
    "geometric_median": "geometric median",
    "centered_clipping": "centered clipping (tau 1, 3 it.)",
    "median_bucketing": "median, bucketing s=2",
    "geometric_median_bucketing": "geometric median, bucketing s=2",
}
ATTACKS: dict[str, dict[str, Any]] = {
    "sign_flip": {"kind": "sign_flip"},
    "gaussian": {"kind": "gaussian", "sigma": 1.0},
    "alie": {"kind": "alie", "omniscient": True},
    "ipm": {"kind": "ipm", "epsilon": 0.1, "omniscient": True},
    "false_diverged": {"kind": "false_diverged"},
}
NONE = "none"


@dataclass(frozen=True)
class Cell:
    """One run's coordinates."""

    s: float
    byzantine: int
    attack: str
    rule: str
    algorithm: str
    seed: int


def configure(cell: Cell, rounds: int) -> Any:
    """The run's config (ConfigError when the rule does not tolerate the attack)."""
    entry, step_name = ALGORITHMS[cell.algorithm]
    algorithm = {**entry, step_name: STEPS[cell.algorithm] / max(cell.s, 1.0)}
    fields: dict[str, Any] = {
        "name": "robust",
        "seed": cell.seed,
        "problem": {"name": "paper_regression", "num_clients": CLIENTS, "dim": 10, "lam": 1e-5, "s": cell.s},
        "sync": {"kind": "fixed", "tau": 20},
        "rounds": rounds,
        "algorithms": [algorithm],
        "aggregation": RULES[cell.rule],
    }
    if cell.attack != NONE:
        fields["attack"] = {**ATTACKS[cell.attack], "clients": list(range(cell.byzantine))}
    return parse_config(fields)


def cells(seeds: Sequence[int]) -> list[Cell]:
    found: list[Cell] = []
    for s in HETEROGENEITY:
        scenarios = [(0, NONE)] + [(f, attack) for f in BYZANTINE for attack in ATTACKS]
        for f, attack in scenarios:
            for rule in RULES:
                for algorithm in ALGORITHMS:
                    found.extend(Cell(s, f, attack, rule, algorithm, seed) for seed in seeds)
    return found


def run_robust(
    seeds: Sequence[int],
    rounds: int,
    out: Path,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Every cell; runs.csv and table.md written to `out`. Returns the table's path."""
    started, cpu = time.perf_counter(), time.process_time()
    batches: dict[str, list[tuple[Cell, BatchRun]]] = defaultdict(list)
    refused: list[Cell] = []
    for cell in cells(seeds):
        try:
            config = configure(cell, rounds)
        except ConfigError:
            refused.append(cell)
            continue
        batches[f"{cell.algorithm}-{cell.s}"].append((cell, BatchRun(config, config.algorithms[0])))
    groups = list(batches.values())
    results = run_batches([[member for _, member in group] for group in groups], workers, progress)
    rows: list[dict[str, Any]] = []
    for group, outcome in zip(groups, results, strict=True):
        for (cell, _), result in zip(group, outcome, strict=True):
            reports = result.extra.get("aggregation", {}).get("rounds_with_diverged_reports", 0)
            rows.append(
                {
                    "s": cell.s,
                    "byzantine": cell.byzantine,
                    "attack": cell.attack,
                    "rule": cell.rule,
                    "algorithm": cell.algorithm,
                    "seed": cell.seed,
                    "status": result.status,
                    "dist_z": result.dist_z if result.status != "diverged" else math.inf,
                    "rounds": result.traffic["algorithm"]["rounds"],
                    "rounds_with_diverged_reports": reports,
                    "z_sha256": result.z_sha256,
                }
            )
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    command = f"python -m fedsaddle.experiments.robust --seeds {len(seeds)} --rounds {rounds} --out {out}"
    table = out / "table.md"
    table.write_text(report(rows, seeds, rounds, command, wall, len(refused)))
    (out / "summary.md").write_text(summary(read_runs(out / "runs.csv")))
    return table


def _cell_text(values: Sequence[float]) -> str:
    if not values:
        return "-"
    q1, median, q3 = quartiles(values)
    return f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}]"


def report(
    rows: Sequence[dict[str, Any]], seeds: Sequence[int], rounds: int, command: str, wall: float, refused: int
) -> str:
    found: dict[tuple[float, int, str, str, str], list[float]] = defaultdict(list)
    for row in rows:
        found[(row["s"], row["byzantine"], row["attack"], row["rule"], row["algorithm"])].append(row["dist_z"])
    lines = [
        "# Byzantine clients on the paper's problem",
        "",
        f"Made by `{command}` ({wall:.0f} s on the 2-core machine, in-process and batched). n = {CLIENTS}, "
        f"d = 10, lambda = 1e-5, tau = 20, sigma = 0, {rounds} rounds (every exchange counted), seeds "
        f"{seeds[0]}-{seeds[-1]}; Byzantine clients 0..f-1; ALIE and IPM (epsilon 0.1) omniscient; gaussian adds "
        "N(0, 1). Each cell: ||z - z*|| after the budget, median [interquartile range] over seeds; "
        f"'diverged': the run ended as diverged (or its iterate overflowed); '-': the rule does not tolerate f "
        f"Byzantine clients among 10, and the config refuses it ({refused} runs refused).",
        "",
    ]
    attacks = [NONE, *ATTACKS]
    for s in HETEROGENEITY:
        lines += [f"## s = {s:g}", ""]
        lines += ["### No attacker", ""]
        lines += ["| algorithm | " + " | ".join(RULE_NAMES[r] for r in RULES) + " |", "|---|" + "---|" * len(RULES)]
        for algorithm in ALGORITHMS:
            cells_text = [_cell_text(found.get((s, 0, NONE, rule, algorithm), [])) for rule in RULES]
            lines.append(f"| {NAMES.get(algorithm, algorithm)} | " + " | ".join(cells_text) + " |")
        lines.append("")
        for f in BYZANTINE:
            lines += [f"### f = {f} Byzantine", ""]
            lines += ["| algorithm | rule | " + " | ".join(attacks[1:]) + " |", "|---|---|" + "---|" * len(attacks[1:])]
            for algorithm in ALGORITHMS:
                for rule in RULES:
                    cells_text = [_cell_text(found.get((s, f, attack, rule, algorithm), [])) for attack in attacks[1:]]
                    lines.append(
                        f"| {NAMES.get(algorithm, algorithm)} | {RULE_NAMES[rule]} | " + " | ".join(cells_text) + " |"
                    )
            lines.append("")
    return "\n".join(lines)


SUMMARY_ALGORITHMS = ("minibatch_md", "mirror_prox", "scaffold_s", "fedavg_s")


def read_runs(path: Path) -> list[dict[str, Any]]:
    """runs.csv as `run_robust` wrote it, numbers as numbers."""
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    for row in rows:
        row["s"], row["dist_z"] = float(row["s"]), float(row["dist_z"])
        row["byzantine"], row["seed"] = int(row["byzantine"]), int(row["seed"])
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """The docs page's tables (docs/robustness.md): heterogeneity with no attacker, and f = 2 at s = 1."""
    found: dict[tuple[float, int, str, str, str], list[float]] = defaultdict(list)
    for row in rows:
        found[(row["s"], row["byzantine"], row["attack"], row["rule"], row["algorithm"])].append(row["dist_z"])
    seeds = sorted({row["seed"] for row in rows})
    rounds = max(int(row["rounds"]) for row in rows)  # the budget (a diverged run spent less)
    lines = [
        f"**No attacker.** ||z - z*|| after {rounds} rounds, median [IQR] over seeds {seeds[0]}-{seeds[-1]}, "
        "by rule (rows) and s (columns):",
        "",
    ]
    columns = [f"s = {s:g}" for s in HETEROGENEITY]
    for algorithm in SUMMARY_ALGORITHMS:
        lines += [
            f"| {NAMES.get(algorithm, algorithm)} | " + " | ".join(columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for rule in RULES:
            cells_text = [_cell_text(found.get((s, 0, NONE, rule, algorithm), [])) for s in HETEROGENEITY]
            lines.append(f"| {RULE_NAMES[rule]} | " + " | ".join(cells_text) + " |")
        lines.append("")
    for f in (2, 3):
        lines += [
            f"**f = {f} of 10 clients Byzantine, s = 1.** ||z - z*|| after {rounds} rounds, median [IQR], "
            "by rule (rows) and attack (columns):",
            "",
        ]
        for algorithm in SUMMARY_ALGORITHMS[:3]:
            lines += [
                f"| {NAMES.get(algorithm, algorithm)} | " + " | ".join(ATTACKS) + " |",
                "|---|" + "---|" * len(ATTACKS),
            ]
            for rule in RULES:
                cells_text = [_cell_text(found.get((1.0, f, attack, rule, algorithm), [])) for attack in ATTACKS]
                lines.append(f"| {RULE_NAMES[rule]} | " + " | ".join(cells_text) + " |")
            lines.append("")
    return "\n".join(lines)


def every_tenth() -> Callable[[int, int], None]:
    """A progress hook that prints "done/total runs" at each tenth of the way."""
    shown = [-1]

    def progress(done: int, total: int) -> None:
        if 10 * done // total != shown[0]:
            shown[0] = 10 * done // total
            print(f"{done}/{total} runs", flush=True)

    return progress


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedsaddle.experiments.robust", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    parser.add_argument("--rounds", type=int, default=200, help="the budget, every exchange counted (default 200)")
    parser.add_argument("--out", default="runs/experiment-robust", help="report folder")
    parser.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.md from OUT/runs.csv")
    args = parser.parse_args(argv)
    if args.summary_only:
        out = Path(args.out)
        if not (out / "runs.csv").is_file():
            parser.error(f"--summary-only: {out / 'runs.csv'} does not exist (run the grid into --out first)")
        (out / "summary.md").write_text(summary(read_runs(out / "runs.csv")))
        print(f"wrote {out / 'summary.md'}")
        return 0
    if args.seeds < 1 or args.rounds < 1:
        parser.error("--seeds and --rounds must be at least 1")
    table = run_robust(range(args.seeds), args.rounds, Path(args.out), args.workers, every_tenth())
    print(f"wrote {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
