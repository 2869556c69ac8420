"""Run outputs: per-round metrics (JSON Lines), a summary (JSON), a plot (PNG), a table."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import make_problem
from fedsaddle.common.problems.shards import metric_rows
from fedsaddle.server.config import ConfigError, RunConfig
from fedsaddle.server.driver import AlgorithmResult
from fedsaddle.server.per_client import OBJECTIVE, clients_of
from fedsaddle.server.reference import shown

log = logging.getLogger("fedsaddle.coordinator")


def make_run_dir(config: RunConfig) -> Path:
    """A fresh folder below config.output.dir, named after the config and the time."""
    base = Path(config.output.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        path = base / (f"{config.name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError as exc:  # a file where a folder must be, no permission, a full disk
            raise ConfigError(
                f"output.dir (--out) {str(base)!r}: cannot create a run directory there: {exc.strerror}"
            ) from None
    raise RuntimeError(f"could not create a run directory below {base}")


def write_summary(
    run_dir: Path, config: RunConfig, results: Sequence[AlgorithmResult], transport: dict[str, Any]
) -> None:
    """summary.json, each algorithm's final iterate (.npy) and the plot, once the run has ended
    (config.json and metrics.jsonl are written as it goes)."""
    files = write_final_iterates(run_dir, results)
    summary = {
        "name": config.name,
        "transport": transport,
        "round_convention": config.round_convention,
        "budget": config.rounds,
        "precision": config.precision,
        "algorithms": [
            {**r.summary(), "z_file": file, "rounds_to": rounds_to(r, config)}
            for r, file in zip(results, files, strict=True)
        ],
    }
    (run_dir / "summary.json").write_text(strict_json(summary, indent=2) + "\n")
    if not config.output.plot:
        return
    # Distances need a known z* (a synthetic problem's, or simulate's centralized solution on data);
    # a gRPC coordinator on private data has none, and shows what the clients evaluate instead.
    try:
        if measured(results):
            plot_distances(run_dir / "distance.png", config, results)
        if metric_names(results):
            plot_metrics(run_dir / "metrics.png", config, results)
    except ImportError:
        log.warning("no plots: matplotlib is not installed (pip install 'fedsaddle[plot]')")


def final_iterate_file(name: str) -> str:
    """The file name of an algorithm's final iterate in a run directory: final_z-NAME.npy, with any
    character that does not belong in a file name (a label's '/', spaces) written as '_'."""
    return "final_z-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".npy"


def _stored(z: Array) -> str:
    """The dtype a final iterate is written in: float32 for a float32 run's, else float64."""
    return "<f4" if z.dtype == np.float32 else "<f8"


def iterates_folder(name: str) -> str:
    """The folder of an algorithm's iterates kept along the run (output.save_every): iterates-NAME."""
    return "iterates-" + final_iterate_file(name)[len("final_z-") : -len(".npy")]


def write_final_iterates(run_dir: Path, results: Sequence[AlgorithmResult]) -> list[str]:
    """Each algorithm's final iterate z = (x, y) as a 1-D little-endian float64 (float32, in a run of
    precision float32) .npy file (numpy's
    format, `np.load` reads it); `sha256(np.load(file))` of fedsaddle.common.numeric, the SHA-256 of
    the array's raw bytes, is the summary's z_sha256. The file names, in the results' order."""
    names: list[str] = []
    for result in results:
        name = final_iterate_file(result.name)
        if name in names:  # two labels that differ only in characters a file name cannot hold
            name = name[: -len(".npy")] + f"-{len(names)}.npy"
        np.save(run_dir / name, np.ascontiguousarray(result.final_z, dtype=_stored(result.final_z)), allow_pickle=False)
        names.append(name)
    return names


def accuracy_label(accuracy: float) -> str:
    """How the summary's keys and the table's columns name an accuracy: 1e-06 for 1e-6, else as
    written (0.025, 1)."""
    short = f"{accuracy:.0e}"
    return short if accuracy < 1 and float(short) == accuracy else f"{accuracy:g}"


def measured(results: Sequence[AlgorithmResult]) -> bool:
    """Whether the records carry ||x - x*|| (z* is known: a synthetic problem, or simulate on data)."""
    return any("dist_x" in record for r in results for record in r.records)


def rounds_to(result: AlgorithmResult, config: RunConfig) -> dict[str, int | None]:
    """The rounds (the config's convention) until ||x - x*|| <= each of output.accuracies: None where
    not reached, or where the accuracy is finer than z*'s own (a --reference's); empty when z* is unknown."""
    if not measured([result]):
        return {}
    convention = config.round_convention
    return {
        accuracy_label(a): result.rounds_to(a, convention) if a >= result.floor else None
        for a in config.output.accuracies
    }


def metric_names(results: Sequence[AlgorithmResult]) -> list[str]:
    """The evaluation metrics any of the results carries, in the order first seen."""
    return list(dict.fromkeys(name for r in results for name in r.metrics))


def strict_json(value: Any, **options: Any) -> str:
    """JSON that every reader accepts (jq, browsers and other languages refuse NaN and Infinity):
    a value that is unknown or not finite is null."""
    return json.dumps(_finite_or_null(value), allow_nan=False, **options)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def plot_distances(path: Path, config: RunConfig, results: Sequence[AlgorithmResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, axis = _x_axis(config)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    finite = [r["dist_x"] for result in results for r in result.records if math.isfinite(r.get("dist_x", math.nan))]
    starts = [result.records[0]["dist_x"] for result in results if result.records and "dist_x" in result.records[0]]
    # A diverged run is drawn up to where it leaves the scale, and marked there: the axis stays readable.
    ceiling = 100 * max([*starts, 1e-300]) if starts else (max(finite) if finite else 1.0)
    for result in results:
        points = [(r[key], r["dist_x"]) for r in result.records if "dist_x" in r and r["dist_x"] > 0]
        shown = [(x, y) for x, y in points if math.isfinite(y) and y <= ceiling]
        if shown:
            xs, ys = zip(*shown, strict=True)
            label = result.name + (" (diverged)" if result.status == "diverged" else "")
            (line,) = ax.semilogy(xs, ys, label=label)
            if result.status == "diverged":
                ax.plot([xs[-1]], [ys[-1]], "x", color=line.get_color(), ms=9)
    if finite:
        ax.set_ylim(max(min(finite), 1e-300) / 10, ceiling * 10)
    floor = max(r.floor for r in results)
    if floor > 0:  # below this line z* (a --reference) cannot tell distances apart
        ax.axhline(floor, color="gray", linestyle=":", label=f"z*'s accuracy {floor:.1e}")
    ax.set_xlabel(axis)
    ax.set_ylabel(r"$\|x - x^\star\|$")
    ax.set_title(_title(config))
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():  # nothing finite to draw (every run diverged at once): no empty legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _x_axis(config: RunConfig) -> tuple[str, str]:
    """The records' key of the round count, and its axis label."""
    convention = config.round_convention
    return convention.record_key, f"communication rounds ({convention.words})"


def _title(config: RunConfig) -> str:
    dim_x, dim_y = make_problem(config.problem).dims()
    return f"{config.name}: {config.problem.name}, n={config.problem.num_clients}, dim x={dim_x}, y={dim_y}"


def plot_metrics(path: Path, config: RunConfig, results: Sequence[AlgorithmResult]) -> None:
    """Each evaluation metric against communication rounds, a panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, axis = _x_axis(config)
    names = metric_names(results)
    # With output.per_client, a band from each metric's best client to its worst, and a panel for the
    # clients' training objectives f_i(z).
    per_client = [OBJECTIVE] if any(clients_of(r) is not None for x in results for r in x.records) else []
    panels = names + per_client
    problem = make_problem(config.problem)
    rows_of = dict(zip(problem.metric_names, metric_rows(problem), strict=True))  # each metric's rows
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), dpi=120, squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        for result in results:
            points = [(r[key], r[name]) for r in result.records if name in r and math.isfinite(r[name])]
            line = None
            if points:
                xs, ys = zip(*points, strict=True)
                (line,) = ax.plot(xs, ys, marker=".", label=result.name)
            entries = [(r[key], clients_of(r) or {}) for r in result.records]
            band = [
                (x, e[name]["best"], e[name]["worst"]) for x, e in entries if e.get(name, {}).get("worst") is not None
            ]
            if band:
                xs, best, worst = zip(*band, strict=True)
                color = line.get_color() if line is not None else None
                label = f"{result.name}: best to worst client" if line is not None else f"{result.name}: clients"
                ax.fill_between(xs, best, worst, alpha=0.2, color=color, label=label)
                if line is None:  # the objective has no average line: the worst client's
                    ax.plot(xs, worst, marker=".", color=color, label=f"{result.name}: worst client")
        ax.set_xlabel(axis)
        ax.set_ylabel(
            "f_i(z), each client's training objective"
            if name == OBJECTIVE
            else f"{name} (on the clients' {rows_of.get(name, 'held-out')} rows)"
        )
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(_title(config))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(value: float, floor: float = 0.0) -> str:
    """A distance: '-' when unknown (no z* to measure against) or not finite; '<FLOOR' when finer than
    z*'s accuracy (a --reference solved to FLOOR cannot tell it)."""
    return shown(value, floor)


def table(results: Sequence[AlgorithmResult]) -> str:
    """One row per algorithm: accuracy (and the final evaluation metrics, if any), communication, time and
    the verdict (server/verdict.py), then a line per algorithm that says what the verdict rests on."""
    names = metric_names(results)
    width = {name: max(10, len(name)) for name in names}
    metrics_header = "".join(f" {name:>{width[name]}}" for name in names)
    header = (
        f"{'algorithm':<22} {'||x-x*||':>10} {'||z-z*||':>10}{metrics_header} {'rounds':>6} "
        f"{'msgs down/up':>13} {'MB down/up (payload)':>21} {'MB down/up (wire)':>18} {'wall s':>7} verdict"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        t = r.traffic["algorithm"]
        entry = r.final_z.dtype.itemsize  # bytes per entry: 8, or 4 in a run of precision float32
        payload = f"{t['floats_down'] * entry / 1e6:.3f}/{t['floats_up'] * entry / 1e6:.3f}"
        wire = f"{t['bytes_down'] / 1e6:.3f}/{t['bytes_up'] / 1e6:.3f}" if t["bytes_down"] else "-"
        status = "" if r.status == "ok" else f"  [{r.status}]"
        final = r.metrics
        values = "".join(f" {_metric(final.get(name)):>{width[name]}}" for name in names)
        lines.append(
            f"{r.name:<22} {_fmt(r.dist_x, r.floor):>10} {_fmt(r.dist_z, r.floor):>10}{values} {t['rounds']:>6} "
            f"{str(t['messages_down']) + '/' + str(t['messages_up']):>13} {payload:>21} {wire:>18} "
            f"{r.wall_s:>7.2f} {r.verdict.kind:<13}{status}".rstrip()
        )
    lines += [f"  {r.name}: {r.verdict.kind}: {r.verdict.detail}" for r in results]
    for r in results:  # output.per_client: the last evaluation's worst and best client of each
        clients = r.summary().get("per_client", {})
        cells = [
            f"{name} worst {e['worst']:.4g} (client {e['worst_client']}), best {e['best']:.4g} "
            f"(client {e['best_client']})"
            for name, e in clients.items()
            if e["worst"] is not None
        ]
        if cells:
            lines.append(f"  {r.name} per client: " + "; ".join(cells))
    return "\n".join(lines)


def rounds_table(results: Sequence[AlgorithmResult], config: RunConfig) -> str | None:
    """The rounds each algorithm spent until ||x - x*|| <= each of output.accuracies ('-': not within
    the budget); None when z* is unknown or no accuracy is asked for."""
    if not measured(results) or not config.output.accuracies:
        return None
    labels = [accuracy_label(a) for a in config.output.accuracies]
    width = max(8, *(len(label) for label in labels))
    counted = config.round_convention.words
    header = f"{'algorithm':<22}" + "".join(f" {label:>{width}}" for label in labels)
    lines = [
        f"communication rounds until ||x-x*|| <= accuracy ({counted}; -: not reached within {config.rounds} rounds)",
        header,
        "-" * len(header),
    ]
    for r in results:
        reached = rounds_to(r, config)  # empty for a run stopped before its first step
        cells = "".join(
            f" {'n/a' if a < r.floor else _count(reached.get(label)):>{width}}"
            for a, label in zip(config.output.accuracies, labels, strict=True)
        )
        lines.append(f"{r.name:<22}{cells}")
    floor = max(r.floor for r in results)
    if any(a < floor for a in config.output.accuracies):
        lines.append(f"n/a: finer than z*'s accuracy ({floor:.1e}, the reference's), which cannot tell it")
    return "\n".join(lines)


def _count(rounds: int | None) -> str:
    return "-" if rounds is None else str(rounds)


def _metric(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4g}"
