"""The PyTorch side of problems written in PyTorch (common/problems/pytorch.py has the contract): the players as
built, the wire vector's flatten and unflatten, and TorchShards, the clients' oracles by autograd.

Only processes that compute import it (client processes, `simulate`): common/problems/pytorch.py, which a
coordinator imports with a config that names a PyTorch problem, loads it on first use, so that a coordinator
never maps PyTorch (about 650 MiB of the CUDA build's libraries, even on a CPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedsaddle.common import devices
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.base import ClientData, accepts_client, client_context
from fedsaddle.common.problems.domains import Box, problem_domain
from fedsaddle.common.problems.shards import Minibatches, ProblemError, shard_columns
from fedsaddle.common.problems.torch_batch import Batch

if TYPE_CHECKING:
    from fedsaddle.common.problems.pytorch import TorchProblem

# Before the first cuBLAS call of the process (torch's "reproducibility" notes): deterministic CUDA matmuls.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _count(parameters: Sequence[torch.Tensor]) -> int:
    return sum(int(p.numel()) for p in parameters)


@dataclass
class Players:
    """One player as the problem built it (`value`: a module or a list of tensors) and its parameters, in the
    wire's order."""

    value: Any
    parameters: list[torch.Tensor]

    @property
    def count(self) -> int:
        """The player's parameter count."""
        return _count(self.parameters)

    @staticmethod
    def of(player: object, role: str, problem: str, device: str | torch.device, dtype: torch.dtype) -> Players:
        if isinstance(player, torch.nn.Module):
            buffers = [name for name, _ in player.named_buffers()]
            if buffers:
                raise ProblemError(
                    f"{problem}: the {role} has buffers {buffers[:5]} (BatchNorm's running statistics, say): they "
                    "would be state outside z that no algorithm sees; use layers without buffers (GroupNorm, "
                    "LayerNorm) or make them parameters"
                )
            frozen = [name for name, p in player.named_parameters() if not p.requires_grad]
            if frozen:
                raise ProblemError(
                    f"{problem}: the {role}'s parameters {frozen[:5]} have requires_grad off; every parameter is "
                    "part of z and is trained (leave constants out of the module's parameters)"
                )
            player.to(device=device, dtype=dtype)
            return Players(player, [p for _, p in player.named_parameters()])
        if isinstance(player, torch.Tensor) or not isinstance(player, Sequence):
            raise ProblemError(
                f"{problem}: players() must return two players, each a torch.nn.Module or a list of tensors; "
                f"the {role} is a {type(player).__name__}"
            )
        tensors = []
        for k, tensor in enumerate(player):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ProblemError(
                    f"{problem}: the {role}'s entry {k} is a {type(tensor).__name__}; expected a float tensor"
                )
            tensors.append(tensor.detach().to(device=device, dtype=dtype).clone().requires_grad_(True))
        return Players(tensors, tensors)


def _shifted(grad: torch.Tensor | None, shift: torch.Tensor, descending: bool) -> torch.Tensor:
    """A parameter's step direction with a control variate's shift: grad + shift on the min player, grad - shift
    on the max player (whose step adds its direction); a parameter the loss does not use moves by the shift alone."""
    # (Out of place: autograd may hand back one tensor for two parameters, or an expanded view.)
    if grad is None:
        return shift.clone() if descending else -shift
    return grad + shift if descending else grad - shift


