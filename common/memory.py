"""Process memory: few heaps, and freed pages handed back to the OS every few seconds (both sides use it).

glibc serves a buffer of megabytes from a fresh mmap until one of that size is
freed; from then on buffers of that size come from its heaps and are reused.
That reuse is what makes rounds at a million entries fast: a fresh mapping costs a
page fault per 4 KiB, which at 16 MB per vector cost more than the copies (a fixed
mmap threshold made the d = 1e6 round 2-4x slower; README, Benchmarks). The price
is that freed pages stay in the heaps, where a live neighbour may pin them after a
burst of large (hostile) messages; `return_freed_memory` hands them back.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Callable

TRIM_EVERY_S = 15.0


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None
    return function


def keep_heaps_few() -> None:
    """At most 4 malloc arenas (glibc makes up to 8 per core): fewer heaps, less memory stranded in them."""
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(-8, 4)  # M_ARENA_MAX


def trim() -> None:
    """Free what only reference cycles still hold, and hand the heaps' free pages back to the OS."""
    gc.collect()
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
