"""A plug-in problem's mistakes are named: which problem, which method, which client, what was wrong.

They show when a run starts (each method is tried once at z = 0), so a federation
fails before its first round with the cause in the coordinator's error, instead of
client processes dying mid-round with a numpy broadcasting error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import yaml
from conftest import CLIENT_ENV, listening_address

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
        (
            {"gradient": lambda self, data, z: np.where(np.arange(4) == 2, np.nan, 0.0)},
            "problem 'toy': gradient() on client 3's data returned nan at z = 0 in entry y[0] "
            "(1 of its 4 entries are nan)",
        ),
        (
            {"gradient": lambda self, data, z: ["a", "b", "c", "d"]},
            "problem 'toy': gradient() on client 3's data returned ['a', 'b', 'c', 'd'] (list); it must return numbers",
        ),
        (
            {"objective": lambda self, data, z: None},
            "problem 'toy': objective() on client 3's data returned None (NoneType); it must return numbers",
        ),
        (
            {"objective": lambda self, data, z: "0.5"},
            "problem 'toy': objective() on client 3's data returned '0.5' (str); it must return numbers",
        ),
        (
            {"metrics": lambda self, data, z: (1.0, None)},
            "problem 'toy': metrics() on client 3's data returned (1.0, None) (tuple); it must return numbers",
        ),
    ],
)
def test_a_mistake_is_named_when_the_shards_are_made(methods: dict[str, Any], message: str) -> None:
    for name, method in methods.items():
        method.__name__ = name
    with pytest.raises(ProblemError) as caught:
        shards_with(**methods)
    assert str(caught.value).startswith(message)


def test_a_nan_at_z_0_outside_the_domain_is_no_mistake() -> None:
    # y on the simplex: z = 0 is a point no run visits, and a gradient of 0/0 there is legitimate
    from fedsaddle.common.problems.domains import Free, Simplex

    def gradient(self: Toy, data: ClientData, z: Array) -> Array:
        x, y = z[:2], z[2:]
        with np.errstate(invalid="ignore"):
            return np.concatenate([x + y / y.sum(), -(x - y)])

    def domains(self: Toy) -> list[object]:
        return [Free(2), Simplex(2)]

    shards = shards_with(gradient=gradient, domains=domains)
    z = np.tile([0.0, 1.0, 0.25, 0.75], (2, 1)).T  # the same z for both clients, on the simplex
    np.testing.assert_array_equal(shards.gradient(z)[:, 0], [0.25, 1.75, 0.25, -0.25])
    with pytest.raises(ProblemError, match=r"returned nan at z = 0 in entry x\[0\]"):
        shards_with(gradient=gradient)  # unconstrained, z = 0 is a point like any other


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


def run_on_plugin(
    tmp_path: Path,
    module: str,
    source: str,
    config: dict[str, Any],
    *,
    features: int,
    command: str = "local",
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`fedsaddle COMMAND` (simulate or local) on a plug-in problem: its module, each client's data file (4 rows
    of `features` ones) and the config written to tmp_path, the run's outputs under tmp_path / COMMAND."""
    (tmp_path / f"{module}.py").write_text(source)
    for i in range(config["problem"]["num_clients"]):
        np.savez(tmp_path / f"client-{i}.npz", X=np.ones((4, features)), y=np.ones(4))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**CLIENT_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "fedsaddle", command, "--config", str(tmp_path / "run.yaml")]
    args += ["--data", str(tmp_path / "client-{i}.npz"), "--out", str(tmp_path / command)]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_federation_on_a_broken_plugin_fails_before_round_one_naming_the_client_and_the_fault(
    tmp_path: Path,
) -> None:
    config = {
        "problem": {"name": "short", "plugin": "short_problem:Short", "num_clients": 3},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    done = run_on_plugin(tmp_path, "short_problem", PLUGIN, config, features=3)
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


LATE_SHORT = (
    PLUGIN.replace("return np.zeros(3)  # one entry short: y's is missing", "return np.ones(4 if at_start(z) else 3)")
    .replace("short", "late")
    .replace("Short", "Late")
    + "\ndef at_start(z):\n    return np.isin(z, (0.0, 1.0)).all()  # z = 0 and z0 = 1\n"
)


def test_a_mistake_a_client_meets_mid_run_is_named_by_the_coordinator_not_taken_for_a_disconnect(
    tmp_path: Path,
) -> None:
    # The start-up checks pass, at z = 0 and z0 = (1, ..., 1); the second round's z does not. The client
    # process tells the coordinator why it stops (a Failure), which fails the round at once naming the client
    # and the fault, instead of "disconnected" and a wait for a rejoin that will not come.
    config = {
        "problem": {"name": "late", "plugin": "late_problem:Late", "num_clients": 2},
        "rounds": 5,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "transport": {"rejoin_timeout_s": 60},
        "output": {"plot": False},
    }
    done = run_on_plugin(tmp_path, "late_problem", LATE_SHORT, config, features=3, timeout=50)
    assert done.returncode == 1, done.stderr
    fault = r"problem 'late': gradient\(\) on client (\d)'s data returned shape \(3,\)"
    named = re.search(r"run failed: client (\d) \(.*\) failed: " + fault + r".* during round 2\n", done.stderr)
    assert named is not None and named[1] == named[2], done.stderr  # (either client may fail first)
    assert "disconnected" not in done.stderr
    (run_dir,) = (tmp_path / "local").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert re.search(fault, summary["transport"]["failure"]), summary["transport"]


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


def test_a_nan_that_appears_later_on_a_simplex_ends_the_run_as_diverged_not_as_a_crash(tmp_path: Path) -> None:
    # The projection onto a simplex of an iterate with a NaN in it used to raise an IndexError, which
    # ended `simulate` with "error: index -1 is out of bounds" and a client process mid-round.
    config = {
        "problem": {"name": "late_nan", "plugin": "late_nan:LateNan", "num_clients": 2},
        "rounds": 6,
        "init": "zeros",  # x = 0, where the gradient is finite: the NaN appears in a step, locally or on the server
        "sync": {"kind": "fixed", "tau": 2},
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}, {"name": "scaffold_s", "gamma_local": 0.1}],
        "output": {"plot": False},
    }
    for command in ("simulate", "local"):
        done = run_on_plugin(tmp_path, "late_nan", LATE_NAN, config, features=2, command=command)
        assert done.returncode == 0, done.stderr
        assert "error" not in done.stderr and "disconnected" not in done.stderr, done.stderr
        (run_dir,) = (tmp_path / command).iterdir()
        summary = yaml.safe_load((run_dir / "summary.json").read_text())
        assert [a["status"] for a in summary["algorithms"]] == ["diverged", "diverged"]


