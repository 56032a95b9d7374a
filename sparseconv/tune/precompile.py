"""Compile kernels off the critical path: a sweep's candidates in parallel before they are
timed (:func:`precompile`), and a decided choice's kernels in the background while the layer runs
the reference (:class:`Background`).

Triton kernels compile on their first launch and CUTLASS cubins on their first call, one after
the other as the sweep reaches each candidate: a cold pool of a dozen Triton tiles paid a dozen
compiles in a row. Each backend's optional ``precompile`` hook (see
:class:`sparseconv.ops.backends.registry.Backend`) compiles what its first call would; here the
hooks of all the sweep's candidates run at once on a thread pool. Triton's compiler spends most
of its time in MLIR/LLVM passes and ptxas, and nvcc is a subprocess, so threads overlap them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable, Hashable, Sequence

from ..coords.kernel_map import KernelMap
from ..ops.backends import registry
from ..ops.problem import ConvProblem
from . import faults
from .configs import Candidate

logger = logging.getLogger("sparseconv.tune")

MAX_THREADS = 16


def precompile(
    namespace: str, problem: ConvProblem, candidates: Sequence[Candidate], kernel_map: KernelMap
) -> dict[str, dict]:
    """Run every candidate's ``precompile`` hook concurrently; returns {candidate id: timing record
    with verdict "failed"} for those whose hook raised (each logged in one line), {} if none did."""
    jobs = [(c, registry.get(c.backend)) for c in candidates]
    jobs = [(c, backend) for c, backend in jobs if backend.precompile is not None]
    if not jobs:
        return {}
    # Not bounded by the core count: nvcc and ptxas are subprocesses a thread only waits on.
    workers = min(len(jobs), MAX_THREADS)
    failed: dict[str, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sparseconv-compile") as pool:
        futures = [(c, backend, pool.submit(backend.precompile, namespace, problem, c.params_dict, kernel_map))
                   for c, backend in jobs]
        for candidate, backend, future in futures:
            error = future.exception()
            if error is None:
                continue
            # Compiler errors carry pages of IR or a reproducer: its first line says enough.
            reason = f"{type(error).__name__} while compiling: {faults.message_line(error)}"[:300]
            logger.info("sparseconv: %s disqualified for %s: %s", candidate.id, namespace, reason)
            failed[candidate.id] = {"backend": candidate.backend, "params": list(map(list, candidate.params)),
                                    "version": backend.version, "ms": None, "samples": 0, "verdict": "failed",
                                    "reason": reason}
    return failed


BACKGROUND_THREADS = 4


class Background:
    """Compiles the kernels of decided choices on a few daemon threads while the caller runs the
    reference, so a cold process starts at once instead of compiling layer after layer.

    Only for choices known to compile (a passing timing on this device, in the cache or the
    shipped tunings): a compiler's output is not captured here (the capture is process-wide and
    would hide the user's own output), and a compile that fails anyway is repeated in the
    foreground by the choice's first call, where it falls back as any failing choice does.
    Daemon threads: a process that ends with compiles queued does not wait for them.
    """

    def __init__(self, threads: int = BACKGROUND_THREADS) -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue | None = None
        self._jobs: dict[Hashable, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def ready(self, key: Hashable, compile: Callable[[], None]) -> bool:
        """Whether ``key``'s compile has finished: the first call queues ``compile`` and says False;
        later calls say False until it is done, then True once (and forget the job)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = concurrent.futures.Future()
                self._start().put((job, compile))
                return False
            if not job.done():
                return False
            del self._jobs[key]
        error = job.exception()
        if error is not None:
            logger.debug("sparseconv: background compile for %s failed (the first call compiles again): %s",
                         key, faults.message_line(error))
        return True

    def pending(self, key: Hashable) -> bool:
        """Whether ``key``'s compile is queued or running (no job is started)."""
        job = self._jobs.get(key)
        return job is not None and not job.done()

    def _start(self) -> queue.SimpleQueue:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            for i in range(max(1, min(self._threads, (os.cpu_count() or 2) // 2))):
                threading.Thread(target=self._work, name=f"sparseconv-background-compile-{i}", daemon=True).start()
        return self._queue

    def _work(self) -> None:
        while True:
            job, compile = self._queue.get()
            if not job.set_running_or_notify_cancel():
                continue
            try:
                compile()
            except BaseException as error:  # noqa: BLE001 - reported to the caller through the job
                job.set_exception(error)
            else:
                job.set_result(None)
