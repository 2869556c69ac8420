"""`fedsaddle check-problem`: a problem author's checks, each failure named."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import yaml
from conftest import fedsaddle

from fedsaddle import api
from fedsaddle.check import check_problem
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, DataProblem, ProblemSpec, read_client_data
from fedsaddle.common.problems.solve import numerical_saddle
from fedsaddle.server.config import parse_config


class SaddleSpec(ProblemSpec):
    name: Literal["saddle"] = "saddle"
    mistake: Literal["none", "sign", "concave_x"] = "none"


class Saddle(DataProblem):
    """f_i(x, y) = 1/2 a_i x^2 + b_i x y - 1/2 y^2 + c_i x (x, y scalars), a_i = the client's X[0, 0] > 0."""

    Spec = SaddleSpec
    spec: SaddleSpec

    def dims(self) -> tuple[int, int]:
        return 1, 1

    def _coefficients(self, data: ClientData) -> tuple[float, float, float]:
        a, b, c = data.X[0]
        return (-a if self.spec.mistake == "concave_x" else a), b, c

    def gradient(self, data: ClientData, z: Array) -> Array:
        a, b, c = self._coefficients(data)
        x, y = z
        grad_y = b * x - y
        return np.array([a * x + b * y + c, grad_y if self.spec.mistake == "sign" else -grad_y])

    def objective(self, data: ClientData, z: Array) -> float:
        a, b, c = self._coefficients(data)
        x, y = z
        return float(0.5 * a * x * x + b * x * y - 0.5 * y * y + c * x)


@pytest.fixture
def saddle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    monkeypatch.setattr("fedsaddle.common.problems.registry.BUILT_IN", {"saddle": f"{__name__}:Saddle"})
    paths = {}
    for i, row in enumerate([[1.0, 0.5, 1.0], [2.0, -0.3, -2.0], [0.5, 1.0, 0.5]]):
        np.savez(tmp_path / f"c{i}.npz", X=np.array([row]), y=np.zeros(1))
        paths[i] = str(tmp_path / f"c{i}.npz")
    return paths


def config(mistake: str = "none") -> Any:
    return parse_config(
        {
            "name": "saddle",
            "problem": {"name": "saddle", "num_clients": 3, "mistake": mistake},
            "rounds": 200,
            "algorithms": [{"name": "mirror_prox", "gamma": 0.2}],
        }
    )


def test_a_correct_problem_passes_and_gets_a_numerical_saddle_point_to_1e_12(saddle: dict[int, str]) -> None:
    report = check_problem(config(), saddle)
    assert report.failure is None, report.lines
    assert report.z_star is not None and report.z_star.residual <= 1e-12
    # the saddle point in closed form: G(z) = [[A, B], [-B, 1]] z + [C, 0] with the clients' means
    a, b, c = np.mean([[1.0, 0.5, 1.0], [2.0, -0.3, -2.0], [0.5, 1.0, 0.5]], axis=0)
    exact = np.linalg.solve(np.array([[a, b], [-b, 1.0]]), -np.array([c, 0.0]))
    assert np.linalg.norm(report.z_star.z - exact) <= report.z_star.accuracy < 1e-11


def test_a_gradient_with_the_wrong_sign_of_y_fails_naming_client_and_entry(saddle: dict[int, str]) -> None:
    report = check_problem(config("sign"), saddle)
    assert report.failure is not None
    assert report.failure.startswith("gradient: client 0, point 0, entry 1 (y[0]): gradient() gives")
    assert "G_i(z) must be (grad_x f_i, -grad_y f_i)" in report.failure
    assert report.z_star is None  # later checks do not run


def test_a_problem_concave_in_x_fails_the_monotonicity_check(saddle: dict[int, str]) -> None:
    report = check_problem(config("concave_x"), saddle)
    assert report.failure is not None
    assert re.match(r"monotonicity: client \d, pair \d+: <G_i\(z\) - G_i\(w\), z - w> = -\d", report.failure)
    assert "not convex-concave" in report.failure


def test_the_numerical_saddle_point_reports_what_it_reached_and_no_bound_without_mu() -> None:
    # G(z) = (x + y, y - x) + (1, 0): strongly monotone with mu = 1, z* = (-1/2, -1/2)
    def field(z: Array) -> Array:
        return np.array([z[0] + z[1] + 1.0, z[1] - z[0]])

    found = numerical_saddle(field, np.zeros(2), mu=1.0)
    assert found.method == "newton" and found.residual <= 1e-12
    np.testing.assert_allclose(found.z, [-0.5, -0.5], atol=1e-12)
    assert math.isinf(numerical_saddle(field, np.zeros(2)).accuracy)


def test_check_problem_on_agnostic_data_and_distances_never_finer_than_z_star(tmp_path: Path) -> None:
    split = fedsaddle(
        "data", "split", "--dataset", "breast_cancer", "--clients", "5", "--partition", "label-skew",
        "--seed", "2", "--out", str(tmp_path / "data"),
    )  # fmt: skip
    assert split.returncode == 0, split.stderr
    run = {
        "name": "afl",
        "problem": {"name": "agnostic", "num_clients": 5, "features": 30, "lam": 0.2, "nu": 0.2},
        "rounds": 600,
        "sync": {"kind": "random", "p": 0.2},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.1}, {"name": "fedavg_s", "gamma_local": 0.1}],
    }
    path = tmp_path / "afl.yaml"
    path.write_text(yaml.safe_dump(run))
    pattern = str(tmp_path / "data" / "client-{i:03d}.npz")
    run_dir = api.run(run, data=pattern, out=tmp_path / "runs").run_dir
    done = fedsaddle(
        "check-problem", "--config", str(path), "--data", pattern, "--run-dir", str(run_dir),
        "--save-reference", str(tmp_path / "z_star.npy"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "domain: z[0:31] free, z[31:36] simplex" in done.stdout
    assert "gradient vs central differences of the objective: ok" in done.stdout
    assert "(reached 1e-12)" in done.stdout
    lines = done.stdout.splitlines()
    scaffold = next(line for line in lines if line.startswith("  scaffold_s: "))
    fedavg = next(line for line in lines if line.startswith("  fedavg_s: "))
    assert "< " in scaffold and "(z*'s accuracy)" in scaffold  # converged beyond what z* can tell
    assert "(z*'s accuracy)" not in fedavg  # client drift: a distance well above z*'s accuracy
    assert np.load(tmp_path / "z_star.npy").shape == (36,)


def test_the_agnostic_experiments_central_saddle_agrees_with_the_generic_numerical_one(tmp_path: Path) -> None:
    from fedsaddle.experiments import agnostic
    from fedsaddle.experiments.datasets import split

    split("breast_cancer", 4, "label-skew", 3, tmp_path)
    paths = {i: str(tmp_path / f"client-{i:03d}.npz") for i in range(4)}
    datas = [read_client_data(paths[i]) for i in range(4)]
    dual, residual = agnostic.central_saddle(datas)
    assert residual < 1e-13
    run = parse_config(
        {
            "problem": {"name": "agnostic", "num_clients": 4, "features": 30, "lam": agnostic.LAM, "nu": agnostic.NU},
            "algorithms": [{"name": "mirror_prox", "gamma": 0.1}],
        }
    )
    report = check_problem(run, paths)
    assert report.failure is None and report.z_star is not None
    assert report.z_star.residual <= 1e-12
    assert np.linalg.norm(report.z_star.z - dual) <= max(report.z_star.accuracy, 1e-12)
    assert np.linalg.norm(report.z_star.z - dual) < 1e-10
