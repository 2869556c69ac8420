"""bench/sweep_cost.py's numpy reproduction of the two Catalysts equals fedsaddle's final iterates bit for bit,
on a small part of `experiment paper`'s grid (the sweep's 500 rounds, two values of s, one seed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from sweep_cost import CATALYSTS, batches, reproduce  # bench/sweep_cost.py

from fedsaddle.experiments.grid import Grid
from fedsaddle.server.batch import run_batch


@pytest.mark.parametrize("algorithm", CATALYSTS)
def test_the_numpy_catalyst_has_fedsaddles_final_iterates_bit_for_bit(algorithm: str) -> None:
    grid = Grid(s_values=(0.0, 8.0), seeds=(0,), algorithms=(algorithm,))
    pieces = batches(grid)[algorithm]
    runs = [member for piece in pieces for member in piece]
    results = [result for piece in pieces for result in run_batch(piece)]
    with np.errstate(all="ignore"):
        finals = reproduce(algorithm, grid, runs)
    kept = [(result, z) for result, z in zip(results, finals, strict=True) if result.status == "ok"]
    # The grid has runs that diverge (left out: fedsaddle stops them) and runs that end ok, in many meta-iterations.
    assert 0 < len(kept) < len(runs)
    assert max(result.extra["meta_iterations"] for result, _ in kept) > 20
    for result, z in kept:
        assert np.array_equal(np.asarray(result.final_z), z), result.spec
    thetas = {result.extra["theta"] for result, _ in kept}
    if algorithm == "catalyst_ours":  # theta estimated from the secants, a value of each run's own
        assert len(thetas) == len(kept) and 1.0 not in thetas
    else:
        assert thetas == {1.0}
