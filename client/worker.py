"""Local computation of the clients one process hosts, vectorized over its shards."""

from __future__ import annotations

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.problems import Array, Shards
from fedsaddle.common.tasks import Answer, GradientTask, LocalStepsTask, Task, step_weight


class Worker:
    """Executes tasks on the private shards of some clients.

    Stochastic gradients are G_i(z) + xi with xi ~ N(0, sigma^2 / dimension * I),
    so E||G^_i(z) - G_i(z)||^2 = sigma^2. Every oracle call draws fresh noise from
    the stream (seed, client index, round id): the two evaluations in SCAFFOLD's
    G^_i(z_i) - G^_i(z~) are independent estimates.
    """

    def __init__(self, shards: Shards, seed: int, gradient_noise: float = 0.0) -> None:
        if gradient_noise < 0:
            raise ValueError(f"gradient_noise must be >= 0, got {gradient_noise}")
        self.shards = shards
        self.seed = seed
        self.noise_scale = gradient_noise / np.sqrt(shards.dimension)

    @property
    def indices(self) -> tuple[int, ...]:
        return self.shards.indices

    def execute(self, task: Task, round_id: int) -> Answer:
        with np.errstate(over="ignore", invalid="ignore"):
            if isinstance(task, GradientTask):
                vectors, objective = self._gradient(task, round_id)
            else:
                vectors, objective = self._local_steps(task, round_id), None
        finite = bool(np.isfinite(vectors).all()) and (objective is None or bool(np.isfinite(objective).all()))
        if not finite:
            return Answer(self.indices, np.empty((len(self.indices), 0)), None, diverged=True)
        return Answer(self.indices, vectors, objective)

    # -- oracles ---------------------------------------------------------------------

    def _noise(self, streams: list[np.random.Generator], batch: int = 1) -> Array:
        dim = self.shards.dimension
        if batch == 1:
            draws = np.stack([stream.standard_normal(dim) for stream in streams])
        else:  # the minibatch average of `batch` independent estimates
            draws = np.stack([stream.standard_normal((batch, dim)).mean(axis=0) for stream in streams])
        result: Array = self.noise_scale * draws
        return result

    def _streams(self, round_id: int) -> list[np.random.Generator]:
        return [seeding.rng(self.seed, seeding.NOISE, i, round_id) for i in self.indices]

    def _gradient(self, task: GradientTask, round_id: int) -> tuple[Array, Array | None]:
        z = np.broadcast_to(task.z, (len(self.indices), task.z.size))
        g = self.shards.gradient(z)
        if self.noise_scale > 0 and not task.exact:
            g = g + self._noise(self._streams(round_id), task.batch)
        objective = self.shards.objective(z) if task.want_objective else None
        return g, objective

    def _local_steps(self, task: LocalStepsTask, round_id: int) -> Array:
        k = len(self.indices)
        z_start = np.broadcast_to(task.z_start, (k, task.z_start.size))
        z = z_start.copy()
        direction_sum = np.zeros_like(z)
        noisy = self.noise_scale > 0
        streams = self._streams(round_id) if noisy else []
        control = task.control
        grad_start = self.shards.gradient(z_start) if control is not None else None
        for step in range(task.steps):
            weight = step_weight(task.decay, task.step_offset + step)
            g = self.shards.gradient(z)
            if noisy:
                g += self._noise(streams)
            if control is not None and grad_start is not None:
                # G_i^theta(z_i) - G_i^theta(z~) + c, where the anchor of Catalyst's
                # regularizer theta (z - z_bar) cancels in the difference.
                start = grad_start + self._noise(streams) if noisy else grad_start
                g = g - start + task.theta * (z - z_start) + control
            direction_sum += weight * g
            z -= (task.gamma_local * weight) * g
        return direction_sum
