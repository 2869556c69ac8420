"""Reports of the paper's sweep: the CSV of every run, Markdown tables, and the paper's two figures."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .grid import ACCURACIES, Best, Grid, Row, best_steps

# Figures clip distances at this floor: with z* = 0 (s = 0 especially) iterates shrink
# past any meaningful accuracy, and 1e-100 would flatten every other curve.
PLOT_FLOOR = 1e-16


def write_csv(path: Path, rows: Sequence[Row]) -> None:
    lines = [row.as_csv() for row in rows]
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)


def fmt(value: float) -> str:
    if not math.isfinite(value):
        return "diverged"
    return "0" if value <= 1e-300 else f"{value:.1e}"


def markdown(caption: str, first: str, columns: Sequence[str], rows: Iterable[tuple[str, Sequence[str]]]) -> str:
    """A Markdown table under its caption: a header of `first` and `columns`, then (label, cells) rows."""
    lines = [caption, "", f"| {first} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines) + "\n"


def final_table(best: dict[tuple[str, float], Best], algorithms: Sequence[str], convention: str) -> str:
    counted = "every exchange counted" if convention == "exchanges" else "the paper's convention"

    def cell(b: Best) -> str:
        return f"{fmt(b.geometric_mean)} [{fmt(min(b.finals))}, {fmt(max(b.finals))}] ({b.step_scale:g})"

    return markdown(
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

    return markdown(
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


def axis_label(convention: str) -> str:
    return "rounds (every exchange)" if convention == "exchanges" else "rounds (paper's count)"


def convention_note(convention: str) -> str:
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
        ax.set_xlabel(axis_label(convention))
        ax.grid(True, which="both", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(f"||x - x*||  (median over seeds, band: min-max; floor {PLOT_FLOOR:g})")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(convention_note(convention), fontsize=9)
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
    ax.set_title(convention_note(convention), fontsize=7, wrap=True)
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
        final_table(best, algorithms, grid.convention),
        *(accuracy_table(rows, algorithms, a) for a in ACCURACIES),
    ]
    (out / "table.md").write_text("\n".join(tables))
    return best