LATE_NAN = """
from typing import Literal
import numpy as np
from fedsaddle.common.problems import DataProblem, ProblemSpec
from fedsaddle.common.problems.domains import Free, Simplex

class LateNanSpec(ProblemSpec):
    name: Literal["late_nan"] = "late_nan"

class LateNan(DataProblem):
    # f_i(x, y) = 1/2 x^2 + x (y_0 - y_1) on y in the simplex; its gradient turns NaN once x is away from 0
    Spec = LateNanSpec
    def dims(self):
        return 1, 2
    def domains(self):
        return [Free(1), Simplex(2)]
    def gradient(self, data, z):
        g = np.array([z[0] + z[1] - z[2] + 1.0, -z[0], z[0]])
        return g if abs(z[0]) < 0.05 else np.full(3, np.nan)
    def objective(self, data, z):
        return 0.5 * z[0] ** 2 + z[0] * (z[1] - z[2]) + z[0]
"""

BROKEN = "from typing import Literal\n\ndef oops(:\n    pass\n"


def test_a_plugin_module_that_does_not_compile_is_a_config_error_naming_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "broken_problem.py").write_text(BROKEN)
    config = {"problem": {"name": "broken", "plugin": "broken_problem:Broken", "num_clients": 2},
              "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "fedsaddle", "simulate", "--config", str(tmp_path / "run.yaml")],
                          capture_output=True, text=True, timeout=60, env=CLIENT_ENV, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        "problem.plugin: plugin 'broken_problem:Broken': importing 'broken_problem' failed: SyntaxError: "
        f"invalid syntax ({tmp_path / 'broken_problem.py'}, line 3)" in done.stderr
    )