def flatten(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> Array:
    """z = (x's parameters, then y's), each flattened row-major, widened to a float64 numpy vector."""
    parts = [p.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for p in (*x, *y)]
    if not parts:
        return np.zeros(0)
    return np.ascontiguousarray(torch.cat(parts).numpy())


def unflatten(z: Array, parameters: Sequence[torch.Tensor]) -> None:
    """Copy z into `parameters` (in their order, each in its own dtype and device: float32 rounds to nearest);
    ValueError if z's length is not their count."""
    total = _count(parameters)
    if np.shape(z) != (total,):
        raise ValueError(f"z has shape {np.shape(z)}; the players have {total} parameters")
    values = np.ascontiguousarray(z, dtype=np.float64)
    # (torch wants a writable array even to read it: a broadcast task column is read-only)
    flat = torch.from_numpy(values if values.flags.writeable else values.copy())
    offset = 0
    with torch.no_grad():
        for p in parameters:
            n = int(p.numel())
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def configure(threads: int) -> None:
    """The settings a process's bits depend on (module docstring): deterministic kernels, `threads` threads."""
    torch.use_deterministic_algorithms(True)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class TorchShards:
    """The clients a process hosts for a PyTorch problem: the Shards interface (common/problems/shards.py) over
    autograd. One pair of players serves every hosted client: each call loads its client's column of z first.

    Checked when made, so that a problem that cannot serve fails before the run's first round, naming the client:
    the players' parameter counts against `dims()`, `batch_size` against each client's rows, and the loss at the
    players' initialization (a scalar, finite).
    """

    def __init__(
        self,
        problem: TorchProblem,
        datas: Sequence[ClientData],
        indices: Sequence[int],
        weighting: Literal["uniform", "samples"] = "uniform",
    ) -> None:
        if len(datas) != len(indices):
            raise ValueError(f"{len(indices)} clients need {len(indices)} data files, got {len(datas)}")
        spec = problem.spec
        configure(spec.threads)
        self.problem = problem
        self.indices = tuple(indices)
        self.device = torch.device(devices.current())
        self.dtype = DTYPES[spec.dtype]
        self.x, self.y = problem.build(self.device, 0)
        self.parameters = [*self.x.parameters, *self.y.parameters]
        counts = (_count(self.x.parameters), _count(self.y.parameters))
        declared = problem.dims()
        if counts != tuple(declared):
            raise ProblemError(
                f"{problem._name()}: its players have {counts[0]} + {counts[1]} parameters (x, y), but dims() "
                f"declares {declared[0]} + {declared[1]}"
            )
        self.dim_x = counts[0]
        self.dimension = counts[0] + counts[1]
        self.datas = list(datas)
        self.contexts = [
            client_context(i, spec.num_clients, data.samples, weighting)
            for i, data in zip(self.indices, self.datas, strict=True)
        ]
        self.batch_size = spec.batch_size
        self.draws = Minibatches(self.indices, [d.samples for d in self.datas], spec.batch_size, problem._name())
        self.begin_round, self.stochastic = self.draws.begin_round, self.draws.stochastic
        self.train = [self._batch(data.X, data.y, data.group) for data in self.datas]
        self.test = [
            None if d.X_test is None or d.y_test is None else self._batch(d.X_test, d.y_test, d.group_test)
            for d in self.datas
        ]
        self._with_context = {name: accepts_client(getattr(problem, name)) for name in ("loss", "test_metrics")}
        self.domain = problem_domain(problem)
        self._iterates: torch.Tensor | None = None  # `local_steps`' first and last iterates
        for j in range(len(self.datas)):  # the loss at the players' initialization
            value = float(self._loss(j, self.train[j]).detach())
            if not np.isfinite(value):
                raise ProblemError(
                    f"{self._where('loss', j)} is {value} at the players' initialization (seed 0): f_i must be "
                    "finite where a run starts"
                )

    def _batch(self, X: Array, t: Array, group: Array | None) -> Batch:
        # Copies (torch.tensor, never a view of numpy's memory): every process holds its rows in torch's own
        # allocations, so no kernel's result can depend on where numpy happened to put an array.
        inputs = self.problem.inputs(torch.tensor(X, dtype=self.dtype, device=self.device))
        targets = torch.tensor(t, dtype=self.dtype, device=self.device)
        groups = None if group is None else torch.tensor(group, dtype=self.dtype, device=self.device)
        return Batch(inputs, targets, groups)

    def _where(self, name: str, j: int) -> str:
        return f"{self.problem._name()}: {name}() on client {self.indices[j]}'s data"

    def _call(self, name: Literal["loss", "test_metrics"], j: int, batch: Batch) -> Any:
        """The problem's `name` on client j's `batch`, given the client's context when it takes one; ProblemError
        naming the method and the client for anything it raises."""
        method = getattr(self.problem, name)
        try:
            if self._with_context[name]:
                return method(self.x.value, self.y.value, batch, client=self.contexts[j])
            return method(self.x.value, self.y.value, batch)
        except Exception as exc:
            raise ProblemError(f"{self._where(name, j)} raised {type(exc).__name__}: {exc}") from exc

    def _loss(self, j: int, batch: Batch) -> torch.Tensor:
        value = self._call("loss", j, batch)
        if not isinstance(value, torch.Tensor):
            raise ProblemError(f"{self._where('loss', j)} returned a {type(value).__name__}; it must return a tensor")
        if value.numel() != 1:
            raise ProblemError(
                f"{self._where('loss', j)} returned shape {tuple(value.shape)}; f_i is a scalar (reduce over the "
                "batch's rows, e.g. with .mean())"
            )
        return value.reshape(())

    def _rows(self, j: int) -> Batch:
        """Client j's rows for this call: its minibatch inside a stochastic call (`draws`), else all of them."""
        rows = self.draws.rows(j)
        batch = self.train[j]
        return batch if rows is None else batch.take(torch.from_numpy(rows).to(self.device))

    # -- the Shards interface ----------------------------------------------------------------------

    def _columns(self, z: Array) -> list[tuple[int, tuple[int, ...], Array]]:
        return shard_columns(z, len(self.datas))

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        out = np.empty_like(z) if out is None else out
        for j, where, column in self._columns(z):
            batch = self._rows(j)
            unflatten(column, self.parameters)
            loss = self._loss(j, batch)
            # (None for a parameter the loss does not use: torch's stubs do not say so)
            grads: Sequence[torch.Tensor | None] = torch.autograd.grad(loss, self.parameters, allow_unused=True)
            # Each gradient widened straight into its rows of the column (exactly: no float32 -> float64 rounding),
            # with no flat copy of its own in between.
            target: tuple[slice | int, ...] = (slice(None), *where)
            g_column = torch.from_numpy(out[target])
            offset = 0
            for p, g in zip(self.parameters, grads, strict=True):
                rows = g_column[offset : offset + int(p.numel())]
                if g is None:
                    rows.zero_()
                else:
                    rows.copy_(g.reshape(-1))
                offset += int(p.numel())
            y_block: tuple[slice | int, ...] = (slice(self.dim_x, None), *where)
            out[y_block] *= -1.0  # G = (grad_x f, -grad_y f)
        return out

    def local_steps(
        self,
        z_start: Array,
        rates: Sequence[float],
        gamma_local: float,
        out: Array | None,
        control: Array | None = None,
    ) -> Array | None:
        """Local steps with the iterate in the players (`local_iterate: players`), from each hosted client's
        column of `z_start` (D, k): step l moves the parameters in place, x by -rates[l] grad_x f_i and y by
        +rates[l] grad_y f_i on the step's minibatch (`sub_`/`add_` with alpha, as a plain loop does), then
        projects the constrained blocks of the domain; the answer is (z_0 - z_L) / gamma_local in float64, the
        steps actually taken (z_0: z_start rounded to the players' dtype; z_L: the last iterate). With a
        `control` c (D,), SCAFFOLD-S's and FedGDA-GT's, the direction is G_i(z) - G_i(z_0) + c, as a plain loop
        keeping a control variate takes it: c rounded to the players' dtype, G_i(z_0) by autograd on all of the
        client's rows at the task's start, s = c - G_i(z_0) formed in that dtype once, and each step's gradient
        shifted by it (x: grad_x f_i + s_x; y: grad_y f_i - s_y, G's y block being -grad_y f_i). None,
        for the worker's own arithmetic, when `local_iterate` is float64 or gamma_local is 0 (nothing moves)."""
        if self.problem.spec.local_iterate != "players" or not gamma_local > 0:
            return None
        out = np.empty(z_start.shape) if out is None else out
        controls = None if control is None else self._split(np.asarray(control))
        descent, ascent = self.x.parameters, self.parameters[len(self.x.parameters) :]
        if self._iterates is None:  # z_0 and z_L, flat in the players' dtype, kept from task to task
            self._iterates = torch.empty((2, self.dimension), dtype=self.dtype, device=self.device)
        first, last = self._iterates
        for j, where, column in self._columns(z_start):
            unflatten(column, self.parameters)
            torch.cat([p.detach().view(-1) for p in self.parameters], out=first)
            shifts = None if controls is None else self._shifts(j, controls, len(descent))
            for rate in rates:
                with self.draws.stochastic():
                    batch = self._rows(j)
                grads = torch.autograd.grad(self._loss(j, batch), self.parameters, allow_unused=True)
                with torch.no_grad():
                    if shifts is not None:  # (x: grad + c_x; y: grad - c_y, since G's y block is -grad_y f)
                        grads = tuple(
                            _shifted(g, shift, k < len(descent))
                            for k, (g, shift) in enumerate(zip(grads, shifts, strict=True))
                        )
                    for p, g in zip(descent, grads, strict=False):
                        if g is not None:
                            p.sub_(g, alpha=rate)
                    for p, g in zip(ascent, grads[len(descent) :], strict=True):
                        if g is not None:
                            p.add_(g, alpha=rate)
                    self._project_players()
            torch.cat([p.detach().view(-1) for p in self.parameters], out=last)
            into: tuple[slice | int, ...] = (slice(None), *where)
            answer = torch.from_numpy(out[into])
            answer.copy_(first)  # (widened exactly)
            answer.sub_(last.to("cpu"))
            answer.div_(gamma_local)
        return out

    def _shifts(self, j: int, controls: list[torch.Tensor], descending: int) -> list[torch.Tensor]:
        """Client j's s = c - G_i(z_0) per parameter, at the players' values, on all of its rows: c_x - grad_x f_i
        on the first `descending` parameters (the min player's), c_y + grad_y f_i on the others."""
        grads = torch.autograd.grad(self._loss(j, self._rows(j)), self.parameters, allow_unused=True)
        with torch.no_grad():
            return [
                c if g is None else (c - g if k < descending else c + g)
                for k, (c, g) in enumerate(zip(controls, grads, strict=True))
            ]

    def _split(self, column: Array) -> list[torch.Tensor]:
        """A column of z's length rounded to the players' dtype and device, cut into one tensor per parameter."""
        flat = torch.as_tensor(np.ascontiguousarray(column), dtype=self.dtype, device=self.device)
        sizes = [int(p.numel()) for p in self.parameters]
        return [piece.view_as(p) for piece, p in zip(torch.split(flat, sizes), self.parameters, strict=True)]

    def _project_players(self) -> None:
        """The players' constrained blocks projected in place: a box entry by entry (clamped to its bounds in the
        players' dtype), a ball or simplex gathered as one float64 vector, projected, and put back."""
        if self.domain is None:
            return
        for rows, block in self.domain.constrained:
            pieces = self._pieces(rows)
            if isinstance(block, Box):
                for p, a, b in pieces:
                    p.view(-1)[a:b].clamp_(min=block.low, max=block.high)
                continue
            values = torch.cat([p.view(-1)[a:b] for p, a, b in pieces]).to(device="cpu", dtype=torch.float64)
            projected = torch.from_numpy(np.ascontiguousarray(block.project(values.numpy())))
            offset = 0
            for p, a, b in pieces:
                p.view(-1)[a:b].copy_(projected[offset : offset + b - a])
                offset += b - a

    def _pieces(self, rows: slice) -> list[tuple[torch.Tensor, int, int]]:
        """The parameters' entries that z[rows] covers: (parameter, first, stop) in z's order."""
        pieces, offset = [], 0
        for p in self.parameters:
            n = int(p.numel())
            a, b = max(rows.start, offset), min(rows.stop, offset + n)
            if a < b:
                pieces.append((p, a - offset, b - offset))
            offset += n
        return pieces

    def objective(self, z: Array) -> Array:
        values = np.empty(z.shape[1:])
        with torch.no_grad():
            for j, where, column in self._columns(z):
                unflatten(column, self.parameters)
                values[where] = float(self._loss(j, self.train[j]))
        return values

    def evaluate(self, z: Array) -> tuple[Array, Array]:
        names = self.problem.metric_names
        values = np.zeros((len(self.datas), len(names)))
        counts = np.zeros(len(self.datas))
        unflatten(np.ascontiguousarray(z), self.parameters)
        for j, batch in enumerate(self.test):
            if batch is None:
                continue
            with torch.no_grad():
                found = self._call("test_metrics", j, batch)
            if np.shape(found) != (len(names),):
                raise ProblemError(
                    f"{self._where('test_metrics', j)} returned shape {np.shape(found)}; it must give one value per "
                    f"metric name {list(names)}"
                )
            values[j] = [float(v) for v in found]
            counts[j] = batch.rows
        return values, counts

    def sample_counts(self) -> list[int]:
        return [data.samples for data in self.datas]
