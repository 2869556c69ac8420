"""The configuration of a run: problem, algorithms, schedule, budget, transport.

Everything is checked when the config is loaded; an invalid config raises
ConfigError naming each offending field and the reason. This module is the schema
(the models, each field's own range) and the reading of a config; the checks across
fields are config_checks.py's, the rendering of errors config_errors.py's, and each
algorithm's spec sits in its own module of server/algorithms/.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from fedsaddle.common import wire
from fedsaddle.common.attacks import Attack, AttackKind
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.numeric import Precision
from fedsaddle.common.problems import PaperRegressionSpec, ProblemNotFound, ProblemSpec, parse_spec, problem_class
from fedsaddle.common.problems.registry import add_plugin_folder
from fedsaddle.common.secagg.graph import default_neighbours
from fedsaddle.common.secagg.settings import SCALE_BITS, SecAggSettings, default_bound
from fedsaddle.server.aggregation import (
    MAX_ROWS_MIB,
    Bucketing,
    CenteredClipping,
    GeometricMedian,
    Krum,
    Mean,
    Median,
    Rule,
    TrimmedMean,
    load_plugin,
)
from fedsaddle.server.algorithms.registry import BUILT_IN, AlgorithmNotFound, definition, parse_algorithm
from fedsaddle.server.algorithms.spec import AlgorithmSpecBase, FixedSync, StrictModel, SyncSpec
from fedsaddle.server.config_checks import fields_disagree
from fedsaddle.server.config_errors import FIELDS_DISAGREE, describe_error
from fedsaddle.server.config_errors import describe_errors as describe_errors

if TYPE_CHECKING:
    from fedsaddle.server.algorithms.base import StepCost


class ConfigError(ValueError):
    """An invalid run configuration; the message names every bad field."""


class RoundConvention(StrEnum):
    """What a communication round is, for the budget, the records and the tables (docs/reference/traffic.md,
    docs/explanation/rounds.md). Every choice that depends on the convention is made here."""

    EXCHANGES = "exchanges"  # every coordinator <-> clients exchange is a round
    PAPER = "paper"  # the paper's count: one per sync or MD step, two per Mirror-prox step

    def rounds_of(self, cost: StepCost) -> int:
        """The rounds a step (or a run so far) of this cost spends in this convention."""
        return cost.paper if self is RoundConvention.PAPER else cost.exchanges

    @property
    def record_key(self) -> str:
        """The field of a step's record that counts rounds in this convention."""
        return "paper_rounds" if self is RoundConvention.PAPER else "rounds"

    @property
    def words(self) -> str:
        """How tables, plots and reports say which rounds they count."""
        return "the paper's convention" if self is RoundConvention.PAPER else "every exchange counted"


class _Model(StrictModel):
    """A section of the run config (unknown fields refused, values frozen, no inf or nan)."""


# The built-in algorithms' specs are declared in their own modules (server/algorithms/*.py), beside their server
# and client halves; every algorithm's spec, built in or a plug-in's, is an AlgorithmSpecBase, found by its name
# (server/algorithms/registry.py). The run's `sync` (FixedSync, RandomSync) is server/algorithms/spec.py's too.
AlgorithmSpec = AlgorithmSpecBase
BUILT_IN_SPECS: tuple[type[AlgorithmSpecBase], ...] = tuple(algorithm.spec for algorithm in BUILT_IN.values())
ALGORITHM_NAMES = tuple(BUILT_IN)


# -- transport and output --------------------------------------------------------------


class TlsSpec(_Model):
    """TLS for the coordinator; with client_ca, mutual TLS (clients must show a certificate)."""

    cert: str = Field(description="the coordinator's certificate chain (PEM file)")
    key: str = Field(description="its private key (PEM file)")
    client_ca: str | None = Field(None, description="CA that signs client certificates; set it to require them")


