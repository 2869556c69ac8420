"""The run config's checks across fields: each fault at the field it names, all found at once.

`RunConfig` (server/config.py) runs `fields_disagree` as its last validator and reports every
fault it returns as an error at the field the fault names (pydantic runs no model validator
after one that raises: a config with several such faults, as a private run's often has,
would show them one attempt at a time). A field's own range and type are its model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fedsaddle.common.problems import DataProblem, Problem, make_problem
from fedsaddle.common.problems.domains import DomainError, problem_domain
from fedsaddle.common.problems.pytorch import TorchProblem
from fedsaddle.common.problems.shards import ProblemError, metric_rows
from fedsaddle.common.secagg.graph import check_neighbours
from fedsaddle.common.secagg.settings import check_bound, check_threshold, round_threshold
from fedsaddle.server.aggregation import PluginNotFound, rule_check, rule_tolerates

if TYPE_CHECKING:
    from fedsaddle.server.config import RunConfig

# A check across fields that fails: the field it names (as a location: ("privacy", "dp"); () for none) and why.
Fault = tuple[tuple[str, ...], str]


def fields_disagree(config: RunConfig, problem_invalid: bool) -> list[Fault]:
    """Every fault of `config` across its fields; `problem_invalid`: its problem's own errors are reported
    already (the problem stands in as its default), so nothing is checked against the problem."""
    return [
        *_what_the_problem_offers(config, problem_invalid),
        *_gradient_norm_is_evaluated(config),
        *_per_client_is_possible(config),
        *_dp_is_sound(config),
        *_secure_aggregation_is_sound(config),
        *_aggregation_is_sound(config, problem_invalid),
        *_labels_unique(config),
        *_precision_fits(config),
    ]


def _what_the_problem_offers(config: RunConfig, problem_invalid: bool) -> list[Fault]:
    if problem_invalid:
        return []  # the problem's own errors are reported; nothing to check it against
    problem = make_problem(config.problem)
    faults: list[Fault] = []
    try:
        problem_domain(problem)  # a declared domain must fit the problem's dimensions
    except DomainError as exc:
        faults.append(((), str(exc)))
    if config.evaluate_every and not problem.metric_names and not config.output.gradient_norm:
        why = (
            f"problem {config.problem.name} has no evaluation metrics "
            "(output.gradient_norm: true evaluates ||G(z)|| on any problem)"
        )
        faults.append((("evaluate_every",), why))
    if config.evaluate_every and problem.metric_names:
        try:
            kinds = metric_rows(problem)
        except ProblemError as exc:
            faults.append((("problem",), str(exc)))
        else:
            if isinstance(problem, TorchProblem) and set(kinds) != {"held-out"}:
                why = (
                    f"problem {config.problem.name} is written in PyTorch, whose test_metrics are computed on each "
                    f"client's held-out rows; its metrics_on must be 'held-out', not {problem.metrics_on!r}"
                )
                faults.append((("problem",), why))
            if len(set(kinds)) > 1 and config.privacy.secure_aggregation:
                named = zip(problem.metric_names, kinds, strict=True)
                why = (
                    f"problem {config.problem.name}'s metrics are on different rows "
                    f"({', '.join(f'{name}: {kind}' for name, kind in named)}), "
                    "so each is weighted by its own row counts, while a masked evaluation row carries one weight per "
                    "client; evaluate with secure aggregation off, or declare one kind of rows for every metric"
                )
                faults.append((("privacy", "secure_aggregation"), why))
    if config.init == "problem" and type(problem).initial_point is Problem.initial_point:
        faults.append((("init",), f"problem {config.problem.name} has no starting point of its own"))
    if config.weighting == "samples" and problem.synthetic:
        faults.append((("weighting",), f"samples needs clients with data files; {config.problem.name} is synthetic"))
    quorum = config.participation.min_clients
    if quorum is not None and quorum > config.problem.num_clients:
        why = f"{quorum} is more than the {config.problem.num_clients} clients"
        faults.append((("participation", "min_clients"), why))
    return faults


def _gradient_norm_is_evaluated(config: RunConfig) -> list[Fault]:
    if config.output.gradient_norm and not config.evaluate_every:  # it would measure nothing, silently
        why = (
            "||G(z)|| is measured at the evaluated steps, and evaluate_every is 0: "
            "set evaluate_every (e.g. 50; the last step is evaluated too)"
        )
        return [(("output", "gradient_norm"), why)]
    return []


def _per_client_is_possible(config: RunConfig) -> list[Fault]:
    if not config.output.per_client:
        return []
    faults: list[Fault] = []
    if not config.evaluate_every:
        why = (
            "each client's results are gathered at the evaluated steps, and evaluate_every is 0: "
            "set evaluate_every (e.g. 50; the last step is evaluated too)"
        )
        faults.append((("output", "per_client"), why))
    if config.privacy.secure_aggregation:
        why = (
            "secure aggregation lets the coordinator hold only sums over the clients, never one client's "
            "value, so it cannot report each client's results; what composes with it: the metrics averaged "
            "over the clients (evaluate_every) and output.gradient_norm, both summed under the masks"
        )
        faults.append((("output", "per_client"), why))
    return faults


def _dp_is_sound(config: RunConfig) -> list[Fault]:
    if config.privacy.dp is None:
        return []
    faults: list[Fault] = []
    if config.weighting != "uniform":  # the weights would be released without noise
        faults.append((("privacy", "dp"), "differential privacy needs weighting: uniform"))
    if config.evaluate_every:  # evaluation metrics are per-client data released without noise
        why = "evaluate_every would release the clients' metrics without noise; set it to 0"
        faults.append((("privacy", "dp"), why))
    return faults


def _precision_fits(config: RunConfig) -> list[Fault]:
    if config.precision == "float64":
        return []
    faults: list[Fault] = []
    if config.privacy.secure_aggregation:
        why = (
            "float32 does not combine with secure aggregation: its fixed-point rows and their overflow bound "
            "are defined on float64 answers; use precision: float64"
        )
        faults.append((("precision",), why))
    if config.privacy.dp is not None:
        why = (
            "float32 does not combine with differential privacy: rounding a clipped answer to float32 can "
            "raise its norm above the clip the noise is calibrated to; use precision: float64"
        )
        faults.append((("precision",), why))
    return faults


def _secure_aggregation_is_sound(config: RunConfig) -> list[Fault]:
    privacy = config.privacy
    if not privacy.secure_aggregation:
        return []
    n = config.problem.num_clients
    per_round = max(1, round(config.participation.fraction * n))  # as sample_clients draws them
    settings = privacy.settings(n)
    needed = round_threshold(settings, per_round)
    faults: list[Fault] = []

    def holds(check: Callable[[], None]) -> bool:
        try:
            check()
        except ValueError as exc:
            faults.append((("privacy",), str(exc)))
            return False
        return True

    threshold_holds = holds(lambda: check_threshold(privacy.threshold or needed, per_round))
    holds(lambda: check_bound(n, settings.bound, privacy.scale_bits))
    neighbours_hold = holds(lambda: check_neighbours(settings.neighbours))
    quorum = config.participation.min_clients
    if quorum is None:
        return faults
    # The quorum is checked against a threshold and neighbours that are sound (else their fault says it all).
    if threshold_holds and quorum < needed:
        why = f"{quorum} is fewer than the {needed} clients secure aggregation needs to unmask a round"
        faults.append((("participation", "min_clients"), why))
    k = privacy.settings(n, config.dropouts_allowed()).neighbours
    if neighbours_hold and 0 < k < per_round - 1 and per_round - quorum > k // 2 - 1:
        # H(k, m) stays connected and every neighbourhood keeps the k/2 + 2 shares a self mask needs
        # (graph.neighbourhood_threshold) while at most k/2 - 1 clients drop
        why = (
            f"{quorum} lets {per_round - quorum} of a round's {per_round} clients drop, more than the "
            f"{k // 2 - 1} a neighbour graph of k = {k} (privacy.neighbours) can lose and still unmask every "
            "round; raise min_clients or neighbours"
        )
        faults.append((("participation", "min_clients"), why))
    return faults


def _aggregation_is_sound(config: RunConfig, problem_invalid: bool) -> list[Fault]:
    aggregation, attack = config.aggregation, config.attack
    faults: list[Fault] = []
    n = config.problem.num_clients
    per_round = max(1, round(config.participation.fraction * n))  # as sample_clients draws them
    if aggregation.keeps_rows and config.privacy.secure_aggregation:
        why = (
            f"{aggregation.rule}{' with bucketing' if aggregation.bucketing else ''} needs each client's vector, "
            "and secure aggregation shows the coordinator only their sum: use rule: mean (privacy.dp's "
            "clipping bounds each client's norm before masking; docs/robustness.md)"
        )
        faults.append((("aggregation",), why))
    if attack is not None and config.privacy.secure_aggregation:
        why = "a simulated attack replaces clients' vectors at the coordinator, which secure aggregation hides"
        faults.append((("attack",), why))
    if aggregation.keeps_rows and config.privacy.dp is not None:
        why = f"differential privacy's noise is calibrated to the clipped mean, not to {aggregation.rule}"
        faults.append((("aggregation",), why))
    if aggregation.keeps_rows and aggregation.rule != "plugin" and config.weighting != "uniform":
        why = f"{aggregation.rule} gives every client one vote; it needs weighting: uniform"
        faults.append((("aggregation",), why))
    if attack is not None and attack.clients[-1] >= n:
        why = f"client {attack.clients[-1]} does not exist: the federation has clients 0..{n - 1}"
        faults.append((("attack", "clients"), why))
    try:
        rule = aggregation.build()
    except (PluginNotFound, ValueError) as exc:
        faults.append((("aggregation",), str(exc)))
        return faults
    if rule is not None:
        try:
            rule_check(rule, per_round)
        except ValueError as exc:
            faults.append((("aggregation",), f"{exc} (a round has {per_round} clients)"))
        tolerated = rule_tolerates(rule, per_round)
        if attack is not None and tolerated is not None and len(attack.clients) > tolerated:
            why = (
                f"{len(attack.clients)} Byzantine clients, more than the {tolerated} that {rule.name} tolerates "
                f"among {per_round} clients"
            )
            faults.append((("attack", "clients"), why))
    flips = attack is not None and attack.kind == "label_flip" and not problem_invalid
    if flips and not isinstance(make_problem(config.problem), DataProblem):
        why = (
            f"label_flip swaps the labels of clients' data files, and problem {config.problem.name} has none: "
            "use a problem on data files with binary labels (auc, fair_logistic, agnostic or a plug-in's)"
        )
        faults.append((("attack", "kind"), why))
    if (rule is not None or attack is not None) and not problem_invalid:
        held = n * make_problem(config.problem).dimension * 8 / 2**20
        if held > aggregation.max_rows_mib:
            why = (
                f"a round's rows would hold {n} x {make_problem(config.problem).dimension} float64 = {held:.0f} MiB "
                f"at the coordinator, more than max_rows_mib = {aggregation.max_rows_mib:g}"
            )
            faults.append((("aggregation", "max_rows_mib"), why))
    return faults


def _labels_unique(config: RunConfig) -> list[Fault]:
    names = [a.display_name for a in config.algorithms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return [((), f"algorithm names repeat: {repeated}; give each a distinct `label`")]
    return []
