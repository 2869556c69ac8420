"""`fedsaddle new problem NAME`: a package to start a problem of one's own from, with a test that passes.

The package holds a working problem (least squares against a learned shift of
the targets: small, strongly convex-concave, with a closed-form saddle point; with
`--torch`, the same game with a small MLP, written in PyTorch),
registered as an entry point, a test that checks its gradient mapping and runs
a federation of four clients to that saddle point, a config that names it, and
a README that says what to change. Nothing is written over: an existing folder
is refused.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import sys
from pathlib import Path

from fedsaddle import __version__
from fedsaddle.common.problems.registry import BUILT_IN


class TemplateError(ValueError):
    """A name or folder that a package cannot be written with; the message says which and why."""


def class_name(name: str) -> str:
    """my_problem -> MyProblem."""
    return "".join(part.capitalize() for part in name.split("_") if part)


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise TemplateError(
            f"problem name {name!r} must be a Python module name in lower case: letters, digits and _, "
            "starting with a letter (e.g. robust_regression)"
        )
    if name.startswith("fedsaddle"):
        raise TemplateError(f"problem name {name!r} must not start with 'fedsaddle' (fedsaddle's own modules do)")
    if name in BUILT_IN:
        raise TemplateError(f"problem name {name!r} is a built-in problem's, which a config naming it would get")
    if name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None:
        raise TemplateError(
            f"problem name {name!r} is a module Python already finds here; a package of that name would shadow it"
        )


def new_problem(name: str, out: Path, torch: bool = False) -> list[Path]:
    """Write the package of problem `name` into the new folder `out`; the files written. `torch`: a problem
    written in PyTorch (an MLP against a learned shift of the targets) instead of numpy."""
    check_name(name)
    if out.exists() and any(out.iterdir()):
        raise TemplateError(f"{out} exists and is not empty; choose another folder (--out)")
    cls = class_name(name)
    values = {"name": name, "cls": cls, "dist": name.replace("_", "-"), "version": __version__.split("+")[0]}
    files = {
        "pyproject.toml": TORCH_PYPROJECT if torch else PYPROJECT,
        "README.md": TORCH_README if torch else README,
        f"src/{name}/__init__.py": INIT,
        f"src/{name}/problem.py": TORCH_PROBLEM if torch else PROBLEM,
        f"tests/test_{name}.py": TORCH_TEST if torch else TEST,
        "run.yaml": TORCH_CONFIG if torch else CONFIG,
    }
    written = []
    for relative, template in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
        written.append(path)
    return written


PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "The fedsaddle problem {name}"
requires-python = ">=3.11"
dependencies = ["fedsaddle>={version}", "numpy"]

# Installed (pip install -e .), the problem is found by its name alone: problem: {{name: {name}, ...}}
[project.entry-points."fedsaddle.problems"]
{name} = "{name}.problem:{cls}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
pythonpath = ["src"]
"""

README = """\
# {name}: a fedsaddle problem

Made by `fedsaddle new problem {name}`. It works as it is: a least-squares fit
against a learned shift of the targets. Change `src/{name}/problem.py` into your
own problem, and keep `tests/test_{name}.py` passing.

```sh
pip install pytest 'fedsaddle[data]'      # what the test and `data split` need beyond the core install
pytest                                    # the gradient mapping against finite differences, and a federation
pip install -e .                          # registers the problem: configs name it without `plugin`
fedsaddle data split --dataset diabetes --clients 4 --out data/
fedsaddle simulate --config run.yaml --data 'data/client-{{i:03d}}.npz'
```

Without installing the package, `run.yaml` names the class by its path
(`plugin: {name}.problem:{cls}`), which fedsaddle finds in `src/` beside the
config. Every process that loads the problem needs it: the coordinator, and
each client process, whose operator allows it with
`fedsaddle client --problem {name}.problem:{cls} ...` (started in this folder,
or with the package installed).

What to change, in `problem.py`:

* `{cls}Spec`: the public hyper-parameters (never data: the spec travels to
  every client and lands in the run directory).
* `dims`: the lengths of x (minimized) and y (maximized), from the spec alone.
* `check`: refuse data the problem cannot use, with `DataError` naming the file.
* `gradient`: G_i(z) = (grad_x f_i, -grad_y f_i) on one client's training rows.
* `objective`: f_i(z).
* optional: `metric_names` and `metrics` (held-out rows), `reference_solution`
  (z* from all clients' data, for tests), `statistics` (spec fields computed
  from data, which `fedsaddle data split` prints and clients check).
"""

