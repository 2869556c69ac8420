"""Process memory: few heaps that keep freed buffers for reuse, and freed pages handed back to the
OS every few seconds (both sides use it).

A buffer of megabytes that comes from a fresh mmap, or from heap pages glibc handed
back when it was freed, costs a page fault per 4 KiB when it is filled: at 16 MB per
vector that cost more than the copies (a fixed 256 KiB mmap threshold made the
d = 1e6 round 2-4x slower; bench/README.md). glibc's own dynamic threshold keeps
such buffers in its heaps only once one of the same size was freed, and still hands
heap tops of twice that size back: at d = 1.4e5 (2.2 MB payloads, chunks of 2 MiB
and a small rest) a client took 1280 page faults per task instead of 320, and the
round 1.9x as long. So buffers up to 32 MiB (glibc's largest threshold) come from
the heaps, and heap tops up to 128 MiB are kept. The price is that freed pages stay
in the heaps, where a live neighbour may pin them after a burst of large (hostile)
messages; `return_freed_memory` hands them back.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import mmap
import os
from collections.abc import Callable

import numpy as np
from numpy.typing import DTypeLike

from fedsaddle.common.numeric import Array

TRIM_EVERY_S = 15.0
LASTING_FROM = 1 << 20  # a lasting buffer this large or larger has a mapping of its own


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None
    return function


MMAP_THRESHOLD = 32 << 20  # buffers up to this size come from the heaps (glibc's DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 128 << 20  # free memory at a heap's top kept for reuse, up to this much


def tune_malloc() -> None:
    """At most 4 malloc arenas (glibc makes up to 8 per core): fewer heaps, less memory stranded in
    them; and large buffers reused from the heaps instead of mapped and faulted in afresh, unless
    the operator set glibc's thresholds (GLIBC_TUNABLES, MALLOC_*_THRESHOLD_: bench/README.md)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    mallopt(-8, 4)  # M_ARENA_MAX
    if not _thresholds_set_by_operator():
        mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (this also ends glibc's dynamic adjustment)
        mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def _thresholds_set_by_operator() -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    named = ("malloc.mmap_threshold", "malloc.trim_threshold")
    variables = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return any(name in tunables for name in named) or any(name in os.environ for name in variables)


def trim() -> None:
    """Free what only reference cycles still hold, and hand the heaps' free pages back to the OS."""
    gc.collect()
    release_heaps()


def release_heaps() -> None:
    """Hand the heaps' free pages back to the OS (no collection: for memory freed outside Python)."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


async def return_freed_memory(every_s: float = TRIM_EVERY_S) -> None:
    """Trim every few seconds, for as long as the task runs (an idle process rarely collects cycles,
    and glibc keeps freed pages). A trimmed page costs a page fault when it is used again: a few
    milliseconds per trim at a million entries."""
    while True:
        await asyncio.sleep(every_s)
        trim()


def lasting(shape: tuple[int, ...], dtype: DTypeLike = np.float64) -> Array:
    """An array (uninitialised) that lives as long as its owner, task after task: a client's task buffer, a
    worker's scratch and answer. From 1 MiB on it has an anonymous mapping of its own instead of a place in
    the heaps. A heap hands back free pages only where nothing live is above them, so a lasting buffer
    placed among a task's temporaries (gRPC's messages, a run's data being generated) kept their pages in
    the process after they were freed; out of the heaps, those are reused by the next temporaries or
    handed back by `trim`. (A private mapping, so a process forked later gets a copy, not a share.)"""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    if count * dtype.itemsize < LASTING_FROM:
        return np.empty(shape, dtype)
    mapping = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype=dtype, count=count).reshape(shape)  # (the array keeps the mapping)
