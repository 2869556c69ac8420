"""Local steps run a block of rows at a time on the paper's problem: the same bits as step after step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, PaperRegressionSpec, make_shards
from fedsaddle.common.problems.regression import LinearRegression, LinearRegressionSpec
from fedsaddle.common.problems.shards import ProblemError, ProblemShards
from fedsaddle.common.tasks import GradientTask, LocalStepsTask
from fedsaddle.common.worker import Worker


class WholeVectors:
    """The same shards without `gradient_pairs`: the worker then takes every step on the whole vector."""

    def __init__(self, shards: Any) -> None:
        self.shards = shards
        self.indices, self.dimension = shards.indices, shards.dimension

    def gradient(self, z: Array, out: Array | None = None) -> Array:
        result: Array = self.shards.gradient(z, out=out)
        return result

    def objective(self, z: Array) -> Array:
        result: Array = self.shards.objective(z)
        return result


CASES = {
    "scaffold": {"control": True, "theta": 0.0, "decay": "constant"},
    "catalyst": {"control": True, "theta": 0.7, "decay": "constant"},
    "fedavg-decay": {"control": False, "theta": 0.0, "decay": "inverse_sqrt"},
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("hosted", [(1,), (0, 2, 3)], ids=["one-client", "three-clients"])
def test_paired_local_steps_give_the_bits_of_whole_vector_steps(case: dict[str, Any], hosted: tuple[int, ...]) -> None:
    # d = 70001 pairs: several blocks and a short last one, for one hosted client and for three.
    spec = PaperRegressionSpec(num_clients=4, dim=70001, lam=0.1, s=2.0)
    shards = make_shards(spec, seed=3, indices=list(hosted))
    rng = np.random.default_rng(5)
    for round_id in (1, 2):
        z = rng.standard_normal(2 * spec.dim)
        control = rng.standard_normal(2 * spec.dim) if case["control"] else None
        task = LocalStepsTask(z, 6, 0.05, 3, case["decay"], control, case["theta"])
        expected = Worker(WholeVectors(shards), seed=0).execute(task, round_id).vectors
        paired = Worker(shards, seed=0).execute(task, round_id).vectors
        assert np.array_equal(paired, expected)
        # A client process's worker runs in the task's own buffer and reuses its answer buffer.
        own = np.concatenate([z, control]) if control is not None else z.copy()
        dimension = 2 * spec.dim
        in_place = task._replace(z_start=own[:dimension], control=None if control is None else own[dimension:])
        process = Worker(shards, seed=0, reuse_answers=True, scratch_tasks=True)
        assert np.array_equal(process.execute(in_place, round_id).vectors, expected)
        # Of the vectors as long as z, it keeps only its answer: the steps' scratch is a block.
        kept = {name: buffer.size for (name, _), buffer in process._buffers.items()}
        assert kept.pop("answer") == dimension * len(hosted)
        assert max(kept.values()) < dimension


def test_a_batch_of_runs_takes_the_same_paired_steps_as_each_run_alone() -> None:
    specs = [PaperRegressionSpec(num_clients=3, dim=9000, lam=lam, s=2.0) for lam in (1e-5, 0.3)]
    runs = [make_shards(spec, seed=9, indices=[0, 2]) for spec in specs]
    stacked = type(runs[0]).stack(runs)  # type: ignore[attr-defined]
    rng = np.random.default_rng(6)
    z, control = rng.standard_normal((2, 2 * 9000)), rng.standard_normal((2, 2 * 9000))
    gamma, theta = np.array([[0.05], [0.02]]), np.array([[0.0], [0.4]])
    batch = Worker(stacked, seed=[0, 0]).execute(LocalStepsTask(z, 4, gamma, 0, "constant", control, theta), 1)
    for run, shards in enumerate(runs):
        alone = LocalStepsTask(z[run], 4, float(gamma[run, 0]), 0, "constant", control[run], float(theta[run, 0]))
        assert np.array_equal(batch.vectors[run], Worker(WholeVectors(shards), seed=0).execute(alone, 1).vectors)


def test_noisy_local_steps_keep_the_whole_vector_order() -> None:
    # Noise is drawn a whole vector per step from each client's stream: those runs do not go by blocks.
    spec = PaperRegressionSpec(num_clients=2, dim=20001, s=2.0)
    shards = make_shards(spec, seed=3, indices=[1])
    rng = np.random.default_rng(7)
    task = LocalStepsTask(rng.standard_normal(2 * spec.dim), 3, 0.05, 0, "constant", rng.standard_normal(2 * spec.dim))
    noisy = Worker(shards, seed=4, gradient_noise=0.3).execute(task, 2).vectors
    assert np.array_equal(noisy, Worker(WholeVectors(shards), seed=4, gradient_noise=0.3).execute(task, 2).vectors)


def test_a_gradient_task_of_several_hosted_clients_reads_one_vector_with_the_same_bits() -> None:
    # Paired shards compute every hosted client's column from the task's one vector, not from a copy per client.
    spec = PaperRegressionSpec(num_clients=4, dim=5000, lam=0.1, s=2.0)
    shards = make_shards(spec, seed=3, indices=[0, 1, 3])
    task = GradientTask(np.random.default_rng(9).standard_normal(2 * spec.dim), exact=True, want_objective=True)
    expected = Worker(WholeVectors(shards), seed=0).execute(task, 1)
    for worker in (Worker(shards, seed=0), Worker(shards, seed=0, reuse_answers=True)):
        answer = worker.execute(task, 1)
        assert np.array_equal(answer.vectors, expected.vectors)
        assert answer.objective is not None and expected.objective is not None
        assert np.array_equal(answer.objective, expected.objective)


class MinibatchRegressionSpec(LinearRegressionSpec):
    batch_size: int | None = None


class MinibatchRegression(LinearRegression):
    """A numpy problem whose spec has a batch_size: its local steps draw minibatches too."""

    Spec = MinibatchRegressionSpec

    def moments(self, data: ClientData) -> tuple[Array, Array]:
        # LinearRegression keeps each file's moments; a minibatch's rows (data.path + "#minibatch") change per call
        if data.path.endswith("#minibatch"):
            return data.X.T @ data.X / data.samples, data.X.T @ data.y / data.samples
        return super().moments(data)


def test_a_numpy_problem_with_a_batch_size_takes_minibatch_local_steps_from_the_documented_stream() -> None:
    rng = np.random.default_rng(4)
    datas = [ClientData(f"c{i}", rng.standard_normal((9, 3)), rng.standard_normal(9)) for i in range(2)]
    problem = MinibatchRegression(MinibatchRegressionSpec(features=3, num_clients=2, batch_size=4))
    worker = Worker(ProblemShards(problem, datas, [0, 1]), seed=21)
    z0 = rng.standard_normal(6)
    answer = worker.execute(LocalStepsTask(z0, 3, 0.1), round_id=5)
    for i, data in enumerate(datas):
        z, total = z0.copy(), np.zeros(6)
        for call in range(3):
            rows = np.random.default_rng([21, 9, i, 5, call]).permutation(9)[:4]
            g = problem.gradient(ClientData("rows#minibatch", data.X[rows], data.y[rows]), z)
            total, z = total + g, z - 0.1 * g
        np.testing.assert_array_equal(answer.vectors[i], total)
    # without a batch_size (every built-in problem), each step takes every row, as before
    plain = Worker(ProblemShards(LinearRegression(LinearRegressionSpec(features=3, num_clients=2)), datas, [0, 1]), 21)
    first = plain.execute(LocalStepsTask(z0, 1, 0.1), round_id=5)
    np.testing.assert_array_equal(first.vectors[1], problem.gradient(datas[1], z0))
    with pytest.raises(ProblemError, match="batch_size is 10, larger than client 0's 9 training rows"):
        too_large = MinibatchRegressionSpec(features=3, num_clients=2, batch_size=10)
        ProblemShards(MinibatchRegression(too_large), datas, [0, 1])
