"""Compile a sweep's kernels in parallel before it is timed.

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
from collections.abc import Sequence

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
