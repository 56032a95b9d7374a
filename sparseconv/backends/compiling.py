"""Kernels compiled off the critical path, in worker processes, while the caller runs something
already compiled (:class:`Background`), and the gate that says where that applies (:func:`in_background`).

The tuner queues a decided choice's kernels here (the reference runs meanwhile), and
:func:`sparseconv.backends.triton_launch.launch_ready` a map view's kernel (torch's ops build the view
meanwhile): one process-wide pool of workers (:func:`background`) serves both.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import math
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch

from .. import config
from ..coords.kernel_map import KernelMap

logger = logging.getLogger("sparseconv.backends")


class MapShape(NamedTuple):
    """What a ``precompile`` hook may read of a kernel map (Triton specialises on none of its data):
    the stand-in a background compile receives, since the map's tensors stay in this process."""

    num_in: int
    num_out: int
    kernel_size: tuple[int, int, int]
    kernel_volume: int
    identity_offset: int | None
    each_input_once: bool
    each_output_once: bool

    @classmethod
    def of(cls, kernel_map: KernelMap) -> MapShape:
        return cls(kernel_map.num_in, kernel_map.num_out, kernel_map.kernel_size, kernel_map.kernel_volume,
                   kernel_map.identity_offset, kernel_map.each_input_once, kernel_map.each_output_once)