class Limits(_Model):
    """What the coordinator grants its peers, so that no peer can exhaust it (defaults suit most federations).

    The one model of the limits: the config's transport.limits, and what the gRPC transport reads.
    """

    max_connections: int = Field(
        16384, ge=1, description="TCP connections in all (at most the open-files limit allows, less 256)"
    )
    max_streams_per_connection: int = Field(8, ge=2, description="concurrent calls on one connection")
    max_streams_per_peer: int = Field(256, ge=1, description="streams from one address (NAT: many clients)")
    max_pending_hellos: int = Field(256, ge=1, description="streams that have not said Hello yet, in all")
    hello_timeout_s: float = Field(10.0, gt=0, description="a stream without a Hello is closed after this long")
    handshake_timeout_s: float = Field(
        5.0, gt=0, description="a connection that carries no session or health call is closed after this long"
    )
    max_quiet_per_peer: int = Field(
        32, ge=1, description="connections from one address that carry no session or health call (more are closed)"
    )
    idle_connection_s: float = Field(30.0, gt=0, description="a connection with no call open is closed after this")
    max_undelivered_mib: float = Field(
        64.0,
        gt=0,
        description="a session whose unread instructions exceed the larger of this and 3 rounds' tasks is dropped",
    )
    receive_window_mib: float = Field(
        1.0,
        ge=0,
        le=1024,
        description="what the coordinator takes in of one client's stream before reading it: a fixed window "
        "(at least 0.0625) bounds the coordinator's memory for answers of large vectors, and caps each client's "
        "upload at this window per round trip; 0, gRPC's own window, which grows with the link (and with it "
        "the coordinator's memory, per client)",
    )
    reorder_mib: float = Field(
        0.0,
        ge=0,
        description="answers that came before their turn in client-index order, held until it comes: beyond "
        "this, the streams of clients whose turn has not come are not read (flow control holds them back); "
        "the client the sum waits on is always read",
    )

    @model_validator(mode="after")
    def _window_is_a_window(self) -> Limits:
        if 0 < self.receive_window_mib < 0.0625:
            raise ValueError(
                f"receive_window_mib must be 0 (gRPC's own) or at least 0.0625 (64 KiB), got {self.receive_window_mib}"
            )
        return self

    @property
    def max_undelivered_bytes(self) -> int:
        return int(self.max_undelivered_mib * (1 << 20))

    @property
    def reorder_bytes(self) -> int:
        return int(self.reorder_mib * (1 << 20))

    @property
    def receive_window_bytes(self) -> int:
        """The HTTP/2 receive window per stream; 0: gRPC's own, grown with the link."""
        return int(self.receive_window_mib * (1 << 20))


class TransportSpec(_Model):
    listen: str = Field("127.0.0.1:50051", description="HOST:PORT the coordinator listens on")
    join_timeout_s: float = Field(120.0, gt=0, description="wait this long for all clients to join")
    round_timeout_s: float = Field(60.0, gt=0, description="fail a round whose answers take longer")
    rejoin_timeout_s: float = Field(
        0.0,
        ge=0,
        description="wait this long for a lost client to come back (same indices and credentials) before "
        "failing the run; 0 fails at once",
    )
    chunk_bytes: int = Field(
        wire.DEFAULT_CHUNK_BYTES,
        ge=wire.MIN_CHUNK_BYTES,
        le=wire.MAX_CHUNK_BYTES,
        description="largest payload piece per message",
    )
    tls: TlsSpec | None = Field(None, description="serve TLS (and mutual TLS) instead of plaintext")
    credentials: str | None = Field(
        None, description="file of client identities and the indices each may speak for (see server/transport/auth.py)"
    )
    token_listen: str | None = Field(
        None,
        description="a second HOST:PORT with TLS but no client certificate, for token identities when "
        "tls.client_ca makes `listen` mutual TLS",
    )
    limits: Limits = Field(default_factory=Limits)

    @model_validator(mode="after")
    def _token_port_needs_tls_and_tokens(self) -> TransportSpec:
        if self.token_listen is not None and (self.tls is None or self.credentials is None):
            raise ValueError("token_listen needs tls and credentials (it serves token identities over TLS)")
        return self


