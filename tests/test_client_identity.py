"""A problem's methods may know which client they run for: index, federation size, aggregation weight."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytest

from fedsaddle import api
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientContext, ClientData, DataProblem, ProblemShards, ProblemSpec


class TiltSpec(ProblemSpec):
    name: Literal["tilt"] = "tilt"


class Tilt(DataProblem):
    """f_i(x, y) = 1/2 x^2 + (i + 1) x - n/2 y^2 ... with x, y scalars: every client pulls x its own way.

    G_i(z) = (x + (i + 1), n y); f = mean_i f_i has x* = -(n + 1) / 2, y* = 0.
    """

    Spec = TiltSpec
    metric_names = ("weight",)
    seen: ClassVar[list[ClientContext]] = []

    def dims(self) -> tuple[int, int]:
        return 1, 1

    def gradient(self, data: ClientData, z: Array, *, client: ClientContext) -> Array:
        self.seen.append(client)
        return np.array([z[0] + (client.index + 1), client.num_clients * z[1]])

    def objective(self, data: ClientData, z: Array, client: ClientContext | None = None) -> float:
        assert client is not None
        return float(0.5 * z[0] ** 2 + (client.index + 1) * z[0] - 0.5 * client.num_clients * z[1] ** 2)

    def metrics(self, data: ClientData, z: Array, *, client: ClientContext) -> Sequence[float]:
        return (float("nan") if client.weight is None else client.weight,)


class Plain(Tilt):
    """The same problem written without the context: an existing plug-in, called as before."""

    def gradient(self, data: ClientData, z: Array) -> Array:  # type: ignore[override]
        return np.array([z[0] + 1.0, z[1]])

    def objective(self, data: ClientData, z: Array) -> float:  # type: ignore[override]
        return float(0.5 * z[0] ** 2 + z[0] - 0.5 * z[1] ** 2)

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:  # type: ignore[override]
        return (7.0,)


def rows(path: str, count: int) -> ClientData:
    return ClientData(path, np.ones((count, 1)), np.ones(count), X_test=np.ones((1, 1)), y_test=np.ones(1))


def test_each_client_gets_its_index_the_federation_size_and_its_weight() -> None:
    problem = Tilt(TiltSpec(num_clients=5))
    shards = ProblemShards(problem, [rows("a", 3), rows("b", 4)], [1, 4])
    z = np.array([[2.0, 2.0], [1.0, 1.0]])
    np.testing.assert_array_equal(shards.gradient(z), [[2.0 + 2, 2.0 + 5], [5.0, 5.0]])
    np.testing.assert_array_equal(shards.objective(z), [2.0 + 4 - 2.5, 2.0 + 10 - 2.5])
    assert ClientContext(4, 5, 0.2, 4, "uniform") in problem.seen
    values, counts = shards.evaluate(z[:, 0])
    np.testing.assert_array_equal(counts, [1.0, 1.0])
    np.testing.assert_array_equal(values, [[0.2], [0.2]])


def test_under_sample_weighting_the_weight_is_unknown_and_the_samples_are_given() -> None:
    problem = Tilt(TiltSpec(num_clients=2))
    shards = ProblemShards(problem, [rows("a", 3), rows("b", 4)], [0, 1], weighting="samples")
    assert shards.contexts == [ClientContext(0, 2, None, 3, "samples"), ClientContext(1, 2, None, 4, "samples")]


def test_a_plug_in_without_the_context_is_called_as_before() -> None:
    shards = ProblemShards(Plain(TiltSpec(num_clients=3)), [rows("a", 2)], [2])
    np.testing.assert_array_equal(shards.gradient(np.array([[1.0], [3.0]])), [[2.0], [3.0]])
    np.testing.assert_array_equal(shards.evaluate(np.zeros(2))[0], [[7.0]])


@pytest.mark.parametrize(
    "algorithm", [{"name": "mirror_prox", "gamma": 0.2}, {"name": "scaffold_s", "gamma_local": 0.1}]
)
def test_a_run_on_a_context_aware_problem_reaches_the_saddle_its_clients_define(
    tmp_path: Path, algorithm: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(4):
        np.savez(tmp_path / f"c{i}.npz", X=np.ones((2, 1)), y=np.ones(2))
    monkeypatch.setattr("fedsaddle.common.problems.registry.BUILT_IN", {"tilt": f"{__name__}:Tilt"})
    config = {
        "name": "tilt",
        "problem": {"name": "tilt", "num_clients": 4},
        "rounds": 600,
        "sync": {"kind": "fixed", "tau": 5},
        "algorithms": [algorithm],
    }
    report = api.run(config, data=str(tmp_path / "c{i}.npz"), out=tmp_path / "runs", reference=np.array([-2.5, 0.0]))
    (result,) = report.results
    assert result.dist_z < 1e-10
