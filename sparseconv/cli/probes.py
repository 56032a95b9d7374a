"""Probes the benchmarks put around a pass: torch ops by the line of sparseconv that issued them, host
syncs by line, Warp launches, a cold pass's seconds by phase. Internal on purpose: what they count no
public API reports."""

from __future__ import annotations

import collections
import functools
import gc
import os
import sys
import threading
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PHASES", "OpSites", "count_syncs", "gpu_busy", "phase_seconds", "probed_round", "sync_sites",
           "thread_seconds", "warp_launches"]


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


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def covered(intervals) -> float:
    """The length of the union of ``intervals`` ((start, end) pairs, in any order, overlapping or not)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def gpu_busy(fn, passes: int = 3) -> dict[str, object]:
    """What ``passes`` calls of ``fn`` on a CUDA device leave the GPU doing (torch.profiler), per pass: "span" (ms
    from the first host event to the last), "busy" (ms during which some kernel ran: the union of their
    intervals), "kernels", "launches" (launch calls on the host), "sync ms" (host time inside the CUDA calls that
    can wait for the device: synchronisations and copies). A pass whose busy time is far under its span is bound
    by the host, not by its kernels; its sync ms say whether the host waited or worked.

    Where the GPU time goes and where it idles: "by kernel" maps each kernel name to (launches, ms) a pass;
    "idle" to the GPU's idle ms a pass between kernels in gaps under 20 µs (launch spacing), 20-200 µs and over
    200 µs (host work before the next launch, or a wait); "gaps" lists the longest gaps over the passes, each as
    (ms, the kernel before it, the kernel after it)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        torch.cuda.synchronize()
        for _ in range(passes):
            fn()
        torch.cuda.synchronize()
    events = profile.events()
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    device = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    busy = covered([(start, end) for start, end, _ in device])
    span = max(e.time_range.end for e in host) - min(e.time_range.start for e in host) if host else 0.0
    waits = sum(e.time_range.end - e.time_range.start for e in host if e.name in SYNC_CALLS)
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in device:
        by_kernel[name][0] += 1
        by_kernel[name][1] += end - start
    idle, gaps, reach, before = collections.Counter(), [], float("-inf"), None
    for start, end, name in device:
        if before is not None and start > reach:
            gap = start - reach
            idle["under 20 us" if gap < 20 else "20-200 us" if gap < 200 else "over 200 us"] += gap
            gaps.append((gap / 1e3, before, name))
        if end > reach:
            reach, before = end, name
    return {"span": span / 1e3 / passes, "busy": busy / 1e3 / passes, "kernels": len(device) / passes,
            "launches": sum(e.name in LAUNCH_CALLS for e in host) / passes, "sync ms": waits / 1e3 / passes,
            "by kernel": {name: (count / passes, us / 1e3 / passes) for name, (count, us) in by_kernel.items()},
            "idle": {band: us / 1e3 / passes for band, us in idle.items()},
            "gaps": sorted(gaps, reverse=True)[:12]}


PHASES = (
    ("imports (first use)", "builtins", "__import__"),
    ("CUDA start (torch)", "torch.cuda", "_lazy_init"),
    ("Warp start and kernel definitions", "sparseconv.coords.warp_kernels", "define"),
    ("Warp module loads", "warp._src.context", "Module.load"),
    ("  of which builds", "warp._src.context", "Module._compile"),
    ("hash tables of new tensors", "sparseconv.coords.hashing", "CoordHashTable.build_checked"),
    ("Triton compiles", "triton.compiler", "compile"),
    ("Triton launches", "sparseconv.backends.triton_launch", "_launch"),
    ("  Triton's JIT: its key, its caches, its compiles", "triton.runtime.jit", "JITFunction._do_compile"),
    ("  Triton's kernel loads", "triton.compiler.compiler", "CompiledKernel._init_handles"),
    ("CUDA C++ compiles", "sparseconv.backends.cuda_jit", "_compile"),
    ("compile workers started", "sparseconv.backends.compiling", "_spawn_worker"),
    ("tuning sweeps", "sparseconv.tune.sweep", "sweep"),
    ("reference products (explicit_gemm)", "sparseconv.backends.explicit", ("forward", "dgrad", "wgrad")),
    ("torch matmuls (mm, addmm, bmm)", "torch", ("mm", "addmm", "bmm")),
    ("tuner decisions (keys met first)", "sparseconv.tune.decide", "Decider.decide"),
    ("  candidate pools", "sparseconv.tune.decide", "candidate_pool"),
    ("  the cost model's predictions", "sparseconv.tune.prior", "predicted"),
    ("  a key's records read", "sparseconv.tune.evidence", "Evidence.read"),
    ("  a sweep's kernels compiled in the call", "sparseconv.tune.sweep", "precompile"),
    ("background compiles queued", "sparseconv.backends.compiling", "Background.ready"),
    ("kernel maps (batch's first request)", "sparseconv.coords.cache", "CoordinateCache._first_request"),
    ("waits for the GPU (synchronize)", "torch.cuda", "synchronize"),
    ("cost model fits", "sparseconv.tune.prior", "CostModel.fit"),
    ("shipped tunings read", "sparseconv.tune.shipped", "_load"),
    ("tuning cache read", "sparseconv.tune.cache", "read_entries"),
)
"""A cold pass's phases: (label, module, function or functions), the seconds of a phase being the calling
thread's time inside those functions (outermost calls; a module imported during the pass is timed from
then on). Phases nest (a sweep compiles the candidates it times; a Warp load builds a module when its
cache has none): a row is not a share of a sum; "in none of these" is the rest. Work in other threads
and processes (background compile workers, the cache writer) is not seen: what is listed is what the
caller waited for. Timing wrappers, not cProfile: Python 3.12's cProfile sees every thread's calls
(sys.monitoring) and mixed their stacks into nonsense cumulative times on a cold GPU pass."""


