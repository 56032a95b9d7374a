"""The tuner: for each product of each conv call, which backend and parameters run.

Single-name modes run that backend untouched. Otherwise the tuner looks up the problem's key in
the cache file, times only the pool's candidates that have no current timing there (under effort
quick, only those the cost model of prior.py ranks first), compiled in parallel first, guards each
against ``explicit_gemm`` on the same inputs, re-times close finishers interleaved, agrees with
the other ranks, remembers the choice for the process and stores every timing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from .. import config
from ..coords.kernel_map import KernelMap
from ..ops.backends import registry
from ..ops.problem import ConvProblem
from ..precision import accumulator_dtype
from . import prior
from .cache import TuneCache
from .configs import Candidate
from .distributed import agree
from .key import TuneKey, make_key
from .pools import FALLBACK, AlgoMode, candidate_pool, resolve_mode
from .precompile import precompile
from .timing import CLOSE, Timer

logger = logging.getLogger("sparseconv.tune")

# Relative Frobenius error a candidate may differ from explicit_gemm by. fp32 on CUDA allows
# tf32 products (~3e-4 typical); half types allow one rounding of the output plus a different
# fp32 summation order.
GUARD_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
GUARD_TOLERANCE_CUDA_FP32 = 2e-3
ROUNDING_SLACK = 4
"""A candidate may also be off by this many times the error of rounding the reference to the
output dtype (a kernel that sums in several rounded parts rounds more than once)."""


def guard_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda":
        return GUARD_TOLERANCE_CUDA_FP32
    return GUARD_TOLERANCE.get(dtype, 1e-5)


def check_output(out: object, reference: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """None if ``out`` (of ``dtype``, default the reference's) passes the numeric guard against
    ``reference`` (which may be in a wider dtype), else why it fails."""
    dtype = dtype or reference.dtype
    if not isinstance(out, torch.Tensor) or out.shape != reference.shape or out.dtype != dtype:
        return f"returned {getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}, expected {tuple(reference.shape)} {dtype}"
    if not bool(torch.isfinite(out).all()):
        return "non-finite values"
    wide = reference.double()
    scale = max(float(wide.norm()), 1e-30)
    error = float((out.double() - wide).norm()) / scale
    # What rounding the exact result to ``dtype`` alone costs. It is ~3e-4 of the norm for normal
    # half values, but an fp16 network's gradients without loss scaling are subnormal (~1e-6,
    # a few mantissa bits), where every correct kernel is off by ~10% and the relative bound
    # alone rejected them all (H100, 2026-11-25).
    floor = float((reference.to(dtype).double() - wide).norm()) / scale if dtype != reference.dtype else 0.0
    tolerance = guard_tolerance(dtype, reference.device)
    if error <= tolerance + ROUNDING_SLACK * floor:
        return None
    return f"relative error {error:.2e} > {tolerance:.0e} + {ROUNDING_SLACK} x {floor:.1e} (rounding to {dtype})"


class Tuner:
    """Chooses, runs and remembers algorithms; one per process (see :func:`sparseconv.tune.get_tuner`)."""

    def __init__(self, cache: TuneCache | None = None) -> None:
        self._cache = cache
        self._choices: dict[tuple, tuple[Candidate, registry.Backend]] = {}
        self._lock = threading.Lock()

    @property
    def cache(self) -> TuneCache:
        if self._cache is None:
            self._cache = TuneCache(config.cache_dir() / "autotune.msgpack")
            self._cache.install_exit_hooks()
        return self._cache

    def run(
        self,
        namespace: str,
        problem: ConvProblem,
        pin: str | Sequence[str] | None,
        a: torch.Tensor,
        b: torch.Tensor,
        kernel_map: KernelMap,
        record: dict[str, str] | None = None,
    ) -> torch.Tensor:
        """Compute ``namespace`` of ``problem`` with the chosen candidate; note its id in ``record``."""
        candidate, backend = self.choose(namespace, problem, pin, a, b, kernel_map)
        if record is not None:
            record[namespace] = candidate.id
        return _execute(namespace, problem, candidate, backend, a, b, kernel_map)

    def choose(
        self,
        namespace: str,
        problem: ConvProblem,
        pin: str | Sequence[str] | None,
        a: torch.Tensor,
        b: torch.Tensor,
        kernel_map: KernelMap,
    ) -> tuple[Candidate, registry.Backend]:
        """The candidate for ``namespace`` of ``problem`` and its backend; ``a``, ``b`` are timed if it must tune.

        Decided once per (problem or key, mode, effort) and then remembered for the process: a
        small layer's call costs a few µs of host time here, not a pool build or a key hash.
        """
        mode = resolve_mode(namespace, pin)
        if mode.single:
            # A named backend's candidate depends on the problem only, never on the map's density.
            memo: tuple = (namespace, problem, mode.names)
            effort = "quick"
        else:
            effort = config.autotune_effort()
            # The key is a function of the map and the problem: keep it with the map, so the hot
            # path (every conv call) hashes it instead of rebuilding it.
            key = kernel_map.derived(("tune_key", namespace, problem), lambda m: make_key(namespace, problem, m))
            memo = (key, mode.level, mode.names, effort)
        choice = self._choices.get(memo)
        if choice is None or not _current(choice):
            with self._lock:
                choice = self._choices.get(memo)
                if choice is None or not _current(choice):
                    if mode.single:
                        candidate = candidate_pool(namespace, problem, mode, effort)[0]
                    else:
                        candidate = self._decide(namespace, key, problem, mode, effort, a, b, kernel_map)
                    choice = self._choices[memo] = (candidate, registry.get(candidate.backend))
        return choice

    def _decide(
        self,
        namespace: str,
        key: TuneKey,
        problem: ConvProblem,
        mode: AlgoMode,
        effort: str,
        a: torch.Tensor,
        b: torch.Tensor,
        kernel_map: KernelMap,
    ) -> Candidate:
        pool = candidate_pool(namespace, problem, mode, effort) or [Candidate(FALLBACK)]
        if len(pool) == 1:
            return pool[0]  # one candidate (the reference alone, or a listed backend's one set): nothing to time
        encoded = key.encode()
        entry = self.cache.get(namespace, encoded) or {"timings": {}, "evidence": 0}
        timings: dict[str, dict] = dict(entry.get("timings", {}))

        def current(c: Candidate) -> dict | None:
            timing = timings.get(c.id)
            return timing if timing is not None and timing.get("version") == registry.get(c.backend).version else None

        fresh: list[Candidate] = []
        if effort != "none":
            missing = [c for c in pool if current(c) is None]
            passed = lambda: any((current(c) or {}).get("verdict") == "ok" for c in pool)  # noqa: E731
            # The cost model's top picks first (effort quick), the rest only if none of them passed.
            for batch in prior.timing_rounds(self.cache, namespace, key, pool, missing, effort, passed):
                timings.update(self._compile_and_sweep(namespace, problem, batch, a, b, kernel_map))
                fresh += batch
        ok = sorted((c for c in pool if (current(c) or {}).get("verdict") == "ok"), key=lambda c: cost(timings[c.id]))
        if ok and len(ok) > 1 and fresh:
            close = [c for c in ok if cost(timings[c.id]) <= cost(timings[ok[0].id]) * (1 + CLOSE)]
            if len(close) > 1 and any(c in fresh for c in close):
                self._retime(namespace, problem, close, timings, a, b, kernel_map)
        if ok:
            winner = pick(timings, [c.id for c in ok])
            choice = next(c for c in ok if c.id == winner)
        elif effort == "none":
            choice = prior.ranked(self.cache, namespace, key, pool)[0]
        else:
            logger.warning("sparseconv: no candidate passed for %s %s; running %s", namespace, encoded, FALLBACK)
            choice = Candidate(FALLBACK)
        agreed = agree(namespace, encoded, choice.id)
        if agreed != choice.id:
            choice = next((c for c in pool if c.id == agreed), None) or _known(agreed) or choice
        if fresh:
            self._store(namespace, encoded, timings)
        _log_sweep(namespace, encoded, pool, timings, choice, fresh)
        return choice

    def _compile_and_sweep(self, namespace: str, problem: ConvProblem, candidates: list[Candidate], a, b,
                           kernel_map) -> dict[str, dict]:
        """Compile the candidates' kernels in parallel, then time those that compiled."""
        failed = precompile(namespace, problem, candidates, kernel_map)
        compiled = [c for c in candidates if c.id not in failed]
        return {**failed, **(self._sweep(namespace, problem, compiled, a, b, kernel_map) if compiled else {})}

    def _sweep(
        self, namespace: str, problem: ConvProblem, candidates: list[Candidate], a, b, kernel_map
    ) -> dict[str, dict]:
        # The reference runs in the accumulator dtype: with half operands explicit_gemm rounds each
        # offset's product to half before summing, which on small values (an fp16 network's
        # gradients without loss scaling, ~1e-6: subnormal) put it 1.5e-2 to 5e-2 away from every
        # fp32-accumulating kernel (H100, 2026-11-25), and the guard then rejected all of them.
        wide = accumulator_dtype(a.dtype)
        reference = registry.get(FALLBACK).run(namespace, problem, {}, a.to(wide), b.to(wide), kernel_map)
        timer = Timer(a.device)
        results = {}
        for candidate in candidates:
            backend = registry.get(candidate.backend)
            params = candidate.params_dict

            def call(backend=backend, params=params):
                return backend.run(namespace, problem, params, a, b, kernel_map)

            record = {"backend": candidate.backend, "params": list(map(list, candidate.params)),
                      "version": backend.version, "ms": None, "samples": 0}
            try:
                failure = check_output(call(), reference, a.dtype)
                if failure is None:
                    record["ms"], record["samples"], record["host_ms"] = timer.measure(call)
                    record["verdict"] = "ok"
                else:
                    record.update(verdict="wrong", reason=failure)
            except Exception as error:  # noqa: BLE001 - a failing candidate is skipped, never fatal
                if isinstance(error, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                record.update(verdict="failed", reason=f"{type(error).__name__}: {error}"[:300])
            if record["verdict"] != "ok":
                logger.info("sparseconv: %s disqualified for %s: %s", candidate.id, namespace, record["reason"])
            results[candidate.id] = record
        return results

    def _retime(self, namespace, problem, candidates: list[Candidate], timings: dict, a, b, kernel_map) -> None:
        calls = [
            (lambda backend=registry.get(c.backend), params=c.params_dict:
             backend.run(namespace, problem, params, a, b, kernel_map))
            for c in candidates
        ]
        for candidate, (ms, samples) in zip(candidates, Timer(a.device).interleaved(calls)):
            timings[candidate.id] = {**timings[candidate.id], "ms": ms, "samples": timings[candidate.id]["samples"] + samples}

    def _store(self, namespace: str, encoded: str, timings: dict[str, dict]) -> None:
        ok = {cid: t for cid, t in timings.items() if t.get("verdict") == "ok"}
        entry = {
            "timings": timings,
            "winner": pick(ok, list(ok)) if ok else FALLBACK,
            "evidence": sum(int(t.get("samples", 0)) for t in timings.values()),
            "updated": time.time(),
        }
        self.cache.put(namespace, encoded, entry)


def cost(timing: Mapping) -> float:
    """Milliseconds a call of a timed candidate costs where calls follow each other: its GPU time
    or the host time of issuing it, whichever is longer (a small layer's calls are host-bound)."""
    return max(timing["ms"], timing.get("host_ms") or 0.0)


def pick(timings: Mapping[str, Mapping], ids: list[str]) -> str:
    """The winner among the timed ``ids``: of those within CLOSE of the least :func:`cost`, the one
    with the least host time a call (entries stored before host times were kept count as costing
    the most), then the fastest."""
    cheapest = min(cost(timings[i]) for i in ids)
    close = [i for i in ids if cost(timings[i]) <= cheapest * (1 + CLOSE)]
    return min(close, key=lambda i: (timings[i].get("host_ms", float("inf")), timings[i]["ms"]))


def _known(candidate_id: str) -> Candidate | None:
    """A candidate another rank chose, if this process has that backend too."""
    name = candidate_id.split("[", 1)[0]
    if name not in registry.names():
        logger.warning("sparseconv: another rank chose %s, which this process lacks", candidate_id)
        return None
    if "[" not in candidate_id:
        return Candidate(name)
    for params in registry.get(name).params_space:
        candidate = Candidate.of(name, params)
        if candidate.id == candidate_id:
            return candidate
    return None


def _current(choice: tuple[Candidate, registry.Backend]) -> bool:
    """Whether a remembered choice's backend is still the registered one (tests swap fakes in and out)."""
    candidate, backend = choice
    try:
        return registry.get(candidate.backend) is backend
    except KeyError:
        return False


def _execute(
    namespace: str, problem: ConvProblem, candidate: Candidate, backend: registry.Backend, a, b, kernel_map: KernelMap
) -> torch.Tensor:
    try:
        return backend.run(namespace, problem, candidate.params_dict, a, b, kernel_map)
    except Exception as error:  # noqa: BLE001 - a tuned choice that fails later (e.g. OOM) falls back
        if candidate.backend == FALLBACK:
            raise
        logger.warning("sparseconv: %s failed for %s (%s); running %s", candidate.id, namespace, error, FALLBACK)
        return registry.get(FALLBACK).run(namespace, problem, {}, a, b, kernel_map)


def _log_sweep(namespace: str, encoded: str, pool, timings: dict, choice: Candidate, fresh) -> None:
    if not config.autotune_log():
        return
    _ensure_handler()
    rows = [f"{'candidate':<40} {'median ms':>10} {'host ms':>8}  verdict"]
    for c in pool:
        t = timings.get(c.id, {})
        ms = f"{t['ms']:.3f}" if t.get("ms") is not None else "-"
        host = f"{t['host_ms']:.3f}" if t.get("host_ms") is not None else "-"
        verdict = t.get("verdict", "not timed") + (f" ({t['reason']})" if t.get("reason") else "")
        cached = c not in fresh and c.id in timings  # one the cost model left out reads "not timed" alone
        rows.append(f"{c.id:<40} {ms:>10} {host:>8}  {verdict}{' [cached]' if cached else ''}")
    logger.info("sparseconv autotune %s %s\n%s\nwinner: %s", namespace, encoded, "\n".join(rows), choice.id)


def _ensure_handler() -> None:
    # SPARSECONV_AUTOTUNE_LOG=1 is a request to see the sweeps: show them even if the
    # application configured no logging, without duplicating a handler it did configure.
    root = logging.getLogger("sparseconv")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
