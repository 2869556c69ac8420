"""A spec's public statistics, checked against the data they summarize.

Some problems' specs hold numbers computed from all clients' data (the AUC
problem's `positive_rate`, the fair problem's `group_rate`): each client needs
them, and none can compute them alone. `fedsaddle data split` prints them; a
wrong one is accepted by every check of the spec and quietly changes the
problem. So whoever loads data compares: a process that holds every client's
rows (`simulate`, `fedsaddle local`) knows the exact value and warns at any
real difference; a client process that hosts some clients knows only their
share, which under label skew may differ a lot from the federation's, and
warns only past a wide tolerance, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsaddle.common.indices import some
from fedsaddle.common.problems.base import ClientData, DataProblem

# All clients' rows at hand: the spec's value should be the pooled one, as `data split` prints it in full.
WHOLE_TOLERANCE = 1e-6
# Some clients' rows: their share of a class or group is an estimate of the federation's, and a skewed one.
SHARE_TOLERANCE = 0.1


def disagreements(problem: DataProblem, datas: Sequence[ClientData], indices: Sequence[int]) -> list[str]:
    """One sentence per spec statistic that the training rows of `datas` (clients `indices`) contradict."""
    if not datas:
        return []
    whole = sorted(indices) == list(range(problem.spec.num_clients))
    tolerance = WHOLE_TOLERANCE if whole else SHARE_TOLERANCE
    found = []
    for field, measured in type(problem).statistics(datas).items():
        given = getattr(problem.spec, field, None)
        if field == "features" or not isinstance(given, int | float):
            continue  # (a wrong feature count is refused outright: DataProblem.expect_features)
        difference = abs(float(given) - float(measured))
        if difference <= tolerance:
            continue
        if whole:
            found.append(
                f"problem.{field} is {given!r} in the spec, but all clients' training rows give {measured!r} "
                f"(difference {difference:.3g} > {tolerance:g}): a wrong value changes the problem; "
                "`fedsaddle data split` prints the right one"
            )
        else:
            rows = sum(d.samples for d in datas)
            found.append(
                f"problem.{field} is {given!r} in the spec, but the {rows} training rows of clients "
                f"{some(list(indices))} hosted here give {measured!r} (difference {difference:.3g} > {tolerance:g}). "
                "The spec's value is over all clients' rows, and one site's may differ when the data is split "
                "unevenly; if the spec's is wrong, the problem is biased: `fedsaddle data split` prints the right one"
            )
    return found