def phase_seconds(fn) -> tuple[float, dict[str, float]]:
    """(wall seconds of one call of ``fn``, seconds per :data:`PHASES` label within it, plus "in none of these")."""
    import builtins
    import importlib

    caller, seconds = threading.get_ident(), dict.fromkeys([label for label, _, _ in PHASES], 0.0)
    depth, covered, patched = collections.Counter(), [0, 0.0], []

    def timing(label, original):
        @functools.wraps(original)
        def timed(*args, **kwargs):
            if threading.get_ident() != caller or depth[label]:
                return original(*args, **kwargs)
            depth[label] += 1
            covered[0] += 1
            start = time.perf_counter()
            if covered[0] == 1:
                covered.append(start)
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                seconds[label] += end - start
                depth[label] -= 1
                covered[0] -= 1
                if covered[0] == 0:
                    covered[1] += end - covered.pop()
                if label == PHASES[0][0]:
                    install()
        return timed

    def install():
        for label, module_name, names in PHASES:
            module = sys.modules.get(module_name) if module_name != "builtins" else builtins
            for name in (names,) if isinstance(names, str) else names:
                owner_name, _, attribute = name.rpartition(".")
                owner = getattr(module, owner_name, None) if owner_name else module
                if owner is None or (owner, attribute) in {(o, a) for o, a, _ in patched}:
                    continue
                raw = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
                if raw is None:
                    continue
                wrapped = (classmethod(timing(label, raw.__func__)) if isinstance(raw, classmethod)
                           else timing(label, raw))
                patched.append((owner, attribute, raw))
                setattr(owner, attribute, wrapped)

    importlib.invalidate_caches()
    install()
    start = time.perf_counter()
    try:
        fn()
    finally:
        wall = time.perf_counter() - start
        for owner, attribute, raw in reversed(patched):
            setattr(owner, attribute, raw)
    seconds["in none of these"] = wall - covered[1]
    return wall, seconds


def thread_seconds() -> dict[str, float]:
    """CPU seconds each thread of this process has run so far, by name ("name#tid"): Python threads by their
    ``threading`` name, native ones (autograd's backward threads, CUDA's, Warp's) by the kernel's (Linux's
    /proc/self/task/*/schedstat, nanoseconds); elsewhere the Python threads alone (their CPU clocks)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = None
    if tasks is None:
        for thread in threading.enumerate():
            try:
                seconds[f"{thread.name}#{thread.native_id}"] = time.clock_gettime(
                    time.pthread_getcpuclockid(thread.ident))
            except (AttributeError, OSError):  # no per-thread clocks here: none counted
                pass
        return seconds
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as file:
                ran_ns = int(file.read().split()[0])
            with open(f"/proc/self/task/{task}/comm") as file:
                comm = file.read().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        seconds[f"{names.get(int(task), comm)}#{task}"] = ran_ns / 1e9
    return seconds


def probed_round(fn) -> dict:
    """One call of ``fn`` with what a settling pass may spend beside its own work: "wall" and "caller" (the
    calling thread's CPU) seconds, "phases" (:func:`phase_seconds` of the caller), "threads" (CPU seconds of
    each other thread of this process in the call, those that ran), "gc" (seconds the collector paused the
    process and its collections by generation)."""
    pauses, started = collections.Counter(), []

    def collector(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses["seconds"] += time.perf_counter() - started.pop()
            pauses[f"gen{info['generation']}"] += 1

    caller = f"{threading.current_thread().name}#{threading.get_native_id()}"
    before = thread_seconds()
    gc.callbacks.append(collector)
    try:
        wall, phases = phase_seconds(fn)
    finally:
        gc.callbacks.remove(collector)
    after = thread_seconds()
    ran = {name: after[name] - before.get(name, 0.0) for name in after}
    return {"wall": wall, "caller": ran.pop(caller, 0.0), "phases": phases, "gc": dict(pauses),
            "threads": {name: seconds for name, seconds in ran.items() if seconds > 0}}
