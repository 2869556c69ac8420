"""What a problem is: the plug-in interface for your own federated minimax objectives.

A problem is min_x max_y f(x, y) with f the mean of the clients' f_i (uniform,
as in the paper, or weighted by the clients' sample counts). fedsaddle needs of
it, on the clients' side, the gradient mapping

    G_i(z) = (grad_x f_i(x, y), -grad_y f_i(x, y)),   z = (x, y),

and f_i itself, computed on client i's own data. To plug in your own:

    class MySpec(ProblemSpec):                 # public hyper-parameters only
        name: Literal["my_problem"] = "my_problem"
        features: int
        lam: float = 1e-2

    class MyProblem(DataProblem):
        Spec = MySpec
        def dims(self): return self.spec.features, 1          # (len(x), len(y))
        def check(self, data): ...                              # raise DataError if unusable
        def gradient(self, data, z): ...                        # -> G_i(z), shape (dim_x + dim_y,)
        def objective(self, data, z): ...                       # -> f_i(z), a float

and name it in the config, `problem: {name: my_problem, plugin: "mypkg.module:MyProblem", ...}`,
or register it as a package entry point in the group `fedsaddle.problems`. Client
processes load only the problems they trust (see registry.py).

Client identity: `gradient`, `objective` and `metrics` that take a keyword argument
`client` receive a ClientContext (the client's index, the number of clients, its
aggregation weight), e.g. `def gradient(self, data, z, *, client): ...`; methods
without it are called as before. Synthetic problems get the hosted indices and
spec.num_clients in `shards(seed, indices)` already.

Constrained domains: `domains()` may declare a domain per block of z (a box, a
Euclidean ball, the probability simplex; see domains.py); every algorithm then
keeps its iterates in it.

The spec is public: it travels to every client as JSON and lands in the run
directory. It must never hold data, nor anything data can be rebuilt from.
Each client loads its own data file (`load`), which never leaves its process.

Synthetic problems (the paper's generated regression, the planted quadratic
game) are a different, labelled source: every client generates its shard from
the spec and a seed the coordinator sends. They are for benchmarks and tests;
their data is by construction not private.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.data import ClientData, DataError, read_client_data

if TYPE_CHECKING:
    from fedsaddle.common.problems.domains import Block
    from fedsaddle.common.problems.shards import Shards

__all__ = ["ClientContext", "ClientData", "DataError", "DataProblem", "Problem", "ProblemSpec", "SyntheticProblem"]


@dataclass(frozen=True)
class ClientContext:
    """Who a client is in the federation, for problems whose f_i depends on it.

    The federation's objective is f = sum_i weight_i f_i. Under the paper's uniform
    weighting weight_i = 1 / num_clients. Under `weighting: samples` it is
    samples_i / sum_j samples_j, and the sum over the other clients is not known to any
    client when its data is loaded: `weight` is then None (use `samples`, this client's
    training rows, and uniform weighting if f_i must know its exact share).
    """

    index: int  # i, in [0, num_clients)
    num_clients: int  # n
    weight: float | None  # this client's aggregation weight (see above)
    samples: int  # this client's training rows (0 for synthetic shards)
    weighting: Literal["uniform", "samples"] = "uniform"


def client_context(
    index: int, num_clients: int, samples: int, weighting: Literal["uniform", "samples"] = "uniform"
) -> ClientContext:
    """The context of client `index` under a run's weighting."""
    weight = 1.0 / num_clients if weighting == "uniform" else None
    return ClientContext(index, num_clients, weight, samples, weighting)


def accepts_client(method: Callable[..., Any]) -> bool:
    """Whether a problem method takes the keyword argument `client` (a ClientContext)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    found = parameters.get("client")
    return found is not None and found.kind in (found.KEYWORD_ONLY, found.POSITIONAL_OR_KEYWORD)


class ProblemSpec(BaseModel):
    """The public part of a problem: its name and hyper-parameters, as the config gives them."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(description="the problem's registered name")
    num_clients: int = Field(10, ge=1, description="n, the number of clients")
    plugin: str | None = Field(
        None, description="module:Class of a problem that is neither built in nor registered as an entry point"
    )


MetricRows = Literal["held-out", "training"]  # the rows a metric is computed on


