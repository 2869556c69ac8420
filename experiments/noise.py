"""Stochastic gradients: where each method levels off under gradient noise sigma."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsaddle.common.worker import ShardCache
from fedsaddle.server.batch import run_batch
from fedsaddle.server.config import RoundConvention
from fedsaddle.server.driver import AlgorithmResult

from .grid import NAMES, NEWER_BASELINES, SWEPT, Grid, quartiles
from .report import DIST_LABEL, MARKERS, PLOT_FLOOR, axis_label, convention_note, fmt, markdown

NOISE_LEVELS = (0.0, 0.01, 0.1, 1.0)


def run_noise(
    out: Path, command: str, s: float = 5.0, seeds: tuple[int, ...] = tuple(range(20)), rounds: int = 500
) -> None:
    """Each method at the paper's largest step, under gradient noise sigma; figure and table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    cache = ShardCache(size=len(seeds))
    # The paper's algorithms and their variants, as the documented report (docs/experiments/noise) has them.
    algorithms = tuple(a for a in SWEPT if a not in NEWER_BASELINES)
    curves: dict[tuple[str, float], list[AlgorithmResult]] = {}
    for sigma in NOISE_LEVELS:
        grid = Grid(
            s_values=(s,),
            seeds=seeds,
            rounds=rounds,
            step_scales=(0.1,),
            variants={},
            overrides={"gradient_noise": sigma},
        )
        for algorithm in algorithms:
            members = grid.members(algorithm)
            curves[(algorithm, sigma)] = run_batch([m for _, m in members], cache)
    fig, axes = plt.subplots(1, len(NOISE_LEVELS), figsize=(4.2 * len(NOISE_LEVELS), 4.0), dpi=110, sharey=True)
    handles = []
    lines = [
        "# Stochastic gradients\n",
        f"Made by `{command}`. s = {s:g}, step 0.1/max(s, 1), tau = 20, {len(seeds)} seeds; gradient noise "
        "E||G^_i - G_i||^2 = sigma^2, fresh for every oracle call (SCAFFOLD's two evaluations are independent). "
        "Cells: where ||x - x*|| levels off (each seed's median over the last 10% of the budget): median over seeds "
        "[interquartile range].\n",
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
            (line,) = ax.semilogy(
                xs, np.median(ys, axis=0), style, marker=MARKERS[algorithm], markevery=max(1, length // 6), ms=4
            )
            if sigma == NOISE_LEVELS[0]:
                handles.append(line)
            levels = np.median(ys[:, int(0.9 * length) :], axis=1)  # each seed's level over the last 10%
            q1, median, q3 = quartiles(list(levels))
            cells.append(f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}]" if length else "diverged")
        rows.append((f"{sigma:g}", cells))
        ax.set_title(rf"$\sigma = {sigma:g}$")
        ax.set_xlabel(axis_label(RoundConvention.EXCHANGES))
        ax.grid(True, which="both", alpha=0.3)
    seed_text = f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    fig.suptitle(
        f"Gradient noise: s = {s:g}, step 0.1/max(s,1) for every method, tau = 20, n = 10, d = 10, {seed_text}; "
        f"median over seeds. {convention_note(RoundConvention.EXCHANGES)}",
        fontsize=8,
        wrap=True,
    )
    axes[0].set_ylabel(f"{DIST_LABEL} (median over seeds; floor {PLOT_FLOOR:g})")
    fig.legend(handles, [NAMES[a] for a in algorithms], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 0.92))
    fig.savefig(out / "figure_noise.png")
    plt.close(fig)
    lines.append(markdown("", "sigma", [NAMES[a] for a in algorithms], rows).lstrip("\n"))
    (out / "noise.md").write_text("\n".join(lines))
