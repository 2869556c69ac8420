"""The tutorials and how-to guides work as written: every shell block runs, in page order, in a fresh
folder (YAML blocks titled with a file name are written there first), or carries a visible note saying
why it cannot run here; the code blocks of the reference's *What a client computes* are the code's formulas. The
site itself is built with warnings as errors by `make docs`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedsaddle.launch import CLIENT_ENV

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs" / "tutorials").glob("*.md")) + sorted((REPO / "docs" / "how-to").glob("*.md"))
NOT_RUN = '!!! note "Not run by the docs test"'
FENCE = re.compile(r'^```(\w+)(?:\s+title="([^"]+)")?\s*$')


def blocks(page: Path) -> list[tuple[str, str | None, str, bool]]:
    """(language, title, text, marked not to run) of each fenced block, in page order."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = "\n".join(lines[max(0, i - 4) : i])
        found.append((opened.group(1), opened.group(2), "\n".join(lines[i + 1 : end]), NOT_RUN in before))
        i = end + 1
    return found


def test_every_guide_has_its_shell_blocks_run_or_marked() -> None:
    assert PAGES, "no tutorials or how-to guides found"
    shell = [(page.name, b) for page in PAGES for b in blocks(page) if b[0] in ("sh", "bash", "shell")]
    assert len(shell) >= 10  # (a change that hid the blocks from this test would show here)
    assert any(not marked for _, (_, _, _, marked) in shell)


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_the_shell_blocks_of_a_guide_run_as_written(page: Path, tmp_path: Path) -> None:
    runnable = [b for b in blocks(page) if b[0] in ("sh", "bash", "shell", "yaml") and not b[3]]
    if not any(language != "yaml" for language, *_ in runnable):
        pytest.skip(f"{page.name}: no shell block to run here (none, or each marked with the reason)")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    env = {k: v for k, v in CLIENT_ENV.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for language, title, text, _ in runnable:
        if language == "yaml":
            if title:
                (tmp_path / title).write_text(text + "\n")
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,  # (a loaded 2-core machine: own-data runs two federations of 1000 rounds)
        )
        assert done.returncode == 0, f"{page.name}: block failed:\n{text}\n--- stderr:\n{done.stderr[-3000:]}"


def test_the_algorithms_table_has_a_row_for_each_built_in_algorithm_and_no_other() -> None:
    from fedsaddle.server.algorithms.registry import BUILT_IN, definition
    from fedsaddle.server.algorithms.spec import PAPER

    table = (REPO / "docs" / "reference" / "algorithms.md").read_text()
    found = re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    rows = {m.group(1): m.group(2) for m in found if m.group(1) != "name"}  # not the header
    assert sorted(rows) == sorted(BUILT_IN)
    for name, paper in rows.items():
        cited = definition(name).paper
        # The paper's own algorithms point to its sections; each newer baseline cites its paper as registered.
        assert paper.startswith("the paper") if cited == PAPER else paper.startswith(cited), (name, paper, cited)


CLIENT_PAGE = REPO / "docs" / "reference" / "client-arithmetic.md"


def titled_block(page: Path, title: str) -> str:
    """The text of the one fenced block of `page` titled `title`."""
    found = [text for _, name, text, _ in blocks(page) if name == title]
    assert len(found) == 1, f"{page.name}: {len(found)} blocks titled {title!r}"
    return found[0]


def test_the_documented_linear_regression_formulas_are_the_codes() -> None:
    """What a client in another language computes for `linear_regression` (fᵢ, Gᵢ, z*, test_mse), as the
    reference page writes it, against the problem's own code."""
    import numpy as np

    from fedsaddle.common.problems.data import ClientData
    from fedsaddle.common.problems.regression import LinearRegression, LinearRegressionSpec

    p, lam = 3, 0.05
    problem = LinearRegression(LinearRegressionSpec(features=p, lam=lam, num_clients=2))
    rng = np.random.default_rng(11)
    datas = [
        ClientData(f"client-{m}", rng.standard_normal((m, p)), rng.standard_normal(m), None,
                   rng.standard_normal((4, p)), rng.standard_normal(4))
        for m in (17, 40)
    ]  # fmt: skip
    formulas = titled_block(CLIENT_PAGE, "linear_regression")
    mse = titled_block(CLIENT_PAGE, "linear_regression test_mse")
    for data in datas:
        z = rng.standard_normal(2 * p)
        found = {"X": data.X, "t": data.y, "m": data.samples, "x": z[:p], "y": z[p:], "lam": lam}
        exec(formulas, {"concatenate": np.concatenate}, found)
        np.testing.assert_allclose(found["f"], problem.objective(data, z), rtol=1e-13)
        np.testing.assert_allclose(found["G"], problem.gradient(data, z), rtol=1e-13, atol=1e-14)
        found = {"X_test": data.X_test, "y_test": data.y_test, "x": z[:p]}
        exec(mse, {}, found)
        np.testing.assert_allclose(found["test_mse"], problem.metrics(data, z)[0], rtol=1e-13)
    solution = titled_block(CLIENT_PAGE, "linear_regression z*")
    for weights in (None, np.array([17.0, 40.0])):  # weighting: uniform, then samples
        w = np.ones(2) if weights is None else weights
        a = sum(wi * d.X.T @ d.X / d.samples for wi, d in zip(w, datas, strict=True)) / w.sum()
        b = sum(wi * d.X.T @ d.y / d.samples for wi, d in zip(w, datas, strict=True)) / w.sum()
        found = {"A": a, "b": b, "lam": lam, "p": p}
        exec(solution, {"solve": np.linalg.solve, "eye": np.eye}, found)
        z_star = np.concatenate([found["x_star"], found["y_star"]])
        np.testing.assert_allclose(z_star, problem.reference_solution(datas, weights), rtol=1e-12, atol=1e-14)


def test_the_documented_noise_stream_gives_the_clients_noise_bit_for_bit() -> None:
    """Gradient noise as the reference page describes it: the stream, the scale σ/√D, the mean of `batch` draws."""
    import numpy as np

    from fedsaddle.common.problems.data import ClientData
    from fedsaddle.common.problems.regression import LinearRegression, LinearRegressionSpec
    from fedsaddle.common.problems.shards import ProblemShards
    from fedsaddle.common.tasks import GradientTask
    from fedsaddle.common.worker import Worker

    p, sigma, noise_seed, round_id = 3, 0.7, 2**62 + 12345, 9  # a seed above 2^53
    problem = LinearRegression(LinearRegressionSpec(features=p, num_clients=4))
    rng = np.random.default_rng(5)
    data = ClientData("client", rng.standard_normal((20, p)), rng.standard_normal(20))
    worker = Worker(ProblemShards(problem, [data], [2]), noise_seed, sigma)
    z, dimension = rng.standard_normal(2 * p), 2 * p
    block = titled_block(CLIENT_PAGE, "noise stream")
    for batch in (1, 3):
        answer = worker.execute(GradientTask(z, batch=batch), round_id)
        found = {"numpy": np, "noise_seed": noise_seed, "i": 2, "round_id": round_id, "D": dimension}
        exec(block, {}, found)
        draws = [found["xi"]] + [found["stream"].standard_normal(dimension) for _ in range(batch - 1)]
        total = draws[0]
        for draw in draws[1:]:
            total = total + draw
        expected = problem.gradient(data, z) + (sigma / np.sqrt(dimension)) * (total / batch)
        assert np.array_equal(answer.vectors[0], expected), batch
