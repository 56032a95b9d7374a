"""How the tuner decides a key's choice from its evidence: what to time (under effort quick, only what the cost model
of prior.py ranks first), sweeps spread over calls within the timing budget, what runs meanwhile, the winner (close
finishers re-timed interleaved), the other ranks' agreement and the record of every timing. The tuner
(:mod:`.tuner`) remembers the choices and runs them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..backends import compiling
from ..backends.problem import ConvProblem
from ..coords.kernel_map import KernelMap
from . import prior
from .budget import TimingBudget
from .cache import TuneCache
from .choice import Provisional, adopt
from .configs import Candidate
from .distributed import Ranks
from .evidence import Evidence, cost, pick
from .key import TuneKey
from .pools import FALLBACK, AlgoMode, candidate_pool, meanwhile
from .precompile import ChoiceCompiles
from .stand_ins import StandIns
from .sweep import compile_and_sweep, log_sweep, refuse_tuning_in_trace, retime
from .timing import CLOSE
from .waiting import Waiting

logger = logging.getLogger("sparseconv.tune")


class Decider:
    """Decides the choices of keys not settled yet (:meth:`decide`), for one :class:`~.tuner.Tuner`, whose parts it
    shares: ``cache`` (called for the tuning cache, opened on first use), ``compiles``, ``ranks``, ``stand_ins``,
    ``waiting`` and ``budget``."""

    def __init__(self, cache: Callable[[], TuneCache], compiles: ChoiceCompiles, ranks: Ranks,
                 stand_ins: StandIns, waiting: Waiting, budget: TimingBudget) -> None:
        self._cache, self._compiles, self._ranks = cache, compiles, ranks
        self._stand_ins, self._waiting, self.budget = stand_ins, waiting, budget
        self._reported: set[str] = set()  # candidates whose failure was logged as a warning
        # memo -> the candidates this process timed for it in earlier calls, while its sweep is spread over calls
        self._sweeps: dict[tuple, list[Candidate]] = {}

    def sweeping(self, memo: tuple) -> bool:
        """Whether this process's sweep of ``memo`` goes on in later calls."""
        return memo in self._sweeps

    def decide(self, namespace: str, key: TuneKey, problem: ConvProblem, mode: AlgoMode, effort: str,
                a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, memo: tuple = ()
                ) -> tuple[Candidate | Provisional, bool]:
        """(the choice, whether its kernels must compile in the call: not both decided by an earlier
        passing timing on this device and left uncompiled by this call's sweep)."""
        pool = candidate_pool(namespace, problem, mode, effort, key.deterministic) or [Candidate(FALLBACK)]
        if len(pool) == 1:
            return pool[0], True  # one candidate (the reference alone, or a listed backend's one set): nothing to time
        encoded = key.encode()
        evidence = Evidence.read(self._cache(), namespace, encoded)
        missing = self._to_time(namespace, key, pool, effort, evidence, memo in self._sweeps)
        fresh: list[Candidate] = []
        started = time.perf_counter()
        if missing:
            stand_in = self._stand_ins.pick(namespace, key, pool, effort, evidence, a, memo, self.budget, self._cache())
            if stand_in is not None:
                return Provisional(stand_in), False  # its kernels may compile in the background meanwhile
            elsewhere = self._timed_elsewhere(namespace, encoded, problem, pool, a, key.deterministic)
            if elsewhere is not None:
                return elsewhere
            refuse_tuning_in_trace(namespace, encoded, a)
            sliced = self._slices(effort, key)
            swept = self._sweep(namespace, key, problem, pool, missing, effort, evidence, a, b, kernel_map, memo,
                                self.budget.per_call if sliced else None)
            if swept is None:
                # Timed once compiled (a later call); the loaded stand-in runs meanwhile, else the reference. The
                # claim stays ours: other ranks run the pool's first until the choice is published.
                running = self.running_meanwhile(memo, namespace, problem, mode, effort, key, kernel_map)
                return Provisional(running), True
            fresh = swept
            if sliced and fresh:
                # The rest of the sweep (and the re-timing of close finishers) waits for later calls.
                self.budget.spend(time.perf_counter() - started)
                return self._sweep_goes_on(memo, problem, pool, evidence, fresh,
                                           lambda: self.running_meanwhile(memo, namespace, problem, mode, effort,
                                                                          key, kernel_map))
        fresh = [*self._sweeps.pop(memo, ()), *fresh]
        choice = self._winner(namespace, key, problem, pool, effort, evidence, fresh, a, b, kernel_map)
        timed_s = time.perf_counter() - started
        choice = adopt(self._ranks.agree(namespace, encoded, choice.id), pool, choice)
        if fresh:
            self.budget.spend(timed_s)
            self._stand_ins.timed(memo)
            self._store(namespace, encoded, evidence.timings)
        log_sweep(namespace, encoded, pool, evidence.timings, choice, fresh)
        # Its compile may wait for the background only if it compiled and passed on this device
        # before (this process compiled the ones it timed just now).
        return choice, choice in fresh or not evidence.passed(choice)

    def _slices(self, effort: str, key: TuneKey) -> bool:
        """Whether a sweep of this key is spread over calls (:attr:`TimingBudget.per_call` candidates a call): under
        effort quick, outside :meth:`TimingBudget.waived` (a moment chosen to tune) and deterministic mode (where
        what ran would depend on how often a layer is called)."""
        return effort == "quick" and not key.deterministic and not self.budget.waiving and bool(self.budget.per_call)

    def _sweep_goes_on(self, memo: tuple, problem: ConvProblem, pool: list[Candidate], evidence: Evidence,
                       fresh: list[Candidate], otherwise: Callable[[], Candidate]) -> tuple[Provisional, bool]:
        """What a key whose sweep goes on in later calls runs meanwhile: the best candidate that passed so far (it
        ran in this process if timed here), else ``otherwise()`` (:meth:`running_meanwhile`)."""
        timed = self._sweeps[memo] = [*self._sweeps.get(memo, ()), *fresh]
        passing = evidence.passing(pool)
        if not passing:
            return Provisional(otherwise()), True
        best = evidence.best(passing)
        self._stand_ins.hold(memo, best, best in timed)
        return Provisional(best), best in timed

    def running_meanwhile(self, memo: tuple, namespace: str, problem: ConvProblem, mode: AlgoMode, effort: str,
                          key: TuneKey | None, kernel_map: KernelMap) -> Candidate:
        """What ``memo`` runs while its kernels compile or its sweep waits: its loaded stand-in, else a candidate of
        its pool whose kernels are compiled already (:meth:`.waiting.Waiting.compiled`), else what needs no compile
        (:func:`.pools.meanwhile`)."""
        return (self._stand_ins.loaded(memo)
                or self._waiting.compiled(memo, self._cache(), namespace, problem, mode, effort, key, kernel_map)
                or meanwhile(problem))

    def _to_time(self, namespace: str, key: TuneKey, pool: list[Candidate], effort: str, evidence: Evidence,
                 sweeping: bool = False) -> list[Candidate]:
        """The candidates of ``pool`` to time for this key (none under effort ``none``); ``sweeping``: this
        process's sweep of the key goes on (its timings so far are not a recorded decision)."""
        if effort == "none":
            return []
        missing = evidence.untimed(pool)
        if missing and not sweeping and not evidence.stale(missing) and effort == "quick" and evidence.any_passed(pool):
            # A recorded decision (this cache's or the shipped one's) stands under quick while its
            # backends are unchanged: only candidates the cost model knows nothing of are timed,
            # not the picks of a model refitted on more data since.
            missing = prior.unknown(self._cache(), namespace, key, missing)
        return missing

    def _timed_elsewhere(self, namespace: str, encoded: str, problem: ConvProblem, pool: list[Candidate],
                         a: torch.Tensor, deterministic: bool) -> tuple[Candidate | Provisional, bool] | None:
        """What runs if another rank times this key (:meth:`Ranks.claim`), else None (this process times it)."""
        other = self._ranks.claim(namespace, encoded)
        if other:
            # Another rank has published its choice: it passed there, so its kernels may compile in the
            # background (the reference runs meanwhile), as a cached choice's.
            return adopt(other, pool, pool[0]), False
        if other is not None:
            # Another rank is timing this key; never wait on it. Until it publishes: what needs no compile where
            # kernels compile in the background, else the pool's first. (The pool's first compiled in the
            # call on a GPU: a compile per key that a DDP step waited for, 74 s against 7.8 s for a first
            # MinkUNet step on one GPU, two H100s, 2026-11-25.)
            return Provisional(meanwhile(problem) if compiling.in_background(a, deterministic) else pool[0]), True
        return None

    def _sweep(self, namespace: str, key: TuneKey, problem: ConvProblem, pool: list[Candidate],
               missing: list[Candidate], effort: str, evidence: Evidence, a: torch.Tensor, b: torch.Tensor,
               kernel_map: KernelMap, memo: tuple, limit: int | None = None) -> list[Candidate] | None:
        """Time ``missing`` into ``evidence``: the cost model's top picks first (effort quick), the rest only
        if none of them passed; at most ``limit`` candidates (None: all). Returns the candidates timed (none: none
        was left), or None where a round's kernels compile in the background first (:meth:`ChoiceCompiles.defer`)."""
        encoded, fresh = key.encode(), []
        passed = lambda: evidence.any_passed(pool)  # noqa: E731
        loaded = self._stand_ins.loaded(memo) is not None
        for batch in prior.timing_rounds(self._cache(), namespace, key, pool, missing, effort, passed):
            if limit is not None and len(fresh) >= limit:
                break
            in_background = len(batch) <= SWEEP_IN_BACKGROUND or loaded
            if in_background and self._compiles.defer(memo, namespace, problem, batch, a, kernel_map,
                                                      key.deterministic):
                return None
            taken = batch if limit is None else batch[:limit - len(fresh)]
            done = dict(evidence.timings)
            evidence.timings.update(compile_and_sweep(
                namespace, problem, taken, a, b, kernel_map, self._cache(), self._reported,
                store=lambda results, done=done: self._store(namespace, encoded, {**done, **results}),
                # Compiled in the background already (defer said so): the hooks again in the call cost a street
                # pass's first slices 11-25 ms (H200). Else a round's kernels compile together at its first slice.
                compile=not (in_background and compiling.in_background(a, key.deterministic)),
                compile_too=() if memo in self._sweeps else batch))
            fresh += taken
        return fresh

    def _winner(self, namespace: str, key: TuneKey, problem: ConvProblem, pool: list[Candidate], effort: str,
                evidence: Evidence, fresh: list[Candidate], a: torch.Tensor, b: torch.Tensor,
                kernel_map: KernelMap) -> Candidate:
        """The pick among the passing candidates (close finishers timed just now re-timed interleaved first);
        the cost model's first under effort ``none``; else the reference."""
        ok, timings = evidence.passing(pool), evidence.timings
        if len(ok) > 1 and fresh:
            close = [c for c in ok if cost(timings[c.id]) <= cost(timings[ok[0].id]) * (1 + CLOSE)]
            if len(close) > 1 and any(c in fresh for c in close):
                retime(namespace, problem, close, timings, a, b, kernel_map)
        if ok:
            return evidence.best(ok)
        if effort == "none":
            return prior.ranked(self._cache(), namespace, key, pool)[0]
        logger.warning("sparseconv: no candidate passed for %s %s; running %s", namespace, key.encode(), FALLBACK)
        return Candidate(FALLBACK)

    def _store(self, namespace: str, encoded: str, timings: dict[str, dict]) -> None:
        ok = {cid: t for cid, t in timings.items() if t.get("verdict") == "ok"}
        entry = {
            "timings": timings,
            "winner": pick(ok, list(ok)) if ok else FALLBACK,
            "evidence": sum(int(t.get("samples", 0)) for t in timings.values()),
            "updated": time.time(),
        }
        self._cache().put(namespace, encoded, entry)


SWEEP_IN_BACKGROUND = prior.QUICK_TOP + 5
"""A sweep of at most this many candidates (the cost model's three picks and up to five it has no data
on) compiles in the background; a larger one (no model yet: the whole pool) compiles in the call, unless
the key has a loaded stand-in (:meth:`.stand_ins.StandIns.pick`) to run meanwhile instead of the reference.
Measured on an H100 (street1 MinkUNet, fp16, no tunings at all): with every sweep in the background the
first training step took 3.7 s but ~800 compile jobs kept the network on the reference (339 ms a step
against 90) for over 40 s, while compiling in the call took 49 s and then ran tuned: fewer steps done in
the first minutes. With the cost model's picks the jobs are few and the wait short. Its picks alone
(three) left the model's picks plus the four small-channel tiles the shipped tunings predate (seven) to
compile in the call: one pass of a cold process took 8.9 s (H200, 2026-11-28)."""