# How a round's answers are weighed: the paper's 1/n, or by the clients' sample counts.
Weighting = Literal["uniform", "samples"]


class ParticipationSpec(_Model):
    """Which clients take part in a round: opt-in modes beyond the paper's full participation."""

    fraction: float = Field(
        1.0, gt=0, le=1, description="clients drawn per round from the coordinator's seed (reproducible); 1: all"
    )
    straggler_deadline_s: float | None = Field(
        None,
        gt=0,
        description="close a round after this many seconds once min_clients have answered (gRPC only; "
        "not reproducible bit for bit)",
    )
    min_clients: int | None = Field(None, ge=1, description="answers a round needs before its straggler deadline")

    @model_validator(mode="after")
    def _deadline_needs_a_quorum(self) -> ParticipationSpec:
        if (self.straggler_deadline_s is None) != (self.min_clients is None):
            raise ValueError("straggler_deadline_s and min_clients go together")
        return self


class DpSpec(_Model):
    """Client-level differential privacy: each client's answer clipped, Gaussian noise on each round's sum."""

    clip: float = Field(gt=0, description="C: each client's answer (with its objective) is scaled to L2 norm <= C")
    noise_multiplier: float = Field(
        gt=0, description="z: each round's sum carries Gaussian noise of standard deviation z * C per entry"
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta at which epsilon is reported")

    def settings(self) -> DpSettings:
        return DpSettings(self.clip, self.noise_multiplier)


class PrivacySpec(_Model):
    """Opt-in privacy: secure aggregation and differential privacy (docs/privacy.md)."""

    secure_aggregation: bool = Field(
        False, description="the coordinator learns only sums over each round's clients, never one client's answer"
    )
    threshold: int | None = Field(
        None,
        ge=2,
        description="clients of a round that must answer for it to be unmasked; default, and never less than, "
        "a majority of one more than the round's clients (k/2 + 1 for k even, (k + 3)/2 for k odd)",
    )
    scale_bits: int = Field(
        SCALE_BITS, ge=8, le=52, description="fixed-point resolution 2^-scale_bits of every value clients send"
    )
    bound: float | None = Field(
        None,
        gt=0,
        description="largest |value| a client may send (it refuses beyond it); default: the largest the "
        "number of clients allows without the sum overflowing",
    )
    neighbours: int | None = Field(
        None,
        ge=0,
        description="SecAgg+: each client masks with k neighbours in a Harary graph of the round's clients "
        "(k even; 0: all pairs); default: all pairs up to 13 clients, above the smallest even k >= 3 log2(n), "
        "or twice one more than the clients a straggler quorum lets drop if that is more",
    )

    dp: DpSpec | None = Field(
        None,
        description="differential privacy: noise added by the clients under secure aggregation, "
        "else by the coordinator",
    )

    def settings(self, num_clients: int, dropouts: int = 0) -> SecAggSettings:
        """What clients are told (the bound and the neighbours resolved for a federation of num_clients, of
        whose rounds a straggler quorum lets `dropouts` clients drop)."""
        bound = self.bound if self.bound is not None else default_bound(num_clients, self.scale_bits)
        neighbours = self.neighbours
        if neighbours is None:  # the log rule, widened to 2 (dropouts + 1) so that any round the quorum closes unmasks
            neighbours = default_neighbours(num_clients)
            if neighbours and dropouts > neighbours // 2 - 1:
                neighbours = 2 * (dropouts + 1) if 2 * (dropouts + 1) < num_clients - 1 else 0
        return SecAggSettings(self.threshold or 0, self.scale_bits, bound, neighbours)


AggregationRuleName = Literal[
    "mean", "median", "trimmed_mean", "krum", "geometric_median", "centered_clipping", "plugin"
]
_RULE_PARAMETERS: dict[str, tuple[str, ...]] = {  # which of AggregationSpec's parameters each rule takes
    "mean": (),
    "median": (),
    "trimmed_mean": ("beta",),
    "krum": ("f", "m"),
    "geometric_median": ("iterations", "eps", "tol"),
    "centered_clipping": ("tau", "iterations"),
    "plugin": ("path", "params"),
}


class AggregationSpec(_Model):
    """How a round's answers are aggregated (server/aggregation.py; docs/robustness.md): the mean, or a
    rule that bounds what Byzantine clients can do, optionally after bucketing."""

    rule: AggregationRuleName = Field("mean", description="the aggregation rule of every algorithm exchange")
    beta: float | None = Field(None, ge=0, lt=0.5, description="trimmed_mean: share cut at each end (default 0.1)")
    f: int | None = Field(None, ge=0, description="krum: Byzantine clients tolerated (needs n > 2f + 2)")
    m: int | None = Field(None, ge=1, description="krum: rows averaged (1: Krum, more: Multi-Krum; default 1)")
    iterations: int | None = Field(
        None, ge=1, le=10_000, description="geometric_median: Weiszfeld steps (default 100); centered_clipping (3)"
    )
    eps: float | None = Field(None, gt=0, description="geometric_median: smoothing of the distances (default 1e-8)")
    tol: float | None = Field(
        None, ge=0, description="geometric_median: stop once a step moves by at most tol ||v|| (1e-10)"
    )
    tau: float | None = Field(None, gt=0, description="centered_clipping: clipping radius (default 1)")
    path: str | None = Field(None, description="plugin: module:Class, or an entry point of fedsaddle.aggregations")
    params: dict[str, Any] = Field(default_factory=dict, description="plugin: keyword arguments of its class")
    bucketing: int | None = Field(
        None, ge=1, description="s: average random buckets of s clients first (Karimireddy et al. 2022)"
    )
    max_rows_mib: float = Field(
        MAX_ROWS_MIB, gt=0, description="most MiB of one round's rows (n * D * 8 bytes) the coordinator holds"
    )

    @model_validator(mode="after")
    def _parameters_of_the_rule(self) -> AggregationSpec:
        takes = _RULE_PARAMETERS[self.rule]
        given = [name for names in _RULE_PARAMETERS.values() for name in names if name not in takes]
        # (A value left at its default is not given: a run directory's config.json writes every field.)
        stray = sorted({name for name in given if getattr(self, name) not in (None, {})})
        if stray:
            raise ValueError(f"{self.rule} takes no {', '.join(stray)} (it takes: {', '.join(takes) or 'nothing'})")
        if self.rule == "krum" and self.f is None:
            raise ValueError("krum needs f, the Byzantine clients it tolerates")
        if self.rule == "plugin" and not self.path:
            raise ValueError("plugin needs path: module:Class, or an entry point of fedsaddle.aggregations")
        return self

    @property
    def keeps_rows(self) -> bool:
        """Whether the coordinator must hold every client's row (any rule but the plain mean)."""
        return self.rule != "mean" or self.bucketing is not None

    def build(self) -> Rule | None:
        """The rule (None: the plain mean, RoundAnswers' own)."""
        rule: Rule
        if self.rule == "mean":
            rule = Mean()
        elif self.rule == "median":
            rule = Median()
        elif self.rule == "trimmed_mean":
            rule = TrimmedMean(0.1 if self.beta is None else self.beta)
        elif self.rule == "krum":
            rule = Krum(self.f or 0, self.m or 1)
        elif self.rule == "geometric_median":
            rule = GeometricMedian(self.iterations or 100, self.eps or 1e-8, 1e-10 if self.tol is None else self.tol)
        elif self.rule == "centered_clipping":
            rule = CenteredClipping(self.tau or 1.0, self.iterations or 3)
        else:
            rule = load_plugin(self.path or "", self.params)
        if self.bucketing is not None:
            return Bucketing(rule, self.bucketing)
        return None if self.rule == "mean" else rule


class AttackSpec(_Model):
    """Byzantine clients, simulated by the coordinator on every algorithm exchange (common/attacks.py)."""

    kind: AttackKind = Field(description="sign_flip, scale, gaussian, alie, ipm, false_diverged or label_flip")
    clients: list[int] = Field(min_length=1, description="the Byzantine clients' indices")
    factor: float = Field(-1.0, description="scale: what their answers are multiplied by")
    sigma: float = Field(1.0, gt=0, description="gaussian: standard deviation of the noise added")
    epsilon: float = Field(0.1, description="ipm: they send -epsilon times the mean")
    z: float | None = Field(None, description="alie: they send mu - z sigma (default: the paper's z_max)")
    omniscient: bool = Field(
        False, description="alie, ipm: the honest clients' statistics (else the Byzantine clients' own)"
    )

    @field_validator("clients")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) < len(value) or min(value) < 0:
            raise ValueError(f"clients must be distinct indices >= 0, got {value}")
        return sorted(value)

    def attack(self) -> Attack:
        return Attack(self.kind, tuple(self.clients), self.factor, self.sigma, self.epsilon, self.z, self.omniscient)


