"""The tutorials and how-to guides work as written: every shell block runs, in page order, in a fresh
folder (YAML blocks titled with a file name are written there first), or carries a visible note saying
why it cannot run here. The site itself is built with warnings as errors by `make docs`."""

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
    from fedsaddle.server.algorithms.builtin import PAPER
    from fedsaddle.server.algorithms.registry import BUILT_IN, definition

    table = (REPO / "docs" / "reference" / "algorithms.md").read_text()
    found = re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    rows = {m.group(1): m.group(2) for m in found if m.group(1) != "name"}  # not the header
    assert sorted(rows) == sorted(BUILT_IN)
    for name, paper in rows.items():
        cited = definition(name).paper
        # The paper's own algorithms point to its sections; each newer baseline cites its paper as registered.
        assert paper.startswith("the paper") if cited == PAPER else paper.startswith(cited), (name, paper, cited)
