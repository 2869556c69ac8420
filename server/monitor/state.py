"""What the monitor knows of a run: kept by the driver's hooks, read by the endpoint's threads.

The driver's thread writes (`on_step`, the pool's `round_done`, `finish`); the
monitor's threads read (`view`, `snapshot`). Writes are a few assignments under one
lock, and the heavier copies (the traffic counts) at most every `SYNC_S`: a round
costs the monitor a histogram observation and a timestamp. What is kept is scalar:
the records' numbers (distances, ||G||, evaluation metrics, epsilon), traffic totals
and each client's liveness; never a vector, a client's data or its per-client traffic.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsaddle.server.config import RunConfig
    from fedsaddle.server.driver import Run, StepDone
    from fedsaddle.server.pool import ClientPool
    from fedsaddle.server.runs import Outcome

SYNC_S = 0.2  # the traffic counts are copied at most this often (and at every algorithm's end)
MAX_POINTS = 2000  # an algorithm's curve keeps about this many points (evenly spaced steps, and its last)
TRAFFIC_FIELDS = ("rounds", "messages_down", "messages_up", "floats_down", "floats_up", "bytes_down", "bytes_up")
CURVE_FIELDS = ("dist_x", "dist_z", "grad_norm", "residual", "epsilon")


@dataclass
class AlgorithmState:
    """One algorithm of the run, as far as it has gone."""

    name: str
    status: str = "waiting"  # waiting, running, then ok, diverged or stopped (ended: until the run's outcome says)
    steps: int = 0
    rounds: int = 0  # spent, counted by the config's round convention
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # category -> TRAFFIC_FIELDS
    last: dict[str, float] = field(default_factory=dict)  # each number's latest value in the records
    points: list[dict[str, float]] = field(default_factory=list)  # the curve so far
    stride: int = 1  # one step in `stride` goes on the curve
    wall_s: float = 0.0


@dataclass
class LiveState:
    """A run as the monitor shows it (see the module's docstring for who writes and who reads)."""

    config: RunConfig
    algorithms: list[AlgorithmState] = field(default_factory=list)
    pool: ClientPool | None = None
    started: float = field(default_factory=time.time)
    finished: bool = False
    failure: str | None = None
    run_dir: str = ""
    secure_dropouts: int = 0
    secure_recoveries: int = 0
    rounds_seen: int = 0  # rounds of every category, as the pool ended them
    lock: threading.Lock = field(default_factory=threading.Lock)
    _synced: float = 0.0
    _current: AlgorithmState | None = None

    def __post_init__(self) -> None:
        stride = max(1, math.ceil(self.config.rounds / MAX_POINTS))
        names = [spec.display_name for spec in self.config.algorithms]
        self.algorithms = [AlgorithmState(name, stride=stride) for name in names]

    @property
    def secure(self) -> bool:
        return bool(self.config.privacy.secure_aggregation)

    def _algorithm(self, name: str) -> AlgorithmState:
        current = self._current
        if current is not None and current.name == name:
            return current
        for state in self.algorithms:
            if state.name == name and state.status in ("waiting", "running"):
                break
        else:  # (a name the config does not list: shown all the same)
            state = AlgorithmState(name, stride=self.algorithms[0].stride if self.algorithms else 1)
            self.algorithms.append(state)
        if current is not None and current.status == "running":  # it ended without a last step (a failed round)
            current.status = "ended"
        state.status = "running"
        self._current = state
        return state

    # -- written by the driver's thread ---------------------------------------------------

    def on_step(self, run: Run, done: StepDone, pool: ClientPool) -> None:
        """The driver's step hook: the step's record (numbers only) and, now and then, the traffic."""
        record = run.records[-1]
        key = run.convention.record_key
        numbers = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
        ending = run.status != "ok" or run.ends_at(done)
        with self.lock:
            state = self._algorithm(run.name)
            # (each measure's latest value: ||G|| and the evaluation metrics come every evaluate_every steps)
            state.steps, state.rounds, state.last = done.steps, int(record.get(key, 0)), {**state.last, **numbers}
            if ending:  # (its budget spent, or diverged)
                state.status = run.status
            if done.steps % state.stride == 0 or ending:
                state.points.append(numbers)
            now = time.monotonic()
            if now - self._synced >= SYNC_S or ending:
                self._synced = now
                state.traffic = _traffic(pool)
                state.wall_s = time.perf_counter() - run.started

    def round_done(self) -> None:
        self.rounds_seen += 1

    def secure_round(self, dropped: int, recovered: int) -> None:
        with self.lock:
            self.secure_dropouts += dropped
            self.secure_recoveries += recovered

    def finish(self, outcome: Outcome) -> None:
        """The run is over: each algorithm's outcome and traffic as summary.json records them."""
        with self.lock:
            for result in outcome.results:
                state = next((s for s in self.algorithms if s.name == result.name and s.status != "waiting"), None)
                if state is None:
                    state = self._algorithm(result.name)
                state.status = result.status
                state.traffic = {c: {f: int(counts[f]) for f in TRAFFIC_FIELDS} for c, counts in result.traffic.items()}
                state.wall_s = result.wall_s
                if result.records:
                    last = {k: float(v) for k, v in result.records[-1].items() if isinstance(v, int | float)}
                    state.last = {**state.last, **last}
                    if not state.points or state.points[-1] != last:
                        state.points.append(last)
            self.finished, self.failure, self.run_dir = True, outcome.failure, str(outcome.run_dir)
            self._current = None

    # -- read by the monitor's threads ----------------------------------------------------

    def clients(self) -> list[dict[str, Any]]:
        """Each client: index, state, last answer's latency; its address too, unless secure aggregation is on
        (then nothing per client beyond liveness and timing)."""
        pool = self.pool
        if pool is None:
            return [{"index": i, "state": "waiting", "latency_s": None} for i in range(self.config.problem.num_clients)]
        shown = []
        for view in pool.client_view():
            entry: dict[str, Any] = {"index": view.client, "state": view.state, "latency_s": view.latency_s}
            if not self.secure:
                entry["address"] = view.address
            shown.append(entry)
        return shown

    def view(self, sent: dict[str, int]) -> dict[str, Any]:
        """The dashboard's state, with each curve's points beyond the `sent` counts (updated in place)."""
        config = self.config
        with self.lock:
            algorithms = []
            points: dict[str, list[dict[str, float]]] = {}
            for state in self.algorithms:
                algorithms.append(
                    {
                        "name": state.name,
                        "status": state.status,
                        "steps": state.steps,
                        "rounds": state.rounds,
                        "wall_s": state.wall_s,
                        "traffic": {c: dict(t) for c, t in state.traffic.items()},
                        "last": dict(state.last),
                    }
                )
                already = sent.get(state.name, 0)
                if len(state.points) > already:
                    points[state.name] = state.points[already:]
                    sent[state.name] = len(state.points)
            outcome = {"failure": self.failure, "run_dir": self.run_dir} if self.finished else None
            secagg = {"dropouts": self.secure_dropouts, "recoveries": self.secure_recoveries}
        pool = self.pool
        return {
            "run": config.name,
            "problem": config.problem.name,
            "budget": config.rounds,
            "convention": config.round_convention.words,
            "round_key": config.round_convention.record_key,
            "secure_aggregation": self.secure,
            "dp": config.privacy.dp is not None,
            "elapsed_s": time.time() - self.started,
            "clients_expected": config.problem.num_clients,
            "clients": self.clients(),
            "algorithms": algorithms,
            "points": points,
            "outcome": outcome,
            "refusals": pool.refusals() if pool is not None else {},
            "connections_closed": pool.connections_closed() if pool is not None else {},
            "secure": secagg,
        }


def _traffic(pool: ClientPool) -> dict[str, dict[str, int]]:
    return {c: {f: int(getattr(counts, f)) for f in TRAFFIC_FIELDS} for c, counts in pool.traffic.items()}
