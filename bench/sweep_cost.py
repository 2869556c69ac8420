"""What a run of `fedsaddle experiment paper` costs, per algorithm, beside a numpy reproduction.

The sweep's shape (n = 10, d = 10, lambda = 1e-5, tau = 20, 500 rounds counted as
exchanges, every algorithm and variant of the sweep with its own step grid, 5
seeds) on half the values of s (--s; the sweep has 0..15). Each (algorithm,
variant) is one batch on one process, as big as each of the sweep's two worker
processes gets on a 2-core machine; the printed figure is the batch's CPU time (this
process's: the machine is shared) divided by its runs, the median over --repeats
sweeps, the sweeps alternating with the other layouts asked for.

--layouts: `declared` is the code as it is: Local Extragradient's and Local
SGDA+'s computations declare the step sizes they take one per run, so one worker
call serves every run of a round. `undeclared` runs the same two computations as
a plug-in that declares nothing: runs share a call only when their parameters are
equal (one call per step size), as every computation did before. Only those two
algorithms run in that layout; its summary takes the others' figures from
`declared`.

`numpy` is an independent reproduction of all ten (Local SGDA+ with a snapshot
every sync): plain numpy over arrays (runs, clients, d), all runs of an
algorithm at once, with the same data and ||x - x*|| recorded at every sync.
The two Catalysts run SCAFFOLD-S on the regularized clients inside the
meta-loop, each run's meta-iteration on its own clock: its theta, stop-rule
yardsticks and secant sums are arrays (runs,), and z_bar moves where a run's
stop rule holds. Its final iterates are compared with fedsaddle's (the largest
relative difference over the runs that did not diverge is printed: 0 means the
same bits). The cost of the reproduced algorithms together, weighted by their
runs (with all ten, the whole sweep's), is also given against numpy's.

    python bench/sweep_cost.py [--s 0,2,4,6,8,10,12,14] [--repeats 3] [--layouts declared,undeclared,numpy]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from fedsaddle.common import computations
from fedsaddle.common.problems.synthetic import PaperRegressionShards, PaperRegressionSpec
from fedsaddle.experiments.grid import NAMES, SWEPT, Grid
from fedsaddle.server.batch import BatchRun, run_batch
from fedsaddle.server.driver import initial_point

COMPUTING = ("local_extragradient", "local_sgda_plus")  # the sweep's algorithms with COMPUTE tasks


@contextmanager
def undeclared() -> Iterator[None]:
    """The two built-in computations as a plug-in that declares no per-run parameters would run."""
    saved = dict(computations.BUILT_IN)
    for name, fn in saved.items():
        computations.BUILT_IN[name] = lambda oracle, z, _fn=fn, **named: _fn(oracle, z, **named)
    try:
        yield
    finally:
        computations.BUILT_IN.clear()
        computations.BUILT_IN.update(saved)


def batches(grid: Grid) -> dict[str, list[list[BatchRun]]]:
    """Each algorithm's batches, one per variant, as `run_grid` makes them."""
    out: dict[str, list[list[BatchRun]]] = {}
    for algorithm in grid.algorithms:
        by_variant: dict[str, list[BatchRun]] = defaultdict(list)
        for key, member in grid.members(algorithm):
            by_variant[key["variant"]].append(member)
        out[algorithm] = list(by_variant.values())
    return out


def fedsaddle_sweep(work: dict[str, list[list[BatchRun]]]) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Seconds per run of each algorithm, and its runs' final iterates."""
    per_run, finals = {}, {}
    for algorithm, pieces in work.items():
        started = time.process_time()
        results = [r for piece in pieces for r in run_batch(piece)]
        per_run[algorithm] = (time.process_time() - started) / len(results)
        finals[algorithm] = results
    return per_run, finals


# -- the numpy reproduction -----------------------------------------------------------


