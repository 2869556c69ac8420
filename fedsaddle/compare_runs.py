"""Compare two run directories: did two runs (a deployment and its simulation, two hosts, two
versions) compute the same thing?

Compared, exactly (floats bit for bit, as the JSON files hold them):

* summary.json, per algorithm (matched by name): status, z_sha256, rounds and paper rounds,
  the distances, the final metrics, the counters (syncs, steps, theta, ...), the rounds-to
  table and the traffic counts (rounds, messages, float64 entries, per client);
* each algorithm's final iterate, `final_z-NAME.npy`, entry by entry;
* metrics.jsonl, record by record, every field;
* config.json, every field.

Measured against z* (`dist_x`, `dist_z`, `rounds_to`, `distance_scale`, `reference_accuracy`) are
compared when both runs know z*; when one does and the other does not (an in-process run on data
computes z* from all clients' files, a gRPC coordinator never has them), they are left out, and so
is each algorithm's `verdict` (judged by ||z - z*|| in one run only), and the verdict says so.

Ignored, because they differ between equal runs: wall-clock times (`wall_s`, every record's
`time_s`), the bytes on the wire (`bytes_down`, `bytes_up`: only a gRPC transport measures
them), the transport's description (`transport` in summary.json: kind, address, BLAS), a
stopped run's `detail` text, and the config's `output` and `transport` sections (where files
go, which address a coordinator listens on).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

IGNORED_FIELDS = frozenset({"wall_s", "time_s", "bytes_down", "bytes_up", "detail"})
IGNORED_CONFIG_SECTIONS = frozenset({"output", "transport"})
REFERENCE_FIELDS = ("dist_x", "dist_z", "rounds_to", "distance_scale", "reference_accuracy")  # known only where z* is
VERDICT_FIELDS = ("verdict", "verdict_detail")  # judged by ||z - z*|| where z* is known, else by ||G||
ONE_SIDED_REFERENCE = "distances to z* known in one run only, not compared"


class RunDirError(ValueError):
    """A run directory cannot be compared (a file missing or unreadable); the message names it."""


def compare_runs(first: str | Path, second: str | Path, limit: int = 20) -> list[str]:
    """The differences between two run directories, one line each (at most `limit`); [] if equal."""
    a, b = Path(first), Path(second)
    found: list[str] = []
    for difference in _differences(a, b):
        found.append(difference)
        if len(found) >= limit:
            break
    return found


def _differences(a: Path, b: Path) -> Iterator[str]:
    summary_a, summary_b = _json(a / "summary.json"), _json(b / "summary.json")
    yield from _compare(_strip_config(_json(a / "config.json")), _strip_config(_json(b / "config.json")), "config")
    algorithms_a = {entry["name"]: entry for entry in summary_a.get("algorithms", [])}
    algorithms_b = {entry["name"]: entry for entry in summary_b.get("algorithms", [])}
    if list(algorithms_a) != list(algorithms_b):
        yield f"summary.json: algorithms {list(algorithms_a)} vs {list(algorithms_b)}"
    for name in algorithms_a.keys() & algorithms_b.keys():
        entry_a, entry_b = algorithms_a[name], algorithms_b[name]
        yield from _compare(*_without_one_sided_reference(_strip(entry_a), _strip(entry_b)), f"summary.json {name}")
        yield from _compare_iterates(a, b, name, entry_a, entry_b)
    yield from _compare_records(a / "metrics.jsonl", b / "metrics.jsonl")


def _compare_iterates(a: Path, b: Path, name: str, entry_a: dict[str, Any], entry_b: dict[str, Any]) -> Iterator[str]:
    file_a, file_b = entry_a.get("z_file"), entry_b.get("z_file")
    if file_a is None or file_b is None:
        if (file_a is None) != (file_b is None):
            yield f"{name}: only one run directory holds its final iterate (z_file)"
        return
    z_a, z_b = _array(a / file_a), _array(b / file_b)
    if z_a.shape != z_b.shape:
        yield f"{name}: final iterates of shapes {z_a.shape} and {z_b.shape}"
    elif z_a.tobytes() != z_b.tobytes():
        where = int(np.argmax(z_a.view(np.uint64) != z_b.view(np.uint64)))
        yield f"{name}: final iterates differ first at entry {where}: {z_a[where]!r} vs {z_b[where]!r}"


def _compare_records(a: Path, b: Path) -> Iterator[str]:
    records_a, records_b = _lines(a), _lines(b)
    if len(records_a) != len(records_b):
        yield f"metrics.jsonl: {len(records_a)} records vs {len(records_b)}"
    for line, (record_a, record_b) in enumerate(zip(records_a, records_b, strict=False), start=1):
        where = f"metrics.jsonl line {line} ({record_a.get('algorithm')}, step {record_a.get('step')})"
        yield from _compare(*_without_one_sided_reference(_strip(record_a), _strip(record_b)), where)


def _known(value: Any) -> bool:
    return value is not None and value != {}


def _one_sided(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The measurements against z* that only one of a and b could make."""
    return [key for key in REFERENCE_FIELDS if _known(a.get(key)) != _known(b.get(key))]


