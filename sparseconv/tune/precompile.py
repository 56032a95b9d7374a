"""Compile kernels off the critical path: a sweep's candidates in parallel before they are
timed (:func:`precompile`), and a decided choice's kernels in the background while the layer runs
the reference (:class:`ChoiceCompiles`, in the workers of :mod:`sparseconv.backends.compiling`).

Triton kernels compile on their first launch and CUTLASS cubins on their first call, one after
the other as the sweep reaches each candidate: a cold pool of a dozen Triton tiles paid a dozen
compiles in a row. Each backend's optional ``precompile`` hook (see
:class:`sparseconv.backends.registry.Backend`) compiles what its first call would; here the
hooks of all the sweep's candidates run at once on a thread pool. Triton's compiler spends most
of its time in MLIR/LLVM passes and ptxas, and nvcc is a subprocess, so threads overlap them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence

import torch

from ..backends import compiling, registry, triton_launch
from ..backends.compiling import MapShape
from ..backends.problem import ConvProblem
from ..coords.kernel_map import KernelMap
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


class ChoiceCompiles:
    """The tuner's background compiles: per memo (a product's decided choice, or the candidates a
    sweep is about to time), the jobs compiling its candidates' kernels in :class:`Background`."""

    def __init__(self) -> None:
        self.background = compiling.background()
        self._waiting: dict[tuple, list] = {}  # memo -> its background compile jobs
        self._kernel_jobs: dict[tuple, list] = {}  # (candidate id, size-less problem) -> :meth:`_jobs`

    def queue(self, memo: tuple, namespace: str, problem: ConvProblem, candidates: Sequence[Candidate],
              kernel_map: KernelMap) -> bool:
        """Whether some of ``candidates``' kernels still compile (the first call queues them)."""
        shape = MapShape.of(kernel_map)
        sizeless = _sizeless(namespace, problem, shape)
        waiting = []
        # What running meanwhile costs, roughly (a gather through the table of every row and offset): the largest
        # layers' kernels compile first.
        priority = float(max(problem.num_in, problem.num_out) * problem.kernel_volume
                         * (problem.in_channels + problem.out_channels))
        for candidate in candidates:
            backend = registry.get(candidate.backend)
            if backend.precompile is None:
                continue
            params = dict(candidate.params_dict)
            args = (namespace, problem, params, shape)
            for at, (hook, hook_args, compiles) in enumerate(self._jobs(candidate, backend, args, sizeless)):
                job = (memo, candidate.id, at)
                if not self.background.ready(job, hook, hook_args, compiles, memo, priority):
                    waiting.append(job)
        if waiting:
            self._waiting[memo] = waiting
        else:
            self._waiting.pop(memo, None)
        return bool(waiting)

    def ahead(self, namespace: str, problem: ConvProblem, candidate: Candidate, kernel_map: KernelMap) -> tuple:
        """Queue ``candidate``'s kernels for ``problem`` ahead of every product's own (a bridge,
        :func:`.pools.bridge`: a few kernels serving every layer, which the products waiting on theirs look for with
        :meth:`all_compiled`); no product waits on them. Returns what they compile (:meth:`kernels`); nothing is
        queued, and () returned, for a backend without a ``precompile`` hook."""
        jobs = self._candidate_jobs(namespace, problem, candidate, kernel_map)
        for hook, hook_args, compiles in jobs:
            self.background.ahead(hook, hook_args, compiles)
        return tuple(compiles for _, _, compiles in jobs)

    def kernels(self, namespace: str, problem: ConvProblem, candidate: Candidate, kernel_map: KernelMap) -> tuple:
        """What the background jobs ``candidate`` needs for ``problem`` compile (as :meth:`Background.compiled` names
        them); () for a backend without a ``precompile`` hook. Queues nothing. A caller looking again and again (a
        waiting product, at every finished job) keeps these and asks :meth:`all_compiled`: 4 µs a candidate of 8
        kernels, where making them again each time (the map's shape, the size-less problem) took 12-27 µs (2-core CPU
        host, 2026-12-07)."""
        return tuple(compiles for _, _, compiles in self._candidate_jobs(namespace, problem, candidate, kernel_map))

    def all_compiled(self, kernels: tuple) -> bool:
        """Whether finished background jobs compiled all of ``kernels`` (:meth:`kernels`; False for none), for the
        product asking or for any other needing the same kernels (they are loaded here: :meth:`Background.compiled`)."""
        return bool(kernels) and all(self.background.compiled(compiles) for compiles in kernels)

    def _candidate_jobs(self, namespace: str, problem: ConvProblem, candidate: Candidate, kernel_map: KernelMap
                        ) -> list[tuple]:
        """:meth:`_jobs` of ``candidate`` for this product; [] for a backend without a ``precompile`` hook."""
        backend = registry.get(candidate.backend)
        if backend.precompile is None:
            return []
        shape = MapShape.of(kernel_map)
        args = (namespace, problem, dict(candidate.params_dict), shape)
        return self._jobs(candidate, backend, args, _sizeless(namespace, problem, shape))

    def _jobs(self, candidate: Candidate, backend: registry.Backend, args: tuple, sizeless: tuple) -> list[tuple]:
        """(hook, its arguments, what it compiles) of each background job ``candidate`` needs for ``args``: one a
        Triton kernel its ``precompile`` hook compiles (found by running the hook without compiling, once per
        size-less problem), so a kernel many layers, products and map views need compiles once, in one job, while
        the others compile beside it (a street MinkUNet's 306 keys made 180 jobs of whole hooks, 27 of them
        compiling new kernels: ~0.25 s of worker time each for the rest, reading kernels others had compiled), where
        the backend says its hook only warms Triton kernels (:attr:`~.registry.Backend.warms_kernels`); else the
        whole hook."""
        memo = (candidate.id, *sizeless)
        jobs = self._kernel_jobs.get(memo)
        if jobs is None:
            launches = triton_launch.recorded(backend.precompile, args) if backend.warms_kernels else None
            if launches is not None:
                jobs = [(triton_launch.warm_kernel, warm_args, ("view", key)) for warm_args, key in launches]
            else:
                compiles = memo if backend.compiles is None else backend.compiles(*args[:3])
                jobs = [(backend.precompile, args, compiles)]
            self._kernel_jobs[memo] = jobs
        return jobs

    def defer(self, memo: tuple, namespace: str, problem: ConvProblem, candidates: Sequence[Candidate],
              a: torch.Tensor, kernel_map: KernelMap, deterministic: bool) -> bool:
        """Whether this call runs the reference while the kernels of ``candidates`` (a decided choice, or
        those a sweep is about to time) compile in worker processes, queued by the first such call: on a
        GPU, unless deterministic (which kernel runs would depend on compile times), tracing or capturing a
        CUDA graph (the reference would be recorded), or switched off (:func:`compiling.in_background`)."""
        return compiling.in_background(a, deterministic) and self.queue(memo, namespace, problem, candidates,
                                                                       kernel_map)

    def pending(self, memo: tuple) -> bool:
        """Whether a compile that ``memo`` waits for is still queued or running."""
        jobs = self._waiting.get(memo)
        return jobs is not None and any(self.background.pending(job) for job in jobs)


def _sizeless(namespace: str, problem: ConvProblem, shape: MapShape) -> tuple:
    """What a product's kernels are compiled for, unless the backend says what its hook compiles: the problem but for
    its row counts (no kernel specialises on them), so layers differing only in size share one job."""
    return namespace, dataclasses.replace(problem, num_in=0, num_out=0), shape._replace(num_in=0, num_out=0)