class Background:
    """Compiles the kernels of decided choices in worker processes while the caller runs the
    reference, so a cold process starts at once instead of compiling layer after layer.

    Processes, not threads: Triton's front end holds the GIL, so compile threads and the layers
    running meanwhile slowed each other (a thread version left a street MinkUNet's compiles
    unfinished after 25 s of training on an H100). A worker runs a backend's ``precompile`` hook
    on a :class:`MapShape`; the compiled kernels land in the compiler's disk cache (Triton's,
    nvcc's cubin directory), where this process's first launch finds them. The workers are
    ``python -m sparseconv.backends.compile_worker`` (not multiprocessing, which would run the user's
    script again in each worker); their output goes nowhere, and they end with this process.

    A job that fails (a candidate that does not compile, a hook that needs more than the shape, a
    worker that cannot start) only means that the first call here compiles it, where a failure is
    handled as without this class (a timed candidate is disqualified in one log line).
    """

    def __init__(self, workers: int | None = None) -> None:
        self._workers = workers or config.compile_workers() or max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))
        self._queue: queue.Queue | None = None
        self._jobs: dict[Hashable, concurrent.futures.Future] = {}  # by the caller's key
        self._compiled: set[Hashable] = set()  # what finished jobs compiled, as compiled() found
        self._compiling: dict[Hashable, concurrent.futures.Future] = {}  # by what it compiles
        self._callers: dict[Hashable, Hashable] = {}  # key -> who waits on it
        self._order = itertools.count()  # queueing order, among jobs of equal priority
        self._lock = threading.Lock()
        self._early = False  # the workers were started ahead of the first job (prestart)
        self.finished = 0
        """Jobs finished so far (compiled and loaded, or failed): what was compiled can change only when it does."""

    def ready(self, key: Hashable, hook: Callable, args: tuple, compiles: Hashable, caller: Hashable = None,
              priority: float = math.inf) -> bool:
        """Whether ``key``'s compile (``hook(*args)`` in a worker) has finished: the first call queues
        it and says False; later calls say False until it is done, then True once (and forget it).
        ``compiles`` names what the hook compiles: keys naming the same share one job (many layers
        of a network run the same kernels on maps of other sizes). ``caller`` (default: ``key``) names
        who waits: :meth:`queued` counts callers (a product waiting on several kernels is one). Jobs start
        highest ``priority`` first (what waiting on them costs; a job's is the highest any caller gave it), in
        queueing order among equals."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._queued(hook, args, compiles, priority, key)
                if job is None:
                    return True
                self._jobs[key] = job
                self._callers[key] = key if caller is None else caller
                if not job.done():
                    return False
            elif not job.done():
                return False
            del self._jobs[key]
            del self._callers[key]
        error = job.exception()
        if error is not None:
            logger.debug("sparseconv: background compile of %s failed (its first call compiles): %s", key,
                         (str(error).strip().splitlines() or [""])[0][:300])
        return True

    def ahead(self, hook: Callable, args: tuple, compiles: Hashable) -> None:
        """Queue ``hook(*args)`` ahead of every caller's job (as :meth:`ready` names what it compiles), for no caller:
        kernels that products will look for with :meth:`compiled` while their own compile (a bridge,
        :meth:`sparseconv.tune.precompile.ChoiceCompiles.ahead`). Nothing where such a job is queued already at that
        priority, running or done."""
        with self._lock:
            self._queued(hook, args, compiles, math.inf, compiles)

    def _queued(self, hook: Callable, args: tuple, compiles: Hashable, priority: float, key: Hashable
                ) -> _Job | None:
        """The job compiling ``compiles``, queued at ``priority`` at least (made on the first request); None where
        ``hook`` cannot go to a worker (a local function: its call compiles it). Under the lock."""
        job = self._compiling.get(compiles)
        if job is None:
            try:
                payload = pickle.dumps((hook, args))
            except Exception as error:  # noqa: BLE001 - a local hook: compiled in the call instead
                logger.debug("sparseconv: %s cannot compile in the background: %s", key, error)
                return None
            job = self._compiling[compiles] = _Job(payload)
        if priority > job.priority and not (job.running() or job.done()):
            # (queued again, ahead: the entry left behind is skipped when it comes up)
            job.priority = priority
            self._start().put((-priority, next(self._order), job, time.perf_counter()))
        return job

    def compiled(self, compiles: Hashable) -> bool:
        """Whether a job compiling ``compiles`` (as :meth:`ready` names it) finished without error: its kernels are
        loaded in this process (starts nothing). Once True, a set lookup (waiting products ask at every finished
        job, for each kernel of each candidate they might run)."""
        if compiles in self._compiled:
            return True
        job = self._compiling.get(compiles)
        if job is None or not job.done() or job.exception() is not None:
            return False
        self._compiled.add(compiles)
        return True

    def pending(self, key: Hashable) -> bool:
        """Whether ``key``'s compile is queued or running (starts nothing)."""
        job = self._jobs.get(key)
        return job is not None and not job.done()

    def queued(self) -> int:
        """How many callers had a compile queued and have not taken their choice since (finished or not)."""
        with self._lock:
            return len({self._callers[key] for key in self._jobs})

    def compiling(self) -> int:
        """How many callers wait on a compile that has not finished: :meth:`queued` less those whose compile ended
        but which have not called since (on unseen point clouds, keys whose cloud did not come again)."""
        with self._lock:
            return len({self._callers[key] for key, job in self._jobs.items() if not job.done()})

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued compile has finished; False if ``timeout`` seconds passed first."""
        jobs = list(self._jobs.values())
        done, not_done = concurrent.futures.wait(jobs, timeout=timeout)
        return not not_done

    def prestart(self) -> None:
        """Start the workers now, ahead of the first job, unless started already: a worker's start-up (Python,
        torch, Triton and this library imported, ~4.5 s on an H200 host) then runs beside what comes before the
        first compile is queued instead of delaying it. A prestarted worker waits :data:`EARLY_IDLE_S` for its
        first job before it goes."""
        with self._lock:
            if self._queue is None:
                self._early = True
                self._start()

    def _start(self) -> queue.PriorityQueue:
        if self._queue is None:
            self._queue = queue.PriorityQueue()
            for i in range(self._workers):
                threading.Thread(target=self._feed, name=f"sparseconv-background-compile-{i}", daemon=True).start()
        return self._queue

    def _feed(self) -> None:
        """One worker process, fed one job at a time (a daemon thread that only waits on pipes).
        A worker idle for IDLE_S goes (its compiler's CUDA context holds ~0.5 GB of the GPU); the
        next job starts another."""
        worker, idle_s = None, None
        if self._early:
            try:
                worker, idle_s = _spawn_worker(), EARLY_IDLE_S
            except Exception as error:  # noqa: BLE001 - the first job starts one, and says why if it cannot
                logger.debug("sparseconv: a compile worker did not start ahead of its first job: %s", error)
        while True:
            try:
                _, _, job, queued = self._queue.get(timeout=idle_s)
            except queue.Empty:
                worker.stdin.close()
                worker.wait()
                worker, idle_s = None, None
                continue
            idle_s = IDLE_S
            with self._lock:
                if job.running() or job.done() or not job.set_running_or_notify_cancel():
                    continue  # an entry a higher priority queued again, or cancelled
            payload = job.payload
            try:
                if worker is None or worker.poll() is not None:
                    worker = _spawn_worker()
                worker.stdin.write(struct.pack("<Q", len(payload)) + payload)
                worker.stdin.flush()
                size = worker.stdout.read(8)
                if len(size) < 8:
                    raise RuntimeError(f"the compile worker ended (exit code {worker.wait()})")
                error, seconds = pickle.loads(worker.stdout.read(struct.unpack("<Q", size)[0]))
            except Exception as failure:  # noqa: BLE001 - reported through the job
                job.set_exception(failure)
                self._finish()
                worker = None
                continue
            waited = time.perf_counter() - queued - seconds
            if error is None:
                loading = time.perf_counter()
                _load_here(payload)
                logger.debug("sparseconv: background compile done after %.1f s in the queue, %.1f s compiling, "
                             "%.2f s loading here", waited, seconds, time.perf_counter() - loading)
                job.set_result(None)
            else:
                job.set_exception(RuntimeError(error))
            self._finish()

    def _finish(self) -> None:
        with self._lock:  # several feeding threads: no increment lost
            self.finished += 1


class _Job(concurrent.futures.Future):
    """A background compile: its pickled ``(hook, args)`` and the highest priority it was queued at."""

    def __init__(self, payload: bytes) -> None:
        super().__init__()
        self.payload = payload
        self.priority = -math.inf


_LOADING = threading.local()


def loading() -> bool:
    """Whether this thread loads what a worker compiled (:func:`_load_here`): a kernel warmed here is loaded into
    this process's CUDA context too (:func:`.triton_launch.warm`)."""
    return getattr(_LOADING, "on", False)


def _load_here(payload: bytes) -> None:
    """Run a finished job's hook in this process (in the thread that fed the worker), where the compilers' disk
    caches now hold its kernels: they are read and loaded here before the job counts as done, not at their first
    launch in a call (about 25 kernels of a cold MinkUNet, 0.7 s of one pass soon after the first, H200,
    2026-11-29), and the layer's next call launches them at once."""
    _LOADING.on = True
    try:
        hook, args = pickle.loads(payload)
        hook(*args)
    except Exception as error:  # noqa: BLE001 - an optimisation only: the first launch loads them, as before
        logger.debug("sparseconv: loading a background compile's kernels failed (their first launch loads them): %s",
                     (str(error).strip().splitlines() or [""])[0][:300])
    finally:
        _LOADING.on = False


MAX_WORKERS = 4
"""Each worker's compiler loads its kernels, which holds a CUDA context (~0.5 GB on an H100)
while it lives: 4 workers at most, gone IDLE_S after the last job."""
IDLE_S = 5.0
EARLY_IDLE_S = 60.0
"""How long a worker started ahead of its first job (:meth:`Background.prestart`) waits for it."""


def _spawn_worker() -> subprocess.Popen:
    """A compile worker with this process's environment and import path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-m", "sparseconv.backends.compile_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


@functools.cache
def background() -> Background:
    """The process's compile workers (none start until a first job is queued)."""
    return Background()


def prestart(device: torch.device) -> None:
    """Start the compile workers where background compiles apply to work on ``device`` (a CUDA device, switched
    on, not deterministic): called at a batch's first map request, so that their start-up runs beside a cold
    process's first map builds (Warp's module loads and hash tables: ~4 s of its first MinkUNet inference on an
    H200) instead of after them, when the first layer queues its kernels (its first compile finished 6 s after the
    first inference where the workers started then). Nothing once started, or on a CPU."""
    global _prestarted
    if _prestarted or not applies(device, config.deterministic()):
        return
    _prestarted = True
    background().prestart()


_prestarted = False


def applies(device: torch.device, deterministic: bool) -> bool:
    """Whether kernels for work on ``device`` compile in the background at all: a CUDA device, unless deterministic
    or switched off (:func:`in_background` says it of a call's tensor)."""
    return device.type == "cuda" and _switched_on(deterministic)


def _switched_on(deterministic: bool) -> bool:
    return not deterministic and config.background_compile()


def on_gpu_eagerly(a: torch.Tensor) -> bool:
    """Whether ``a`` is a real CUDA tensor outside any trace or CUDA-graph capture."""
    return (a.is_cuda and not torch.compiler.is_compiling() and not isinstance(a, torch._subclasses.FakeTensor)
            and not torch.cuda.is_current_stream_capturing())


def in_background(a: torch.Tensor, deterministic: bool) -> bool:
    """Whether kernels for work on ``a`` compile in worker processes while something compiled runs: on a GPU,
    unless deterministic (which kernel runs would depend on compile times), tracing or capturing a CUDA graph
    (what runs meanwhile would be recorded), or switched off (``SPARSECONV_BACKGROUND_COMPILE=0``)."""
    return on_gpu_eagerly(a) and _switched_on(deterministic)


def kernel_ready(tensor: torch.Tensor, key: Hashable, hook: Callable, args: tuple) -> bool:
    """Whether a view kernel (``key``) may launch on ``tensor`` now: where kernels compile in the background
    (:func:`in_background`), one not compiled yet compiles in the workers (``hook(*args)``, queued by the first
    call) while torch's ops build the view (a cold process's first batch); elsewhere it compiles in the call."""
    if not in_background(tensor, config.deterministic()):
        return True
    return background().ready(("view", key), hook, args, ("view", key))
