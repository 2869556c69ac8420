"""Ablations: the choices the paper leaves open, and Catalyst's theta and stop rule.

Each ablation is a question and its variants; a variant is an algorithm entry
(without its step size), the step grid it is tried on, and any config fields it
changes. Every variant runs at every s of the paper's grid over 20 seeds, at the
best step of its grid; cells give the median over seeds and its interquartile range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsaddle.common.worker import ShardCache
from fedsaddle.server.batch import run_batch

from .grid import NAMES, PAPER_ENTRIES, PAPER_FIVE, STEP_GRIDS, STEP_SCALES, Grid, Row, best_steps, quartiles
from .report import fmt, markdown

ABLATION_S = tuple(float(s) for s in range(16))


@dataclass(frozen=True)
class Variant:
    label: str
    entry: dict[str, Any]  # an algorithm config entry, without its step size
    step_scales: tuple[float, ...] = STEP_SCALES
    overrides: dict[str, Any] = field(default_factory=dict)  # other config fields, e.g. init


@dataclass(frozen=True)
class Ablation:
    title: str
    question: str
    variants: tuple[Variant, ...]


def catalyst(theta: float, stop: dict[str, Any], rule: str = "fixed", scale: float = 1.0) -> dict[str, Any]:
    return {"name": "scaffold_catalyst_s", "theta": theta, "theta_rule": rule, "theta_scale": scale, "stop": stop}


OBJECTIVE_STOP = {"rule": "objective", "rtol": 1e-3, "max_inner_syncs": 50}
GRADIENT_STOP = {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50}
CATALYST_STEPS = (0.5, 0.2, 0.1)  # around Catalyst's best steps in the paper sweep

ABLATIONS = (
    Ablation(
        "Starting point",
        "The paper does not give z0. Default: x0 = y0 = 1 (all ones); alternative: z0 ~ N(0, I) per seed.",
        tuple(
            Variant(f"{NAMES[a]}, z0 = {init}", PAPER_ENTRIES[a], STEP_GRIDS[a], overrides={"init": init})
            for a in (*PAPER_FIVE, "catalyst_ours")
            for init in ("ones", "random")
        ),
    ),
    Ablation(
        "Catalyst's theta",
        "The paper fixes theta = 1; its theory says theta = beta - mu under high heterogeneity (about 10 to 30 "
        "here: beta is about max(a_i)/2 + 1, mu = lambda = 1e-5) and theta = c mu under low. 'estimated' sets "
        "theta = c mu_hat each meta-iteration, mu_hat the secant monotonicity along the iterates (starting at 1).",
        (
            *(
                Variant(f"theta = {theta:g}, {stop['rule']} stop", catalyst(theta, stop), CATALYST_STEPS)
                for stop in (OBJECTIVE_STOP, GRADIENT_STOP)
                for theta in (0.1, 1.0, 10.0)
            ),
            *(
                Variant(
                    f"estimated, c = {c:g}, gradient stop", catalyst(1.0, GRADIENT_STOP, "estimated", c), CATALYST_STEPS
                )
                for c in (0.5, 1.0, 2.0)
            ),
        ),
    ),
    Ablation(
        "Catalyst's inner stop rule",
        "The paper leaves a meta-iteration on 'sufficient objective decrease' without a threshold (its "
        "sensitivity to that threshold is in the paper sweep's tables); the gradient rule leaves when "
        "||G^theta(z~)|| <= rtol ||G(z_bar)||; or a fixed number of inner syncs.",
        (
            *(
                Variant(f"gradient, rtol = {rtol:g}", catalyst(1.0, {**GRADIENT_STOP, "rtol": rtol}), CATALYST_STEPS)
                for rtol in (0.5, 0.1, 0.01)
            ),
            Variant("fixed, 10 inner syncs", catalyst(1.0, {"rule": "fixed", "inner_syncs": 10}), CATALYST_STEPS),
        ),
    ),
)


def variant_grid(variant: Variant, seeds: tuple[int, ...], rounds: int) -> Grid:
    return Grid(
        s_values=ABLATION_S,
        seeds=seeds,
        rounds=rounds,
        step_scales=variant.step_scales,
        algorithms=(variant.label,),
        entries={variant.label: variant.entry},
        variants={},
        overrides=variant.overrides,
    )


def run_ablations(
    out: Path,
    command: str,
    seeds: tuple[int, ...] = tuple(range(20)),
    rounds: int = 500,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Every ablation as a table: final ||x - x*|| (median [IQR] over seeds, best step) at every s."""
    out.mkdir(parents=True, exist_ok=True)
    cache = ShardCache(size=len(ABLATION_S) * len(seeds))
    lines = [
        "# Ablations\n",
        f"Made by `{command}`. Each cell: final ||x - x*|| after {rounds} rounds (every exchange counted), median "
        f"[interquartile range] over {len(seeds)} seeds (0-{len(seeds) - 1}), at the best step of the variant's grid "
        "(its scale times 1/max(s,1) in parentheses). Values below 1e-16 are at the floating-point floor of a "
        "distance to z* = 0. Rows: s; columns: the variants.\n",
    ]
    done = 0
    for ablation in ABLATIONS:
        columns: list[list[str]] = []
        for variant in ablation.variants:
            grid = variant_grid(variant, seeds, rounds)
            members = grid.members(variant.label)
            results = run_batch([m for _, m in members], cache)
            best = best_steps([Row(key, result) for (key, _), result in zip(members, results, strict=True)])
            chosen = [best[(variant.label, s)] for s in ABLATION_S]
            columns.append([_cell(b.finals, b.step_scale) for b in chosen])
            done += 1
            if progress is not None:
                progress(done)
        labels = [v.label for v in ablation.variants]
        rows = [(f"{s:g}", [column[i] for column in columns]) for i, s in enumerate(ABLATION_S)]
        lines.append(markdown(f"## {ablation.title}\n\n{ablation.question}", "s", labels, rows))
    (out / "ablations.md").write_text("\n".join(lines))


def _cell(finals: list[float], scale: float) -> str:
    q1, median, q3 = quartiles(finals)
    return f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}] ({scale:g})"


def variant_count() -> int:
    return sum(len(a.variants) for a in ABLATIONS)
