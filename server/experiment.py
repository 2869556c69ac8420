"""The paper's experiments (section Experiments), as one command.

    fedsaddle experiment paper [--seeds 5] [--rounds 500] [--convention exchanges|paper]

The grid: n = 10, d = 10, lambda = 1e-5, tau = 20, sigma = 0, s = 0..15, step
sizes {0.1, 0.05, 0.01} / max(s, 1), for the five algorithms (FedAvg-S with the
decaying local step, SCAFFOLD-Catalyst-S with theta = 1 and the paper's
objective-decrease heuristic), plus SCAFFOLD-Catalyst-S with this project's
defaults beside it (the gradient-mapping stop rule and the estimated theta). Each algorithm's runs go through
the in-process transport as one batch (server/sweep.py); with --transport grpc
a subset runs over client processes instead and is checked bit for bit against
the batch.

For each (algorithm, s) the step with the smallest geometric mean of the final
||x - x*|| over seeds is kept; its spread over seeds is reported as [min, max].
"""

from __future__ import annotations

import csv
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.config import RunConfig, parse_config
from fedsaddle.common.problems import Shards
from fedsaddle.server.coordinator import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import ClientPool
from fedsaddle.server.sweep import BatchRun, run_batch

STEP_SCALES = (0.1, 0.05, 0.01)
ACCURACIES = (1e-6, 1e-10)
# Figures clip distances at this floor: with z* = 0 (s = 0 especially) iterates shrink
# past any meaningful accuracy, and 1e-100 would flatten every other curve.
PLOT_FLOOR = 1e-16


def paper_algorithms(step: float) -> dict[str, dict[str, Any]]:
    """The algorithms of the paper's Experiments at one step size (gamma_g = gamma_l = step)."""
    return {
        "minibatch_md": {"name": "minibatch_md", "gamma": step},
        "mirror_prox": {"name": "mirror_prox", "gamma": step},
        "fedavg_s": {"name": "fedavg_s", "gamma_local": step, "decay": "inverse_sqrt"},
        "scaffold_s": {"name": "scaffold_s", "gamma_local": step},
        "scaffold_catalyst_s": {
            "name": "scaffold_catalyst_s",
            "gamma_local": step,
            "theta": 1.0,
            "theta_rule": "fixed",
            "stop": {"rule": "objective", "rtol": 1e-3, "max_inner_syncs": 50},
        },
        "catalyst_ours": {
            "name": "scaffold_catalyst_s",
            "label": "catalyst_ours",
            "gamma_local": step,
            "theta": 1.0,
            "theta_rule": "estimated",
            "stop": {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50},
        },
    }


PAPER_FIVE = ("minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s")


@dataclass(frozen=True)
class Grid:
    s_values: tuple[float, ...] = tuple(float(s) for s in range(16))
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    step_scales: tuple[float, ...] = STEP_SCALES
    rounds: int = 500
    convention: str = "exchanges"
    tau: int = 20
    algorithms: tuple[str, ...] = (*PAPER_FIVE, "catalyst_ours")
    overrides: dict[str, Any] = field(default_factory=dict)  # extra config fields, e.g. init
    catalog: Callable[[float], dict[str, dict[str, Any]]] = paper_algorithms  # step -> algorithm entries

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
                "algorithms": [self.catalog(step)[algorithm]],
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


