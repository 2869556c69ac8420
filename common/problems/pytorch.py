"""Problems written in PyTorch: the players are modules (or tensors), f_i a torch function, G_i by autograd.

    class MySpec(TorchSpec):
        name: Literal["my_game"] = "my_game"
        features: int = 10

    class MyGame(TorchProblem):
        Spec = MySpec
        def players(self):                      # built afresh; fedsaddle seeds torch first
            return nn.Linear(self.spec.features, 1), [torch.zeros(1)]
        def loss(self, x, y, batch, *, client): # f_i(x, y; batch): a scalar tensor
            ...

fedsaddle derives G_i(z) = (grad_x f_i, -grad_y f_i) with torch.autograd and hands
every algorithm a float64 numpy vector, as for numpy problems. A PyTorch problem is a
plug-in like any other (entry point, or `plugin: module:Class`), takes the client's
ClientContext, may declare domains (a box or simplex on the max player's block) and
reports `metric_names` through `test_metrics`. docs/how-to/pytorch-problems.md is the
guide; what follows is the contract.

The wire vector. z is the min player's parameters, then the max player's, each in
`named_parameters()` order (a list of tensors: in list order), each parameter
flattened in row-major (C) order: what `torch.nn.utils.parameters_to_vector` gives,
widened to float64. So dim_x and dim_y are the players' parameter counts. `flatten`
and `unflatten` convert both ways. A player's buffers (BatchNorm's running
statistics) would be state outside z that no algorithm sees: modules with buffers
are refused, as are parameters with requires_grad off.

Arithmetic. Each oracle call copies z (float64, as the worker computes) into the
parameters in the spec's `dtype` (float32 by default: z's entries rounded to nearest),
computes f_i and its gradient in that dtype, and widens the gradient to float64
exactly. What travels is the run's `precision`, as for any problem. With
`local_iterate: players`, FedAvg-S's local steps keep the iterate in the parameters
instead, in `dtype`, stepped in place (`TorchShards.local_steps`).

Imports. This module does not import torch (common/problems/torch_shards.py, which
computes, does): a coordinator imports a problem's module for its spec, dimensions
and domain, and builds z0 in a child process when torch is not imported
(`initial_point`), so that it never maps PyTorch.

Determinism. In every process that hosts clients fedsaddle calls
`torch.use_deterministic_algorithms(True)` and `torch.set_num_threads(spec.threads)`
(1 by default: one per client process, and `simulate` uses the same count, so that
its sums match a client process's), and sets CUBLAS_WORKSPACE_CONFIG=:4096:8 for
CUDA (unless set already). The players are built under `torch.manual_seed(seed)`
with the global generator forked, so building them disturbs no one's stream. Bits
hold on the same device kind, the same PyTorch build and the same thread count;
across them results agree to round-off only.

Minibatches. With `batch_size` b set, each stochastic oracle call of client i (a
local step's G_i(z_j), a GRADIENT task's G_i(z) unless it is exact, a local
computation's stochastic gradient) takes b of the client's m training rows: the
first b entries of `numpy.random.default_rng([seed, 9, i, round_id, call]).permutation(m)`,
`call` counting the client's stochastic calls in the round from 0 (`minibatch_rows`;
docs/reference/client-arithmetic.md). Exact calls (SCAFFOLD's G_i(z~), f_i) take
every row. A `batch_size` larger than a client's rows is refused.
"""

from __future__ import annotations

import abc
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientContext, ClientData, DataProblem, ProblemSpec
from fedsaddle.common.problems.shards import ProblemError, minibatch_rows
from fedsaddle.common.problems.torch_batch import Batch

if TYPE_CHECKING:
    import torch

    from fedsaddle.common.problems.shards import Shards
    from fedsaddle.common.problems.torch_shards import Players, TorchShards, configure, flatten, unflatten

__all__ = [
    "Batch",
    "TorchProblem",
    "TorchShards",
    "TorchSpec",
    "configure",
    "flatten",
    "minibatch_rows",
    "unflatten",
]

