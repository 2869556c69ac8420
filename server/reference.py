"""A saddle point z* given from a file, and the accuracy it was solved to.

The format, written by `fedsaddle check-problem --save-reference FILE.npy` and read
by `--reference FILE.npy` (simulate, local, coordinator):

* `FILE.npy`: z* as a 1-D little-endian float64 array (numpy's format; `np.load`
  reads it, so `api.run(reference=np.load(FILE))` still takes it);
* `FILE.json` beside it (the same name, `.json` for `.npy`): `accuracy`, a bound on
  ||z* - the true saddle point|| (null: unknown), with `residual`, `method`,
  `problem`, `dimension` and `z_sha256` (the SHA-256 of the .npy's float64 bytes,
  so a sidecar left beside another z* is noticed).

A `.npy` without its `.json` is taken as exact (accuracy 0): a closed-form z* of
one's own. Distances to z* finer than its accuracy are never printed: the tables
and progress lines show `<ACCURACY` instead, and the rounds-to table leaves out the
accuracies z* cannot tell.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedsaddle.common.numeric import Array, sha256

FORMAT = "fedsaddle reference 1"


class ReferenceError(ValueError):
    """A reference file that cannot be used: the message names the file and the fault."""


class Reference(NamedTuple):
    z: Array
    accuracy: float  # a bound on ||z - z*||; 0: exact
    path: str


def sidecar(path: Path) -> Path:
    """The JSON file beside FILE.npy that holds its accuracy: FILE.json."""
    return path.with_suffix(".json")


def save_reference(
    path: Path, z: Array, accuracy: float, residual: float, method: str, problem: str
) -> tuple[Path, Path]:
    """Write z* to `path` (.npy) and its accuracy beside it; ReferenceError unless `path` ends in .npy."""
    if path.suffix != ".npy":
        raise ReferenceError(f"--save-reference {path}: the file must end in .npy (its accuracy goes beside it)")
    z = np.ascontiguousarray(z, dtype="<f8")
    np.save(path, z, allow_pickle=False)
    note = {
        "format": FORMAT,
        "problem": problem,
        "dimension": int(z.size),
        "accuracy": accuracy if math.isfinite(accuracy) else None,
        "residual": residual if math.isfinite(residual) else None,
        "method": method,
        "z_sha256": sha256(z),
    }
    sidecar(path).write_text(json.dumps(note, indent=2) + "\n")
    return path, sidecar(path)


def load_reference(path: Path, problem: str, dimension: int) -> Reference:
    """z* and its accuracy from `path`, checked against the problem's size (ReferenceError naming the file)."""
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ReferenceError(f"--reference {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"--reference {path}: not a .npy array ({exc})") from None
    if z.ndim != 1 or not np.issubdtype(z.dtype, np.floating):
        raise ReferenceError(f"--reference {path}: z* must be a 1-D float array, got shape {z.shape} of {z.dtype}")
    if z.size != dimension:
        raise ReferenceError(
            f"--reference {path}: z* has {z.size} entries, but problem {problem!r} has z of {dimension} entries"
        )
    z = np.asarray(z, dtype=float)
    if not np.isfinite(z).all():
        raise ReferenceError(f"--reference {path}: z* has entries that are not finite")
    note_path = sidecar(path)
    if not note_path.exists():
        return Reference(z, 0.0, str(path))
    note = _read_note(note_path)
    if note.get("z_sha256") not in (None, sha256(z)):
        raise ReferenceError(
            f"--reference {path}: {note_path} was written for another z* (its z_sha256 differs); "
            "save the reference again, or remove the .json to take the .npy as exact"
        )
    if note.get("problem") not in (None, problem):
        raise ReferenceError(
            f"--reference {path}: {note_path} says it was solved for problem {note['problem']!r}, "
            f"and this run's problem is {problem!r}"
        )
    accuracy = note.get("accuracy", 0.0)
    if accuracy is None:
        raise ReferenceError(
            f"--reference {path}: its accuracy is unknown ({note_path} says null: check-problem saw no positive mu), "
            "so no distance to it would mean anything; write a bound on ||z - z*|| as its accuracy if you know one"
        )
    if not isinstance(accuracy, int | float) or not math.isfinite(accuracy) or accuracy < 0:
        raise ReferenceError(f"--reference {path}: {note_path}'s accuracy must be a number >= 0, got {accuracy!r}")
    return Reference(z, float(accuracy), str(path))


def _read_note(path: Path) -> dict[str, Any]:
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(note, dict):
        raise ReferenceError(f"{path}: must be a JSON object with an `accuracy`, got {type(note).__name__}")
    return note


def shown(distance: float, accuracy: float) -> str:
    """A distance to z* as the tables print it: '-' when unknown, '<ACCURACY' when z* cannot tell it."""
    if not math.isfinite(distance):
        return "-"
    if distance < accuracy:
        return f"<{accuracy:.1e}"
    return f"{distance:.3e}"
