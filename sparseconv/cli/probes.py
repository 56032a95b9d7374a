"""Probes the benchmarks put around a pass: torch ops by the line of sparseconv that issued them, host
syncs by line, Warp launches. Internal on purpose: what they count no public API reports."""

from __future__ import annotations

import collections
import os
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpSites", "count_syncs", "sync_sites", "warp_launches"]


def warp_launches(fn) -> int:
    """Warp kernel launches (hash-table inserts and queries) of one call of ``fn``."""
    # Internal on purpose: the column counts the hash table's launches, which no public API reports.
    from ..coords import warp_launch

    launch, count = warp_launch.launch, [0]

    def counting(*args):
        count[0] += 1
        return launch(*args)

    warp_launch.launch = counting
    try:
        fn()
    finally:
        warp_launch.launch = launch
    return count[0]


def count_syncs(fn, device: torch.device) -> int | str:
    if device.type != "cuda":
        return "-"
    return sum(sync_sites(fn).values())


class OpSites(TorchDispatchMode):
    """Counts the torch ops each line of sparseconv issues, with their host time (launch and any
    wait included): the profiler's Python stacks are not available on every torch build."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not ("/sparseconv/" in frame.f_code.co_filename
                                         and "site-packages" not in frame.f_code.co_filename):
            frame = frame.f_back
        where = "(outside sparseconv)" if frame is None else (
            f"{frame.f_code.co_filename.rsplit('/sparseconv/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        entry = self.counts[f"{where}  {func.__name__}"]
        entry[0] += 1
        entry[1] += 1e3 * (time.perf_counter() - start)
        return out


def sync_sites(fn) -> collections.Counter:
    """Where ``fn``'s host syncs happen: file:line of the Python frame that caused each one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
