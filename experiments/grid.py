"""The paper's experimental grid (section Experiments) and how its runs are kept and compared.

n = 10, d = 10, lambda = 1e-5, tau = 20, sigma = 0, s = 0..15, step sizes
{0.1, 0.05, 0.01} / max(s, 1) for the five algorithms (FedAvg-S with the
decaying local step, SCAFFOLD-Catalyst-S with theta = 1 and the paper's
objective-decrease heuristic), plus SCAFFOLD-Catalyst-S with this project's
defaults beside it (the gradient-mapping stop rule and the estimated theta).

For each (algorithm, s) the step with the smallest geometric mean of the final
||x - x*|| over seeds is kept; its spread over seeds is reported as [min, max].
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsaddle.server.config import RunConfig, parse_config
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import ClientPool

from .batch import BatchRun, run_batches

STEP_SCALES = (0.1, 0.05, 0.01)
ACCURACIES = (1e-6, 1e-10)

# Each algorithm of the paper's Experiments as a config entry, without its step size.
PAPER_ENTRIES: dict[str, dict[str, Any]] = {
    "minibatch_md": {"name": "minibatch_md"},
    "mirror_prox": {"name": "mirror_prox"},
    "fedavg_s": {"name": "fedavg_s", "decay": "inverse_sqrt"},
    "scaffold_s": {"name": "scaffold_s"},
    "scaffold_catalyst_s": {
        "name": "scaffold_catalyst_s",
        "theta": 1.0,
        "theta_rule": "fixed",
        "stop": {"rule": "objective", "rtol": 1e-3, "max_inner_syncs": 50},
    },
    "catalyst_ours": {
        "name": "scaffold_catalyst_s",
        "label": "catalyst_ours",
        "theta": 1.0,
        "theta_rule": "estimated",
        "stop": {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50},
    },
}
PAPER_FIVE = ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s")


def with_step(entry: Mapping[str, Any], step: float) -> dict[str, Any]:
    """The entry with its step size set (gamma_g = gamma_l = step, as in the paper)."""
    key = "gamma" if entry["name"] in ("minibatch_md", "mirror_prox") else "gamma_local"
    return {**entry, key: step}


@dataclass(frozen=True)
class Grid:
    s_values: tuple[float, ...] = tuple(float(s) for s in range(16))
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    step_scales: tuple[float, ...] = STEP_SCALES
    rounds: int = 500
    convention: str = "exchanges"
    tau: int = 20
    algorithms: tuple[str, ...] = (*PAPER_FIVE, "catalyst_ours")
    entries: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: PAPER_ENTRIES)
    overrides: dict[str, Any] = field(default_factory=dict)  # extra config fields, e.g. init

    def config(self, algorithm: str, s: float, scale: float, seed: int) -> RunConfig:
        step = scale / max(s, 1.0)
        return parse_config(
            {
                "name": "paper",
                "seed": seed,
                "problem": {"name": "paper_regression", "num_clients": 10, "dim": 10, "lam": 1e-5, "s": s},
                "sync": {"kind": "fixed", "tau": self.tau},
                "rounds": self.rounds,
                "round_convention": self.convention,
                "algorithms": [with_step(self.entries[algorithm], step)],
                **self.overrides,
            }
        )

    def members(self, algorithm: str) -> list[tuple[dict[str, Any], BatchRun]]:
        out = []
        for s in self.s_values:
            for scale in self.step_scales:
                for seed in self.seeds:
                    config = self.config(algorithm, s, scale, seed)
                    key = {"algorithm": algorithm, "s": s, "step_scale": scale, "seed": seed}
                    out.append((key, BatchRun(config, config.algorithms[0])))
        return out

    @property
    def size(self) -> int:
        return len(self.algorithms) * len(self.s_values) * len(self.step_scales) * len(self.seeds)


@dataclass
class Row:
    """One run of the grid."""

    key: dict[str, Any]
    result: AlgorithmResult

    def rounds_to(self, accuracy: float) -> int | None:
        for record in self.result.records:
            if record["dist_x"] <= accuracy:
                return int(record["rounds"])
        return None

    def as_csv(self) -> dict[str, Any]:
        r = self.result
        t = r.traffic["algorithm"]
        return {
            **self.key,
            "gamma": r.spec.get("gamma", r.spec.get("gamma_local")),
            "status": r.status,
            "dist_x": r.dist_x,
            "dist_z": r.dist_z,
            "rounds": t["rounds"],
            "paper_rounds": r.records[-1]["paper_rounds"] if r.records else 0,
            "floats_up": t["floats_up"],
            "syncs_or_steps": r.extra.get("syncs", r.extra.get("steps", "")),
            "meta_iterations": r.extra.get("meta_iterations", ""),
            **{f"rounds_to_{a:g}": self.rounds_to(a) for a in ACCURACIES},
            "z_sha256": r.z_sha256,
        }


def run_grid(grid: Grid, progress: Callable[[int], None] | None = None, workers: int | None = None) -> list[Row]:
    """Every (algorithm, s, step, seed) of the grid: one batch per algorithm, spread over
    `workers` processes (default: one per core); `progress(runs done)`."""
    members = [grid.members(algorithm) for algorithm in grid.algorithms]
    hook = None if progress is None else (lambda done, _total: progress(done))
    results = run_batches([[m for _, m in batch] for batch in members], workers, hook)
    return [
        Row(key, result)
        for batch, batch_results in zip(members, results, strict=True)
        for (key, _), result in zip(batch, batch_results, strict=True)
    ]


def run_rows_on(
    pool: ClientPool, grid: Grid, keys: Iterable[dict[str, Any]], progress: Callable[[int], None] | None = None
) -> list[Row]:
    """The given grid points one by one on a pool (e.g. over gRPC)."""
    rows = []
    for key in keys:
        config = grid.config(key["algorithm"], key["s"], key["step_scale"], key["seed"])
        rows.append(Row(key, run_algorithm(config.algorithms[0], config, pool)))
        if progress is not None:
            progress(len(rows))
    return rows


# -- choosing and summarizing ----------------------------------------------------------


def log_mean(values: Sequence[float]) -> float:
    if any(not math.isfinite(v) for v in values):
        return math.inf
    return float(np.mean(np.log10(np.maximum(values, 1e-300))))


@dataclass
class Best:
    algorithm: str
    s: float
    step_scale: float
    rows: list[Row]  # one per seed

    @property
    def finals(self) -> list[float]:
        return [r.result.dist_x for r in self.rows]

    @property
    def geometric_mean(self) -> float:
        value = log_mean(self.finals)
        return 10**value if math.isfinite(value) else math.inf


def best_steps(rows: Sequence[Row]) -> dict[tuple[str, float], Best]:
    groups: dict[tuple[str, float, float], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row.key["algorithm"], row.key["s"], row.key["step_scale"])].append(row)
    best: dict[tuple[str, float], Best] = {}
    for (algorithm, s, scale), members in groups.items():
        candidate = Best(algorithm, s, scale, members)
        current = best.get((algorithm, s))
        if current is None or log_mean(candidate.finals) < log_mean(current.finals):
            best[(algorithm, s)] = candidate
    return best
