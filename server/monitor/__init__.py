"""The coordinator's monitor: Prometheus metrics at /metrics and a live dashboard at /, read-only.

`Monitor(config)` binds its address at once (a taken address is a MonitorError
before the run starts), `attach(pool)` makes the pool tell it of every round, its
hooks (`on_step`, `finish`) see the driver's records, and `close` stops it. The
endpoint itself (threads, TLS, the viewer token, its bounds) is common/monitoring.py;
what it knows of the run, state.py; the page, static/ (plain HTML, CSS and
JavaScript, no build step, nothing fetched from elsewhere).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from typing import TYPE_CHECKING, Any

from fedsaddle.common.monitoring import Exposure, MonitorError, MonitorServer, Reply
from fedsaddle.server.monitor.state import CURVE_FIELDS, LiveState

if TYPE_CHECKING:
    from fedsaddle.server.config import MonitorSpec, RunConfig
    from fedsaddle.server.driver import Run, StepDone
    from fedsaddle.server.pool import Category, ClientPool
    from fedsaddle.server.runs import Outcome

__all__ = ["Monitor", "MonitorError"]

EVENT_EVERY_S = 0.5  # a dashboard is sent the state this often
KEEP_ALIVE_S = 15.0
# Round durations, seconds: a loopback round at d = 10 takes a few milliseconds, one at d = 10^6 a few tenths.
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def exposure_of(spec: MonitorSpec) -> Exposure:
    tls = spec.tls
    return Exposure(spec.listen, tls.cert if tls else None, tls.key if tls else None, spec.token_file)


class Monitor:
    """A run's monitor: see the module's docstring."""

    def __init__(self, config: RunConfig, spec: MonitorSpec) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise MonitorError("monitor: needs prometheus-client: pip install 'fedsaddle[monitor]'") from None
        self.state = LiveState(config)
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        durations = prometheus_client.Histogram(
            "fedsaddle_round_duration_seconds",
            "Wall time of each round, from its task sent to its answers collected, by traffic category",
            ["category"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._durations = {c: durations.labels(c) for c in ("algorithm", "evaluation", "retransmission", "privacy")}
        self.registry.register(_Collector(self))
        self._exposition = prometheus_client.generate_latest
        self._content_type = prometheus_client.CONTENT_TYPE_LATEST
        pages = {path: self._page(name, kind) for path, (name, kind) in STATIC.items()}
        self.server = MonitorServer(
            exposure_of(spec),
            {"/metrics": self._metrics, "/state": self._state, **pages},
            {"/events": self._events},
            max_streams=spec.max_viewers,
            max_connections=max(32, 4 * spec.max_viewers),
        )
        self.address, self.url = self.server.address, f"{self.server.scheme}://{self.server.address}/"

    # -- the run's hooks --------------------------------------------------------------------

    def attach(self, pool: ClientPool) -> None:
        """Watch this pool: its clients, and every round it ends."""
        self.state.pool = pool
        pool.observer = self

    def round_done(self, category: Category, seconds: float) -> None:
        self._durations[category].observe(seconds)
        self.state.round_done()

    def secure_round(self, dropped: int, recovered: int) -> None:
        self.state.secure_round(dropped, recovered)

    def on_step(self, run: Run, done: StepDone, pool: ClientPool) -> None:
        self.state.on_step(run, done, pool)

    def finish(self, outcome: Outcome) -> None:
        self.state.finish(outcome)

    def close(self) -> None:
        pool = self.state.pool
        if pool is not None and pool.observer is self:
            pool.observer = None
        self.server.close()

    # -- what it serves -----------------------------------------------------------------------

    def _metrics(self) -> Reply:
        return Reply(self._exposition(self.registry), self._content_type)

    def _state(self) -> Reply:
        return Reply(json.dumps(_finite(self.state.view({}))).encode(), "application/json")

    @staticmethod
    def _page(name: str, kind: str) -> Callable[[], Reply]:
        body = resources.files("fedsaddle.server.monitor").joinpath("static", name).read_bytes()
        return lambda: Reply(body, kind)

    def _events(self, write: Callable[[bytes], None], stopping: threading.Event) -> None:
        """Server-sent events: the state now, then every EVENT_EVERY_S what changed (each curve's new points)."""
        sent: dict[str, int] = {}
        last = ""
        quiet = 0.0
        while not stopping.is_set():
            view = self.state.view(sent)
            text = json.dumps(_finite(view), separators=(",", ":"))
            if text != last or view["points"]:
                write(b"data: " + text.encode() + b"\n\n")
                last, quiet = text, 0.0
            elif quiet >= KEEP_ALIVE_S:
                write(b": keep-alive\n\n")
                quiet = 0.0
            if stopping.wait(EVENT_EVERY_S):
                return
            quiet += EVENT_EVERY_S


def _finite(value: Any) -> Any:
    """JSON that browsers read: NaN and infinities as null."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class _Collector:
    """The run's metrics, read from the monitor's state at each scrape (prometheus-client's custom collector)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def describe(self) -> list[Any]:
        return []  # (the families depend on the run: collected at each scrape)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        state = self.monitor.state
        config = state.config
        view = state.view({a.name: len(a.points) for a in state.algorithms})  # (no curve points)
        info = InfoMetricFamily("fedsaddle_run", "The run: its config's name, problem and round convention")
        info.add_metric(
            [], {"run": config.name, "problem": config.problem.name, "convention": config.round_convention.value}
        )
        yield info
        yield GaugeMetricFamily("fedsaddle_clients_expected", "Clients the federation has", value=len(view["clients"]))
        joined = sum(1 for c in view["clients"] if c["state"] == "joined")
        yield GaugeMetricFamily("fedsaddle_clients_joined", "Clients whose index a live session holds", value=joined)
        states = GaugeMetricFamily(
            "fedsaddle_client_state",
            "1 for each client's state (joined, lost, refused, waiting, left)",
            labels=["client", "state"],
        )
        latency = GaugeMetricFamily(
            "fedsaddle_client_answer_latency_seconds",
            "Each client's last answer: from the round's task sent to its answer in",
            labels=["client"],
        )
        for client in view["clients"]:
            for name in ("joined", "lost", "refused", "waiting", "left"):
                states.add_metric([str(client["index"]), name], 1.0 if client["state"] == name else 0.0)
            if client["latency_s"] is not None:
                latency.add_metric([str(client["index"])], client["latency_s"])
        yield states
        yield latency
        yield GaugeMetricFamily(
            "fedsaddle_round_budget", "The run's communication budget per algorithm", value=view["budget"]
        )
        status = GaugeMetricFamily(
            "fedsaddle_algorithm_status", "1 for each algorithm's status", labels=["algorithm", "status"]
        )
        round_gauge = GaugeMetricFamily(
            "fedsaddle_round", "Rounds each algorithm has spent (the config's round convention)", labels=["algorithm"]
        )
        steps = GaugeMetricFamily("fedsaddle_steps", "Steps each algorithm has taken", labels=["algorithm"])
        rounds = CounterMetricFamily(
            "fedsaddle_rounds",
            "Communication rounds, by algorithm and traffic category",
            labels=["algorithm", "category"],
        )
        messages = CounterMetricFamily(
            "fedsaddle_messages",
            "Messages (one per client per round), by algorithm, category and direction",
            labels=["algorithm", "category", "direction"],
        )
        floats = CounterMetricFamily(
            "fedsaddle_floats",
            "float64 vector entries carried, by algorithm, category and direction",
            labels=["algorithm", "category", "direction"],
        )
        wire = CounterMetricFamily(
            "fedsaddle_bytes",
            "Bytes on the wire (gRPC), by algorithm, category and direction",
            labels=["algorithm", "category", "direction"],
        )
        curve = GaugeMetricFamily(
            "fedsaddle_convergence",
            "The latest record's measure: dist_x, dist_z (where z* is known), grad_norm, residual",
            labels=["algorithm", "measure"],
        )
        evaluation = GaugeMetricFamily(
            "fedsaddle_evaluation", "The latest evaluation metrics (mean over clients)", labels=["algorithm", "metric"]
        )
        epsilon = GaugeMetricFamily(
            "fedsaddle_dp_epsilon", "Differential privacy's epsilon spent", labels=["algorithm"]
        )
        record_fields = {"step", "rounds", "paper_rounds", "time_s", *CURVE_FIELDS}
        for algorithm in view["algorithms"]:
            name = algorithm["name"]
            for value in ("waiting", "running", "ended", "ok", "diverged", "stopped"):
                status.add_metric([name, value], 1.0 if algorithm["status"] == value else 0.0)
            round_gauge.add_metric([name], algorithm["rounds"])
            steps.add_metric([name], algorithm["steps"])
            for category, counts in algorithm["traffic"].items():
                rounds.add_metric([name, category], counts["rounds"])
                for direction in ("down", "up"):
                    messages.add_metric([name, category, direction], counts[f"messages_{direction}"])
                    floats.add_metric([name, category, direction], counts[f"floats_{direction}"])
                    wire.add_metric([name, category, direction], counts[f"bytes_{direction}"])
            last = algorithm["last"]
            for measure in ("dist_x", "dist_z", "grad_norm", "residual"):
                if measure in last:
                    curve.add_metric([name, measure], last[measure])
            if "epsilon" in last:
                epsilon.add_metric([name], last["epsilon"])
            for metric, value in last.items():
                if metric not in record_fields:
                    evaluation.add_metric([name, metric], value)
        yield from (status, round_gauge, steps, rounds, messages, floats, wire, curve, evaluation, epsilon)
        refusals = CounterMetricFamily(
            "fedsaddle_refusals", "Streams the coordinator ended with an error status, by its code", labels=["reason"]
        )
        for reason, count in sorted(view["refusals"].items()):
            refusals.add_metric([reason], count)
        yield refusals
        closed = view["connections_closed"]
        connections = CounterMetricFamily(
            "fedsaddle_connections_closed",
            "Connections closed for carrying nothing: silent past the handshake deadline, or over an address's cap",
            labels=["reason"],
        )
        for reason in ("silent", "over_peer_cap"):
            connections.add_metric([reason], closed.get(reason, 0))
        yield connections
        yield CounterMetricFamily(
            "fedsaddle_connections_held_off",
            "Times an address's new connections were dropped in the kernel (a flood)",
            value=closed.get("held_off", 0),
        )
        yield CounterMetricFamily(
            "fedsaddle_secagg_dropouts",
            "Secure aggregation: clients of a masked round that did not answer",
            value=view["secure"]["dropouts"],
        )
        yield CounterMetricFamily(
            "fedsaddle_secagg_recoveries",
            "Secure aggregation: dropped clients whose masks the others' unmasking removed",
            value=view["secure"]["recoveries"],
        )
        yield GaugeMetricFamily(
            "fedsaddle_run_finished", "1 once the run is over", value=1.0 if view["outcome"] else 0.0
        )
        failed = bool(view["outcome"] and view["outcome"]["failure"])
        yield GaugeMetricFamily("fedsaddle_run_failed", "1 if the run ended in a failure", value=1.0 if failed else 0.0)
        server = self.monitor.server
        yield GaugeMetricFamily("fedsaddle_monitor_viewers", "Dashboards connected now", value=server.viewers)
        turned = CounterMetricFamily(
            "fedsaddle_monitor_refused", "Requests the monitor turned away, by why", labels=["reason"]
        )
        for reason, count in sorted(server.refused.items()):
            turned.add_metric([reason], count)
        yield turned