def _without_one_sided_reference(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """a and b without the measurements against z* that only one of them could make."""
    one_sided = _one_sided(a, b)
    if one_sided:  # a verdict judged by ||z - z*|| in one run and without it in the other
        one_sided += VERDICT_FIELDS
    return {k: v for k, v in a.items() if k not in one_sided}, {k: v for k, v in b.items() if k not in one_sided}


def one_sided_reference(first: str | Path, second: str | Path) -> bool:
    """Whether one run measured against z* and the other could not (compared without those fields)."""
    entries = [_json(Path(run) / "summary.json").get("algorithms", []) for run in (first, second)]
    return any(_one_sided(a, b) for a, b in zip(*entries, strict=False))


def _compare(a: Any, b: Any, where: str) -> Iterator[str]:
    """Differences between two JSON values, naming the path of each."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b:
                yield f"{where}: {key} only in the {'first' if key in a else 'second'} run"
            else:
                yield from _compare(a[key], b[key], f"{where}: {key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (item_a, item_b) in enumerate(zip(a, b, strict=True)):
            yield from _compare(item_a, item_b, f"{where}[{i}]")
    elif not _same(a, b):
        yield f"{where}: {_show(a)} vs {_show(b)}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, list | dict) else json.dumps(value)[:80]


def _strip(entry: dict[str, Any]) -> dict[str, Any]:
    """A summary entry or a record without the fields that differ between equal runs."""
    stripped: dict[str, Any] = {}
    for key, value in entry.items():
        if key in IGNORED_FIELDS or key == "z_file":
            continue
        stripped[key] = _strip(value) if isinstance(value, dict) else value
    return stripped


def _strip_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in IGNORED_CONFIG_SECTIONS}


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path}: no such file (is {path.parent} a run directory of a finished run?)") from None
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise RunDirError(f"{path}: expected a JSON object")
    return value


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunDirError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise RunDirError(f"{path} line {number}: not JSON ({exc})") from None
    return records


def _array(path: Path) -> np.ndarray:
    try:
        value = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: cannot be read as .npy: {exc}") from None
    if not isinstance(value, np.ndarray) or value.dtype not in (np.dtype("<f8"), np.dtype("<f4")):
        raise RunDirError(f"{path}: expected a float64 array (float32 for a run of precision float32)")
    return value


def main_compare(first: str, second: str, limit: int) -> tuple[int, Sequence[str]]:
    """(exit code, lines to print): 0 and a line saying so when equal, 1 and the differences when not."""
    differences = compare_runs(first, second, limit)
    if not differences:
        reference = f"; {ONE_SIDED_REFERENCE}" if one_sided_reference(first, second) else ""
        return 0, [
            f"same: {first} and {second} (hashes, final iterates, counts, metrics and config; "
            f"times and wire bytes ignored{reference})"
        ]
    more = " (first ones shown; --limit for more)" if len(differences) >= limit else ""
    return 1, [f"differ: {first} and {second}{more}", *(f"  {d}" for d in differences)]
