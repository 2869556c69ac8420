"""Process memory: large buffers go back to the OS when freed (both sides use it)."""

from __future__ import annotations

import ctypes


def keep_memory_returnable() -> None:
    """Ask glibc to give large buffers back to the OS when they are freed.

    By default glibc raises its mmap threshold after freeing a large block, so
    later messages of megabytes land in its heaps, where any live neighbour pins
    the pages: after a burst of large (hostile) messages the process would stay
    at its peak. A fixed threshold keeps them in mmap, freed at once; fewer
    arenas fragment less. Elsewhere than glibc this does nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD: fixed, not adjusted upwards
        libc.mallopt(-8, 4)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass
