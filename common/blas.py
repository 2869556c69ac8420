"""BLAS on one thread in every process of a federation, unless the operator sets a count.

Two reasons. Client processes are many on one machine (`fedsaddle local` runs one
per client, containers share a host): BLAS's own threads would oversubscribe the
cores and spin, and the rounds of a dense problem at d = 1000 took 3x as long.
And BLAS splits long sums over its threads: XᵀX of a client's 5000-row file has
other bits on two threads than on one, so every process that computes for a run,
in-process or over gRPC, must use the same count for the two to agree bit for bit.

The count is OPENBLAS_NUM_THREADS when the operator sets it, else 1. A process
that has not loaded numpy yet sets the environment (the CLI does, first thing),
which its children inherit; one that has (a notebook calling `fedsaddle.api`)
sets the loaded OpenBLAS for the length of a run, through its C interface, and
an in-process pool sets it when a run starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from pathlib import Path

VARIABLE = "OPENBLAS_NUM_THREADS"
_ALSO = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # for BLAS builds that read these instead
VARIABLES = (VARIABLE, *_ALSO)  # every variable `set_environment` sets
# (set, get) in the OpenBLAS numpy's wheels bundle, and in a plain OpenBLAS.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


def threads() -> int:
    """The BLAS threads a fedsaddle process uses: OPENBLAS_NUM_THREADS if set to a count, else 1."""
    try:
        return max(1, int(os.environ.get(VARIABLE, "1")))
    except ValueError:
        return 1


def set_environment() -> None:
    """Before numpy loads: this process, and every process it starts, runs BLAS on `threads()` threads."""
    count = str(threads())
    for name in VARIABLES:
        os.environ.setdefault(name, count)


_CORENAME = ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename")


class _OpenBLAS:
    """The loaded OpenBLAS's functions that fedsaddle uses."""

    def __init__(self, library: ctypes.CDLL, setter: Callable[[int], object], getter: Callable[[], int]) -> None:
        self.library, self.set_threads, self.get_threads = library, setter, getter


def _openblas() -> _OpenBLAS | None:
    """The loaded OpenBLAS, or None if none is loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower() and ".so" in line}
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            setter, getter = getattr(library, set_name, None), getattr(library, get_name, None)
            if setter is not None and getter is not None:
                return _OpenBLAS(library, setter, getter)
    return None


_FOUND: list[_OpenBLAS] = []  # kept once found


def _loaded() -> _OpenBLAS | None:
    if not _FOUND:  # looked for again while none is loaded: numpy may load later
        found = _openblas()
        if found is None:
            return None
        _FOUND.append(found)
    return _FOUND[0]


def describe() -> str:
    """The loaded BLAS's kernel and thread count, e.g. 'OpenBLAS SkylakeX kernel, 1 thread'.

    Kernels are chosen per CPU (or by OPENBLAS_CORETYPE), and two kernels sum matrix
    products in other orders: processes that must agree bit for bit need the same one.
    """
    found = _loaded()
    if found is None:
        return "no OpenBLAS loaded"
    kernel = "unknown"
    for name in _CORENAME:
        function = getattr(found.library, name, None)
        if function is not None:
            function.restype = ctypes.c_char_p
            kernel = (function() or b"unknown").decode(errors="replace")
            break
    count = int(found.get_threads())
    return f"OpenBLAS {kernel} kernel, {count} thread{'s' if count != 1 else ''}"


def numeric_stack() -> str:
    """numpy's version and the BLAS kernel: what a client reports in Ready, e.g.
    'numpy 2.3.1, OpenBLAS SkylakeX kernel, 1 thread'."""
    import numpy as np

    return f"numpy {np.__version__}, {describe()}"


def apply() -> None:
    """The loaded BLAS on `threads()` threads from now on (nothing happens if none is found)."""
    found = _loaded()
    if found is not None:
        found.set_threads(threads())


@contextlib.contextmanager
def threads_for_run() -> Iterator[None]:
    """The loaded BLAS on `threads()` threads while the block runs, as it was afterwards.
    (Client processes the block starts set their own: the CLI calls `set_environment`.)"""
    found = _loaded()
    if found is None:
        yield
        return
    before = int(found.get_threads())
    found.set_threads(threads())
    try:
        yield
    finally:
        found.set_threads(before)
