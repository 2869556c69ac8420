"""Ablations: the choices the paper leaves open, and Catalyst's theta and stop rule.

Each ablation is a question and its variants; a variant is an algorithm entry
(without its step size), the step grid it is tried on, and any config fields it
changes. Every variant runs at s = 0, 5, 10, 15 over a few seeds, at the best
step of its grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsaddle.common.worker import ShardCache

from .batch import run_batch
from .grid import PAPER_ENTRIES, PAPER_FIVE, STEP_SCALES, Grid, Row, best_steps
from .report import fmt, markdown

ABLATION_S = (0.0, 5.0, 10.0, 15.0)


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

ABLATIONS = (
    Ablation(
        "Starting point",
        "The paper does not give z0. Default: x0 = y0 = 1 (all ones); alternative: z0 ~ N(0, I) per seed.",
        tuple(
            Variant(f"{a}, z0 = {init}", PAPER_ENTRIES[a], overrides={"init": init})
            for a in PAPER_FIVE
            for init in ("ones", "random")
        ),
    ),
    Ablation(
        "FedAvg-S local step",
        "The Experiments decay FedAvg-S's step as gamma / (sqrt(k) + 1); k is read as the global local-step index.",
        (
            Variant("decaying (paper)", PAPER_ENTRIES["fedavg_s"]),
            Variant("constant", {"name": "fedavg_s", "decay": "constant"}),
        ),
    ),
    Ablation(
        "Step size of the minibatch methods",
        "The paper uses the same grid {0.1, 0.05, 0.01}/max(s,1) for all methods, although MD and Mirror-prox "
        "take one step per round where the local methods take tau = 20. Alternative: the grid times tau.",
        (
            *(Variant(f"{a}, grid", PAPER_ENTRIES[a]) for a in ("minibatch_md", "mirror_prox")),
            *(
                Variant(f"{a}, grid x tau", PAPER_ENTRIES[a], tuple(20 * s for s in STEP_SCALES))
                for a in ("minibatch_md", "mirror_prox")
            ),
        ),
    ),
    Ablation(
        "Catalyst's theta",
        "The paper fixes theta = 1; its theory says theta = beta - mu under high heterogeneity (about 10 to 30 "
        "here: beta is about max(a_i)/2 + 1, mu = lambda = 1e-5) and theta = c mu under low. 'estimated' sets "
        "theta = c mu_hat each meta-iteration, mu_hat the secant monotonicity along the iterates (starting at 1).",
        (
            *(
                Variant(f"theta = {theta:g}, {stop['rule']} stop", catalyst(theta, stop))
                for stop in (OBJECTIVE_STOP, GRADIENT_STOP)
                for theta in (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
            ),
            *(
                Variant(f"estimated, c = {c:g}, {stop['rule']} stop", catalyst(1.0, stop, "estimated", c))
                for stop in (OBJECTIVE_STOP, GRADIENT_STOP)
                for c in (0.5, 1.0, 2.0)
            ),
        ),
    ),
    Ablation(
        "Catalyst's inner stop rule",
        "The paper leaves a meta-iteration on 'sufficient objective decrease' without a threshold; "
        "the gradient rule leaves when ||G^theta(z~)|| <= rtol ||G(z_bar)||.",
        (
            *(
                Variant(f"{stop['rule']}, rtol = {rtol:g}", catalyst(1.0, {**stop, "rtol": rtol}))
                for stop, rtols in ((OBJECTIVE_STOP, (1e-2, 1e-3, 1e-4)), (GRADIENT_STOP, (0.5, 0.1, 0.01)))
                for rtol in rtols
            ),
            Variant("fixed, 10 inner syncs", catalyst(1.0, {"rule": "fixed", "inner_syncs": 10})),
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
        overrides=variant.overrides,
    )


def run_ablations(
    out: Path,
    command: str,
    seeds: tuple[int, ...] = (0, 1, 2),
    rounds: int = 500,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Every ablation as a table: final ||x - x*|| (geometric mean over seeds, best step) at s = 0, 5, 10, 15."""
    out.mkdir(parents=True, exist_ok=True)
    cache = ShardCache(size=len(ABLATION_S) * len(seeds))
    lines = [
        "# Ablations\n",
        f"Made by `{command}`. Each cell: final ||x - x*|| after {rounds} rounds (every exchange counted), geometric "
        f"mean over {len(seeds)} seeds, at the best step of the variant's grid (its scale in parentheses). Values "
        "below 1e-16 are at the floating-point floor of a distance to z* = 0.\n",
    ]
    done = 0
    for ablation in ABLATIONS:
        cells: list[tuple[str, list[str]]] = []
        for variant in ablation.variants:
            grid = variant_grid(variant, seeds, rounds)
            members = grid.members(variant.label)
            results = run_batch([m for _, m in members], cache)
            best = best_steps([Row(key, result) for (key, _), result in zip(members, results, strict=True)])
            chosen = [best[(variant.label, s)] for s in ABLATION_S]
            cells.append((variant.label, [f"{fmt(b.geometric_mean)} ({b.step_scale:g})" for b in chosen]))
            done += 1
            if progress is not None:
                progress(done)
        lines.append(
            markdown(
                f"## {ablation.title}\n\n{ablation.question}", "variant", [f"s = {s:g}" for s in ABLATION_S], cells
            )
        )
    (out / "ablations.md").write_text("\n".join(lines))


def variant_count() -> int:
    return sum(len(a.variants) for a in ABLATIONS)
