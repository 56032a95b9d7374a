"""Timing candidates: CUDA events on GPU (L2 flushed between runs), perf_counter on CPU.

Medians, not means: one preempted run on a shared CPU or a clock ramp on a GPU moves a mean
but not a median. Candidates whose medians are within ``CLOSE`` of the best are re-timed
interleaved (A B C A B C ...), so a drift in machine state hits all of them alike before a
winner is declared. Each sample also records the host time of issuing the calls: the tuner
ranks candidates by the longer of the two times (``tuner.cost``), and among those still within
``CLOSE`` of the best the one that costs the host least wins.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CLOSE = 0.05

clock: Callable[[], float] = time.perf_counter
"""Seconds of wall time, the CPU's timer (read through this name at each sample, so the tests of the
tuner's decisions can time fake backends on a virtual clock instead of real sleeps)."""


class TooSlow(Exception):
    """A call cost more than the limit it was measured under; args: (ms, limit_ms)."""


@dataclass(frozen=True)
class TimingPlan:
    """``repeats`` samples after ``warmup`` runs, but no more than ``budget_ms`` of timed runs
    per candidate (estimated from the warm-up) and never fewer than ``min_repeats``. A sample
    is the mean of ``calls`` back-to-back calls (one L2 flush before them): with more than one,
    a call's host work overlaps the previous call's kernels, as in a loop that never waits."""

    warmup: int
    repeats: int
    flush_l2: bool
    min_repeats: int = 3
    budget_ms: float = float("inf")
    calls: int = 1

    def __post_init__(self) -> None:
        if self.calls < 1:
            raise ValueError(f"calls must be >= 1, got {self.calls}")


def plan_for(device: torch.device) -> TimingPlan:
    if device.type == "cuda":
        return TimingPlan(warmup=3, repeats=20, flush_l2=True, min_repeats=10, budget_ms=200.0)
    # CPU runs are noisier (other processes, frequency scaling): more samples when they are
    # cheap, but a bounded budget so a 100 ms layer does not make tuning take seconds. 50 ms and
    # 3 samples at least (150 and 5 before): the demo's network tuned whole under effort full in
    # 65 s instead of 114, its step 0.300x naive torch's against 0.303x, and after 200 steps effort
    # quick ran at 1.18x of it against 1.23x (`scripts/bench_tuner.py --converge 200`, 2 cores, one
    # run each; runs of one setting spread by ~0.08).
    return TimingPlan(warmup=1, repeats=25, flush_l2=False, min_repeats=3, budget_ms=50.0)


class Timer:
    """Times zero-argument callables on one device; returns milliseconds per run."""

    def __init__(self, device: torch.device, plan: TimingPlan | None = None) -> None:
        self.device = device
        self.plan = plan or plan_for(device)
        self._flush_buffer: torch.Tensor | None = None

    def _flush(self) -> None:
        if not self.plan.flush_l2 or self.device.type != "cuda":
            return
        if self._flush_buffer is None:
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 64 << 20)
            self._flush_buffer = torch.empty(2 * max(l2, 1 << 20), dtype=torch.uint8, device=self.device)
        self._flush_buffer.zero_()

    def once(self, fn: Callable[[], object]) -> float:
        """Milliseconds per call of one sample (``plan.calls`` back-to-back calls)."""
        return self._sample(fn)[0]

    def _sample(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(ms per call, host ms per call to issue it) of one sample; on the CPU both are wall time."""
        self._flush()
        calls = self.plan.calls
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - begin
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls, 1e3 * host / calls
        begin = clock()
        for _ in range(calls):
            fn()
        wall = 1e3 * (clock() - begin) / calls
        return wall, wall

    def median(self, fn: Callable[[], object], warmup: int | None = None, repeats: int | None = None) -> tuple[float, int]:
        """(median ms, samples) after warm-up; the sample count follows the plan's budget."""
        return self.measure(fn, warmup, repeats)[:2]

    def measure(self, fn: Callable[[], object], warmup: int | None = None,
                repeats: int | None = None, limit_ms: float = float("inf")) -> tuple[float, int, float]:
        """(median ms, samples, median host ms a call) after warm-up; the sample count follows the
        plan's budget. Raises TooSlow when the first two calls each cost (the longer of device and
        host time) more than ``limit_ms``; two, so that one preempted call is not the verdict.
        These calls count as warm-up."""
        warm: list[float] = []
        if limit_ms != float("inf"):
            costs = []
            for _ in range(2):
                ms, host = self._sample(fn)
                warm.append(ms)
                costs.append(max(ms, host))
                if costs[-1] <= limit_ms:
                    break
            else:
                raise TooSlow(min(costs), limit_ms)
        warmup = self.plan.warmup if warmup is None else warmup
        warm += [self.once(fn) for _ in range(warmup - len(warm))]
        if repeats is None:
            repeats = self.plan.repeats
            if warm and self.plan.budget_ms != float("inf"):
                affordable = int(self.plan.budget_ms / max(min(warm), 1e-3))
                repeats = max(self.plan.min_repeats, min(repeats, affordable))
        samples = [self._sample(fn) for _ in range(repeats)]
        return (statistics.median(ms for ms, _ in samples), len(samples),
                statistics.median(host for _, host in samples))

    def interleaved(self, fns: Sequence[Callable[[], object]], rounds: int | None = None) -> list[tuple[float, int]]:
        """(median ms, samples) of each callable, timed round-robin."""
        rounds = rounds or self.plan.min_repeats * 2
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                samples[i].append(self.once(fn))
        return [(statistics.median(s), len(s)) for s in samples]
