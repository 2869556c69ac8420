"""The event loop under gRPC: uvloop's where it is installed, asyncio's own by choice, the same bits either way."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import fedsaddle

from fedsaddle.common import eventloop

RUN: dict[str, Any] = {
    "name": "loops",
    "problem": {"name": "paper_regression", "num_clients": 3, "dim": 4, "s": 3.0},
    "rounds": 20,
    "sync": {"kind": "random", "p": 0.3},
    "algorithms": [{"name": "scaffold_s", "gamma_local": 0.03}, {"name": "scaffold_catalyst_s", "gamma_local": 0.03}],
}


def _local(tmp_path: Path, choice: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(RUN))
    out = tmp_path / choice
    done = fedsaddle("-v", "local", "--config", str(config), "--out", str(out), env={eventloop.VARIABLE: choice})
    assert done.returncode == 0, done.stderr
    (run_dir,) = list(out.iterdir())
    return done, json.loads((run_dir / "summary.json").read_text())


def test_a_federation_on_asyncios_own_loop_ends_with_the_bits_and_counts_of_one_on_uvloop(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    on_uvloop, fast = _local(tmp_path, "uvloop")
    on_asyncio, plain = _local(tmp_path, "asyncio")
    # The coordinator says what it runs on (its clients: below).
    assert "fedsaddle.coordinator DEBUG event loop: uvloop" in on_uvloop.stderr
    assert "fedsaddle.coordinator DEBUG event loop: asyncio" in on_asyncio.stderr
    for a, b in zip(fast["algorithms"], plain["algorithms"], strict=True):
        assert a["z_sha256"] == b["z_sha256"]
        assert (a["rounds"], a["traffic"]["algorithm"]) == (b["rounds"], b["traffic"]["algorithm"])
    assert [a["status"] for a in fast["algorithms"]] == ["ok", "ok"]


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_a_client_process_runs_on_the_loop_its_environment_chooses(choice: str) -> None:
    if choice == "uvloop":
        pytest.importorskip("uvloop")
    command = ["-v", "client", "--coordinator", "127.0.0.1:9", "--clients", "0", "--connect-timeout", "0.5"]
    done = fedsaddle(*command, timeout=60, env={eventloop.VARIABLE: choice})
    assert done.returncode == 1  # (no coordinator there)
    assert f"fedsaddle.client DEBUG event loop: {choice}" in done.stderr


@pytest.mark.parametrize("command", [["local"], ["client", "--coordinator", "127.0.0.1:9", "--clients", "0"]])
def test_an_event_loop_of_no_known_name_is_refused_naming_it(command: list[str]) -> None:
    done = fedsaddle(*command, timeout=60, env={eventloop.VARIABLE: "tokio"})
    assert done.returncode == 2
    assert "FEDSADDLE_EVENT_LOOP='tokio' names no event loop: give uvloop, asyncio or auto" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("choice", "module"), [("asyncio", "asyncio"), ("uvloop", "uvloop"), ("", "uvloop")])
def test_run_and_new_event_loop_make_the_chosen_kind(monkeypatch: pytest.MonkeyPatch, choice: str, module: str) -> None:
    if module == "uvloop":
        pytest.importorskip("uvloop")
    monkeypatch.setenv(eventloop.VARIABLE, choice)

    async def where() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(where()).startswith(module)
    loop = eventloop.new_event_loop()
    try:
        assert type(loop).__module__.startswith(module)
    finally:
        loop.close()
    assert eventloop.chosen() == module
