"""Reports of the paper's sweep: the CSV of every run, Markdown tables, and the paper's two figures."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fedsaddle.server.config import RoundConvention

from .grid import ACCURACIES, NAMES, Best, Grid, Row, best_steps, quartiles

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


def _name(algorithm: str) -> str:
    return NAMES.get(algorithm, algorithm)


def _iqr(values: Sequence[float]) -> str:
    q1, median, q3 = quartiles(values)
    return f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}]"


def _choice(b: Best) -> str:
    variant = f", {b.variant}" if b.variant else ""
    return f"({b.step_scale:g}{variant}{', edge' if b.edge else ''})"


def final_table(best: dict[tuple[str, float], Best], algorithms: Sequence[str], grid: Grid) -> str:
    def cell(b: Best) -> str:
        diverged = f", {b.diverged} diverged" if b.diverged else ""
        return f"{_iqr(b.finals)} {_choice(b)}{diverged}"

    return markdown(
        f"Final ||x - x*|| after the budget ({grid.describe()}): median over seeds [interquartile range], at the "
        "best step of the method's grid (its scale times 1/max(s,1) in parentheses; 'edge': the best step is the "
        "grid's smallest or largest; for Catalyst (paper) also its best stop threshold).",
        "s",
        [_name(a) for a in algorithms],
        ((f"{s:g}", [cell(best[(a, s)]) for a in algorithms]) for s in sorted({s for _, s in best})),
    )


def accuracy_table(rows: Sequence[Row], algorithms: Sequence[str], accuracy: float, grid: Grid) -> str:
    """Rounds until ||x - x*|| <= accuracy: median [IQR] over seeds, at the (step, variant) that gets there fastest."""
    groups: dict[tuple[str, float, float, str], list[float]] = defaultdict(list)
    diverged: set[tuple[str, float, float, str]] = set()
    for row in rows:
        reached = row.rounds_to(accuracy)
        key = (row.key["algorithm"], row.key["s"], row.key["step_scale"], row.key.get("variant", ""))
        groups[key].append(math.inf if reached is None else float(reached))
        if row.result.status == "diverged":
            diverged.add(key)
    fastest: dict[tuple[str, float], tuple[float, list[float], float, str]] = {}
    for (algorithm, s, scale, variant), values in groups.items():
        # A step that diverges on some seeds is no choice, as for the final distance.
        median = math.inf if (algorithm, s, scale, variant) in diverged else quartiles(values)[1]
        if (algorithm, s) not in fastest or median < fastest[(algorithm, s)][0]:
            fastest[(algorithm, s)] = (median, values, scale, variant)

    def cell(median: float, values: list[float], scale: float, variant: str) -> str:
        if not math.isfinite(median):
            return "not reached"
        q1, _, q3 = quartiles(values)
        spread = f"[{q1:.0f}, {'not reached' if not math.isfinite(q3) else f'{q3:.0f}'}]"
        return f"{median:.0f} {spread} ({scale:g}{', ' + variant if variant else ''})"

    counted = grid.convention.words
    return markdown(
        f"Rounds until ||x - x*|| <= {accuracy:g} ({counted}): median over seeds [interquartile range], at the step "
        "of the grid that gets there fastest with no seed diverging (in parentheses); 'not reached' = not within "
        "the run's budget.",
        "s",
        [_name(a) for a in algorithms],
        ((f"{s:g}", [cell(*fastest[(a, s)]) for a in algorithms]) for s in sorted({s for _, s in fastest})),
    )


def stop_threshold_table(rows: Sequence[Row]) -> str | None:
    """The paper's Catalyst at each stop threshold: median final ||x - x*|| at that threshold's best step."""
    mine = [r for r in rows if r.key["algorithm"] == "scaffold_catalyst_s" and r.key.get("variant")]
    if not mine:
        return None
    by_variant: dict[str, list[Row]] = defaultdict(list)
    for row in mine:
        by_variant[row.key["variant"]].append(row)
    best = {variant: best_steps(members) for variant, members in by_variant.items()}
    variants = sorted(best, key=lambda v: -float(v.split("=")[1]))
    s_values = sorted({r.key["s"] for r in mine})
    return markdown(
        "Catalyst (paper): sensitivity to its stop threshold (the objective-decrease rtol). Final ||x - x*||, "
        "median over seeds [interquartile range], at each threshold's best step.",
        "s",
        variants,
        ((f"{s:g}", [f"{_iqr(best[v][('scaffold_catalyst_s', s)].finals)}" for v in variants]) for s in s_values),
    )


# -- figures ---------------------------------------------------------------------------

MARKERS = {
    "minibatch_md": "o",
    "mirror_prox": "s",
    "fedavg_s": "v",
    "fedavg_s_constant": "^",
    "scaffold_s": "D",
    "scaffold_catalyst_s": "P",
    "catalyst_ours": "*",
}
DIST_LABEL = r"$\|x - x^\star\|$"


def axis_label(convention: RoundConvention) -> str:
    if convention is RoundConvention.PAPER:
        return "communication rounds (paper's count)"
    return "communication rounds (every exchange)"


def convention_note(convention: RoundConvention) -> str:
    if convention is not RoundConvention.PAPER:
        return (
            "A round is every coordinator-clients exchange: SCAFFOLD-S and Catalyst spend 2 per sync "
            "(+1 at the start), Mirror-prox 2 per step, MD and FedAvg-S 1."
        )
    return (
        "A round as the paper counts: one per sync (FedAvg-S, SCAFFOLD-S, Catalyst) or MD step, "
        "two per Mirror-prox step; SCAFFOLD's G(z~) exchanges are not counted."
    )


def _curve(row: Row, key: str, length: int) -> tuple[list[float], list[float]]:
    """A run's (rounds, distance) padded to `length` points; a diverged run is +inf from its end on."""
    points = [(r[key], r["dist_x"]) for r in row.result.records]
    xs = [p[0] for p in points]
    ys = [p[1] if math.isfinite(p[1]) else math.inf for p in points]
    if row.result.status == "diverged" and ys:
        ys[-1] = math.inf
    return xs, ys + [math.inf if row.result.status == "diverged" else ys[-1]] * (length - len(ys))