INIT = '''\
"""The fedsaddle problem {name}."""

from {name}.problem import {cls}, {cls}Spec

__all__ = ["{cls}", "{cls}Spec"]
'''

PROBLEM = '''\
"""{cls}: least squares against a learned shift of the targets (replace with your own problem).

    f_i(x, u) = mean over client i's rows of 1/2 (a^T x - t - u)^2 + lam/2 ||x||^2 - rho/2 u^2

x (minimized) is the regressor, u (maximized) a shift of every target that hurts
the fit most; rho > 1 makes f strongly concave in u, lam > 0 strongly convex in x.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import ClientData, DataProblem, ProblemSpec


class {cls}Spec(ProblemSpec):
    """The public hyper-parameters: they travel to every client, so never put data here."""

    name: Literal["{name}"] = "{name}"
    features: int = Field(ge=1, description="columns of each client's X")
    lam: float = Field(0.1, gt=0, description="L2 weight on x")
    rho: float = Field(2.0, gt=1, description="the cost of a shift of the targets (> 1)")


class {cls}(DataProblem):
    Spec = {cls}Spec
    spec: {cls}Spec
    metric_names = ("test_mse",)

    def dims(self) -> tuple[int, int]:
        return self.spec.features, 1  # x, then u

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)
        return data

    def _errors(self, data: ClientData, z: Array) -> Array:
        return data.X @ z[:-1] - data.y - z[-1]  # a^T x - t - u, one per row

    def gradient(self, data: ClientData, z: Array) -> Array:
        e = self._errors(data, z)
        grad_x = data.X.T @ e / data.samples + self.spec.lam * z[:-1]
        grad_u = -e.mean() - self.spec.rho * z[-1]
        return np.concatenate([grad_x, [-grad_u]])  # G = (grad_x f, -grad_u f)

    def objective(self, data: ClientData, z: Array) -> float:
        e = self._errors(data, z)
        x, u = z[:-1], z[-1]
        return float(0.5 * e @ e / data.samples + 0.5 * self.spec.lam * x @ x - 0.5 * self.spec.rho * u * u)

    def metrics(self, data: ClientData, z: Array) -> Sequence[float]:
        assert data.X_test is not None and data.y_test is not None
        residual = data.X_test @ z[:-1] - data.y_test
        return (float(residual @ residual / len(residual)),)

    def reference_solution(self, datas: Sequence[ClientData], weights: Array | None) -> Array:
        """G is affine in z here: z* solves mean_i G_i(z) = 0 (weighted by `weights`, if given)."""
        w = np.ones(len(datas)) if weights is None else np.asarray(weights, dtype=float)

        def mean_gradient(z: Array) -> Array:
            return sum(wi * self.gradient(d, z) for wi, d in zip(w, datas, strict=True)) / w.sum()

        n = self.dimension
        at_zero = mean_gradient(np.zeros(n))
        matrix = np.column_stack([mean_gradient(np.eye(n)[j]) - at_zero for j in range(n)])
        return np.linalg.solve(matrix, -at_zero)
'''

TEST = '''\
"""{cls}: its gradient mapping is the objective's, and a federation of four clients finds its saddle point."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsaddle import api
from {name} import {cls}, {cls}Spec

FEATURES = 5


def write_clients(folder: Path, clients: int = 4, rows: int = 40) -> str:
    """Client data files of random rows, each client's targets from its own linear model (heterogeneous)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(clients):
        X, X_test = rng.standard_normal((rows, FEATURES)), rng.standard_normal((10, FEATURES))
        w = rng.standard_normal(FEATURES) + i
        y, y_test = X @ w + 0.1 * rng.standard_normal(rows), X_test @ w
        np.savez(folder / f"client-{{i:03d}}.npz", X=X, y=y, X_test=X_test, y_test=y_test)
    return str(folder / "client-{{i:03d}}.npz")


def test_the_gradient_mapping_matches_finite_differences(tmp_path: Path) -> None:
    pattern = write_clients(tmp_path)
    problem = {cls}({cls}Spec(features=FEATURES))
    data = problem.load(pattern.format(i=0))
    n = problem.dimension
    z = np.random.default_rng(1).standard_normal(n)
    numeric = np.empty(n)
    for j in range(n):
        step = np.zeros(n)
        step[j] = 1e-6
        derivative = (problem.objective(data, z + step) - problem.objective(data, z - step)) / 2e-6
        numeric[j] = derivative if j < FEATURES else -derivative  # G = (grad_x f, -grad_y f)
    np.testing.assert_allclose(problem.gradient(data, z), numeric, atol=1e-6)


def test_a_federation_finds_the_saddle_point(tmp_path: Path) -> None:
    pattern = write_clients(tmp_path / "data")
    config = {{
        "problem": {{"name": "{name}", "plugin": "{name}.problem:{cls}", "num_clients": 4, "features": FEATURES}},
        "rounds": 301,
        "evaluate_every": 50,
        "sync": {{"kind": "fixed", "tau": 10}},
        "algorithms": [{{"name": "scaffold_s", "gamma_local": 0.05}}],
        "output": {{"plot": False}},
    }}
    report = api.run(config, data=pattern, out=tmp_path / "runs")
    (result,) = report.results
    assert result.status == "ok"
    assert result.dist_z < 1e-8  # the distance to reference_solution's z*
    assert result.traffic["algorithm"]["rounds"] == 301
'''

