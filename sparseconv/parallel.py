"""CPU work split over threads where a kernel runs single-threaded: Warp's CPU kernels (the hash-table queries)
run on their caller's thread alone and let go of the GIL while they run (ctypes), so ranges of rows on several
threads run at once. (torch's CPU ``index_add_`` split the same way measured no faster on 2 cores.)

Nothing here starts a thread at import: the pool starts at the first parallel call.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable

import torch


def ranges(rows: int, work_per_row: int, min_work: int) -> list[int]:
    """Bounds of ``rows`` split for :func:`in_parallel`: one range per torch thread (``torch.get_num_threads()``,
    what the user allows), each at least ``min_work`` units of work (a thread's hand-off costs tens of µs),
    never an empty one; ``[0, rows]`` where one range is all it is worth."""
    parts = max(1, min(torch.get_num_threads(), rows, rows * work_per_row // max(1, min_work)))
    return [rows * i // parts for i in range(parts + 1)]


def in_parallel(work: Callable[..., None], arguments: list[tuple]) -> None:
    """``work(*a)`` for every ``a`` in ``arguments``: the first on this thread, the others at once on the pool's
    threads; returns when all are done (none may still write afterwards), raising the first error. One set
    of arguments: a plain call."""
    if len(arguments) == 1:
        work(*arguments[0])
        return
    futures = [_pool().submit(work, *a) for a in arguments[1:]]
    try:
        work(*arguments[0])
    finally:
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                                 thread_name_prefix="sparseconv-cpu")
