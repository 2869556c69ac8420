"""The plug-in through fedsaddle's public API only: registered in-process, run in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fedsaddle_fedprox_gda import FEDPROX_GDA

from fedsaddle import api
from fedsaddle.server.algorithms import available, register, unregister


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    register(FEDPROX_GDA)  # what the entry point does for an installed package, for this process only
    yield
    unregister("fedprox_gda")


GAME = {"name": "quadratic_game", "num_clients": 5, "dim": 4, "heterogeneity": 0.5}


def run(algorithms: list[dict[str, Any]], tmp: Any, problem: dict[str, Any] = GAME) -> api.Report:
    config = {
        "problem": problem,
        "algorithms": algorithms,
        "rounds": 60,
        "sync": {"kind": "fixed", "tau": 5},
        "output": {"dir": str(tmp), "plot": False},
    }
    return api.run(config)


def test_the_plugin_is_listed_among_the_algorithms() -> None:
    assert "fedprox_gda" in available()


def test_without_the_proximal_pull_it_is_fedavg_s_with_a_constant_step_bit_for_bit(tmp_path: Any) -> None:
    report = run(
        [
            {"name": "fedprox_gda", "gamma_local": 0.05, "mu": 0.0},
            {"name": "fedavg_s", "gamma_local": 0.05, "decay": "constant"},
        ],
        tmp_path,
    )
    plugin, fedavg = report.results
    assert plugin.status == fedavg.status == "ok"
    assert plugin.z_sha256 == fedavg.z_sha256
    assert plugin.traffic == fedavg.traffic


def test_homogeneous_clients_converge_to_the_saddle_point(tmp_path: Any) -> None:
    report = run([{"name": "fedprox_gda", "gamma_local": 0.05, "mu": 0.5}], tmp_path, {**GAME, "heterogeneity": 0.0})
    (result,) = report.results
    assert result.dist_z < 1e-6