CONFIG = """\
# A federation of four clients on the problem {name}: `fedsaddle simulate --config run.yaml --data ...`
name: {name}
problem:
  name: {name}
  plugin: {name}.problem:{cls}   # found in src/ beside this file; installed, the name alone will do
  num_clients: 4
  features: 10
weighting: samples
evaluate_every: 50
rounds: 301
sync: {{kind: fixed, tau: 10}}
algorithms:
  - {{name: scaffold_s, gamma_local: 0.05}}
"""


# -- `--torch`: the same game, with an MLP written in PyTorch ----------------------------------------------

TORCH_PYPROJECT = PYPROJECT.replace('"fedsaddle>={version}", "numpy"', '"fedsaddle[torch]>={version}", "numpy"')

TORCH_README = """\
# {name}: a fedsaddle problem written in PyTorch

Made by `fedsaddle new problem {name} --torch`. It works as it is: a small MLP
fitted against a learned shift of the targets. Change `src/{name}/problem.py`
into your own problem, and keep `tests/test_{name}.py` passing.

```sh
pip install pytest 'fedsaddle[data,torch]'   # the test, `data split` and PyTorch (about 5 GB with CUDA)
pytest                                       # G_i against finite differences, and a federation that learns
pip install -e .                             # registers the problem: configs name it without `plugin`
fedsaddle data split --dataset diabetes --clients 4 --out data/
fedsaddle simulate --config run.yaml --data 'data/client-{{i:03d}}.npz'
fedsaddle local --config run.yaml --data 'data/client-{{i:03d}}.npz'   # the same bits, in client processes
```

What to change, in `problem.py` (fedsaddle's docs: how-to/pytorch-problems.md):

* `{cls}Spec`: the public hyper-parameters (never data). It inherits `batch_size`
  (rows per local step; none: every row), `dtype` (float32 by default) and
  `threads` (torch's threads per client process).
* `players`: the min player's and the max player's parameters, built afresh (a
  `torch.nn.Module` or a list of tensors each). z on the wire is the min player's
  `named_parameters()`, then the max player's, each flattened.
* `loss`: f_i(x, y) on a batch of one client's rows, a scalar tensor. fedsaddle
  derives G_i = (grad_x f_i, -grad_y f_i) by autograd.
* `inputs`: the data file's rows as the network takes them (e.g. images).
* optional: `metric_names` and `test_metrics` (held-out rows), `domains` (a box or
  a simplex on the max player's block).

`init: problem` in the config starts from the network as PyTorch initializes it
under the run's seed.
"""

