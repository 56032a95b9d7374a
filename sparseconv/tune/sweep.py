"""Timing candidates: compile a sweep's kernels in parallel, time each against the reference (a
failure is one log line, never fatal), and re-time close finishers interleaved. The tuner
(:mod:`.tuner`) decides what to time and keeps the records."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .. import config
from ..backends import registry
from ..backends.problem import ConvProblem
from ..precision import accumulator_dtype
from . import faults
from .cache import TuneCache
from .configs import Candidate
from .guard import check_output
from .pools import FALLBACK
from .precompile import precompile
from .timing import Timer, TooSlow

logger = logging.getLogger("sparseconv.tune")


def compile_and_sweep(namespace: str, problem: ConvProblem, candidates: list[Candidate], a, b, kernel_map,
                      cache: TuneCache, reported: set[str],
                      store: Callable[[dict[str, dict]], None] | None = None,
                      compile: bool = True, compile_too: Sequence[Candidate] = ()) -> dict[str, dict]:
    """Compile the candidates' kernels in parallel (with those of ``compile_too``, timed by later calls; none if not
    ``compile``: compiled elsewhere), then time those that compiled (:func:`sweep`). Returns their records and the
    failed compiles' of both."""
    later = [c for c in compile_too if c not in candidates]
    # Compilers print (Triton's reproducer on a failure): nothing of it reaches the terminal.
    with faults.captured_output() as captured:
        failed = precompile(namespace, problem, [*candidates, *later], kernel_map) if compile else {}
    if captured.text:
        logger.debug("sparseconv: compiler output while precompiling for %s:\n%s", namespace, captured.text)
    compiled = [c for c in candidates if c.id not in failed]
    swept = sweep(namespace, problem, compiled, a, b, kernel_map, cache, reported, store) if compiled else {}
    return {**failed, **swept}