Accuracy = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class OutputSpec(_Model):
    dir: str = Field("runs", description="run directories are created below this folder")
    plot: bool = True
    accuracies: tuple[Accuracy, ...] = Field(
        (1e-2, 1e-4, 1e-6, 1e-8),
        max_length=8,
        description="the rounds each algorithm spent until ||x - x*|| <= each of these are reported "
        "(summary.json and a table; when z* is known)",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="write checkpoint.npz every this many rounds, to resume a killed coordinator (0: never)"
    )
    gradient_norm: bool = Field(
        False,
        description="at every evaluated step (evaluate_every, which it needs, and the last) also gather the exact "
        "G_i(z) and record grad_norm = ||G(z)|| of the federation's objective (on a constrained problem also "
        "residual = ||z - P(z - G(z))||): a convergence measure that needs no z*; one more exchange, counted as "
        "evaluation",
    )
    trackers: tuple[Literal["tensorboard", "mlflow"], ...] = Field(
        (),
        description="experiment trackers that also get every record of metrics.jsonl: tensorboard (event files in "
        "RUN_DIR/tensorboard/, the tensorboard extra) and mlflow (MLflow's local file store in RUN_DIR/mlruns/, "
        "the mlflow extra)",
    )

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"each tracker at most once, got {list(value)}")
        return value

    per_client: bool = Field(
        False,
        description="at every evaluated step (evaluate_every, which it needs) also keep each client's evaluation "
        "metrics and its training objective f_i(z), with the worst, the best and their spread, in metrics.jsonl, "
        "summary.json, the progress lines and metrics.png; one more exchange (f_i(z) with G_i(z), counted as "
        "evaluation); refused with secure aggregation, which never lets the coordinator see one client's value",
    )
    stop_beyond_scale: bool = Field(
        False,
        description="stop a run as diverged as soon as ||z - z*|| is more than 10 times the problem's scale "
        "max(||z*||, ||z0 - z*||) (where z* is known), instead of at 10^4-fold growth over its start only",
    )
    converged_below: Accuracy = Field(
        1e-6,
        description="a run's verdict is `converged` when its last ||z - z*|| (without z*: the projected residual, "
        "or ||G(z)||, with gradient_norm) is at most this (server/verdict.py says every rule)",
    )
    save_every: int | None = Field(
        None,
        description="keep every this many steps' iterate as iterates-NAME/step-NNNNNN.npy along the run "
        "(null: only the final one); at most save_max files per algorithm",
    )
    save_max: int = Field(
        100,
        ge=2,
        le=100_000,
        description="the most iterates save_every keeps per algorithm: when one more is due, every other one is "
        "removed and the interval doubles, so the files still span the whole run",
    )

    @field_validator("save_every")
    @classmethod
    def _save_every(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(
                f"must be a number of steps >= 1, got {value}; leave it out (null) to keep only the final iterate"
            )
        return value


class MonitorSpec(_Model):
    """The operator's view of a run: Prometheus metrics at /metrics and a live dashboard at /, read-only.

    Off unless set (or `--monitor HOST:PORT`). An address other than loopback needs `tls` and `token_file`."""

    listen: str = Field("127.0.0.1:9464", description="HOST:PORT it serves on (127.0.0.1: this host alone)")
    tls: TlsSpec | None = Field(None, description="serve HTTPS with this certificate and key (client_ca is not used)")
    token_file: str | None = Field(
        None, description="file holding the viewer token (at least 16 characters) a viewer or a scraper must send"
    )
    max_viewers: int = Field(8, ge=1, le=256, description="dashboards open at once (more are told to come back)")
    linger_s: float = Field(
        0.0, ge=0, le=3600, description="keep serving this long after the run ends, so that a last scrape sees its end"
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"must be HOST:PORT with a port from 0 to 65535, got {value!r}")
        return value


class RunConfig(_Model):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = Field(0, ge=0, lt=2**63)
    problem: SerializeAsAny[ProblemSpec] = Field(
        default_factory=PaperRegressionSpec,
        description="the problem's name and public hyper-parameters (never data); see common/problems",
    )
    algorithms: list[SerializeAsAny[AlgorithmSpecBase]] = Field(
        min_length=1, description="the algorithms to run, each by its `name` (built in or installed) and its own fields"
    )
    sync: SyncSpec = Field(default_factory=FixedSync)
    rounds: int = Field(500, ge=1, description="communication budget, counted as `round_convention` says")
    round_convention: RoundConvention = Field(
        RoundConvention.EXCHANGES,
        description="exchanges: every coordinator<->clients exchange is a round; "
        "paper: one per sync or MD step, two per Mirror-prox step",
    )
    gradient_noise: float = Field(0.0, ge=0, description="sigma: E||G^_i - G_i||^2 = sigma^2")
    init: Literal["ones", "zeros", "random", "problem"] = Field(
        "ones",
        description="starting point z0: all ones, zeros, N(0, I) from the seed, or the problem's own for the seed "
        "(a PyTorch problem's initialized network)",
    )
    weighting: Weighting = Field(
        "uniform",
        description="aggregation weights: uniform (the paper's 1/n) or by the clients' sample counts "
        "(what FedAvg users expect; clients then tell the coordinator their sample counts)",
    )
    participation: ParticipationSpec = Field(default_factory=ParticipationSpec)
    privacy: PrivacySpec = Field(default_factory=PrivacySpec)
    aggregation: AggregationSpec = Field(
        default_factory=AggregationSpec, description="the rule every algorithm exchange is aggregated by"
    )
    attack: AttackSpec | None = Field(None, description="simulated Byzantine clients (research and tests)")
    evaluate_every: int = Field(
        0, ge=0, description="every this many steps, clients evaluate the iterate on their held-out data (0: never)"
    )
    transport: TransportSpec = Field(default_factory=TransportSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    precision: Precision = Field(
        "float64",
        description="the element type of every vector the run stores and sends: tasks, answers, the algorithms' "
        "state, checkpoints, the final iterate (float32: half the bytes; docs/explanation/numerics.md)",
    )
    monitor: MonitorSpec | None = Field(
        None, description="serve Prometheus metrics and a live dashboard while the run goes (None: off)"
    )

    @field_validator("problem", mode="before")
    @classmethod
    def _problem(cls, value: Any) -> Any:
        if isinstance(value, dict):  # a plain mapping, e.g. RunConfig(problem={...}) in Python
            try:
                return parse_spec(value)
            except ProblemNotFound as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("algorithms", mode="before")
    @classmethod
    def _algorithms(cls, value: Any) -> Any:
        """Each entry validated by its own algorithm's spec (parse_config reports each field's error)."""
        if not isinstance(value, list):
            return value
        specs = []
        for i, item in enumerate(value):
            if isinstance(item, AlgorithmSpecBase):
                specs.append(item)
                continue
            try:
                specs.append(parse_algorithm(item))
            except AlgorithmNotFound as exc:
                raise ValueError(f"[{i}]: {exc}") from None
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise ValueError(f"[{i}].{where}: {first['msg']}") from None
        return specs

    @model_validator(mode="after")
    def _fields_agree(self, info: ValidationInfo) -> RunConfig:
        """Every check across fields (config_checks.py), each fault at the field it names, all reported at once."""
        faults = fields_disagree(self, problem_invalid=bool(info.context and info.context.get("problem_invalid")))
        if faults:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(FIELDS_DISAGREE, "{fault}", {"fault": fault}),
                        loc=where,
                        input=self._value_at(where),
                    )
                    for where, fault in faults
                ],
            )
        return self

    def _value_at(self, where: tuple[str, ...]) -> Any:
        value: Any = self
        for name in where:
            value = getattr(value, name)
        return value

    def dropouts_allowed(self) -> int:
        """How many of a round's clients a straggler quorum lets drop (0 without one)."""
        quorum = self.participation.min_clients
        if quorum is None:
            return 0
        return max(0, max(1, round(self.participation.fraction * self.problem.num_clients)) - quorum)

    def secure_settings(self) -> SecAggSettings:
        """Secure aggregation as the clients are told it (privacy.secure_aggregation must be on)."""
        return self.privacy.settings(self.problem.num_clients, self.dropouts_allowed())


