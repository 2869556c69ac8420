"""`fedsaddle check-problem`: is a problem (a plug-in, on its data files) what fedsaddle assumes?

Checks, in order, and stops at the first that fails, naming it:

1. the problem loads, and every client's data file with it (the problem's own `check`);
2. its domain, if it declares one, fits z;
3. gradient: each client's G_i(z) against central differences of its objective,
   (df_i/dx, -df_i/dy), at a few random points of the domain;
4. monotonicity: <G_i(z) - G_i(w), z - w> >= 0 for each client, and for the
   federation's G, on random pairs (what convex-concave f_i guarantee); the
   smallest and largest ratios estimate mu (strong monotonicity) and L;
5. z*: the problem's `reference_solution`, or else a numerical saddle point
   (common/problems/solve.py), with the residual it reached and the accuracy that
   implies; distances to it finer than that accuracy are never printed.

Everything runs in this process, on all clients' data: a tool for the problem's
author, not for a federation's coordinator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.numeric import Array, norm
from fedsaddle.common.problems import DataProblem, ProblemShards, Shards, make_problem
from fedsaddle.common.problems.domains import Domain, Simplex, problem_domain
from fedsaddle.common.problems.solve import NumericalSaddle, numerical_saddle
from fedsaddle.common.problems.solve import residual as residual_at
from fedsaddle.common.worker import ShardCache
from fedsaddle.server.config import RunConfig

GRADIENT_RTOL = 1e-5  # central differences with h = 1e-6 are good to ~1e-9 relative on smooth f_i


@dataclass
class CheckReport:
    lines: list[str] = field(default_factory=list)
    failure: str | None = None
    z_star: NumericalSaddle | None = None

    def say(self, line: str) -> None:
        self.lines.append(line)

    def fail(self, line: str) -> CheckReport:
        self.failure = line
        self.lines.append("FAILED " + line)
        return self


class Federation:
    """All clients' oracles in this process: G_i and f_i per client, G of the federation."""

    def __init__(self, config: RunConfig, shards: Shards) -> None:
        self.shards = shards
        self.n = config.problem.num_clients
        counts = getattr(shards, "sample_counts", None)
        self.counts: Array | None = None  # the sample counts, when the run weights by them
        if config.weighting == "samples" and counts is not None:
            self.counts = np.asarray(counts(), dtype=float)
            self.weights = self.counts / self.counts.sum()
        else:
            self.weights = np.full(self.n, 1.0 / self.n)

    def gradients(self, z: Array) -> Array:
        """(D, n): G_i(z) of every client."""
        return self.shards.gradient(np.ascontiguousarray(np.repeat(z[:, None], self.n, axis=1)))

    def objectives(self, columns: Array) -> Array:
        """(n,): f_i at client i's own column."""
        return self.shards.objective(np.ascontiguousarray(columns))

    def field(self, z: Array) -> Array:
        """G(z) = sum_i w_i G_i(z)."""
        result: Array = self.gradients(z) @ self.weights
        return result


def check_problem(
    config: RunConfig, data: dict[int, str], points: int = 3, pairs: int = 20, seed: int = 0, seconds: float = 60.0
) -> CheckReport:
    report = CheckReport()
    problem = make_problem(config.problem)
    dim_x, dim_y = problem.dims()
    where = config.problem.plugin or type(problem).__module__ + ":" + type(problem).__name__
    report.say(
        f"problem {config.problem.name} ({where}): dim_x {dim_x}, dim_y {dim_y}, {config.problem.num_clients} clients"
    )
    domain = problem_domain(problem)  # a misfit was refused with the config already
    report.say("domain: " + ("unconstrained" if domain is None else domain.describe()))
    shards = ShardCache(size=1, data=data).get(
        config.problem, config.seed, range(config.problem.num_clients), config.weighting
    )
    if isinstance(shards, ProblemShards):
        rows = [d.samples for d in shards.datas]
        report.say(f"data: {len(rows)} client files loaded ({min(rows)} to {max(rows)} training rows each)")
    federation = Federation(config, shards)
    rng = np.random.default_rng(seed)
    dimension = dim_x + dim_y

    if _gradient_check(report, federation, dim_x, _points(rng, dimension, points, domain)):
        if getattr(config.problem, "dtype", "float64") == "float32":
            report.say(
                "the problem computes in float32, where central differences of f_i are too coarse for this check: "
                "check it with `dtype: float64` in its spec"
            )
        return report
    estimates = _monotonicity_check(report, federation, _points(rng, dimension, 2 * pairs, domain))
    if estimates is None:
        return report
    mu, lipschitz = estimates
    _solution(report, problem, shards, federation, domain, mu, lipschitz, dimension, seconds)
    return report


def _points(rng: np.random.Generator, dimension: int, count: int, domain: Domain | None) -> list[Array]:
    """Random points of the domain, inside its simplices (so that small differences stay near it)."""
    found = []
    for _ in range(count):
        z = rng.standard_normal(dimension)
        if domain is not None:
            z = domain.project(z)
            for rows, block in domain.constrained:
                if isinstance(block, Simplex):
                    z[rows] = 0.5 * z[rows] + 0.5 / block.size
        found.append(z)
    return found