def run_grid(grid: Grid, progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every (algorithm, s, step, seed) of the grid, one batch per algorithm."""
    data: dict[tuple[str, int], Shards] = {}
    rows: list[Row] = []
    for algorithm in grid.algorithms:
        members = grid.members(algorithm)
        started = time.perf_counter()
        results = run_batch([m for _, m in members], data)
        rows.extend(Row(key, result) for (key, _), result in zip(members, results, strict=True))
        if progress:
            progress(f"{algorithm:<24} {len(members)} runs in {time.perf_counter() - started:.2f} s")
    return rows


def run_rows_on(pool: ClientPool, grid: Grid, keys: Iterable[dict[str, Any]]) -> list[Row]:
    """The given grid points one by one on a pool (e.g. over gRPC)."""
    rows = []
    for key in keys:
        config = grid.config(key["algorithm"], key["s"], key["step_scale"], key["seed"])
        rows.append(Row(key, run_algorithm(config.algorithms[0], config, pool)))
    return rows


# -- choosing and summarizing ----------------------------------------------------------


def _log_mean(values: Sequence[float]) -> float:
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
        value = _log_mean(self.finals)
        return 10**value if math.isfinite(value) else math.inf


def best_steps(rows: Sequence[Row]) -> dict[tuple[str, float], Best]:
    groups: dict[tuple[str, float, float], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row.key["algorithm"], row.key["s"], row.key["step_scale"])].append(row)
    best: dict[tuple[str, float], Best] = {}
    for (algorithm, s, scale), members in groups.items():
        candidate = Best(algorithm, s, scale, members)
        current = best.get((algorithm, s))
        if current is None or _log_mean(candidate.finals) < _log_mean(current.finals):
            best[(algorithm, s)] = candidate
    return best


def write_csv(path: Path, rows: Sequence[Row]) -> None:
    lines = [row.as_csv() for row in rows]
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "diverged"
    return "0" if value <= 1e-300 else f"{value:.1e}"


def _table(caption: str, first: str, columns: Sequence[str], rows: Iterable[tuple[str, Sequence[str]]]) -> str:
    """A Markdown table under its caption: a header of `first` and `columns`, then (label, cells) rows."""
    lines = [caption, "", f"| {first} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines) + "\n"


def markdown_table(best: dict[tuple[str, float], Best], algorithms: Sequence[str], convention: str) -> str:
    counted = "every exchange counted" if convention == "exchanges" else "the paper's convention"

    def cell(b: Best) -> str:
        return f"{_fmt(b.geometric_mean)} [{_fmt(min(b.finals))}, {_fmt(max(b.finals))}] ({b.step_scale:g})"

    return _table(
        f"Final ||x - x*|| after the budget ({counted}): geometric mean over seeds [min, max], "
        "at the best of the three step sizes (its scale in parentheses).",
        "s",
        algorithms,
        ((f"{s:g}", [cell(best[(a, s)]) for a in algorithms]) for s in sorted({s for _, s in best})),
    )


def accuracy_table(rows: Sequence[Row], algorithms: Sequence[str], accuracy: float) -> str:
    """Rounds (every exchange counted) until ||x - x*|| <= accuracy: median over seeds, at the fastest step."""
    groups: dict[tuple[str, float, float], list[float]] = defaultdict(list)
    for row in rows:
        reached = row.rounds_to(accuracy)
        groups[(row.key["algorithm"], row.key["s"], row.key["step_scale"])].append(
            math.inf if reached is None else reached
        )
    fastest: dict[tuple[str, float], tuple[float, float]] = {}
    for (algorithm, s, scale), values in groups.items():
        median = sorted(values)[len(values) // 2]
        if (algorithm, s) not in fastest or median < fastest[(algorithm, s)][0]:
            fastest[(algorithm, s)] = (median, scale)

    def cell(median: float, scale: float) -> str:
        return "not reached" if not math.isfinite(median) else f"{int(median)} ({scale:g})"

    return _table(
        f"Rounds until ||x - x*|| <= {accuracy:g}, every exchange counted: median over seeds, at the step of the "
        "grid that gets there fastest (its scale in parentheses); 'not reached' = not within the run's budget.",
        "s",
        algorithms,
        ((f"{s:g}", [cell(*fastest[(a, s)]) for a in algorithms]) for s in sorted({s for _, s in fastest})),
    )


# -- figures ---------------------------------------------------------------------------

LABELS = {
    "minibatch_md": "Minibatch MD",
    "mirror_prox": "Minibatch Mirror-prox",
    "fedavg_s": "FedAvg-S",
    "scaffold_s": "SCAFFOLD-S",
    "scaffold_catalyst_s": "SCAFFOLD-Catalyst-S (paper's stop heuristic)",
    "catalyst_ours": "SCAFFOLD-Catalyst-S (gradient stop, estimated theta)",
}


def _axis_label(convention: str) -> str:
    return "rounds (every exchange)" if convention == "exchanges" else "rounds (paper's count)"


def _convention_note(convention: str) -> str:
    if convention == "exchanges":
        return (
            "A round is every coordinator-clients exchange: SCAFFOLD-S and Catalyst spend 2 per sync "
            "(+1 at the start), Mirror-prox 2 per step, MD and FedAvg-S 1."
        )
    return (
        "A round as the paper counts: one per sync (FedAvg-S, SCAFFOLD-S, Catalyst) or MD step, "
        "two per Mirror-prox step; SCAFFOLD's G(z~) exchanges are not counted."
    )


def figure_curves(
    path: Path,
    best: dict[tuple[str, float], Best],
    algorithms: Sequence[str],
    s_values: Sequence[float],
    convention: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "rounds" if convention == "exchanges" else "paper_rounds"
    fig, axes = plt.subplots(1, len(s_values), figsize=(5 * len(s_values), 4.2), dpi=110, sharey=True)
    for ax, s in zip(np.atleast_1d(axes), s_values, strict=True):
        for algorithm in algorithms:
            b = best[(algorithm, s)]
            curves = [[(r[key], r["dist_x"]) for r in row.result.records] for row in b.rows]
            length = min(len(c) for c in curves)
            if length == 0:
                continue
            xs = [p[0] for p in curves[0][:length]]
            ys = np.maximum(np.array([[p[1] for p in c[:length]] for c in curves]), PLOT_FLOOR)
            style = "--" if algorithm == "catalyst_ours" else "-"
            ax.semilogy(xs, np.median(ys, axis=0), style, label=f"{LABELS[algorithm]} ({b.step_scale:g}/max(s,1))")
            ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), alpha=0.15)
        ax.set_title(f"s = {s:g}")
        ax.set_xlabel(_axis_label(convention))
        ax.grid(True, which="both", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(f"||x - x*||  (median over seeds, band: min-max; floor {PLOT_FLOOR:g})")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(_convention_note(convention), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def figure_final_vs_s(
    path: Path, best: dict[tuple[str, float], Best], algorithms: Sequence[str], budget: int, convention: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s_values = sorted({s for _, s in best})
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for algorithm in algorithms:
        means, lows, highs = [], [], []
        for s in s_values:
            finals = [max(f, PLOT_FLOOR) if math.isfinite(f) else np.nan for f in best[(algorithm, s)].finals]
            means.append(max(best[(algorithm, s)].geometric_mean, PLOT_FLOOR))
            lows.append(np.nanmin(finals) if not all(np.isnan(finals)) else np.nan)
            highs.append(np.nanmax(finals) if not all(np.isnan(finals)) else np.nan)
        m = np.array(means, dtype=float)
        m[~np.isfinite(m)] = np.nan
        err = np.array([m - np.array(lows), np.array(highs) - m])
        style = "--o" if algorithm == "catalyst_ours" else "-o"
        ax.errorbar(s_values, m, yerr=np.maximum(err, 0), fmt=style, ms=3, capsize=2, label=LABELS[algorithm])
    ax.set_yscale("log")
    ax.set_xlabel("s (heterogeneity and ill-conditioning)")
    ax.set_ylabel(f"||x - x*|| after {budget} rounds\nfloor {PLOT_FLOOR:g}; bars: min-max over seeds")
    ax.set_title(_convention_note(convention), fontsize=7, wrap=True)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out: Path, grid: Grid, rows: Sequence[Row], command: str) -> dict[tuple[str, float], Best]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    best = best_steps(rows)
    algorithms = [a for a in grid.algorithms if any(k[0] == a for k in best)]
    curve_s = [s for s in (0.0, 5.0, 10.0) if s in grid.s_values] or list(grid.s_values[:3])
    figure_curves(out / "figure1_curves.png", best, algorithms, curve_s, grid.convention)
    figure_final_vs_s(out / "figure2_final_vs_s.png", best, algorithms, grid.rounds, grid.convention)
    tables = [
        f"# Paper experiment ({grid.convention} convention)\n",
        f"Made by `{command}`.\n",
        markdown_table(best, algorithms, grid.convention),
        *(accuracy_table(rows, algorithms, a) for a in ACCURACIES),
    ]
    (out / "table.md").write_text("\n".join(tables))
    return best


# -- ablations: the paper's ambiguities, and Catalyst's theta and stop rule -------------

ABLATION_S = (0.0, 5.0, 10.0, 15.0)


def _catalyst(
    step: float, theta: float, stop: dict[str, Any], rule: str = "fixed", scale: float = 1.0
) -> dict[str, Any]:
    return {
        "name": "scaffold_catalyst_s",
        "gamma_local": step,
        "theta": theta,
        "theta_rule": rule,
        "theta_scale": scale,
        "stop": stop,
    }


def _catalyst_catalog(
    theta: float, stop: dict[str, Any], rule: str = "fixed", scale: float = 1.0
) -> Callable[[float], dict[str, dict[str, Any]]]:
    return lambda step: {"x": _catalyst(step, theta, stop, rule, scale)}


def ablations(
    seeds: tuple[int, ...] = (0, 1, 2), rounds: int = 500
) -> list[tuple[str, str, list[tuple[str, Grid, str]]]]:
    """(title, what it shows, [(variant label, grid, algorithm)]) for each question."""

    def grid(
        algorithm: str, catalog: Callable[[float], dict[str, dict[str, Any]]] = paper_algorithms, **kw: Any
    ) -> Grid:
        return Grid(s_values=ABLATION_S, seeds=seeds, rounds=rounds, algorithms=(algorithm,), catalog=catalog, **kw)

    def only(entry: Callable[[float], dict[str, Any]]) -> Callable[[float], dict[str, dict[str, Any]]]:
        return lambda step: {"x": entry(step)}

    objective = {"rule": "objective", "rtol": 1e-3, "max_inner_syncs": 50}
    gradient = {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50}
    return [
        (
            "Starting point",
            "The paper does not give z0. Default: x0 = y0 = 1 (all ones); alternative: z0 ~ N(0, I) per seed.",
            [
                (f"{a}, z0 = {init}", grid(a, overrides={"init": init}), a)
                for a in PAPER_FIVE
                for init in ("ones", "random")
            ],
        ),
        (
            "FedAvg-S local step",
            "The Experiments decay FedAvg-S's step as gamma / (sqrt(k) + 1); k is read as the global local-step index.",
            [
                ("decaying (paper)", grid("fedavg_s"), "fedavg_s"),
                (
                    "constant",
                    grid("x", only(lambda g: {"name": "fedavg_s", "gamma_local": g, "decay": "constant"})),
                    "x",
                ),
            ],
        ),
        (
            "Step size of the minibatch methods",
            "The paper uses the same grid {0.1, 0.05, 0.01}/max(s,1) for all methods, although MD and Mirror-prox "
            "take one step per round where the local methods take tau = 20. Alternative: the grid times tau.",
            [(f"{a}, grid", grid(a), a) for a in ("minibatch_md", "mirror_prox")]
            + [
                (f"{a}, grid x tau", grid(a, step_scales=tuple(20 * s for s in STEP_SCALES)), a)
                for a in ("minibatch_md", "mirror_prox")
            ],
        ),
        (
            "Catalyst's theta",
            "The paper fixes theta = 1; its theory says theta = beta - mu under high heterogeneity (about 10 to 30 "
            "here: beta is about max(a_i)/2 + 1, mu = lambda = 1e-5) and theta = c mu under low. 'estimated' sets "
            "theta = c mu_hat each meta-iteration, mu_hat the secant monotonicity along the iterates (starting at 1).",
            [
                (
                    f"theta = {theta:g}, {stop['rule']} stop",
                    grid("x", _catalyst_catalog(theta, stop)),
                    "x",
                )
                for stop in (objective, gradient)
                for theta in (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
            ]
            + [
                (
                    f"estimated, c = {c:g}, {stop['rule']} stop",
                    grid("x", _catalyst_catalog(1.0, stop, "estimated", c)),
                    "x",
                )
                for stop in (objective, gradient)
                for c in (0.5, 1.0, 2.0)
            ],
        ),
        (
            "Catalyst's inner stop rule",
            "The paper leaves a meta-iteration on 'sufficient objective decrease' without a threshold; "
            "the gradient rule leaves when ||G^theta(z~)|| <= rtol ||G(z_bar)||.",
            [
                (
                    f"{rule['rule']}, rtol = {rtol:g}",
                    grid("x", _catalyst_catalog(1.0, {**rule, "rtol": rtol})),
                    "x",
                )
                for rule, rtols in ((objective, (1e-2, 1e-3, 1e-4)), (gradient, (0.5, 0.1, 0.01)))
                for rtol in rtols
            ]
            + [
                (
                    "fixed, 10 inner syncs",
                    grid("x", _catalyst_catalog(1.0, {"rule": "fixed", "inner_syncs": 10})),
                    "x",
                )
            ],
        ),
    ]


def run_ablations(
    out: Path, command: str, seeds: tuple[int, ...] = (0, 1, 2), progress: Callable[[str], None] | None = None
) -> None:
    """Every ablation as a table: final ||x - x*|| (geometric mean over seeds, best step) at s = 0, 5, 10, 15."""
    out.mkdir(parents=True, exist_ok=True)
    data: dict[tuple[str, int], Shards] = {}
    lines = [
        "# Ablations\n",
        f"Made by `{command}`. Each cell: final ||x - x*|| after 500 rounds (every exchange counted), geometric mean "
        f"over {len(seeds)} seeds, at the best step of the variant's grid (its scale in parentheses). Values below "
        "1e-16 are at the floating-point floor of a distance to z* = 0.\n",
    ]
    for title, note, variants in ablations(seeds):
        rows: list[tuple[str, list[str]]] = []
        for label, grid, algorithm in variants:
            members = grid.members(algorithm)
            results = run_batch([m for _, m in members], data)
            best = best_steps([Row(key, result) for (key, _), result in zip(members, results, strict=True)])
            rows.append(
                (
                    label,
                    [
                        f"{_fmt(best[(algorithm, s)].geometric_mean)} ({best[(algorithm, s)].step_scale:g})"
                        for s in ABLATION_S
                    ],
                )
            )
            if progress:
                progress(f"{title}: {label}")
        lines.append(_table(f"## {title}\n\n{note}", "variant", [f"s = {s:g}" for s in ABLATION_S], rows))
    (out / "ablations.md").write_text("\n".join(lines))


# -- stochastic gradients: where each method levels off ---------------------------------

NOISE_LEVELS = (0.0, 0.01, 0.1, 1.0)


def run_noise(out: Path, command: str, s: float = 5.0, seeds: tuple[int, ...] = (0, 1, 2), rounds: int = 500) -> None:
    """Each method at the paper's largest step, under gradient noise sigma; figure and table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    data: dict[tuple[str, int], Shards] = {}
    algorithms = (*PAPER_FIVE, "catalyst_ours")
    curves: dict[tuple[str, float], list[AlgorithmResult]] = {}
    for sigma in NOISE_LEVELS:
        grid = Grid(s_values=(s,), seeds=seeds, rounds=rounds, step_scales=(0.1,), overrides={"gradient_noise": sigma})
        for algorithm in algorithms:
            members = grid.members(algorithm)
            curves[(algorithm, sigma)] = run_batch([m for _, m in members], data)
    fig, axes = plt.subplots(1, len(NOISE_LEVELS), figsize=(5 * len(NOISE_LEVELS), 4.2), dpi=110, sharey=True)
    lines = [
        "# Stochastic gradients\n",
        f"Made by `{command}`. s = {s:g}, step 0.1/max(s, 1), tau = 20, {len(seeds)} seeds; gradient noise "
        "E||G^_i - G_i||^2 = sigma^2, fresh for every oracle call (SCAFFOLD's two evaluations are independent). "
        "Cells: median over seeds of ||x - x*|| over the last 10% of the budget (where the curve levels off).\n",
    ]
    rows: list[tuple[str, list[str]]] = []
    for ax, sigma in zip(axes, NOISE_LEVELS, strict=True):
        cells = []
        for algorithm in algorithms:
            results = curves[(algorithm, sigma)]
            length = min(len(r.records) for r in results)
            xs = [rec["rounds"] for rec in results[0].records[:length]]
            ys = np.maximum(np.array([[rec["dist_x"] for rec in r.records[:length]] for r in results]), PLOT_FLOOR)
            style = "--" if algorithm == "catalyst_ours" else "-"
            ax.semilogy(xs, np.median(ys, axis=0), style, label=LABELS[algorithm])
            tail = ys[:, int(0.9 * length) :]
            cells.append(_fmt(float(np.median(tail))) if length else "diverged")
        rows.append((f"{sigma:g}", cells))
        ax.set_title(f"sigma = {sigma:g}")
        ax.set_xlabel(_axis_label("exchanges"))
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(_convention_note("exchanges"), fontsize=9)
    axes[0].set_ylabel(f"||x - x*|| (median over seeds; floor {PLOT_FLOOR:g})")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "figure_noise.png")
    plt.close(fig)
    lines.append(_table("", "sigma", algorithms, rows).lstrip("\n"))
    (out / "noise.md").write_text("\n".join(lines))