def parse_config(data: Any, source: str = "config") -> RunConfig:
    """Validate a config mapping; raise ConfigError naming each bad field.

    The problem entry is validated by its own problem's Spec first, so that its
    errors read `problem.features: ...` like every other field's.
    """
    errors: list[str] = []
    if isinstance(data, dict) and isinstance(data.get("problem"), dict):
        data = dict(data)
        try:
            data["problem"] = parse_spec(data["problem"])
        except ProblemNotFound as exc:
            errors.append(f"  problem.{exc.field}: {exc}")
            del data["problem"]
        except ValidationError as exc:
            plugin = data["problem"].get("plugin")
            spec = problem_class(data["problem"]["name"], plugin if isinstance(plugin, str) else None).Spec
            errors += [f"  problem.{describe_error(e, spec)}" for e in exc.errors()]
            del data["problem"]
    algorithm_errors = False
    if isinstance(data, dict) and isinstance(data.get("algorithms"), list):
        data = dict(data)
        data["algorithms"], found = _parse_algorithms(data["algorithms"])
        errors += found
        algorithm_errors = bool(found)
    try:
        config = RunConfig.model_validate(data, context={"problem_invalid": bool(errors)})
    except ValidationError as exc:
        # Entries already reported field by field leave no second, vaguer line.
        left = [e for e in exc.errors() if not (algorithm_errors and e["loc"][:1] == ("algorithms",))]
        errors += [f"  {describe_error(e, RunConfig)}" for e in left]
    if errors:
        raise ConfigError(f"invalid {source}:\n" + "\n".join(errors))
    return config