def _gradient_check(report: CheckReport, federation: Federation, dim_x: int, points: Sequence[Array]) -> bool:
    """True if it failed (and said where)."""
    worst = 0.0
    for p, z in enumerate(points):
        g = federation.gradients(z)  # (D, n)
        columns = np.repeat(z[:, None], federation.n, axis=1)
        for j in range(z.size):
            h = 1e-6 * max(1.0, abs(float(z[j])))
            up, down = columns.copy(), columns.copy()
            up[j] += h
            down[j] -= h
            derivative = (federation.objectives(up) - federation.objectives(down)) / (2 * h)
            expected = derivative if j < dim_x else -derivative  # G = (grad_x f, -grad_y f)
            error = np.abs(g[j] - expected) / np.maximum(1.0, np.abs(expected))
            worst = max(worst, float(error.max()))
            wrong = np.flatnonzero(~(error <= GRADIENT_RTOL))  # (NaN is wrong too)
            if wrong.size:
                i = int(wrong[0])  # the first client, in index order
                name = f"x[{j}]" if j < dim_x else f"y[{j - dim_x}]"
                report.fail(
                    f"gradient: client {federation.shards.indices[i]}, point {p}, entry {j} ({name}): gradient() gives "
                    f"{float(g[j, i]):.9g}, central differences of objective() {float(expected[i]):.9g} (relative "
                    f"error {float(error[i]):.2e} > {GRADIENT_RTOL:g}); G_i(z) must be (grad_x f_i, -grad_y f_i)"
                )
                return True
    report.say(
        f"gradient vs central differences of the objective: ok ({len(points)} points x {federation.n} clients x "
        f"{points[0].size} entries; worst relative error {worst:.1e})"
    )
    return False


def _monotonicity_check(
    report: CheckReport, federation: Federation, points: Sequence[Array]
) -> tuple[float, float] | None:
    """(mu, L) estimated over the pairs, or None if it failed (and said where)."""
    mu, lipschitz = math.inf, 0.0
    for p in range(len(points) // 2):
        z, w = points[2 * p], points[2 * p + 1]
        dz = z - w
        dg = federation.gradients(z) - federation.gradients(w)  # (D, n)
        inner = dz @ dg  # (n,)
        slack = 1e-9 * np.sqrt(np.sum(dg * dg, axis=0)) * norm(dz) + 1e-300
        bad = np.flatnonzero(inner < -slack)
        if bad.size:
            i = int(bad[0])
            report.fail(
                f"monotonicity: client {federation.shards.indices[i]}, pair {p}: <G_i(z) - G_i(w), z - w> = "
                f"{inner[i]:.3e} < 0, so f_i is not convex-concave (convex in x, concave in y) there"
            )
            return None
        field = dg @ federation.weights
        mu = min(mu, float(dz @ field) / float(dz @ dz))
        lipschitz = max(lipschitz, norm(field) / norm(dz))
    report.say(
        f"monotonicity of G on {len(points) // 2} random pairs: ok (every client and the federation; "
        f"estimated mu {mu:.3g}, L {lipschitz:.3g} for the federation's G)"
    )
    return mu, lipschitz


def _solution(
    report: CheckReport,
    problem: Any,
    shards: Shards,
    federation: Federation,
    domain: Domain | None,
    mu: float,
    lipschitz: float,
    dimension: int,
    seconds: float,
) -> None:
    known = None
    if isinstance(problem, DataProblem) and isinstance(shards, ProblemShards):
        known = problem.reference_solution(shards.datas, federation.counts)
    if known is not None:
        r = residual_at(federation.field, np.asarray(known, dtype=float), domain)
        bound = _bound(r, mu, lipschitz, domain)
        report.z_star = NumericalSaddle(np.asarray(known, dtype=float), r, bound, "reference_solution()", 0)
        report.say(f"z*: reference_solution(): residual {r:.2e}, so ||z - z*|| is known to {_accuracy(bound)}")
        return
    found = numerical_saddle(federation.field, np.zeros(dimension), domain, mu, lipschitz, seconds=seconds)
    report.z_star = found
    reached = "reached 1e-12" if found.residual <= 1e-12 else "did NOT reach 1e-12"
    report.say(
        f"z*: no reference_solution(); numerical ({found.method}, {found.iterations} iterations): residual "
        f"{found.residual:.2e} ({reached}), so ||z - z*|| is known to {_accuracy(found.accuracy)}"
    )


def _bound(r: float, mu: float, lipschitz: float, domain: Domain | None) -> float:
    if not (mu > 0):
        return math.inf
    return r / mu if domain is None else (1 + lipschitz) * r / mu


def _accuracy(bound: float) -> str:
    return "no bound (no positive mu seen)" if not math.isfinite(bound) else f"{bound:.1e}"


def distances(report: CheckReport, run_dir: Path, dim_x: int) -> list[str]:
    """Each final iterate's distance to z*, never finer than z*'s accuracy."""
    assert report.z_star is not None
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [f"{run_dir}:"]
    for entry in summary["algorithms"]:
        if entry.get("z_file") is None:
            lines.append(f"  {entry['name']}: no final iterate file")
            continue
        z = np.load(run_dir / entry["z_file"], allow_pickle=False)
        accuracy = report.z_star.accuracy
        cells = []
        for label, part in (("x", slice(0, dim_x)), ("z", slice(None))):
            d = norm(z[part] - report.z_star.z[part])
            cells.append(
                f"||{label} - {label}*|| " + (f"< {accuracy:.1e} (z*'s accuracy)" if d < accuracy else f"{d:.3e}")
            )
        if not math.isfinite(accuracy):
            cells = ["no distance: z*'s accuracy is unknown"]
        lines.append(f"  {entry['name']}: " + ", ".join(cells))
    return lines