class Problem(abc.ABC):
    """A federated minimax problem, as the coordinator and the clients see it."""

    Spec: ClassVar[type[ProblemSpec]]
    synthetic: ClassVar[bool] = False  # True: data generated from (spec, seed), not private
    metric_names: ClassVar[tuple[str, ...]] = ()  # evaluation metrics on held-out data, if any
    # The metrics of metric_names for which a higher value is better (an AUC, an accuracy); the others are
    # losses. Per-client results (output.per_client) name each metric's worst and best client by it.
    higher_is_better: ClassVar[tuple[str, ...]] = ()
    # The rows `metrics` computes on: each client's held-out rows (the default), or its training rows; one
    # kind for every metric, or a tuple of kinds, one per name of metric_names (a training loss beside a
    # held-out accuracy). The coordinator weighs each client's value of a metric by the count of the rows
    # that metric is on (common/problems/shards.py's `metric_rows` reads and checks this declaration).
    metrics_on: ClassVar[MetricRows | tuple[MetricRows, ...]] = "held-out"

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @abc.abstractmethod
    def dims(self) -> tuple[int, int]:
        """(len(x), len(y)), from the public spec alone."""

    @property
    def dimension(self) -> int:
        """Length of z = (x, y)."""
        dim_x, dim_y = self.dims()
        return dim_x + dim_y

    def domains(self) -> Sequence[Block] | None:
        """The domain of each block of z, in order, covering all dim_x + dim_y entries (Free, Box,
        Ball, Simplex from fedsaddle.common.problems.domains); None: unconstrained (the default)."""
        return None

    def initial_point(self, seed: int) -> Array | None:
        """The problem's own starting point z0 for the run seed `seed` (the config's `init: problem`), e.g. a
        network's initialization; None: the problem has none (the default), and `init: problem` is refused."""
        return None


class DataProblem(Problem):
    """A problem on real data: each client computes on the file it owns. Subclass this for your own."""

    def load(self, path: str | Path) -> ClientData:
        """Read and check one client's data file; DataError naming the file and the fault."""
        return self.check(read_client_data(path))

    def check(self, data: ClientData) -> ClientData:
        """Refuse data this problem cannot use (raise DataError naming data.path and the fault)."""
        return data

    # Each of gradient, objective and metrics may also take a keyword argument `client`, a
    # ClientContext (index, num_clients, weight); fedsaddle passes it only to methods that take it.

    @abc.abstractmethod
    def gradient(self, data: ClientData, z: Array) -> Array:
        """G_i(z) = (grad_x f_i, -grad_y f_i) on this client's training rows, shape (dimension,)."""

    @abc.abstractmethod
    def objective(self, data: ClientData, z: Array) -> float:
        """f_i(z) on this client's training rows."""

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        """The values of `metric_names` at z on this client's held-out rows (when it has some)."""
        return ()

    def client_shards(
        self, datas: Sequence[ClientData], indices: Sequence[int], weighting: Literal["uniform", "samples"] = "uniform"
    ) -> Shards | None:
        """The hosted clients' oracles on their loaded data, for a problem that computes its own way (PyTorch
        problems); None (the default): ProblemShards, which calls `gradient`, `objective` and `metrics` client by
        client."""
        return None

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array | None:
        """z* of the federation's f, from all clients' data (for tests and reports), if known."""
        return None

    @classmethod
    def statistics(cls, datas: Sequence[ClientData]) -> dict[str, int | float]:
        """The spec fields that summarize data (`features`, `positive_rate`, ...), computed from the training
        rows of `datas` pooled. `fedsaddle data split` prints them; a client warns when its data disagrees
        with the spec's values (common/problems/statistics.py). Empty: the spec holds no such field."""
        return {}

    def expect_features(self, data: ClientData, features: int) -> None:
        """A helper for `check`: the file must have `features` columns."""
        if data.X.shape[1] != features:
            raise DataError(f"{data.path}: {data.X.shape[1]} features, but the problem expects {features}")

    def expect_labels(self, data: ClientData, allowed: Sequence[float]) -> None:
        """A helper for `check`: every label (training and held-out) must be one of `allowed`."""
        for name, labels in (("y", data.y), ("y_test", data.y_test)):
            if labels is None:
                continue
            bad = ~np.isin(labels, allowed)
            if bad.any():
                row = int(np.argmax(bad))
                raise DataError(
                    f"{data.path}: {name}[{row}] is {labels[row]:g}; this problem accepts labels {list(allowed)}"
                )


class SyntheticProblem(Problem):
    """A benchmark data source: each client generates its shard from the spec and a seed."""

    synthetic = True

    @abc.abstractmethod
    def shards(self, seed: int, indices: Sequence[int]) -> Shards:
        """The generated shards of the given clients (each process builds only its own)."""

    def solution(self, seed: int) -> Array | None:
        """z*, when the spec and seed determine it."""
        return None
