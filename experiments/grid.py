"""The paper's experimental grid (section Experiments) and how its runs are kept and compared.

n = 10, d = 10, lambda = 1e-5, tau = 20, sigma = 0, s = 0..15, for the five
algorithms (FedAvg-S with the decaying local step, SCAFFOLD-Catalyst-S with
theta = 1 and the paper's objective-decrease heuristic), plus two variants
beside them: FedAvg-S with a constant step, and SCAFFOLD-Catalyst-S with this
project's defaults (the gradient-mapping stop rule and the estimated theta).

The paper tries steps {0.1, 0.05, 0.01}/max(s, 1) for every method; the best
step was at that grid's edge almost everywhere. Here each method has its own
grid, wide enough that its best step lies inside it (the reports flag any best
at an edge), and the paper's Catalyst is also tuned over its stop threshold
rtol in {1e-1, ..., 1e-4}, so that every method is compared at its best.

For each (algorithm, s) the (step, variant) with no diverged seed and the
smallest median final ||x - x*|| over seeds is kept, distances below FLOOR
counting as equal (ties there go to the fewest median rounds to 1e-10);
reports give the median and the interquartile range over seeds.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsaddle.server.batch import BatchRun, run_batches
from fedsaddle.server.config import RoundConvention, RunConfig, parse_config
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import ClientPool

STEP_SCALES = (0.1, 0.05, 0.01)  # the paper's grid, times 1/max(s, 1)
ACCURACIES = (1e-6, 1e-10)
FLOOR = 1e-15  # distances to z* = 0 below this are round-off: equal for choosing a step

_OBJECTIVE_STOP = {"rule": "objective", "rtol": 1e-3, "max_inner_syncs": 50}

# Each algorithm of the sweep as a config entry, without its step size.
PAPER_ENTRIES: dict[str, dict[str, Any]] = {
    "minibatch_md": {"name": "minibatch_md"},
    "mirror_prox": {"name": "mirror_prox"},
    "fedavg_s": {"name": "fedavg_s", "decay": "inverse_sqrt"},
    "fedavg_s_constant": {"name": "fedavg_s", "decay": "constant", "label": "fedavg_s_constant"},
    "scaffold_s": {"name": "scaffold_s"},
    "scaffold_catalyst_s": {
        "name": "scaffold_catalyst_s",
        "theta": 1.0,
        "theta_rule": "fixed",
        "stop": _OBJECTIVE_STOP,
    },
    "catalyst_ours": {
        "name": "scaffold_catalyst_s",
        "label": "catalyst_ours",
        "theta": 1.0,
        "theta_rule": "estimated",
        "stop": {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50},
    },
    # The newer baselines (docs/reference/algorithms.md), at their papers' defaults besides the step.
    "fedgda_gt": {"name": "fedgda_gt"},
    "local_extragradient": {"name": "local_extragradient"},
    "local_sgda_plus": {"name": "local_sgda_plus", "snapshot_every": 1},
}
PAPER_FIVE = ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s")
NEWER_BASELINES = ("fedgda_gt", "local_extragradient", "local_sgda_plus")
SWEPT = (
    "minibatch_md",
    "mirror_prox",
    "fedavg_s",
    "fedavg_s_constant",
    "scaffold_s",
    "scaffold_catalyst_s",
    "catalyst_ours",
    *NEWER_BASELINES,
)

# One name per algorithm variant, in every table and figure (runs.csv keeps the keys).
NAMES = {
    "minibatch_md": "Minibatch MD",
    "mirror_prox": "Minibatch Mirror-prox",
    "fedavg_s": "FedAvg-S (decaying step)",
    "fedavg_s_constant": "FedAvg-S (constant step)",
    "scaffold_s": "SCAFFOLD-S",
    "scaffold_catalyst_s": "Catalyst (paper)",
    "catalyst_ours": "Catalyst (ours)",
    "fedgda_gt": "FedGDA-GT",
    "local_extragradient": "Local Extragradient",
    "local_sgda_plus": "Local SGDA+",
}

# Each method's step grid, times 1/max(s, 1), chosen to bracket its best step at every s.
STEP_GRIDS: dict[str, tuple[float, ...]] = {
    "minibatch_md": (1.0, 0.5, 0.2, 0.1),
    "mirror_prox": (5.0, 2.0, 1.0, 0.5),
    "fedavg_s": (2.0, 1.0, 0.5, 0.2, 0.1, 0.05),
    "fedavg_s_constant": (0.05, 0.02, 0.01, 0.005, 0.002, 0.001),
    "scaffold_s": (0.5, 0.2, 0.1, 0.05),
    "scaffold_catalyst_s": (1.0, 0.5, 0.2, 0.1),
    "catalyst_ours": (1.0, 0.5, 0.2, 0.1, 0.05),
    "fedgda_gt": (0.5, 0.2, 0.1, 0.05, 0.02),
    "local_extragradient": (0.1, 0.05, 0.02, 0.01, 0.005, 0.002),
    "local_sgda_plus": (0.05, 0.02, 0.01, 0.005, 0.002, 0.001),
}

# Hyper-parameters tuned beside the step: the paper's Catalyst at each stop threshold.
STOP_THRESHOLDS = (1e-1, 1e-2, 1e-3, 1e-4)
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "scaffold_catalyst_s": {f"rtol={r:g}": {"stop": {**_OBJECTIVE_STOP, "rtol": r}} for r in STOP_THRESHOLDS},
}


# The field that holds each algorithm's step (gamma_local for the local methods of the paper).
STEP_FIELDS = {
    "minibatch_md": "gamma",
    "mirror_prox": "gamma",
    "local_extragradient": "gamma",
    "fedgda_gt": "eta",
    "local_sgda_plus": "eta_x",
}


def with_step(entry: Mapping[str, Any], step: float) -> dict[str, Any]:
    """The entry with its step size set (gamma_g = gamma_l = step, as in the paper)."""
    return {**entry, STEP_FIELDS.get(entry["name"], "gamma_local"): step}


@dataclass(frozen=True)
class Grid:
    s_values: tuple[float, ...] = tuple(float(s) for s in range(16))
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    step_scales: tuple[float, ...] | None = None  # one grid for every algorithm; None: STEP_GRIDS
    rounds: int = 500
    convention: RoundConvention = RoundConvention.EXCHANGES
    tau: int = 20
    algorithms: tuple[str, ...] = SWEPT
    entries: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: PAPER_ENTRIES)
    variants: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=lambda: VARIANTS)
    overrides: dict[str, Any] = field(default_factory=dict)  # extra config fields, e.g. init

    def __post_init__(self) -> None:
        # Grid(convention="paper") is the same grid as Grid(convention=RoundConvention.PAPER).
        object.__setattr__(self, "convention", RoundConvention(self.convention))

    def scales(self, algorithm: str) -> tuple[float, ...]:
        if self.step_scales is not None:
            return self.step_scales
        return STEP_GRIDS.get(algorithm, STEP_SCALES)

    def variants_of(self, algorithm: str) -> Mapping[str, Mapping[str, Any]]:
        return self.variants.get(algorithm) or {"": {}}

    def config(self, algorithm: str, s: float, scale: float, seed: int, variant: str = "") -> RunConfig:
        step = scale / max(s, 1.0)
        entry = {**self.entries[algorithm], **self.variants_of(algorithm)[variant]}
        return parse_config(
            {
                "name": "paper",
                "seed": seed,
                "problem": {"name": "paper_regression", "num_clients": 10, "dim": 10, "lam": 1e-5, "s": s},
                "sync": {"kind": "fixed", "tau": self.tau},
                "rounds": self.rounds,
                "round_convention": self.convention,
                "algorithms": [with_step(entry, step)],
                **self.overrides,
            }
        )

    def members(self, algorithm: str) -> list[tuple[dict[str, Any], BatchRun]]:
        out = []
        for s in self.s_values:
            for scale in self.scales(algorithm):
                for variant in self.variants_of(algorithm):
                    for seed in self.seeds:
                        config = self.config(algorithm, s, scale, seed, variant)
                        key = {"algorithm": algorithm, "s": s, "step_scale": scale, "variant": variant, "seed": seed}
                        out.append((key, BatchRun(config, config.algorithms[0])))
        return out

    @property
    def size(self) -> int:
        per_s = sum(len(self.scales(a)) * len(self.variants_of(a)) for a in self.algorithms)
        return per_s * len(self.s_values) * len(self.seeds)

    def describe(self) -> str:
        """The parameters, for figure captions and report headers."""
        seeds = self.seeds
        seed_text = (
            f"seeds {seeds[0]}-{seeds[-1]}" if seeds == tuple(range(seeds[0], seeds[-1] + 1)) else f"seeds {seeds}"
        )
        counted = self.convention.words
        return (
            f"n = 10, d = 10, lambda = 1e-5, tau = {self.tau}, sigma = 0; {len(seeds)} {seed_text}; "
            f"{self.rounds} rounds ({counted})"
        )


@dataclass
class Row:
    """One run of the grid."""

    key: dict[str, Any]
    result: AlgorithmResult
    convention: RoundConvention = RoundConvention.EXCHANGES  # the grid's: how its rounds are counted

    def rounds_to(self, accuracy: float) -> int | None:
        return self.result.rounds_to(accuracy, self.convention)

    def as_csv(self) -> dict[str, Any]:
        r = self.result
        t = r.traffic["algorithm"]
        return {
            **self.key,
            "gamma": r.spec.get(STEP_FIELDS.get(r.spec["name"], "gamma_local")),  # the swept step
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
    # One batch per (algorithm, variant): batches of similar size keep the worker processes busy alike.
    members: list[list[tuple[dict[str, Any], BatchRun]]] = []
    for algorithm in grid.algorithms:
        by_variant: dict[str, list[tuple[dict[str, Any], BatchRun]]] = defaultdict(list)
        for member in grid.members(algorithm):
            by_variant[member[0]["variant"]].append(member)
        members.extend(by_variant.values())
    hook = None if progress is None else (lambda done, _total: progress(done))
    results = run_batches([[m for _, m in batch] for batch in members], workers, hook)
    return [
        Row(key, result, grid.convention)
        for batch, batch_results in zip(members, results, strict=True)
        for (key, _), result in zip(batch, batch_results, strict=True)
    ]


def run_rows_on(
    pool: ClientPool, grid: Grid, keys: Iterable[dict[str, Any]], progress: Callable[[int], None] | None = None
) -> list[Row]:
    """The given grid points one by one on a pool (e.g. over gRPC)."""
    rows = []
    for key in keys:
        config = grid.config(key["algorithm"], key["s"], key["step_scale"], key["seed"], key.get("variant", ""))
        rows.append(Row(key, run_algorithm(config.algorithms[0], config, pool), grid.convention))
        if progress is not None:
            progress(len(rows))
    return rows


# -- choosing and summarizing ----------------------------------------------------------


def log_mean(values: Sequence[float]) -> float:
    if any(not math.isfinite(v) for v in values):
        return math.inf
    return float(np.mean(np.log10(np.maximum(values, 1e-300))))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """q1, median, q3 of the values; a diverged run (NaN or inf) counts as +inf."""
    if not values:
        return math.nan, math.nan, math.nan
    # Interpolating next to an infinity would give NaN: compute with a huge stand-in, map it back.
    stand_in = [v if math.isfinite(v) else 1e300 for v in values]
    found = np.percentile(stand_in, [25, 50, 75], method="median_unbiased")
    q1, median, q3 = (float(v) if v < 1e299 else math.inf for v in found)
    return q1, median, q3


@dataclass
class Best:
    algorithm: str
    s: float
    step_scale: float
    rows: list[Row]  # one per seed
    variant: str = ""
    edge: bool = False  # the step is the smallest or largest of its grid

    @property
    def finals(self) -> list[float]:
        return [r.result.dist_x for r in self.rows]

    @property
    def median(self) -> float:
        return quartiles(self.finals)[1]

    @property
    def diverged(self) -> int:
        return sum(r.result.status == "diverged" for r in self.rows)

    @property
    def geometric_mean(self) -> float:
        value = log_mean(self.finals)
        return 10**value if math.isfinite(value) else math.inf

    def score(self) -> tuple[bool, float, float]:
        """What choosing minimizes: any seed diverged (a step that diverges on some data is not a
        choice), the median final distance (round-off counting as equal), then rounds to 1e-10."""
        reached = [r.rounds_to(1e-10) for r in self.rows]
        rounds = quartiles([math.inf if x is None else float(x) for x in reached])[1]
        median = quartiles([max(f, FLOOR) if math.isfinite(f) else math.inf for f in self.finals])[1]
        return self.diverged > 0, max(median, FLOOR), rounds


def best_steps(rows: Sequence[Row]) -> dict[tuple[str, float], Best]:
    """For each (algorithm, s): the step (and variant) of the grid with the best score over seeds."""
    groups: dict[tuple[str, float, float, str], list[Row]] = defaultdict(list)
    scales: dict[str, set[float]] = defaultdict(set)
    for row in rows:
        key = row.key
        groups[(key["algorithm"], key["s"], key["step_scale"], key.get("variant", ""))].append(row)
        scales[key["algorithm"]].add(key["step_scale"])
    best: dict[tuple[str, float], tuple[tuple[bool, float, float], Best]] = {}
    for (algorithm, s, scale, variant), members in groups.items():
        candidate = Best(algorithm, s, scale, members, variant)
        score = candidate.score()  # once per candidate: it scans every run's records
        current = best.get((algorithm, s))
        if current is None or score < current[0]:
            best[(algorithm, s)] = (score, candidate)
    picked = {key: chosen for key, (_, chosen) in best.items()}
    for chosen in picked.values():
        grid = scales[chosen.algorithm]
        chosen.edge = len(grid) > 1 and chosen.step_scale in (min(grid), max(grid))
    return picked
