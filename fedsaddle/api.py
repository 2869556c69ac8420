"""fedsaddle from Python: run a federation in-process or over gRPC and get its results.

    from fedsaddle import api

    report = api.run("run.yaml", data="data/client-{i}.npz")              # in-process
    report = api.run(config, data=paths, transport="grpc")                # client processes on loopback
    for result in report.results:
        print(result.name, result.status, result.records[-1])

Each result carries the final iterate, `result.final_z` (a numpy float64 vector, float32
with `precision: float32`; z = (x, y), x first, as long as the problem's dims), also written to the run
directory as `final_z-NAME.npy`; `result.z_sha256` is its hash.

`config` is a RunConfig, a mapping of config fields (as a YAML file would give),
or the path of a YAML/JSON config. `data` gives each client's own data file: a
pattern with `{i}`, one path per client in index order, or a mapping index ->
path (synthetic problems need none). Outputs are written to a run directory as
the command line writes them (`report.run_dir`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedsaddle.common import blas
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import data_paths
from fedsaddle.server.config import RunConfig, load_config, parse_config
from fedsaddle.server.driver import AlgorithmResult
from fedsaddle.server.runs import Outcome, run_config
from fedsaddle.server.transport.local_pool import reference_solution

__all__ = ["Report", "load", "reference_solution", "run"]


@dataclass
class Report:
    """What a run of a config did."""

    results: list[AlgorithmResult]  # one per algorithm: status, per-step records, traffic, final iterate
    run_dir: Path  # metrics.jsonl, summary.json, config.json, distance.png and/or metrics.png
    failure: str | None  # None if every algorithm ran to its budget

    def result(self, name: str) -> AlgorithmResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no algorithm named {name!r} in this run; it has {[r.name for r in self.results]}")


def load(config: RunConfig | Mapping[str, Any] | str | Path) -> RunConfig:
    """A RunConfig from any of the forms `run` accepts; ConfigError naming every bad field."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str | Path):
        return load_config(config)
    return parse_config(dict(config))


def run(
    config: RunConfig | Mapping[str, Any] | str | Path,
    *,
    data: str | Sequence[str] | Mapping[int, str] | None = None,
    transport: Literal["inprocess", "grpc"] = "inprocess",
    clients_per_process: int = 1,
    reference: Array | None = None,
    out: str | Path | None = None,
    progress: Callable[[str, int, int, float], None] | None = None,
) -> Report:
    """Run every algorithm of the config.

    `reference`: a known saddle point z* (a vector as long as z) to measure the runs against; the
    records and the summary then carry ||x - x*|| and ||z - z*||, the rounds-to table and
    distance.png. Without it, a synthetic problem's planted z* is used, and an in-process run on
    data asks the problem's `reference_solution` (a gRPC run has no data to compute it from).
    `out`: the folder for the run directory (overrides the config's output.dir).
    """
    config = load(config)
    if out is not None:
        config = config.model_copy(update={"output": config.output.model_copy(update={"dir": str(out)})})
    paths = data_paths(data, range(config.problem.num_clients))
    with blas.threads_for_run():  # the count every client process uses (common/blas.py)
        outcome = _run(config, paths, transport, clients_per_process, reference, progress)
    return Report(outcome.results, outcome.run_dir, outcome.failure)


def _run(
    config: RunConfig,
    paths: dict[int, str] | None,
    transport: Literal["inprocess", "grpc"],
    clients_per_process: int,
    reference: Array | None,
    progress: Callable[[str, int, int, float], None] | None,
) -> Outcome:
    outcome: Outcome
    if transport == "inprocess":
        from fedsaddle.server.transport.local_pool import LocalPool

        local = LocalPool(data=paths)
        if reference is None:
            reference = reference_solution(config, local.cache)
        outcome = run_config(config, local, local.describe(), progress, reference)
    else:
        from fedsaddle.launch import loopback_federation

        with loopback_federation(config, clients_per_process, data=paths) as (pool, processes):
            info = {"kind": "grpc", "address": pool.address, "client_processes": len(processes)}
            outcome = run_config(config, pool, info, progress, reference)
    return outcome
