"""A plug-in problem's mistakes are named: which problem, which method, which client, what was wrong.

They show when a run starts (each method is tried once at z = 0), so a federation
fails before its first round with the cause in the coordinator's error, instead of
client processes dying mid-round with a numpy broadcasting error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import yaml
from conftest import CLIENT_ENV

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, DataProblem, ProblemError, ProblemShards, ProblemSpec


class ToySpec(ProblemSpec):
    name: Literal["toy"] = "toy"


class Toy(DataProblem):
    """f_i(x, y) = 1/2 |x|^2 + x.y - 1/2 |y|^2 with x, y in R^2: correct, until a test breaks one method."""

    Spec = ToySpec
    metric_names = ("a", "b")

    def dims(self) -> tuple[int, int]:
        return 2, 2

    def gradient(self, data: ClientData, z: Array) -> Array:
        x, y = z[:2], z[2:]
        return np.concatenate([x + y, -(x - y)])

    def objective(self, data: ClientData, z: Array) -> float:
        x, y = z[:2], z[2:]
        return float(0.5 * x @ x + x @ y - 0.5 * y @ y)

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        return (1.0, 2.0)


def data(path: str) -> ClientData:
    rows = np.ones((3, 2))
    return ClientData(path, rows, np.ones(3), X_test=rows, y_test=np.ones(3))


def shards_with(**methods: Any) -> ProblemShards:
    problem = type("Broken", (Toy,), methods)(ToySpec(num_clients=8))
    return ProblemShards(problem, [data("a.npz"), data("b.npz")], [3, 7])


def test_a_correct_problem_passes_and_computes_per_client() -> None:
    shards = shards_with()
    z = np.arange(8.0).reshape(4, 2)  # columns: clients 3 and 7
    np.testing.assert_array_equal(shards.gradient(z)[:, 1], [1.0 + 5.0, 3.0 + 7.0, -(1.0 - 5.0), -(3.0 - 7.0)])
    np.testing.assert_array_equal(shards.evaluate(z[:, 0])[0], [[1.0, 2.0], [1.0, 2.0]])


@pytest.mark.parametrize(
    ("methods", "message"),
    [
        (
            {"gradient": lambda self, data, z: z[:3]},
            "problem 'toy': gradient() on client 3's data returned shape (3,); "
            "G_i(z) has dim_x + dim_y = 2 + 2 = 4 entries",
        ),
        (
            {"gradient": lambda self, data, z: z[:, None]},
            "problem 'toy': gradient() on client 3's data returned shape (4, 1)",
        ),
        (
            {"objective": lambda self, data, z: z[:2]},
            "problem 'toy': objective() on client 3's data returned shape (2,); f_i(z) is a number",
        ),
        (
            {"metrics": lambda self, data, z: (1.0,)},
            "problem 'toy': metrics() on client 3's data returned shape (1,); "
            "it must give one value per metric name ['a', 'b']",
        ),
        (
            {"gradient": lambda self, data, z: 1 / 0},
            "problem 'toy': gradient() on client 3's data raised ZeroDivisionError: division by zero",
        ),
    ],
)
def test_a_mistake_is_named_when_the_shards_are_made(methods: dict[str, Any], message: str) -> None:
    for name, method in methods.items():
        method.__name__ = name
    with pytest.raises(ProblemError) as caught:
        shards_with(**methods)
    assert str(caught.value).startswith(message)


def test_a_mistake_that_shows_only_later_is_named_too() -> None:
    def gradient(self: Toy, data: ClientData, z: Array) -> Array:
        return Toy.gradient(self, data, z) if data.path == "a.npz" or not z.any() else z[:1]

    shards = shards_with(gradient=gradient)
    with pytest.raises(ProblemError, match=r"gradient\(\) on client 7's data returned shape \(1,\)"):
        shards.gradient(np.ones((4, 2)))


PLUGIN = """
from typing import Literal
import numpy as np
from fedsaddle.common.problems import DataProblem, ProblemSpec

class ShortSpec(ProblemSpec):
    name: Literal["short"] = "short"

class Short(DataProblem):
    Spec = ShortSpec
    def dims(self):
        return 3, 1
    def gradient(self, data, z):
        return np.zeros(3)  # one entry short: y's is missing
    def objective(self, data, z):
        return 0.0
"""


def test_a_federation_on_a_broken_plugin_fails_before_round_one_naming_the_client_and_the_fault(
    tmp_path: Path,
) -> None:
    (tmp_path / "short_problem.py").write_text(PLUGIN)
    for i in range(3):
        np.savez(tmp_path / f"client-{i}.npz", X=np.ones((4, 3)), y=np.ones(4))
    config = {
        "problem": {"name": "short", "plugin": "short_problem:Short", "num_clients": 3},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**CLIENT_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(tmp_path / "run.yaml")]
    command += ["--data", str(tmp_path / "client-{i}.npz"), "--out", str(tmp_path / "runs")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert "cannot serve run" in done.stderr
    assert (
        "problem 'short': gradient() on client 0's data returned shape (3,); "
        "G_i(z) has dim_x + dim_y = 3 + 1 = 4 entries" in done.stderr
    )
    assert "disconnected" not in done.stderr and "Traceback" not in done.stderr
    # The coordinator says why the run failed; its client processes, in the same terminal, do not repeat it.
    assert done.stderr.count("run failed: client 0") == 1
    assert "the coordinator ended the run as failed" not in done.stderr


def test_a_signal_that_lands_inside_a_problem_method_is_not_taken_for_its_mistake() -> None:
    # SIGTERM's handler raises Stopped (Ctrl-C's KeyboardInterrupt) wherever the main thread is: in
    # an in-process run, often inside a gradient. It stops the run; it is not the problem's fault.
    from fedsaddle.common.stop import Stopped

    for signal_raises in (Stopped, KeyboardInterrupt):

        def gradient(self: Toy, data: ClientData, z: Array, raises: type[BaseException] = signal_raises) -> Array:
            if z.any():
                raise raises
            return Toy.gradient(self, data, z)

        shards = shards_with(gradient=gradient)
        with pytest.raises(signal_raises):
            shards.gradient(np.ones((4, 2)))