def paper_data(runs: Sequence[BatchRun]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A_i / 2 and b_i / 2 as (R, n, d), and lambda as (R, 1, 1), of each run's clients."""
    half_a, half_b, lam = [], [], []
    for run in runs:
        spec = run.config.problem
        assert isinstance(spec, PaperRegressionSpec)
        shards = PaperRegressionShards(spec, run.config.seed, range(spec.num_clients))
        half_a.append(shards.a.T / 2)
        half_b.append(shards.b.T / 2)
        lam.append(spec.lam)
    return np.array(half_a), np.array(half_b), np.array(lam)[:, None, None]


def steps_of(runs: Sequence[BatchRun], field: str) -> np.ndarray:
    return np.array([getattr(run.spec, field) for run in runs])[:, None, None]


def reproduce(algorithm: str, grid: Grid, runs: Sequence[BatchRun]) -> np.ndarray:
    """The final z of every run, (R, 2d), from plain numpy; ||x|| (z* = 0) kept at every sync."""
    half_a, half_b, lam = paper_data(runs)
    _, n, d = half_a.shape
    tau, budget = grid.tau, grid.rounds
    z0 = np.array([initial_point(run.config) for run in runs])[:, None]  # where fedsaddle's runs start
    x, y = z0[..., :d], z0[..., d:]
    distances = []

    def grad(xi: np.ndarray, yi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return lam * xi - half_a * yi, yi - half_b + half_a * xi  # (grad_x, -grad_y)

    if algorithm == "minibatch_md":
        gamma = steps_of(runs, "gamma")
        for _ in range(budget):
            gx, gy = grad(x, y)
            x = x - gamma * gx.mean(axis=1, keepdims=True)
            y = y - gamma * gy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "mirror_prox":
        gamma = steps_of(runs, "gamma")
        for _ in range(budget // 2):  # two exchanges a step
            gx, gy = grad(x, y)
            x_half = x - gamma * gx.mean(axis=1, keepdims=True)
            y_half = y - gamma * gy.mean(axis=1, keepdims=True)
            gx, gy = grad(x_half, y_half)
            x = x - gamma * gx.mean(axis=1, keepdims=True)
            y = y - gamma * gy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "scaffold_s":
        gamma = steps_of(runs, "gamma_local")
        gamma_global = np.array(
            [run.spec.gamma_local if run.spec.gamma_global is None else run.spec.gamma_global for run in runs]
        )[:, None, None]
        gx, gy = grad(x, y)  # init: the control G(z0), one exchange
        cx, cy = gx.mean(axis=1, keepdims=True), gy.mean(axis=1, keepdims=True)
        for _ in range((budget - 1) // 2):  # a sync: the local steps, then G at the new z~
            start_x, start_y = grad(x, y)  # G_i(z~), each client's
            sx, sy = corrected_steps(grad, x, y, (start_x, start_y), (cx, cy), gamma, tau)
            x = x - gamma_global * sx.mean(axis=1, keepdims=True)
            y = y - gamma_global * sy.mean(axis=1, keepdims=True)
            gx, gy = grad(x, y)
            cx, cy = gx.mean(axis=1, keepdims=True), gy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "fedavg_s":  # the paper's decaying step: local step k weighs 1 / (sqrt(k) + 1)
        gamma = steps_of(runs, "gamma_local")  # gamma_global = gamma_local
        for sync in range(budget):
            xi, yi = np.repeat(x, n, axis=1), np.repeat(y, n, axis=1)
            sx, sy = np.zeros_like(xi), np.zeros_like(yi)
            for step in range(tau):
                w = 1.0 / (float(np.sqrt(sync * tau + step)) + 1.0)
                gx, gy = grad(xi, yi)
                sx += w * gx
                sy += w * gy
                xi, yi = xi - (gamma * w) * gx, yi - (gamma * w) * gy
            x = x - gamma * sx.mean(axis=1, keepdims=True)
            y = y - gamma * sy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "fedgda_gt":
        eta = steps_of(runs, "eta")
        for _ in range(budget // 2):  # G(z), then the local steps corrected by it
            start_x, start_y = grad(x, y)
            cx, cy = start_x.mean(axis=1, keepdims=True), start_y.mean(axis=1, keepdims=True)
            sx, sy = corrected_steps(grad, x, y, (start_x, start_y), (cx, cy), eta, tau)
            x = x - eta * sx.mean(axis=1, keepdims=True)
            y = y - eta * sy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "fedavg_s_constant":
        gamma = steps_of(runs, "gamma_local")
        for _ in range(budget):
            xi, yi = np.repeat(x, n, axis=1), np.repeat(y, n, axis=1)
            sx, sy = np.zeros_like(xi), np.zeros_like(yi)
            for _ in range(tau):
                gx, gy = grad(xi, yi)
                sx += gx
                sy += gy
                xi, yi = xi - gamma * gx, yi - gamma * gy
            x = x - gamma * sx.mean(axis=1, keepdims=True)
            y = y - gamma * sy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm in CATALYSTS:
        x, y = catalyst(runs, grad, half_a, half_b, lam, x, y, tau, (budget - 1) // 2, distances)
    elif algorithm == "local_extragradient":
        gamma = steps_of(runs, "gamma")
        for _ in range(budget):
            xi, yi = np.repeat(x, n, axis=1), np.repeat(y, n, axis=1)
            sx, sy = np.zeros_like(xi), np.zeros_like(yi)
            for _ in range(tau):
                gx, gy = grad(xi, yi)
                hx, hy = grad(xi - gamma * gx, yi - gamma * gy)
                sx += hx
                sy += hy
                xi, yi = xi - gamma * hx, yi - gamma * hy
            x = x - gamma * sx.mean(axis=1, keepdims=True)
            y = y - gamma * sy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    elif algorithm == "local_sgda_plus":
        eta = steps_of(runs, "eta_x")  # eta_y = eta_x in the sweep
        for _ in range(budget):
            snapshot = x  # refreshed every sync (snapshot_every = 1)
            xi, yi = np.repeat(x, n, axis=1), np.repeat(y, n, axis=1)
            sx, sy = np.zeros_like(xi), np.zeros_like(yi)
            for _ in range(tau):
                gx, _ = grad(xi, yi)
                _, gy = grad(snapshot, yi)
                sx += gx
                sy += gy
                xi, yi = xi - eta * gx, yi - eta * gy
            x = x - eta * sx.mean(axis=1, keepdims=True)
            y = y - eta * sy.mean(axis=1, keepdims=True)
            distances.append(np.linalg.norm(x, axis=2))
    else:
        raise ValueError(algorithm)
    return np.concatenate([x[:, 0], y[:, 0]], axis=1)


Grad = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (x, y) -> each client's G_i, two halves


def corrected_steps(
    grad: Grad,
    x: np.ndarray,
    y: np.ndarray,
    start: tuple[np.ndarray, np.ndarray],
    control: tuple[np.ndarray, np.ndarray],
    gamma: np.ndarray,
    tau: int,
    theta: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Every client's tau local steps from z~ = (x, y) along G_i(z_i) - G_i(z~) + c (SCAFFOLD-S, FedGDA-GT;
    `start` is G_i(z~), `control` c), or with Catalyst's `theta` along G_i(z_i) - G_i(z~) + theta (z_i - z~) + c,
    the regularized problem's: the sums of the directions, (R, n, d) twice."""
    (start_x, start_y), (cx, cy) = start, control
    n = start_x.shape[1]
    xi, yi = np.repeat(x, n, axis=1), np.repeat(y, n, axis=1)
    sx, sy = np.zeros_like(xi), np.zeros_like(yi)
    for _ in range(tau):
        gx, gy = grad(xi, yi)
        if theta is None:
            gx, gy = gx - start_x + cx, gy - start_y + cy
        else:  # (its own expression, not theta = 0 above: the same operations as fedsaddle's, bit for bit)
            gx, gy = gx - start_x + theta * (xi - x) + cx, gy - start_y + theta * (yi - y) + cy
        sx += gx
        sy += gy
        xi, yi = xi - gamma * gx, yi - gamma * gy
    return sx, sy


def ordered(v: np.ndarray, axis: int) -> np.ndarray:
    """The sum over one axis, added strictly in index order (fedsaddle's `ordered_sum`)."""
    return np.cumsum(v, axis=axis)[(slice(None),) * (axis % v.ndim) + (-1,)]


def catalyst(
    runs: Sequence[BatchRun],
    grad: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    half_a: np.ndarray,
    half_b: np.ndarray,
    lam: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    tau: int,
    syncs: int,
    distances: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """SCAFFOLD-S on f_i^theta = f_i + theta/2 ||x - x_bar||^2 - theta/2 ||y - y_bar||^2 inside the Catalyst
    meta-loop, every run's meta-iteration on its own clock: z_bar <- z~ where a run's stop rule holds.

    Each run's numbers that fedsaddle keeps as floats (theta, the stop rule's yardsticks, the secant sums)
    are arrays (R,) here. The stop rule is the objective change (Catalyst (paper)) or the gradient mapping
    (Catalyst (ours), with theta estimated from the secants); the sweep gives each algorithm one rule."""
    specs = [run.spec for run in runs]
    (rule,) = {spec.stop.rule for spec in specs}
    (theta_rule,) = {spec.theta_rule for spec in specs}
    n = half_a.shape[1]
    gamma = steps_of(runs, "gamma_local")
    gamma_global = np.array([s.gamma_local if s.gamma_global is None else s.gamma_global for s in specs])[:, None, None]
    rtol = np.array([spec.stop.rtol for spec in specs])
    max_syncs = np.array([spec.stop.max_inner_syncs for spec in specs])
    scale = np.array([spec.theta_scale for spec in specs])
    theta_max = 1.0 / gamma[:, 0, 0]  # (gamma_local > 0 in the sweep)
    floor = 100.0 * float(np.finfo(np.float64).eps)  # secants within 100 ulps of z~ are round-off
    a, b, lam_2 = 2.0 * half_a, 2.0 * half_b, lam[:, :, 0]

    def flat(u: np.ndarray, v: np.ndarray) -> np.ndarray:  # (R, 1, d) twice -> z as rows (R, 2d)
        return np.concatenate([u[:, 0], v[:, 0]], axis=1)

    def dot(u: np.ndarray, v: np.ndarray) -> np.ndarray:  # over the last, contiguous axis: as one vector's
        return np.sum(u * v, axis=-1)

    def mean_objective(xi: np.ndarray, yi: np.ndarray) -> np.ndarray:  # f(z) = (1/n) sum_i f_i(z), (R,)
        inner = ordered(yi * yi, 2) - ordered(b * yi, 2) + ordered(yi * a * xi, 2)
        return ordered(-0.5 * inner + 0.5 * lam_2 * ordered(xi * xi, 2), 1) / n

    def mean_grad(xi: np.ndarray, yi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        gx, gy = grad(xi, yi)
        return gx.mean(axis=1, keepdims=True), gy.mean(axis=1, keepdims=True)

    # init: G(z_bar^0) and f(z_bar^0), one exchange
    gx_t, gy_t = mean_grad(x, y)
    bar_x, bar_y = x, y
    theta = np.array([spec.theta for spec in specs])
    inner_syncs = np.zeros(len(runs), dtype=int)
    anchor_norm = np.sqrt(dot(flat(gx_t, gy_t), flat(gx_t, gy_t)))
    last = mean_objective(x, y) if rule == "objective" else np.zeros(len(runs))
    secant_inner, secant_norm = np.zeros(len(runs)), np.zeros(len(runs))
    for _ in range(syncs):
        t = theta[:, None, None]
        cx, cy = gx_t + t * (x - bar_x), gy_t + t * (y - bar_y)  # the control G^theta(z~)
        sx, sy = corrected_steps(grad, x, y, grad(x, y), (cx, cy), gamma, tau, theta=t)
        new_x = x - gamma_global * sx.mean(axis=1, keepdims=True)
        new_y = y - gamma_global * sy.mean(axis=1, keepdims=True)
        new_gx, new_gy = mean_grad(new_x, new_y)
        z_new, g_new = flat(new_x, new_y), flat(new_gx, new_gy)
        dz, dg = z_new - flat(x, y), g_new - flat(gx_t, gy_t)
        secant_inner, secant_norm = secant_inner + dot(dg, dz), secant_norm + dot(dz, dz)
        inner_syncs = inner_syncs + 1
        if rule == "objective":  # |f^theta(z~_k) - f^theta(z~_{k-1})| <= rtol |f^theta(z~_{k-1})|
            f = mean_objective(new_x, new_y)
            dx, dy = new_x[:, 0] - bar_x[:, 0], new_y[:, 0] - bar_y[:, 0]
            objective = f + 0.5 * theta * (dot(dx, dx) - dot(dy, dy))
            solved = np.abs(objective - last) <= rtol * np.abs(last)
        else:  # ||G^theta(z~)|| <= rtol ||G(z_bar)||
            g_theta = g_new + theta[:, None] * (z_new - flat(bar_x, bar_y))
            solved = np.sqrt(dot(g_theta, g_theta)) <= rtol * anchor_norm
            objective = f = last
        done = (inner_syncs >= max_syncs) | solved
        if theta_rule == "estimated":  # theta = c mu_hat, kept where the secants measure nothing
            measured = (secant_inner > 0) & (secant_norm > (floor * np.maximum(np.sqrt(dot(z_new, z_new)), 1.0)) ** 2)
            estimate = scale * (secant_inner / secant_norm)
            estimate = np.where(theta_max < estimate, theta_max, estimate)  # (Python's min(estimate, theta_max))
            theta = np.where(done & measured, estimate, theta)
        last = np.where(done, f, objective)
        inner_syncs = np.where(done, 0, inner_syncs)
        anchor_norm = np.where(done, np.sqrt(dot(g_new, g_new)), anchor_norm)
        secant_inner, secant_norm = np.where(done, 0.0, secant_inner), np.where(done, 0.0, secant_norm)
        keep = done[:, None, None]
        bar_x, bar_y = np.where(keep, new_x, bar_x), np.where(keep, new_y, bar_y)
        x, y, gx_t, gy_t = new_x, new_y, new_gx, new_gy
        distances.append(np.linalg.norm(x, axis=2))
    return x, y


CATALYSTS = ("scaffold_catalyst_s", "catalyst_ours")

REPRODUCED = (
    "minibatch_md",
    "mirror_prox",
    "fedavg_s",
    "fedavg_s_constant",
    "scaffold_s",
    *CATALYSTS,
    "fedgda_gt",
    "local_extragradient",
    "local_sgda_plus",
)


def numpy_sweep(grid: Grid, work: dict[str, list[list[BatchRun]]]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    per_run, finals = {}, {}
    for algorithm in (a for a in REPRODUCED if a in work):
        runs = [m for piece in work[algorithm] for m in piece]
        started = time.process_time()
        with np.errstate(all="ignore"):
            finals[algorithm] = reproduce(algorithm, grid, runs)
        per_run[algorithm] = (time.process_time() - started) / len(runs)
    return per_run, finals


def agreement(results: list[Any], reference: np.ndarray) -> tuple[float, int]:
    """The largest relative difference between fedsaddle's final z and the reproduction's, over runs that
    neither diverged, and how many runs those are."""
    worst, compared = 0.0, 0
    for result, z in zip(results, reference, strict=True):
        if result.status != "ok" or not np.isfinite(z).all():
            continue
        ours = np.asarray(result.final_z)
        worst = max(worst, float(np.max(np.abs(ours - z)) / max(np.max(np.abs(z)), 1e-300)))
        compared += 1
    return worst, compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--s", default="0,2,4,6,8,10,12,14", help="the values of s (the sweep: 0..15)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="declared,undeclared,numpy")
    parser.add_argument("--algorithms", default=",".join(SWEPT))
    args = parser.parse_args()
    grid = Grid(
        s_values=tuple(float(s) for s in args.s.split(",")),
        seeds=tuple(range(args.seeds)),
        algorithms=tuple(args.algorithms.split(",")),
    )
    layouts = args.layouts.split(",")
    work = batches(grid)
    sizes = {a: sum(len(p) for p in pieces) for a, pieces in work.items()}
    timings: dict[str, dict[str, list[float]]] = {layout: defaultdict(list) for layout in layouts}
    checks: dict[str, tuple[float, int]] = {}
    runners: dict[str, Callable[[], tuple[dict[str, float], Any]]] = {
        "declared": lambda: fedsaddle_sweep(work),
        "numpy": lambda: numpy_sweep(grid, work),
    }
    finals: dict[str, Any] = {}
    for _ in range(args.repeats):
        for layout in layouts:
            if layout == "undeclared":  # (only the two algorithms it changes)
                with undeclared():
                    per_run, out = fedsaddle_sweep({a: p for a, p in work.items() if a in COMPUTING})
            else:
                per_run, out = runners[layout]()
            finals[layout] = out
            for algorithm, seconds in per_run.items():
                timings[layout][algorithm].append(seconds)
    if "numpy" in finals and "declared" in finals:
        for algorithm in REPRODUCED:
            if algorithm in finals["declared"]:
                checks[algorithm] = agreement(finals["declared"][algorithm], finals["numpy"][algorithm])
    print(f"sweep of {sum(sizes.values())} runs: {grid.describe()}; s in {grid.s_values}")
    print(f"CPU ms per run, median of {args.repeats} alternating sweeps, one process")
    print(f"  {'algorithm':<28} {'runs':>5} " + " ".join(f"{layout:>11}" for layout in layouts))
    medians = {layout: {a: statistics.median(v) * 1e3 for a, v in timings[layout].items()} for layout in layouts}
    for algorithm in grid.algorithms:
        cells = [f"{medians[layout].get(algorithm, float('nan')):11.2f}" for layout in layouts]
        print(f"  {NAMES[algorithm]:<28} {sizes[algorithm]:5d} " + " ".join(cells))
    ordinary = [a for a in grid.algorithms if a not in COMPUTING]
    for layout in (x for x in layouts if x != "numpy"):
        m = {**medians.get("declared", {}), **medians[layout]}  # (`undeclared` changes only COMPUTING's)
        if ordinary and all(a in m for a in COMPUTING):
            base = sum(m[a] * sizes[a] for a in ordinary) / sum(sizes[a] for a in ordinary)
            ratios = ", ".join(f"{NAMES[a]} {m[a] / base:.2f}" for a in COMPUTING)
            print(f"  {layout}: ordinary tasks {base:.2f} ms per run; per-run cost against it: {ratios}")
        whole = sum(m[a] * sizes[a] for a in m) / sum(sizes[a] for a in m)
        print(f"  {layout}: the whole sweep {whole:.2f} ms per run")
        if "numpy" in medians:
            ratios = ", ".join(
                f"{NAMES[a]} {m[a] / medians['numpy'][a]:.2f}" for a in REPRODUCED if a in m and a in medians["numpy"]
            )
            print(f"  {layout} / numpy per run: {ratios}")
            both = [a for a in REPRODUCED if a in m and a in medians["numpy"]]
            if both:
                ours = sum(m[a] * sizes[a] for a in both)
                theirs = sum(medians["numpy"][a] * sizes[a] for a in both)
                if set(both) == set(grid.algorithms):
                    runs = sum(sizes.values())
                    print(
                        f"  {layout} / numpy over the whole sweep, weighted by runs: {ours / theirs:.2f}"
                        f" ({ours / runs:.2f} against {theirs / runs:.2f} ms per run)"
                    )
                else:
                    print(f"  {layout} / numpy over the {len(both)} reproduced algorithms' runs: {ours / theirs:.2f}")
    for algorithm, (worst, compared) in checks.items():
        print(
            f"  {NAMES[algorithm]}: largest relative difference of the final z from the reproduction's {worst:.1e}"
            f" ({compared} of {sizes[algorithm]} runs, those that did not diverge)"
        )


if __name__ == "__main__":
    main()
