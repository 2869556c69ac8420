"""What every algorithm shares: the step protocol, the sync schedule, state files.

An algorithm is (init, step) over an explicit state object: `init` may spend
rounds (SCAFFOLD-S gathers G(z0)), `step` advances by one sync (or one MD / MP
step) and returns a new state. The state is a frozen dataclass of arrays and
numbers, so it can be saved after any step (`save_state`) and read back.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.config import FixedSync, RandomSync
from fedsaddle.common.problems import Array
from fedsaddle.server.pool import ClientPool

State = TypeVar("State")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Rounds one step spends, counted both ways (see README, Communication)."""

    exchanges: int  # every coordinator <-> clients exchange
    paper: int  # the paper's convention: syncs (and Mirror-prox's two gathers)


class SyncSchedule:
    """Draws the number of local steps before each sync.

    Fixed: always tau. Random: the paper flips a coin with probability p after
    every local step; the number of steps up to and including the first success
    is Geometric(p), so the coordinator draws it once per sync from its seeded
    stream and sends it with the task (identical in distribution, one draw).
    """

    def __init__(self, spec: FixedSync | RandomSync, seed: int) -> None:
        self.spec = spec
        self._rng = seeding.rng(seed, seeding.SYNC)

    def next_interval(self) -> int:
        if isinstance(self.spec, FixedSync):
            return self.spec.tau
        return int(self._rng.geometric(self.spec.p))

    def state(self) -> dict[str, Any]:
        return dict(self._rng.bit_generator.state)

    def restore(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state


class Algorithm(abc.ABC, Generic[State]):
    name: str

    @abc.abstractmethod
    def init(self, z0: Array, pool: ClientPool, schedule: SyncSchedule) -> State:
        """The starting state (may spend rounds; see init_cost)."""

    @abc.abstractmethod
    def step(self, state: State, pool: ClientPool, schedule: SyncSchedule) -> State:
        """One sync (or one MD/MP step)."""

    @abc.abstractmethod
    def iterate(self, state: State) -> Array:
        """The coordinator's current iterate: what metrics are taken at."""

    @abc.abstractmethod
    def step_cost(self, state: State) -> StepCost:
        """Rounds the next step will spend."""

    def init_cost(self) -> StepCost:
        return StepCost(0, 0)


# -- arithmetic that must not depend on batching ----------------------------------------


def norm(v: Array) -> Array:
    """Euclidean norm over the last axis, kept as a trailing axis of 1.

    Used for every norm an algorithm or a metric takes, so that one run alone and
    the same run inside a batch of runs compute it with the same additions.
    """
    result: Array = np.sqrt(np.sum(v * v, axis=-1, keepdims=True))
    return result


def positive(name: str, value: float | Array, allow_zero: bool = False) -> float | Array:
    """Check a step size or weight (a number, or one per run of a batch)."""
    values = np.asarray(value, dtype=float)
    ok = values >= 0 if allow_zero else values > 0
    if not (np.all(ok) and np.all(np.isfinite(values))):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


# -- state files -----------------------------------------------------------------------


def save_state(state: Any, path: str | Path) -> None:
    """Write a state dataclass to an .npz file (arrays exact, numbers as JSON)."""
    arrays = {
        f.name: getattr(state, f.name)
        for f in dataclasses.fields(state)
        if isinstance(getattr(state, f.name), np.ndarray)
    }
    scalars = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in arrays}
    meta = json.dumps({"type": type(state).__name__, "scalars": scalars})
    np.savez(Path(path), __meta__=np.array(meta), **arrays)


def load_state(cls: type[State], path: str | Path) -> State:
    """Read a state written by save_state back into an instance of cls."""
    with np.load(Path(path)) as data:
        meta = json.loads(str(data["__meta__"]))
        if meta["type"] != cls.__name__:
            raise ValueError(f"{path} holds a {meta['type']}, not a {cls.__name__}")
        fields = {name: data[name].copy() for name in data.files if name != "__meta__"}
    fields.update(meta["scalars"])
    return cls(**fields)
