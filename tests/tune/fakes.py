"""Fake backends injected through the registry to prove the tuner's guard, failure path and filters."""

from __future__ import annotations

import contextlib
import time

import torch

from sparseconv.backends import Backend, explicit, register, unregister
from sparseconv.backends.problem import NAMESPACES

ALL = frozenset(NAMESPACES)


class Calls:
    """Counts calls per (backend, namespace)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, name: str, namespace: str) -> None:
        self.counts[(name, namespace)] = self.counts.get((name, namespace), 0) + 1

    def of(self, name: str, namespace: str | None = None) -> int:
        return sum(v for (n, ns), v in self.counts.items() if n == name and (namespace is None or ns == namespace))


class VirtualClock:
    """A clock (seconds) that moves only when told: in place of :data:`sparseconv.tune.timing.clock`, the
    timings of fakes that advance it are exact, whatever else the machine runs meanwhile."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def slow(calls: Calls, name: str = "fake_slow", delay_s: float = 0.01, **fields) -> Backend:
    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(name, namespace)
        time.sleep(delay_s)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    return Backend(name, fields.pop("ops", ALL), run, **fields)


def fast(calls: Calls, name: str = "fake_fast", **fields) -> Backend:
    """Right and nearly free: replays the explicit result computed on its first call per input."""
    memo: dict[tuple, torch.Tensor] = {}

    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(name, namespace)
        key = (namespace, a.data_ptr(), b.data_ptr(), id(kernel_map))
        if key not in memo:
            memo[key] = explicit.run(namespace, problem, params, a, b, kernel_map)
        return memo[key].clone()

    return Backend(name, fields.pop("ops", ALL), run, **fields)


def wrong(calls: Calls, name: str = "fake_wrong", how: str = "noise", **fields) -> Backend:
    """Instant and wrong: noisy, NaN, or raising."""

    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(name, namespace)
        if how == "raise":
            raise RuntimeError("fake compile error")
        out = explicit.run(namespace, problem, params, a, b, kernel_map)
        if how == "nan":
            return out.index_fill(0, torch.tensor([0], device=out.device), float("nan"))
        return out + 0.1 * out.abs().mean() * torch.randn_like(out)

    return Backend(name, fields.pop("ops", ALL), run, **fields)


@contextlib.contextmanager
def registered(*backends: Backend):
    for backend in backends:
        register(backend)
    try:
        yield
    finally:
        for backend in backends:
            unregister(backend.name)