def sweep(
    namespace: str, problem: ConvProblem, candidates: list[Candidate], a, b, kernel_map, cache: TuneCache,
    reported: set[str], store: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """Timing records of ``candidates``; ``store`` is given the records so far after each one,
    so a signal mid-sweep loses only the candidate being timed (see ``faults`` for failures).
    ``reported``: the candidates whose failure was logged as a warning (the tuner's, for the
    process); ``cache`` is flushed before a candidate that broke the CUDA context is raised."""
    # The reference runs in the accumulator dtype: with half operands explicit_gemm rounds each
    # offset's product to half before summing, which on small values (an fp16 network's
    # gradients without loss scaling, ~1e-6: subnormal) put it 1.5e-2 to 5e-2 away from every
    # fp32-accumulating kernel (H100, 2026-11-25), and the guard then rejected all of them.
    wide = accumulator_dtype(a.dtype)
    begin = time.perf_counter()
    reference = registry.get(FALLBACK).run(namespace, problem, {}, a.to(wide), b.to(wide), kernel_map)
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    limit_ms = faults.time_limit_ms(1e3 * (time.perf_counter() - begin))
    timer = Timer(a.device)
    results = {}
    for candidate in candidates:
        backend = registry.get(candidate.backend)
        params = candidate.params_dict

        def call(backend=backend, params=params):
            return backend.run(namespace, problem, params, a, b, as_run(kernel_map, problem))

        record = {"backend": candidate.backend, "params": list(map(list, candidate.params)),
                  "version": backend.version, "ms": None, "samples": 0}
        output, out_of_memory = faults.Captured(), False
        try:
            with faults.captured_output() as output:  # the first call compiles: keep compilers off the terminal
                failure = check_output(call(), reference, a.dtype)
            if failure is None:
                record["ms"], record["samples"], record["host_ms"] = timer.measure(call, limit_ms=limit_ms)
                record["verdict"] = "ok"
            else:
                record.update(verdict="wrong", reason=failure)
        except TooSlow as slow:
            ms, limit = slow.args
            record.update(verdict="slow", reason=f"a call took {ms:.1f} ms, over the limit of {limit:.1f} ms "
                          f"({faults.SLOW_FACTOR:g}x the reference + {faults.SLOW_FLOOR_MS:g} ms)")
        except Exception as error:  # noqa: BLE001 - a failing candidate is skipped, never fatal
            record.update(verdict="failed", reason=faults.first_line(error))
            out_of_memory = faults.is_out_of_memory(error)
            logger.debug("sparseconv: %s failed for %s", candidate.id, namespace, exc_info=error)
            broken = faults.probe(a.device)
            if broken is not None:
                record["reason"] = f"broke the CUDA context: {record['reason']}"
                results[candidate.id] = record
                if store is not None:
                    store(results)
                cache.flush(force=True)
                raise faults.poisoned(namespace, candidate.id, error, broken, recorded=store is not None) from error
        if record["verdict"] == "failed" and out_of_memory and torch.cuda.is_available():
            torch.cuda.empty_cache()  # here, where the error's frames (and their tensors) are gone
        if output.text:
            logger.debug("sparseconv: output of %s's first call for %s:\n%s", candidate.id, namespace, output.text)
        if record["verdict"] != "ok":
            # One line per candidate; a WARNING (shown even where logging is not configured)
            # only the first time a candidate fails to run in this process.
            loud = record["verdict"] == "failed" and candidate.id not in reported
            if loud:
                reported.add(candidate.id)
            logger.log(logging.WARNING if loud else logging.INFO, "sparseconv: skipped %s for %s: %s",
                       candidate.id, namespace, record["reason"])
        results[candidate.id] = record
        if store is not None:
            store(results)
    return results


def as_run(kernel_map, problem: ConvProblem):
    """The map a timed call runs on: for a lone map's product (:attr:`ConvProblem.lone`), the map without
    its views (:meth:`~sparseconv.coords.kernel_map.KernelMap.unviewed`), so that each call builds the views
    its candidate needs, as each new batch's map will for this product alone; else the map itself, whose
    views its other products share (and a new batch's map plan builds ahead)."""
    return kernel_map.unviewed() if problem.lone else kernel_map


def retime(namespace, problem, candidates: list[Candidate], timings: dict, a, b, kernel_map) -> None:
    """Time close finishers again, interleaved, and update their ``timings`` in place."""
    calls = [
        (lambda backend=registry.get(c.backend), params=c.params_dict:
         backend.run(namespace, problem, params, a, b, as_run(kernel_map, problem)))
        for c in candidates
    ]
    for candidate, (ms, samples) in zip(candidates, Timer(a.device).interleaved(calls)):
        timings[candidate.id] = {**timings[candidate.id], "ms": ms, "samples": timings[candidate.id]["samples"] + samples}


def log_sweep(namespace: str, encoded: str, pool, timings: dict, choice: Candidate, fresh) -> None:
    """Log a decision's table of candidates (SPARSECONV_AUTOTUNE_LOG=1): each one's times and verdict, the winner."""
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


def refuse_tuning_in_trace(namespace: str, encoded: str, a: torch.Tensor) -> None:
    """RuntimeError if timing candidates now would time a trace or a CUDA-graph capture, not kernels."""
    if torch.compiler.is_compiling():
        where = "inside a torch.compile trace"
    elif a.device.type == "meta" or isinstance(a, torch._subclasses.FakeTensor):
        where = "on fake tensors (a torch.compile, torch.export or make_fx trace)"
    elif a.is_cuda and torch.cuda.is_current_stream_capturing():
        where = "during CUDA-graph capture"
    else:
        return
    raise RuntimeError(
        f"sparseconv: {namespace} {encoded} is not tuned yet and cannot be tuned {where}, where candidate "
        "kernels cannot be timed. Call sparseconv.warmup(model, example_input) eagerly first (one forward "
        "and backward that tunes every layer), or pin the algorithms (fwd_algo= ..., SPARSECONV_*_ALGO_MODE) "
        "or set SPARSECONV_AUTOTUNE_EFFORT=none."
    )