def figure_curves(
    path: Path, best: dict[tuple[str, float], Best], algorithms: Sequence[str], s_values: Sequence[float], grid: Grid
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = grid.convention.record_key
    fig, axes = plt.subplots(1, len(s_values), figsize=(4.2 * len(s_values), 4.0), dpi=110, sharey=True)
    lines = {}
    for ax, s in zip(np.atleast_1d(axes), s_values, strict=True):
        chosen = []
        for algorithm in algorithms:
            b = best[(algorithm, s)]
            length = max(len(r.result.records) for r in b.rows)
            longest = max(b.rows, key=lambda r: len(r.result.records))
            xs = _curve(longest, key, length)[0]
            ys = np.array([_curve(r, key, length)[1] for r in b.rows])
            q1, median, q3 = np.percentile(ys, [25, 50, 75], axis=0, method="median_unbiased")
            finite = np.isfinite(median)
            style = "--" if algorithm == "catalyst_ours" else "-"
            (line,) = ax.semilogy(
                np.array(xs)[finite],
                np.maximum(median[finite], PLOT_FLOOR),
                style,
                marker=MARKERS.get(algorithm),
                markevery=max(1, int(finite.sum()) // 6),
                ms=4,
            )
            lines[algorithm] = line
            band = finite & np.isfinite(q3)
            ax.fill_between(
                np.array(xs)[band],
                np.maximum(q1[band], PLOT_FLOOR),
                np.maximum(q3[band], PLOT_FLOOR),
                color=line.get_color(),
                alpha=0.15,
            )
            if not finite.all():  # the median run diverged: marked where, not drawn off the scale
                at = np.array(xs)[~finite][0] if (~finite).any() else xs[-1]
                ax.plot([at], [1e2], "x", color=line.get_color(), ms=8, clip_on=False)
            chosen.append(f"{_name(algorithm)}: {b.step_scale:g}{', ' + b.variant if b.variant else ''}")
        ax.text(
            0.98,
            0.98,
            "steps (x 1/max(s,1)):\n" + "\n".join(chosen),
            transform=ax.transAxes,
            fontsize=6,
            va="top",
            ha="right",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"},
        )
        ax.set_title(f"$s = {s:g}$")
        ax.set_xlabel(axis_label(grid.convention))
        ax.set_ylim(PLOT_FLOOR / 10, 1e3)
        ax.grid(True, which="both", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(f"{DIST_LABEL}, median over seeds (band: interquartile range)")
    fig.legend(
        [lines[a] for a in algorithms],
        [_name(a) for a in algorithms],
        loc="lower center",
        ncol=min(4, len(algorithms)),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        f"{grid.describe()}; x: a diverged median run. {convention_note(grid.convention)}", fontsize=8, wrap=True
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.93))
    fig.savefig(path)
    plt.close(fig)


def figure_final_vs_s(path: Path, best: dict[tuple[str, float], Best], algorithms: Sequence[str], grid: Grid) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s_values = sorted({s for _, s in best})
    fig, ax = plt.subplots(figsize=(8.5, 4.8), dpi=110)
    for algorithm in algorithms:
        stats = [quartiles(best[(algorithm, s)].finals) for s in s_values]
        median = np.array([m for _, m, _ in stats])
        finite = np.isfinite(median)
        low = np.array([max(q1, PLOT_FLOOR) for q1, _, _ in stats])
        high = np.array([q3 if math.isfinite(q3) else 1e3 for _, _, q3 in stats])
        shown = np.maximum(median, PLOT_FLOOR)
        style = "--" if algorithm == "catalyst_ours" else "-"
        bars = ax.errorbar(
            np.array(s_values)[finite],
            shown[finite],
            yerr=np.maximum([shown[finite] - low[finite], high[finite] - shown[finite]], 0),
            fmt=style,
            marker=MARKERS.get(algorithm),
            ms=4,
            capsize=2,
            label=_name(algorithm),
        )
        if not finite.all():
            color = bars.lines[0].get_color()
            ax.plot(np.array(s_values)[~finite], [1e2] * int((~finite).sum()), "x", color=color, ms=8)
    ax.set_yscale("log")
    ax.set_ylim(PLOT_FLOOR / 10, 1e3)
    ax.set_xlabel("$s$ (heterogeneity and ill-conditioning)")
    ax.set_ylabel(f"final {DIST_LABEL} after {grid.rounds} rounds\n(median, bars: interquartile range)")
    ax.set_title(
        f"{grid.describe()}; best step of each method's grid per $s$; x: diverged median. "
        f"{convention_note(grid.convention)}",
        fontsize=7,
        wrap=True,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out: Path, grid: Grid, rows: Sequence[Row], command: str) -> dict[tuple[str, float], Best]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    best = best_steps(rows)
    algorithms = [a for a in grid.algorithms if any(k[0] == a for k in best)]
    curve_s = [s for s in (0.0, 5.0, 10.0, 15.0) if s in grid.s_values] or list(grid.s_values[:4])
    figure_curves(out / "figure1_curves.png", best, algorithms, curve_s, grid)
    figure_final_vs_s(out / "figure2_final_vs_s.png", best, algorithms, grid)
    edges = sorted(f"{_name(a)} at s = {s:g}" for (a, s), b in best.items() if b.edge)
    tables = [
        f"# Paper experiment ({grid.convention} convention)\n",
        f"Made by `{command}`. {grid.describe()}. Names: "
        + ", ".join(f"{_name(a)} = `{a}`" for a in algorithms)
        + " (the keys of runs.csv).\n",
        "Best step at its grid's edge: " + ("; ".join(edges) if edges else "nowhere") + ".\n",
        final_table(best, algorithms, grid),
        *(accuracy_table(rows, algorithms, a, grid) for a in ACCURACIES),
    ]
    sensitivity = stop_threshold_table(rows)
    if sensitivity is not None:
        tables.append(sensitivity)
    (out / "table.md").write_text("\n".join(tables))
    return best
