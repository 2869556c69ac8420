"""Stochastic gradients: where each method levels off under gradient noise sigma."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsaddle.common.worker import ShardCache
from fedsaddle.server.driver import AlgorithmResult

from .batch import run_batch
from .grid import PAPER_FIVE, Grid
from .report import LABELS, PLOT_FLOOR, axis_label, convention_note, fmt, markdown

NOISE_LEVELS = (0.0, 0.01, 0.1, 1.0)


def run_noise(out: Path, command: str, s: float = 5.0, seeds: tuple[int, ...] = (0, 1, 2), rounds: int = 500) -> None:
    """Each method at the paper's largest step, under gradient noise sigma; figure and table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    cache = ShardCache(size=len(seeds))
    algorithms = (*PAPER_FIVE, "catalyst_ours")
    curves: dict[tuple[str, float], list[AlgorithmResult]] = {}
    for sigma in NOISE_LEVELS:
        grid = Grid(s_values=(s,), seeds=seeds, rounds=rounds, step_scales=(0.1,), overrides={"gradient_noise": sigma})
        for algorithm in algorithms:
            members = grid.members(algorithm)
            curves[(algorithm, sigma)] = run_batch([m for _, m in members], cache)
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
            cells.append(fmt(float(np.median(tail))) if length else "diverged")
        rows.append((f"{sigma:g}", cells))
        ax.set_title(f"sigma = {sigma:g}")
        ax.set_xlabel(axis_label("exchanges"))
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(convention_note("exchanges"), fontsize=9)
    axes[0].set_ylabel(f"||x - x*|| (median over seeds; floor {PLOT_FLOOR:g})")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "figure_noise.png")
    plt.close(fig)
    lines.append(markdown("", "sigma", algorithms, rows).lstrip("\n"))
    (out / "noise.md").write_text("\n".join(lines))