TORCH_PROBLEM = '''\
"""{cls}: an MLP fitted against a learned shift of the targets (replace with your own problem).

    f_i(w, u) = mean over client i's rows of 1/2 (h_w(a) - t - u)^2 + lam/2 ||w||^2 - rho/2 u^2

w (minimized) is the network h_w, u (maximized) a shift of every target that hurts the fit
most; rho > 1 makes f strongly concave in u. f is nonconvex in w.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from fedsaddle.common.problems import ClientContext, ClientData
from fedsaddle.common.problems.pytorch import Batch, TorchProblem, TorchSpec


class {cls}Spec(TorchSpec):
    """The public hyper-parameters: they travel to every client, so never put data here."""

    name: Literal["{name}"] = "{name}"
    features: int = Field(ge=1, description="columns of each client's X")
    hidden: int = Field(16, ge=1, description="the MLP's hidden width")
    lam: float = Field(1e-3, ge=0, description="L2 weight on the network")
    rho: float = Field(2.0, gt=1, description="the cost of a shift of the targets (> 1)")


class {cls}(TorchProblem):
    Spec = {cls}Spec
    spec: {cls}Spec
    metric_names = ("test_mse",)

    def players(self) -> tuple[Any, Any]:
        network = torch.nn.Sequential(
            torch.nn.Linear(self.spec.features, self.spec.hidden), torch.nn.Tanh(), torch.nn.Linear(self.spec.hidden, 1)
        )
        return network, [torch.zeros(1)]  # x: the network; y: the shift u

    def check(self, data: ClientData) -> ClientData:
        self.expect_features(data, self.spec.features)  # a DataError naming the file, if not
        return data

    def loss(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> torch.Tensor:
        (u,) = y
        errors = x(batch.inputs).squeeze(1) - batch.targets - u
        penalty = sum(torch.sum(w**2) for w in x.parameters())
        value: torch.Tensor = 0.5 * torch.mean(errors**2) + self.spec.lam / 2 * penalty
        return value - self.spec.rho / 2 * torch.sum(u**2)

    def test_metrics(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> Sequence[float]:
        residual = x(batch.inputs).squeeze(1) - batch.targets
        return (float(torch.mean(residual**2)),)
'''

TORCH_TEST = '''\
"""{cls}: G_i is the gradient mapping of f_i, and a federation of four clients learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsaddle import api
from {name} import {cls}, {cls}Spec

FEATURES = 5


def write_clients(folder: Path, clients: int = 4, rows: int = 40) -> str:
    """Client data files of random rows, each client's targets from its own nonlinear model (heterogeneous)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    shared = rng.standard_normal(FEATURES)
    for i in range(clients):
        X, X_test = rng.standard_normal((rows, FEATURES)), rng.standard_normal((10, FEATURES))
        w = shared + 0.1 * i
        y, y_test = np.tanh(X @ w) + 0.05 * rng.standard_normal(rows), np.tanh(X_test @ w)
        np.savez(folder / f"client-{{i:03d}}.npz", X=X, y=y, X_test=X_test, y_test=y_test)
    return str(folder / "client-{{i:03d}}.npz")


def test_the_gradient_mapping_matches_finite_differences(tmp_path: Path) -> None:
    pattern = write_clients(tmp_path)
    problem = {cls}({cls}Spec(features=FEATURES, dtype="float64"))  # float64: finite differences need it
    data = problem.load(pattern.format(i=0))
    dim_x, _ = problem.dims()
    z = problem.initial_point(seed=1)
    numeric = np.empty(problem.dimension)
    for j in range(problem.dimension):
        step = np.zeros(problem.dimension)
        step[j] = 1e-6
        derivative = (problem.objective(data, z + step) - problem.objective(data, z - step)) / 2e-6
        numeric[j] = derivative if j < dim_x else -derivative  # G = (grad_x f, -grad_y f)
    np.testing.assert_allclose(problem.gradient(data, z), numeric, atol=1e-6)


def test_a_federation_learns(tmp_path: Path) -> None:
    pattern = write_clients(tmp_path / "data")
    config = {{
        "problem": {{"name": "{name}", "plugin": "{name}.problem:{cls}", "num_clients": 4, "features": FEATURES,
                    "batch_size": 8}},
        "init": "problem",
        "rounds": 60,
        "evaluate_every": 10,
        "sync": {{"kind": "fixed", "tau": 5}},
        "algorithms": [{{"name": "local_sgda_plus", "eta_x": 0.1, "eta_y": 0.1}}],
        "output": {{"plot": False}},
    }}
    report = api.run(config, data=pattern, out=tmp_path / "runs")
    (result,) = report.results
    assert result.status == "ok"
    mse = [record["test_mse"] for record in result.records if "test_mse" in record]
    assert mse[-1] < 0.5 * mse[0]  # the held-out error at least halves
'''

TORCH_CONFIG = """\
# A federation of four clients on the PyTorch problem {name}: `fedsaddle simulate --config run.yaml --data ...`
name: {name}
problem:
  name: {name}
  plugin: {name}.problem:{cls}   # found in src/ beside this file; installed, the name alone will do
  num_clients: 4
  features: 10
  batch_size: 16                 # rows per local step (a fresh minibatch each); leave out for every row
init: problem                    # the MLP as PyTorch initializes it under the run's seed
evaluate_every: 50
rounds: 300
sync: {{kind: fixed, tau: 5}}
algorithms:
  - {{name: local_sgda_plus, eta_x: 0.05, eta_y: 0.05}}
"""
