"""What a run's records say happened: converged, not converged (and how it was going), or diverged.

A run's `status` says how it ended (`ok`: within its budget; `diverged`; `stopped`);
its verdict says where it got to, by these rules, in this order:

1. **The measure.** ||z - z*|| when the records carry it (z* known: a synthetic
   problem's, the problem's `reference_solution`, or `--reference`); else the
   projected residual ||z - P(z - G(z))|| on a constrained problem, or ||G(z)||,
   when `output.gradient_norm` records them. With none of them the verdict is
   `unknown`.
2. **diverged**: the status is `diverged` (an iterate that is not finite, or
   ||z - z*|| grown 10^4-fold over its start); or the last measure is not finite;
   or, where the problem gives a scale, the last ||z - z*|| is more than
   `DIVERGED_OVER_SCALE` (10) times it: the scale is max(||z*||, ||z0 - z*||), so
   the iterate ended ten times farther from z* than both the origin and the
   starting point are; or the last ||G|| (residual) is more than
   `DIVERGED_OVER_START` (100) times the first one recorded.
3. **converged**: the last measure is at most `output.converged_below`, or below
   z*'s accuracy (a `--reference` solved to a coarser accuracy cannot tell more).
4. **not converged**, with the last value and its trend over the last half of
   the recorded values (w_0 ... w_k): `decreasing` when w_k <= 0.8 w_0, `growing`
   when w_k >= 1.25 w_0, else `oscillating` when the window spans a factor of at
   least 2 and at least a third of its successive changes turn direction, else
   `stalled`.

The verdict is computed from the records after the run: it never changes a run's
iterates, its status or when it stops. `output.stop_beyond_scale` applies the scale
rule of 2 while the run goes (server/driver.py, `Run.record`), stopping it there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

DIVERGED_OVER_SCALE = 10.0
DIVERGED_OVER_START = 100.0

VerdictKind = Literal["converged", "not converged", "diverged", "unknown"]
Trend = Literal["decreasing", "growing", "oscillating", "stalled", "one value"]

# The measures in the order they are preferred, with how a verdict names them.
MEASURES = (("dist_z", "||z-z*||"), ("residual", "||z-P(z-G(z))||"), ("grad_norm", "||G(z)||"))


class Verdict(NamedTuple):
    kind: VerdictKind
    detail: str


def measure_of(records: Sequence[dict[str, float | int]]) -> tuple[str, str] | None:
    """The records' key of the measure a verdict is judged by, and its name; None without one."""
    for key, label in MEASURES:
        if any(key in record for record in records):
            return key, label
    return None


def trend(values: Sequence[float]) -> tuple[Trend, float]:
    """How the last half of `values` went (see the module's rules), and the factor w_k / w_0."""
    window = list(values[len(values) // 2 :]) if len(values) > 2 else list(values)
    if len(window) < 2:
        return "one value", 1.0
    first, last = window[0], window[-1]
    ratio = last / first if first > 0 else math.inf if last > 0 else 1.0
    if ratio <= 0.8:
        return "decreasing", ratio
    if ratio >= 1.25:
        return "growing", ratio
    steps = [b - a for a, b in itertools.pairwise(window) if b != a]
    turns = sum((a > 0) != (b > 0) for a, b in itertools.pairwise(steps))
    low = min(window)
    spans = max(window) >= 2 * low if low > 0 else max(window) > 0
    if spans and len(steps) > 1 and 3 * turns >= len(steps) - 1:
        return "oscillating", ratio
    return "stalled", ratio


def judge(
    records: Sequence[dict[str, float | int]],
    diverged: str | None,
    scale: float,
    floor: float,
    converged_below: float,
) -> Verdict:
    """The verdict on a run's records (see the module's rules).

    `diverged`: why the run diverged, when its status says it did (None: it did not);
    `scale`: max(||z*||, ||z0 - z*||) (nan: unknown); `floor`: z*'s accuracy (0: exact);
    `converged_below`: the config's output.converged_below.
    """
    found = measure_of(records)
    if diverged is not None:
        return Verdict("diverged", diverged or "the run diverged")
    if found is None:
        return Verdict("unknown", "no ||z-z*|| (no z*) and no ||G(z)|| (output.gradient_norm) to judge by")
    key, label = found
    values = [float(record[key]) for record in records if key in record]
    last = values[-1]
    if not math.isfinite(last):
        return Verdict("diverged", f"the last {label} is not finite")
    if key == "dist_z" and math.isfinite(scale) and scale > 0 and last > DIVERGED_OVER_SCALE * scale:
        return Verdict(
            "diverged",
            f"{label} {last:.3g} at the end, over {DIVERGED_OVER_SCALE:g} times the problem's scale "
            f"max(||z*||, ||z0-z*||) = {scale:.3g}",
        )
    if key != "dist_z" and values[0] > 0 and last > DIVERGED_OVER_START * values[0]:
        return Verdict("diverged", f"{label} grew from {values[0]:.3g} to {last:.3g}")
    if key == "dist_z" and last < floor:
        return Verdict("converged", f"{label} below z*'s accuracy {floor:.1e}")
    if last <= converged_below:
        return Verdict("converged", f"{label} {last:.3e} <= {converged_below:g}")
    direction, ratio = trend(values)
    return Verdict("not converged", f"{label} {last:.3e} at the end, {direction} (x{ratio:.3g} over the last half)")
