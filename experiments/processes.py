"""An experiment's independent runs, in order, in this process or spread over processes of their own."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def each(
    function: Callable[..., T], work: Sequence[tuple[Any, ...]], jobs: int, progress: Callable[[int], None]
) -> list[T]:
    """function(*args) for every args of `work`, the results in work's order: in this process when `jobs` is 1,
    else over `jobs` worker processes (spawned: fresh interpreters, not forks of one whose torch may already
    hold threads; `function` and its arguments must pickle). progress(n) once n of them are done."""
    if jobs == 1:
        found = []
        for args in work:
            found.append(function(*args))
            progress(len(found))
        return found
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(function, *args) for args in work]
        for done, _ in enumerate(concurrent.futures.as_completed(futures), start=1):
            progress(done)
        return [f.result() for f in futures]
