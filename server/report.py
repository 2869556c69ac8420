"""Run outputs: per-round metrics (JSON Lines), a summary (JSON), a plot (PNG), a table."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedsaddle.common.problems import make_problem
from fedsaddle.server.config import RunConfig
from fedsaddle.server.driver import AlgorithmResult

log = logging.getLogger("fedsaddle.coordinator")


def make_run_dir(config: RunConfig) -> Path:
    """A fresh folder below config.output.dir, named after the config and the time."""
    base = Path(config.output.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        path = base / (f"{config.name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory below {base}")


def write_summary(
    run_dir: Path, config: RunConfig, results: Sequence[AlgorithmResult], transport: dict[str, Any]
) -> None:
    """summary.json and the plot, once the run has ended (config.json and metrics.jsonl are written as it goes)."""
    summary = {
        "name": config.name,
        "transport": transport,
        "round_convention": config.round_convention,
        "budget": config.rounds,
        "algorithms": [r.summary() for r in results],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if config.output.plot:
        try:
            plot_distances(run_dir / "distance.png", config, results)
        except ImportError:
            log.warning("no distance.png: matplotlib is not installed (pip install 'fedsaddle[plot]')")


def plot_distances(path: Path, config: RunConfig, results: Sequence[AlgorithmResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "rounds" if config.round_convention == "exchanges" else "paper_rounds"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    finite = [r["dist_x"] for result in results for r in result.records if math.isfinite(r.get("dist_x", math.nan))]
    starts = [result.records[0]["dist_x"] for result in results if result.records and "dist_x" in result.records[0]]
    # A diverged run is drawn up to where it leaves the scale, and marked there: the axis stays readable.
    ceiling = 100 * max([*starts, 1e-300]) if starts else (max(finite) if finite else 1.0)
    for result in results:
        points = [(r[key], r["dist_x"]) for r in result.records if "dist_x" in r and r["dist_x"] > 0]
        shown = [(x, y) for x, y in points if math.isfinite(y) and y <= ceiling]
        if shown:
            xs, ys = zip(*shown, strict=True)
            label = result.name + (" (diverged)" if result.status == "diverged" else "")
            (line,) = ax.semilogy(xs, ys, label=label)
            if result.status == "diverged":
                ax.plot([xs[-1]], [ys[-1]], "x", color=line.get_color(), ms=9)
    if finite:
        ax.set_ylim(max(min(finite), 1e-300) / 10, ceiling * 10)
    axis = (
        "communication rounds (every exchange counted)"
        if key == "rounds"
        else "communication rounds (paper's convention)"
    )
    ax.set_xlabel(axis)
    ax.set_ylabel(r"$\|x - x^\star\|$")
    dim_x, dim_y = make_problem(config.problem).dims()
    ax.set_title(f"{config.name}: {config.problem.name}, n={config.problem.num_clients}, dim x={dim_x}, y={dim_y}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.3e}"


def table(results: Sequence[AlgorithmResult]) -> str:
    """One row per algorithm: accuracy, communication and time."""
    header = (
        f"{'algorithm':<22} {'||x-x*||':>10} {'||z-z*||':>10} {'rounds':>6} "
        f"{'msgs down/up':>13} {'MB down/up (payload)':>21} {'MB down/up (wire)':>18} {'wall s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        t = r.traffic["algorithm"]
        payload = f"{t['floats_down'] * 8 / 1e6:.3f}/{t['floats_up'] * 8 / 1e6:.3f}"
        wire = f"{t['bytes_down'] / 1e6:.3f}/{t['bytes_up'] / 1e6:.3f}" if t["bytes_down"] else "-"
        status = "" if r.status == "ok" else f"  [{r.status}]"
        lines.append(
            f"{r.name:<22} {_fmt(r.dist_x):>10} {_fmt(r.dist_z):>10} {t['rounds']:>6} "
            f"{str(t['messages_down']) + '/' + str(t['messages_up']):>13} {payload:>21} {wire:>18} "
            f"{r.wall_s:>7.2f}{status}"
        )
    return "\n".join(lines)