def test_a_client_whose_copy_of_the_plugin_does_not_compile_says_so_before_it_connects(tmp_path: Path) -> None:
    # The client's copy of the plug-in, in the folder it is started in, does not compile: it used to connect
    # and refuse the run only when the run started. Now it exits 2 at once with the whole message, and never
    # dials (nothing listens at the address it is given).
    site = tmp_path / "site"
    site.mkdir()
    (site / "short_problem.py").write_text(PLUGIN + "\ndef oops(:\n")
    np.savez(site / "client-0.npz", X=np.ones((4, 3)), y=np.ones(4))
    env = {k: v for k, v in CLIENT_ENV.items() if k != "PYTHONPATH"}
    client = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "client", "--coordinator", "127.0.0.1:9", "--clients", "0",
         "--problem", "short_problem:Short", "--data", "client-{i}.npz", "--connect-timeout", "30"],
        cwd=site, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    fault = (
        "--problem short_problem:Short: plugin 'short_problem:Short': importing 'short_problem' failed: "
        f"SyntaxError: invalid syntax ({site / 'short_problem.py'}, line 18)"
    )
    assert client.returncode == 2 and fault in client.stderr, client.stderr
    assert "reach" not in client.stderr and "Traceback" not in client.stderr

    # A data file that does not read (a NaN in it): exit 2, the client, the file and the fault named, before
    # connecting. (What depends on the run's spec, as the number of features, waits for the run.)
    (site / "short_problem.py").write_text(PLUGIN)
    np.savez(site / "client-1.npz", X=np.array([[1.0, np.nan, 1.0]] * 4), y=np.ones(4))
    client = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "client", "--coordinator", "127.0.0.1:9", "--clients", "0-1",
         "--problem", "short_problem:Short", "--data", "client-{i}.npz", "--connect-timeout", "30"],
        cwd=site, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert client.returncode == 2, client.stderr
    assert "fedsaddle: client 1: client-1.npz: X[0, 1] is nan (NaN and Inf are refused)" in client.stderr


# A problem whose check depends on its spec (`rows`): the data is checked when the run starts, and the
# refusal (long: it lists every row) goes to the coordinator.
NEEDS_SPEC = """
from typing import Literal
import numpy as np
from fedsaddle.common.problems import DataError, DataProblem, ProblemSpec

class PickySpec(ProblemSpec):
    name: Literal["picky"] = "picky"
    rows: int

class Picky(DataProblem):
    Spec = PickySpec
    def dims(self):
        return 1, 1
    def check(self, data):
        if len(data.y) != self.spec.rows:
            listed = ", ".join(f"row {i} = {v:g}" for i, v in enumerate(data.y))
            raise DataError(f"{data.path}: {len(data.y)} rows, not {self.spec.rows}: {listed}; end of the list")
        return data
    def gradient(self, data, z):
        return np.array([z[0] + z[1], z[1] - z[0]])
    def objective(self, data, z):
        return 0.5 * z[0] ** 2 + z[0] * z[1] - 0.5 * z[1] ** 2
"""


def test_the_coordinator_keeps_a_clients_whole_refusal(tmp_path: Path) -> None:
    (tmp_path / "picky_problem.py").write_text(NEEDS_SPEC)
    np.savez(tmp_path / "client-0.npz", X=np.ones((80, 1)), y=np.arange(80.0))
    config = {
        "problem": {"name": "picky", "plugin": "picky_problem:Picky", "num_clients": 1, "rows": 5},
        "rounds": 3,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.1}],
        "output": {"plot": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**CLIENT_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedsaddle", "coordinator", "--config", str(tmp_path / "run.yaml"),
         "--listen", "127.0.0.1:0", "--out", str(tmp_path / "runs")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        address = listening_address(coordinator)
        client = subprocess.run(
            [sys.executable, "-m", "fedsaddle", "client", "--coordinator", address, "--clients", "0",
             "--problem", "picky_problem:Picky", "--data", "client-{i}.npz"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        _, said = coordinator.communicate(timeout=60)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    assert client.returncode == 1, client.stderr  # its data fits only the run's spec, so it refused the run
    whole = "client-0.npz: 80 rows, not 5: row 0 = 0, " + ", ".join(f"row {i} = {i}" for i in range(1, 80))
    assert len(whole) > 1000  # (it used to be cut after 512 characters)
    assert coordinator.returncode == 1 and "cannot serve run" in said, said
    assert whole + "; end of the list" in said and "more characters" not in said, said
