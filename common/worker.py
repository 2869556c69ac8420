"""What clients compute for a task: local steps and gradients over their shards.

Shared by the client runtime (client/) and the in-process transport
(server/transport/local_pool.py, server/batch.py), so that every transport runs the
same arithmetic on the same data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.attacks import flip_labels
from fedsaddle.common.computations import broken_plugins, find_computation
from fedsaddle.common.indices import some
from fedsaddle.common.memory import lasting
from fedsaddle.common.numeric import BLOCK, Array, all_finite, blocks
from fedsaddle.common.problems import (
    DataError,
    DataProblem,
    ProblemShards,
    ProblemSpec,
    Shards,
    SyntheticProblem,
    make_problem,
)
from fedsaddle.common.problems.domains import Domain, problem_domain
from fedsaddle.common.problems.statistics import disagreements
from fedsaddle.common.tasks import (
    Answer,
    ComputeTask,
    EvaluateTask,
    GradientTask,
    LocalStepsTask,
    Task,
    step_weight,
)

log = logging.getLogger("fedsaddle.data")
PairedGradient = Callable[[Array, slice, Array], Array]  # a shards' gradient_pairs (common/problems/synthetic.py)
# Entries per scratch array of paired local steps (512 KiB): fewer, and the Python per block costs more than
# the arithmetic at d = 1e3 and 10 clients; more, and a block's arrays no longer stay in cache from step to
# step (at d = 1e6 a round's local steps took 24 ms, against 44 ms on whole vectors).
PAIRED_BLOCK = 4 * BLOCK


class Worker:
    """Executes tasks on the private shards of some clients.

    Stochastic gradients are G_i(z) + xi with xi ~ N(0, sigma^2 / dimension * I),
    so E||G^_i(z) - G_i(z)||^2 = sigma^2. Every oracle call draws fresh noise from
    the stream (seed, client index, round id): the two evaluations in SCAFFOLD's
    G^_i(z_i) - G^_i(z~) are independent estimates.

    A worker may also hold a batch of B runs (stacked shards, one seed per run):
    then task vectors are (B, dimension), per-run step sizes (B, 1), answers
    (B, k, dimension), and non-finite values are left for the caller to flag per
    run. The arithmetic per run is the same, element for element.

    Inside, vectors are columns (dimension, k[, B]), as the shards want them;
    answers are turned back to rows, one per client.
    """

    def __init__(
        self,
        shards: Shards,
        seed: int | Sequence[int],
        gradient_noise: float = 0.0,
        reuse_answers: bool = False,
        scratch_tasks: bool = False,
        element: np.dtype[np.floating] | None = None,
    ) -> None:
        if not (math.isfinite(gradient_noise) and gradient_noise >= 0):  # (NaN would pass for exact gradients)
            raise ValueError(f"the run's gradient noise must be finite and >= 0, got {gradient_noise}")
        self.shards = shards
        self.batched = not isinstance(seed, int)
        self.seeds: tuple[int, ...] = tuple(seed) if not isinstance(seed, int) else (seed,)
        self.noise_scale = gradient_noise / np.sqrt(shards.dimension)
        # A client process sends each answer before it takes the next task, so its answers may
        # share one buffer; in-process callers keep the answers, and get fresh ones.
        self.reuse_answers = reuse_answers
        # A client process hands over its task's buffer (a writable view): the local steps may run
        # in it. In-process callers keep their vectors, which are never written.
        self.scratch_tasks = scratch_tasks
        self._buffers: dict[tuple[str, tuple[int, ...]], Array] = {}
        # A constrained problem's domain (common/problems/domains.py): local steps are projected onto it.
        self.domain: Domain | None = getattr(shards, "domain", None)
        # A run of precision float32: its tasks' vectors are widened to float64 (exactly) and computed on as a
        # float64 run's, and what the clients computed is rounded to float32 once, in `answer` (and the
        # evaluation's metrics); None (float64) leaves every task and answer as it is.
        self.element = None if element is None or element == np.float64 else np.dtype(element)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> Array:
        """An array kept from task to task: at a million entries, a fresh one would cost a page
        fault per 4 KiB every round, more than the arithmetic."""
        buffer = self._buffers.get((name, shape))
        if buffer is None:
            buffer = self._buffers[name, shape] = lasting(shape)
        return buffer

    def _answer_buffer(self, shape: tuple[int, ...]) -> Array | None:
        return self._buffer("answer", shape) if self.reuse_answers else None

    def lone_gradient(self) -> Callable[[Array], Array] | None:
        """`execute`'s arithmetic for a GradientTask of the one client this worker hosts, with no noise drawn
        and no objective asked: a function from z, as a column (dimension, 1), to G_i(z) in the answer
        buffer. None unless the worker hosts one client, alone (no batch), draws no gradient noise and
        reuses its answers (a client process's worker). The usual small round takes it (client/hosted.py),
        and hands what it does not send as it is to `answer`."""
        if self.batched or len(self.indices) != 1 or self.noise_scale > 0 or not self.reuse_answers:
            return None
        if getattr(self.shards, "batch_size", None) is not None:  # a GRADIENT task draws a minibatch
            return None
        shape = (self.shards.dimension, 1)
        return functools.partial(self.shards.gradient, out=self._buffer("answer", shape))

    @property
    def indices(self) -> tuple[int, ...]:
        return self.shards.indices

    def select(self, runs: Sequence[int]) -> Worker:
        """A worker over some runs of this batch (same data and seeds for those runs)."""
        selected = Worker.__new__(Worker)
        selected.shards = self.shards.select_runs(runs)  # type: ignore[attr-defined]
        selected.batched = True
        selected.seeds = tuple(self.seeds[r] for r in runs)
        selected.noise_scale = self.noise_scale
        selected.reuse_answers = selected.scratch_tasks = False
        selected._buffers = {}
        selected.domain = self.domain
        selected.element = self.element
        return selected

    def _begin_round(self, round_id: int) -> None:
        """Start the hosted clients' minibatch streams of round `round_id` (shards with a `batch_size`:
        PyTorch problems; see `_stochastic`)."""
        begin = getattr(self.shards, "begin_round", None)
        if begin is not None:
            begin(self.seeds, round_id)

    def _stochastic(self) -> contextlib.AbstractContextManager[object]:
        """Inside it, each oracle call G^_i(z) of the hosted clients draws its minibatch of training rows, the
        next of the round's stream (shards with a `batch_size`); outside it, calls take every row: G_i(z~)
        computed once per task under SCAFFOLD, exact GRADIENT tasks, objectives. Shards without minibatches
        compute as before."""
        stochastic = getattr(self.shards, "stochastic", None)
        return contextlib.nullcontext() if stochastic is None else stochastic()

    def execute(self, task: Task, round_id: int, clients: tuple[int, ...] | None = None) -> Answer:
        """The answer of the hosted clients, or of `clients` among them (those taking part in the round).

        Every hosted client computes (a client's result depends only on its own
        data and streams); only the answering ones' results are checked and kept.
        A run that diverges overflows: numpy's float warnings are the caller's to
        silence (the driver, batch runs and client processes do), once, not per task.
        """
        if self.element is not None:
            task = widened(task)
        self._begin_round(round_id)
        if isinstance(task, GradientTask):
            vectors, objective = self._gradient(task, round_id)
        elif isinstance(task, EvaluateTask):
            return self._evaluate(task)
        elif isinstance(task, ComputeTask):
            vectors, objective = self._compute(task, round_id), None
        else:
            vectors, objective = self._local_steps(task, round_id), None
        return self.answer(vectors, objective, clients)

    def answer(self, vectors: Array, objective: Array | None = None, clients: tuple[int, ...] | None = None) -> Answer:
        """`execute`'s answer from what the hosted clients computed, as columns (D, k[, B]) (and their objective
        values, (k[, B])): the answering clients' rows, or `diverged` if one of them is not finite."""
        vectors = vectors.T  # columns (D, k[, B]) -> rows ([B,] k, D)
        if objective is not None:
            objective = objective.T
        indices = self.indices
        if clients is not None and not self.batched:
            rows = [indices.index(i) for i in clients]
            indices, vectors = tuple(clients), vectors[rows]
            objective = None if objective is None else objective[rows]
        if self.batched:
            return Answer(indices, vectors, objective)
        if self.element is not None:  # (a value beyond float32's range rounds to inf: diverged, below)
            with np.errstate(over="ignore"):
                vectors = vectors.astype(self.element)
                objective = None if objective is None else objective.astype(self.element)
        if not all_finite(vectors) or (objective is not None and not all_finite(objective)):
            return Answer(indices, np.empty((len(indices), 0)), None, diverged=True)
        return Answer(indices, vectors, objective)

    def _evaluate(self, task: EvaluateTask) -> Answer:
        evaluate = getattr(self.shards, "evaluate", None)
        if evaluate is None or self.batched:
            raise ValueError("this problem has no evaluation metrics (no held-out data)")
        with np.errstate(all="ignore"):
            values, counts = evaluate(task.z)
        # A client whose metrics are not defined (e.g. one class only in its held-out rows) takes no part.
        if self.element is not None:
            with np.errstate(over="ignore"):
                values = values.astype(self.element)
        # Metrics on different rows (counts (k, m)) are each a client's own: one it cannot take weighs nothing.
        defined = np.isfinite(values) & (counts > 0) if counts.ndim == 2 else np.isfinite(values).all(axis=1)[:, None]
        metrics = np.where(defined, values, values.dtype.type(0))
        counts = np.where(defined, counts, 0.0) if counts.ndim == 2 else np.where(defined[:, 0], counts, 0.0)
        return Answer(self.indices, metrics, counts=counts)

    # -- oracles ---------------------------------------------------------------------

    def _per_client(self, vector: Array) -> Array:
        """([B,] D) -> (D, k[, B]): every hosted client starts from the same vector."""
        columns = vector.T[:, None]
        if len(self.indices) == 1:  # (D, 1[, B]) already: a view, no broadcast machinery
            return columns
        return np.broadcast_to(columns, (columns.shape[0], len(self.indices), *columns.shape[2:]))

    @staticmethod
    def _per_run(value: float | Array) -> float | Array:
        """A per-run number: a float, or a batch's (B, 1) column made (B,) for the (D, k, B) layout."""
        return np.ravel(value) if np.ndim(value) else value

    def _streams(self, round_id: int) -> list[np.random.Generator]:
        return [seeding.rng(seed, seeding.NOISE, i, round_id) for seed in self.seeds for i in self.indices]

    def _noise(self, streams: list[np.random.Generator], batch: int = 1) -> Array:
        dim = self.shards.dimension
        if batch == 1:
            draws = np.stack([stream.standard_normal(dim) for stream in streams])
        else:  # the minibatch average of `batch` independent estimates
            draws = np.stack([_mean_of_draws(stream, batch, dim) for stream in streams])
        if self.batched:
            draws = draws.reshape(len(self.seeds), len(self.indices), dim)
        result: Array = self.noise_scale * draws.T  # as columns
        return result

    def _gradient(self, task: GradientTask, round_id: int) -> tuple[Array, Array | None]:
        z = task.z
        if z.ndim == 1 and len(self.shards.indices) == 1:  # one client's column (D, 1): a view if z is contiguous
            z = np.ascontiguousarray(z[:, None])
        else:
            z = self._per_client(z)
            if getattr(self.shards, "gradient_pairs", None) is None:
                # Each hosted client's column of its own (shards may want them contiguous); shards computed
                # entry by entry (`gradient_pairs`) read every client's column from the one vector instead: at
                # d = 1e6, a vector less per hosted client.
                z = np.ascontiguousarray(z)
        with contextlib.nullcontext() if task.exact else self._stochastic():
            g = self.shards.gradient(z, out=self._answer_buffer(z.shape))
        if self.noise_scale > 0 and not task.exact:
            g += self._noise(self._streams(round_id), task.batch)
        objective = self.shards.objective(z) if task.want_objective else None
        return g, objective

    def _local_steps(self, task: LocalStepsTask, round_id: int) -> Array:
        # Shards that keep the iterate in their own parameters (a PyTorch problem's `local_iterate: players`) run
        # FedAvg-S's steps themselves, or answer None for the arithmetic below.
        # With a control (SCAFFOLD-S, FedGDA-GT) they form c - G_i(z~) themselves, G_i(z~) on all the client's
        # rows as below; Catalyst's regularized steps (theta > 0) stay below.
        in_place = getattr(self.shards, "local_steps", None)
        plain = task.control is None or (np.ndim(task.theta) == 0 and task.theta == 0)
        if in_place is not None and not self.batched and self.noise_scale == 0 and plain:
            gamma = float(task.gamma_local)
            rates = [gamma * step_weight(task.decay, task.step_offset + step) for step in range(task.steps)]
            columns = self._per_client(task.z_start)
            done: Array | None = in_place(columns, rates, gamma, self._answer_buffer(columns.shape), task.control)
            if done is not None:
                return done
        if self.domain is not None:
            return self._projected_local_steps(task, round_id, self.domain)
        gradient_pairs = getattr(self.shards, "gradient_pairs", None)
        if gradient_pairs is not None and self.noise_scale == 0:
            return self._paired_local_steps(task, gradient_pairs)
        z_start = self._per_client(task.z_start)
        shape = z_start.shape
        gamma_local, theta = self._per_run(task.gamma_local), self._per_run(task.theta)
        regularized = np.ndim(theta) > 0 or theta != 0
        # Buffers reused every step and every task; the operations are those of the formulas.
        g = self._buffer("g", shape)
        if self.scratch_tasks and not regularized and z_start.flags.writeable:
            z = z_start  # the task's own buffer: z~ is needed only for G(z~), computed below before z moves
        else:
            z = self._buffer("z", shape)
            np.copyto(z, z_start)
        direction_sum = self._answer_buffer(shape)
        if direction_sum is None:
            direction_sum = np.zeros(shape)
        else:
            direction_sum.fill(0.0)
        noisy = self.noise_scale > 0
        streams = self._streams(round_id) if noisy else []
        control = None if task.control is None else task.control.T[:, None]
        grad_start = self.shards.gradient(z_start, out=self._buffer("start", shape)) if control is not None else None
        scratch = self._buffer("scratch", (min(BLOCK, shape[0]), *shape[1:]))
        for step in range(task.steps):
            weight = step_weight(task.decay, task.step_offset + step)
            with self._stochastic():
                self.shards.gradient(z, out=g)
            if noisy:
                g += self._noise(streams)
            if control is not None and grad_start is not None:
                # G_i^theta(z_i) - G_i^theta(z~) + c, where the anchor of Catalyst's
                # regularizer theta (z - z_bar) cancels in the difference.
                g -= grad_start + self._noise(streams) if noisy else grad_start
                if regularized:
                    for rows in blocks(shape[0]):
                        part = scratch[: rows.stop - rows.start]
                        g[rows] += np.multiply(theta, np.subtract(z[rows], z_start[rows], out=part), out=part)
                g += control
            # Elementwise, block by block: the same operations as on whole vectors, with a
            # scratch block that stays in cache instead of a scratch vector as long as z.
            for rows in blocks(shape[0]):
                part = scratch[: rows.stop - rows.start]
                if weight == 1.0:
                    direction_sum[rows] += g[rows]
                else:
                    direction_sum[rows] += np.multiply(weight, g[rows], out=part)
                z[rows] -= np.multiply(gamma_local * weight, g[rows], out=part)
        return direction_sum

    def _paired_local_steps(self, task: LocalStepsTask, gradient_pairs: PairedGradient) -> Array:
        """`_local_steps` for shards whose G_i(z) has entry j depend on x_j and y_j alone (`gradient_pairs`),
        without gradient noise: every step of one block of rows runs before the next block's first.

        Each entry goes through the operations of `_local_steps`, in its order, so the answer is the same
        bit for bit; what changes is the memory. z, the step's gradient and G_i(z~) are only needed one block
        at a time (a block stays in cache from step to step), so of the vectors as long as z only the task's
        and the answer remain: at d = 1e6 a hosted client needs two vectors less (30.5 MiB).
        (Noise is drawn as whole vectors, step after step, from each client's stream: noisy runs keep the
        order of `_local_steps`.)
        """
        z_start = self._per_client(task.z_start)
        shape = z_start.shape
        gamma_local, theta = self._per_run(task.gamma_local), self._per_run(task.theta)
        regularized = np.ndim(theta) > 0 or theta != 0
        direction_sum = self._answer_buffer(shape)
        if direction_sum is None:
            direction_sum = np.zeros(shape)
        else:
            direction_sum.fill(0.0)
        # A block of `rows` pairs holds about PAIRED_BLOCK entries per scratch array, whatever the number
        # of hosted clients and runs (the trailing axes).
        pairs, rest = shape[0] // 2, shape[1:]
        rows = min(pairs, max(1, PAIRED_BLOCK // (2 * math.prod(rest))))
        # In the task's own buffer when it may be written over (see `_local_steps`), else a block's copy.
        in_place = self.scratch_tasks and not regularized and z_start.flags.writeable
        g = self._buffer("g_pairs", (2, rows, *rest))
        part = self._buffer("part_pairs", (2, rows, *rest))
        z_block = None if in_place else self._buffer("z_pairs", (2, rows, *rest))
        control = None if task.control is None else _pairs(task.control.T[:, None])
        grad_start = None if control is None else self._buffer("start_pairs", (2, rows, *rest))
        z_all, start_all, sum_all = _pairs(z_start), _pairs(z_start), _pairs(direction_sum)
        for block in blocks(pairs, rows):
            size = block.stop - block.start
            g_b, part_b, z_start_b, sum_b = g[:, :size], part[:, :size], start_all[:, block], sum_all[:, block]
            if z_block is None:
                z = z_all[:, block]
            else:
                z = z_block[:, :size]
                np.copyto(z, z_start_b)
            if control is not None and grad_start is not None:
                start_b, control_b = grad_start[:, :size], control[:, block]
                gradient_pairs(z_start_b, block, start_b)
            for step in range(task.steps):
                weight = step_weight(task.decay, task.step_offset + step)
                gradient_pairs(z, block, g_b)
                if control is not None:
                    g_b -= start_b
                    if regularized:
                        g_b += np.multiply(theta, np.subtract(z, z_start_b, out=part_b), out=part_b)
                    g_b += control_b
                if weight == 1.0:
                    sum_b += g_b
                else:
                    sum_b += np.multiply(weight, g_b, out=part_b)
                z -= np.multiply(gamma_local * weight, g_b, out=part_b)
        return direction_sum

    def _compute(self, task: ComputeTask, round_id: int) -> Array:
        """A named local computation (common/computations.py) on the hosted clients, as columns."""
        computation = find_computation(task.name)
        if computation is None:
            raise UnknownComputation(task.name)
        z = np.array(self._per_client(task.z))  # the computation's own copy, one column per client
        named: dict[str, object] = {name: self._per_client(array) for name, array in task.arrays}
        named.update(task.params)
        named.update((name, self._per_run(column)) for name, column in task.per_run)  # (B, 1) -> (B,)
        result = np.asarray(computation(_Oracle(self, round_id), z, **named), dtype=np.float64)
        if result.shape != z.shape:
            raise ValueError(
                f"local computation {task.name!r} answered shape {result.shape}; it must answer z's {z.shape}"
            )
        return result

    def _projected_local_steps(self, task: LocalStepsTask, round_id: int, domain: Domain) -> Array:
        """Local steps on a constrained problem: z_i <- P(z_i - gamma_l w_l g_i^l), with the direction
        of `_local_steps` (FedAvg-S's or SCAFFOLD-S's), and the answer sum_l (z_i^l - z_i^{l+1}) /
        gamma_l: the steps actually taken, which is sum_l w_l g_i^l wherever the projection does not
        act. With gamma_l = 0 (SCAFFOLD-S allows it) nothing moves and the answer is sum_l w_l g_i^l."""
        z_start = np.ascontiguousarray(self._per_client(task.z_start))
        gamma_local, theta = self._per_run(task.gamma_local), self._per_run(task.theta)
        moves = bool(np.all(np.asarray(gamma_local) > 0))
        noisy = self.noise_scale > 0
        streams = self._streams(round_id) if noisy else []
        control = None if task.control is None else task.control.T[:, None]
        grad_start = self.shards.gradient(z_start) if control is not None else None
        z = z_start.copy()
        direction_sum = np.zeros(z.shape)
        g = self._buffer("g", z.shape)  # (written whole by every gradient: one page-faulted vector, not one a step)
        for step in range(task.steps):
            weight = step_weight(task.decay, task.step_offset + step)
            with self._stochastic():
                self.shards.gradient(z, out=g)
            if noisy:
                g += self._noise(streams)
            if control is not None and grad_start is not None:
                g -= grad_start + self._noise(streams) if noisy else grad_start
                g += theta * (z - z_start)
                g += control
            if not moves:
                direction_sum += weight * g
                continue
            z_next = domain.project(z - gamma_local * weight * g)
            direction_sum += (z - z_next) / gamma_local
            z = z_next
        return direction_sum


def _wide(vector: Array) -> Array:
    return vector if vector.dtype == np.float64 else vector.astype(np.float64)


def widened(task: Task) -> Task:
    """The task with its vectors in float64 (a float32 run's, widened exactly; a float64 task as it is): the
    clients compute a float32 run's answers with the float64 arithmetic of every other run."""
    if isinstance(task, GradientTask | EvaluateTask):
        return task._replace(z=_wide(task.z))
    if isinstance(task, ComputeTask):
        return task._replace(z=_wide(task.z), arrays=tuple((name, _wide(array)) for name, array in task.arrays))
    control = None if task.control is None else _wide(task.control)
    return task._replace(z_start=_wide(task.z_start), control=control)


def _pairs(vectors: Array) -> Array:
    """(2d, ...) -> (2, d, ...): x's rows, then y's, as a view (never a copy: it is written through)."""
    paired = vectors.reshape(2, vectors.shape[0] // 2, *vectors.shape[1:])
    if not np.may_share_memory(paired, vectors):  # (reshape(copy=False) needs numpy 2.1; 1.26 is supported)
        raise ValueError("these vectors cannot be paired without a copy")
    return paired


class UnknownComputation(LookupError):
    """A task names a local computation this process does not have."""

    def __init__(self, name: str) -> None:
        broken = broken_plugins()
        failed = f" (installed plug-ins that failed to load here: {broken})" if broken else ""
        super().__init__(
            f"this client has no local computation {name[:64]!r}: install the package of the algorithm that "
            f"provides it (entry-point group 'fedsaddle.algorithms') in every client's environment{failed}"
        )
        self.name = name


class _Oracle:
    """The hosted clients' data as a local computation sees it (common/computations.py's ClientOracle)."""

    def __init__(self, worker: Worker, round_id: int) -> None:
        self._worker = worker
        self._shards = worker.shards
        self._streams = worker._streams(round_id) if worker.noise_scale > 0 else []
        # Shards that draw a minibatch per call (`Worker._stochastic`); most draw none, and enter nothing per call.
        self._minibatches = getattr(worker.shards, "stochastic", None)

    @property
    def constrained(self) -> bool:
        return self._worker.domain is not None

    def gradient(self, z: Array, out: Array | None = None, rows: slice | None = None) -> Array:
        z = np.ascontiguousarray(z)
        if out is not None:
            _check_out(out, z)
        if rows is None:
            return self._shards.gradient(z, out=out)
        if out is None:
            raise ValueError("a gradient's rows are written into out: give out= with rows=")
        rows = _consecutive(rows, z.shape[0])
        partial = getattr(self._shards, "gradient_rows", None)
        if partial is not None:  # shards that compute only the rows asked for (common/problems/synthetic.py)
            partial(z, rows, out)
        else:  # the whole gradient, of which only the rows are kept
            whole = self._shards.gradient(z, out=self._worker._buffer("oracle_rows", z.shape))
            out[rows] = whole[rows]
        return out

    def stochastic_gradient(self, z: Array, out: Array | None = None, rows: slice | None = None) -> Array:
        if self._minibatches is None:
            g = self.gradient(z, out, rows)
        else:
            with self._minibatches():
                g = self.gradient(z, out, rows)
        if self._streams:  # (the whole draw, whatever the rows: each client's stream moves as for every call)
            noise = self._worker._noise(self._streams)
            if rows is None:
                g += noise
            else:
                g[rows] += noise[rows]
        return g

    def objective(self, z: Array) -> Array:
        return self._shards.objective(np.ascontiguousarray(z))

    def project(self, z: Array) -> Array:
        domain = self._worker.domain
        return z if domain is None else domain.project(z)


def _consecutive(rows: object, length: int) -> slice:
    """A gradient's `rows` as slice(start, stop) within `length` rows: a slice of consecutive rows (integer
    bounds, step 1), or ValueError."""
    if isinstance(rows, slice):
        try:
            start, stop, step = rows.indices(length)
        except TypeError:  # (bounds that are not integers)
            step = 0
        if step == 1:
            return slice(start, stop)
    raise ValueError(f"a gradient's rows must be a slice of consecutive rows (step 1), got {rows!r}")


def _check_out(out: object, z: Array) -> None:
    """A computation's array for the oracle's gradient at z: float64, of z's shape, apart from z."""
    if not (isinstance(out, np.ndarray) and out.shape == z.shape and out.dtype == np.float64):
        got = (
            f"an array of shape {out.shape} and dtype {out.dtype}"
            if isinstance(out, np.ndarray)
            else type(out).__name__
        )
        raise ValueError(f"a gradient's out must be a float64 array of z's shape {z.shape}, got {got}")
    if np.may_share_memory(out, z):
        raise ValueError("a gradient's out must not share memory with z (G_i(z) is written while z is read)")


def _mean_of_draws(stream: np.random.Generator, batch: int, dim: int) -> Array:
    """The mean of `batch` draws of N(0, I_dim): bit for bit what stream.standard_normal((batch, dim))
    .mean(axis=0) gives (the same draws, added row after row), without holding batch x dim entries.

    The draws come a block of rows at a time; each block is reduced together with the running
    total as its first row, which keeps numpy's order of additions (row by row along axis 0).
    """
    rows = min(batch, max(1, BLOCK // dim))
    block = np.empty((rows + 1, dim))
    stream.standard_normal(out=block[:rows])
    total: Array = np.add.reduce(block[:rows], axis=0)
    done = rows
    while done < batch:
        take = min(rows, batch - done)
        block[0] = total
        stream.standard_normal(out=block[1 : take + 1])
        total = np.add.reduce(block[: take + 1], axis=0)
        done += take
    total /= batch
    return total


def no_data_files(problem: str, clients: Sequence[int]) -> str:
    """What to say when a data problem's clients were given no data file."""
    return (
        f"problem {problem} needs each client's own data file; none was given for clients {some(clients)} "
        "(give --data 'DIR/client-{i:03d}.npz'; `fedsaddle data split` makes such files)"
    )


class ShardCache:
    """The shards of a process's clients for a run, generated or loaded, and kept for the next run.

    A synthetic problem's shards are generated from (spec, seed); a data
    problem's are read from the clients' own files (`data`, one path per client
    index), checked by the problem. Keeps the `size` most recently used entries:
    generating or loading is a run's costly start.
    """

    def __init__(
        self,
        size: int = 8,
        data: Mapping[int, str | Path] | None = None,
        trusted: Collection[str] | None = None,
        check_statistics: bool = True,
        flipped: Collection[int] = (),
    ) -> None:
        self.size = size
        # A client process's `--attack label_flip`: its clients' training labels are swapped as they load.
        self.flipped = frozenset(flipped)
        # Warn when the spec's public statistics contradict the loaded data (common/problems/statistics.py);
        # off where the same data was already checked whole (the client processes of `fedsaddle local`).
        self.check_statistics = check_statistics
        self.data = {int(i): str(p) for i, p in (data or {}).items()}
        self.trusted = trusted
        self._entries: OrderedDict[tuple[str, int, tuple[int, ...], str, tuple[int, ...]], Shards] = OrderedDict()

    def get(
        self,
        spec: ProblemSpec,
        seed: int | None,
        indices: Sequence[int],
        weighting: Literal["uniform", "samples"] = "uniform",
        flipped: Collection[int] = (),
    ) -> Shards:
        """The shards of clients `indices`; DataError naming a file and its fault, ValueError otherwise.

        `weighting`: the run's, which a data problem's clients see in their ClientContext. `flipped`: clients
        whose training labels are swapped (a simulated `label_flip` attack, common/attacks.py), besides this
        cache's own."""
        problem = make_problem(spec, self.trusted)
        synthetic = isinstance(problem, SyntheticProblem)
        flip = tuple(sorted((self.flipped | set(flipped)) & set(indices)))
        if flip and synthetic:
            raise ValueError(f"label_flip needs a problem on data files; {spec.name} generates its own data")
        key = (spec.model_dump_json(), seed if synthetic and seed is not None else -1, tuple(indices), weighting, flip)
        shards = self._entries.get(key)
        if shards is not None:
            self._entries.move_to_end(key)
            return shards
        if isinstance(problem, SyntheticProblem):
            if seed is None:
                raise ValueError(f"problem {spec.name} is synthetic: its data needs the run's seed")
            shards = problem.shards(seed, indices)
        else:
            assert isinstance(problem, DataProblem)
            missing = [i for i in indices if i not in self.data]
            if missing:
                raise DataError(no_data_files(spec.name, missing))
            datas = []
            for i in indices:
                try:
                    datas.append(problem.load(self.data[i]))
                except DataError as exc:
                    raise DataError(f"client {i}: {exc}") from None
            try:
                trained = [flip_labels(d) if i in flip else d for i, d in zip(indices, datas, strict=True)]
            except DataError as exc:
                raise DataError(f"label_flip: {exc}") from None
            own = problem.client_shards(trained, indices, weighting)  # a PyTorch problem's, say
            shards = own if own is not None else ProblemShards(problem, trained, indices, weighting)
            if self.check_statistics:  # (the spec describes the honest data)
                try:
                    found = disagreements(problem, datas, indices)
                except Exception as exc:  # a plug-in's statistics() is a check, not the run's arithmetic
                    found = [f"problem {spec.name!r}: statistics() raised {type(exc).__name__}: {exc}"]
                for disagreement in found:
                    log.warning("%s", disagreement)
        if isinstance(problem, SyntheticProblem):
            domain = problem_domain(problem)
            if domain is not None:  # the worker projects local steps onto it (ProblemShards carry it already)
                shards.domain = domain  # type: ignore[attr-defined]
        self._entries[key] = shards
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return shards