Player: TypeAlias = "torch.nn.Module | Sequence[torch.Tensor]"
# What common/problems/torch_shards.py defines, importable from here as it always was (it imports torch: loaded
# on first use, so that importing this module does not).
_RUNTIME = ("Players", "TorchShards", "configure", "flatten", "unflatten")


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from fedsaddle.common.problems import torch_shards

        return getattr(torch_shards, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TorchSpec(ProblemSpec):
    """The fields every PyTorch problem has; a problem's own Spec subclasses it."""

    batch_size: int | None = Field(
        None,
        ge=1,
        description="training rows per stochastic oracle call (a local step draws a fresh minibatch); "
        "None: every row (full batch)",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="what the players compute in (the wire carries the run's precision)"
    )
    threads: int = Field(1, ge=1, le=256, description="torch's CPU threads in each process that hosts clients")
    local_iterate: Literal["float64", "players"] = Field(
        "float64",
        description="where a client keeps its iterate during a task's local steps (FedAvg-S's): float64, the "
        "worker's arithmetic as for numpy problems; players, in the parameters themselves, in dtype, stepped in "
        "place as a plain PyTorch loop does (faster; other bits than float64 when dtype is float32)",
    )


class TorchProblem(DataProblem):
    """A federated minimax problem whose players and loss are written in PyTorch. Subclass it: write
    `players` and `loss`, and, for evaluation metrics, `metric_names` and `test_metrics`."""

    Spec: ClassVar[type[ProblemSpec]] = TorchSpec
    spec: TorchSpec

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self._counts: tuple[int, int] | None = None
        self._lones: list[tuple[ClientData, int, str, TorchShards]] = []  # `_lone`'s recent shards

    # -- what the author writes ------------------------------------------------------------------

    @abc.abstractmethod
    def players(self) -> tuple[Player, Player]:
        """The min player's and the max player's parameters, built afresh: each a torch.nn.Module or a list of
        tensors. fedsaddle seeds torch before calling it and moves them to the device and dtype."""

    @abc.abstractmethod
    def loss(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> torch.Tensor:
        """f_i(x, y) on `batch` (this client's rows): a scalar tensor. `x`, `y`: what `players` returned, holding
        the current z."""

    def test_metrics(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> Sequence[float]:
        """The values of `metric_names` on this client's held-out rows `batch` (run under torch.no_grad())."""
        return ()

    def inputs(self, X: torch.Tensor) -> torch.Tensor:
        """A data file's rows X (rows x features) as the players take them, e.g. X.reshape(-1, 1, 8, 8)."""
        return X

    # -- what fedsaddle derives --------------------------------------------------------------------

    def dims(self) -> tuple[int, int]:
        """The players' parameter counts (built once, on the CPU). Override it to declare them from the spec:
        the client processes then check the built players against it."""
        if self._counts is None:
            x, y = self.build("cpu", 0)
            self._counts = (x.count, y.count)
        return self._counts

    def build(self, device: str | torch.device, seed: int) -> tuple[Players, Players]:
        """The two players, built under `torch.manual_seed(seed)` (the global generator forked), on `device` in
        the spec's dtype; ProblemError naming the fault if they are not usable."""
        import torch

        from fedsaddle.common.problems.torch_shards import DTYPES, Players

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                x, y = self.players()
            except Exception as exc:
                raise ProblemError(f"{self._name()}: players() raised {type(exc).__name__}: {exc}") from exc
        dtype = DTYPES[self.spec.dtype]
        return (
            Players.of(x, "min player (x)", self._name(), device, dtype),
            Players.of(y, "max player (y)", self._name(), device, dtype),
        )

    def initial_point(self, seed: int) -> Array:
        """z0 for `init: problem`: the players as `players` initializes them under torch.manual_seed(seed).

        A process that has not imported torch (a coordinator: it never computes) builds them in a child process
        instead, which hands z0 back and exits, so that it never maps PyTorch's libraries (the same build, on the
        CPU: the same bits)."""
        if "torch" not in sys.modules:
            return self._initial_point_elsewhere(seed)
        from fedsaddle.common.problems.torch_shards import flatten

        x, y = self.build("cpu", seed)
        return flatten(x.parameters, y.parameters)

    def _initial_point_elsewhere(self, seed: int) -> Array:
        cls = type(self)
        key = (f"{cls.__module__}:{cls.__qualname__}", self.spec.model_dump_json(), seed)
        held = _INITIAL_POINTS.get(key)
        if held is None:
            request = json.dumps({"problem": key[0], "spec": json.loads(key[1]), "seed": seed, "path": sys.path})
            done = subprocess.run(
                [sys.executable, "-c", _CHILD], input=request.encode(), capture_output=True, check=False
            )
            if done.returncode != 0:
                said = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(nothing on stderr)"]
                raise ProblemError(
                    f"{self._name()}: building its players for `init: problem` (in a child process, which imports "
                    f"torch) failed with exit code {done.returncode}: {said[0]}"
                )
            held = np.frombuffer(done.stdout, dtype=np.float64)
            if held.shape != (self.dimension,):
                raise ProblemError(
                    f"{self._name()}: its players have {held.size} parameters, but dims() declares {self.dimension}"
                )
            _INITIAL_POINTS[key] = held
        return held.copy()

    def unflatten(self, z: Array, device: str = "cpu") -> tuple[Any, Any]:
        """The two players (as `players` returns them, on `device`) holding z: e.g. to score the final iterate."""
        from fedsaddle.common.problems.torch_shards import unflatten

        x, y = self.build(device, 0)
        unflatten(z, [*x.parameters, *y.parameters])
        return x.value, y.value

    def client_shards(
        self, datas: Sequence[ClientData], indices: Sequence[int], weighting: Literal["uniform", "samples"] = "uniform"
    ) -> Shards:
        from fedsaddle.common.problems.torch_shards import TorchShards

        return TorchShards(self, datas, indices, weighting)

    # The numpy interface, for one client's data at a time (tools that call a problem directly use it;
    # runs compute through TorchShards).

    def gradient(self, data: ClientData, z: Array, *, client: ClientContext | None = None) -> Array:
        shards = self._lone(data, client)
        return shards.gradient(np.ascontiguousarray(z)[:, None])[:, 0]

    def objective(self, data: ClientData, z: Array, *, client: ClientContext | None = None) -> float:
        return float(self._lone(data, client).objective(np.ascontiguousarray(z)[:, None])[0])

    def metrics(self, data: ClientData, z: Array, *, client: ClientContext | None = None) -> Sequence[float]:
        values, _ = self._lone(data, client).evaluate(z)
        return tuple(float(v) for v in values[0])

    def _lone(self, data: ClientData, client: ClientContext | None) -> TorchShards:
        """Shards of one client on `data`, kept for the next calls on the same data (finite differences make
        many)."""
        index = 0 if client is None else client.index
        weighting = "uniform" if client is None else client.weighting
        for held, i, w, shards in self._lones:
            if held is data and i == index and w == weighting:
                return shards
        from fedsaddle.common.problems.torch_shards import TorchShards

        shards = TorchShards(self, [data], [index], weighting)
        self._lones = [*self._lones[-3:], (data, index, weighting, shards)]
        return shards

    def _name(self) -> str:
        return f"problem {self.spec.name!r}"


# z0 of each (problem class, spec, seed) that a child process built: a coordinator asks more than once.
_INITIAL_POINTS: dict[tuple[str, str, int], Array] = {}

# The child process: reads the request on stdin, writes z0's float64 bytes on stdout.
_CHILD = """
import json, sys
request = json.loads(sys.stdin.buffer.read())
sys.path[:] = request["path"]
import importlib
module, name = request["problem"].split(":")
cls = importlib.import_module(module)
for part in name.split("."):
    cls = getattr(cls, part)
import torch  # (before initial_point, so that it builds here)
z0 = cls(cls.Spec.model_validate(request["spec"])).initial_point(request["seed"])
sys.stdout.buffer.write(z0.astype("float64").tobytes())
"""