def _parse_algorithms(entries: list[Any]) -> tuple[list[Any], list[str]]:
    """The `algorithms:` entries validated by their own specs, and an error line per bad field."""
    parsed: list[Any] = []
    errors: list[str] = []
    for i, entry in enumerate(entries):
        try:
            parsed.append(parse_algorithm(entry))
        except AlgorithmNotFound as exc:
            errors.append(f"  algorithms[{i}]: {exc}")
            parsed.append(entry)
        except ValidationError as exc:
            spec = definition(entry["name"]).spec
            errors += [f"  algorithms[{i}].{describe_error(e, spec)}" for e in exc.errors()]
            parsed.append(entry)
    return parsed, errors


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # each key and its line
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, Hashable) and key in seen:
                # (no marks: the message stays one line, with both places in it)
                raise yaml.constructor.ConstructorError(
                    None, None, f"found the key {key!r} twice (line {seen[key]} and line {line}); keep one", None
                )
            if isinstance(key, Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    """A YAML document, as yaml.safe_load reads it, but a key given twice is a yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader: no object of any other type is built


def load_config(path: str | Path) -> RunConfig:
    """Read a run config from YAML or JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else read_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of fields, got {type(data).__name__}")
    add_plugin_folder(path.parent)  # a plug-in package beside its config needs no PYTHONPATH
    return parse_config(data, source=f"config {path}")
