"""The tuner: for each product of each conv call, which backend and parameters run.

Single-name modes run that backend untouched. Otherwise the tuner looks up the problem's key in
the cache file, times only the pool's candidates that have no current timing there (under effort
quick, only those the cost model of prior.py ranks first), compiled in parallel first, guards each
against ``explicit_gemm`` on the same inputs, re-times close finishers interleaved, agrees with
the other ranks, remembers the choice for the process and stores every timing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .. import config
from ..coords.batch import MapUse
from ..coords.kernel_map import KernelMap
from ..backends import compiling, registry
from ..backends.problem import ConvProblem, layer_problem
from . import prior
from .budget import TimingBudget
from .cache import TuneCache
from .choice import Progress, Provisional, adopt, current, execute
from .configs import Candidate
from .distributed import Ranks
from .evidence import Evidence, cost, pick
from .key import TuneKey, make_key
from .pools import FALLBACK, AlgoMode, candidate_pool, meanwhile, resolve_mode
from .precompile import ChoiceCompiles
from .stand_ins import StandIns
from .sweep import compile_and_sweep, log_sweep, refuse_tuning_in_trace, retime
from .timing import CLOSE
from .waiting import Waiting

logger = logging.getLogger("sparseconv.tune")


AHEAD = "AB_gather_scatter"
"""The product a new batch's map plan prepares ahead (:meth:`Tuner.prepare_ahead`): the forward's, whose views
the plan builds; a backward product's views (dgrad plans, pair lists) made then would sit through the forward
pass's memory peak."""


class Tuner:
    """Chooses, runs and remembers algorithms; one per process (see :func:`sparseconv.tune.get_tuner`)."""

    def __init__(self, cache: TuneCache | None = None, compiles: ChoiceCompiles | None = None,
                 ranks: Ranks | None = None, budget: TimingBudget | None = None) -> None:
        """``cache``: the tuning cache (the user's file, opened on first use); ``compiles``: the background
        compiles of decided choices and small sweeps; ``ranks``: the agreement with the job's other ranks;
        ``budget``: the share of wall time timing may take inside calls (:mod:`.budget`)."""
        self._cache = cache
        self._choices: dict[tuple, tuple[Candidate, registry.Backend]] = {}
        self._lock = threading.Lock()
        self._reported: set[str] = set()  # candidates whose failure was logged as a warning
        self._compiles = compiles or ChoiceCompiles()  # no worker until a first choice compiles there
        self._ranks = ranks or Ranks()
        self.budget = budget or TimingBudget()
        self._stand_ins = StandIns()  # what keys run untimed
        self._adoptions = 0  # choices _adopted settled
        # memo -> the candidates this process timed for it in earlier calls, while its sweep is spread over calls
        self._sweeps: dict[tuple, list[Candidate]] = {}
        self._waiting = Waiting(self._compiles)  # compiled candidates for products waiting on their kernels

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
        use: MapUse | None = None,
    ) -> torch.Tensor:
        """Compute ``namespace`` of ``problem`` with the chosen candidate; note its id in ``record``.

        A settled choice of a backend that prepares its products is kept in the map's ``use`` in its batch,
        with the prepared call (:attr:`~sparseconv.coords.batch.MapUse.calls`): the layer's later calls on the
        map look up the settings and that entry and call the kernels (~20 µs of host time less a call than
        choosing and running through the backend's lookups). Without a ``use`` nothing is kept."""
        settings = config.product_settings(namespace)
        memo = (namespace, problem, pin, settings)
        out = None if use is None else self._run_held(use, memo, a, b, record)
        if out is not None:
            return out
        candidate, backend, settled = self._choose(namespace, problem, pin, a, b, kernel_map, settings)
        if record is not None:
            record[namespace] = candidate.id
        if settled and backend.prepare is not None:
            out = self._run_prepared(memo, candidate, backend, a, b, kernel_map, use)
            if out is not None:
                return out
        return execute(namespace, problem, candidate, backend, a, b, kernel_map)

    def _run_held(self, use: MapUse, memo: tuple, a: torch.Tensor, b: torch.Tensor,
                  record: dict[str, str] | None) -> torch.Tensor | None:
        """The product by the call prepared in ``use`` under ``memo``, or None if there is none (or it failed)."""
        held = use.calls.get(memo)
        if held is None or held[0] is not self or not current(held[1]):
            return None
        if record is not None:
            record[memo[0]] = held[1][0].id
        try:
            return held[2](a.contiguous(), b.contiguous())
        except Exception:  # noqa: BLE001 - through the backend again, and its fallback if it fails there
            use.calls.pop(memo, None)
            return None

    def _run_prepared(self, memo: tuple, candidate: Candidate, backend: registry.Backend, a: torch.Tensor,
                      b: torch.Tensor, kernel_map: KernelMap, use: MapUse | None) -> torch.Tensor | None:
        """The product of a settled choice, prepared first and then called (not run, then prepared from the views
        run built: a new batch's first call of each layer on each map comes here, 74 of 125 a MinkUNet step), the
        call kept in ``use``; None if preparing or calling failed."""
        namespace, problem, pin, _ = memo
        try:
            call = backend.prepare(namespace, problem, candidate.params_dict, kernel_map)
            out = call(a.contiguous(), b.contiguous())
        except Exception:  # noqa: BLE001 - through the backend again, and its fallback if it fails there
            return None
        if use is not None:
            use.calls[memo] = (self, (candidate, backend), call)
            if namespace == AHEAD:
                use.note_call((namespace, pin, problem.layer))  # the next batch's map has it prepared ahead
        return out

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
        return self._choose(namespace, problem, pin, a, b, kernel_map, config.product_settings(namespace))[:2]

    def _choose(self, namespace: str, problem: ConvProblem, pin: str | Sequence[str] | None, a: torch.Tensor,
                b: torch.Tensor, kernel_map: KernelMap, settings: tuple[str | None, bool, str]
                ) -> tuple[Candidate, registry.Backend, bool]:
        """:meth:`choose` given the call's settings, and whether the choice is settled (remembered
        for the process: not the reference while kernels compile, nor a provisional pick)."""
        memo, mode, effort, key = self._memo(namespace, problem, pin, kernel_map, settings)
        deterministic = settings[1]
        choice = self._choices.get(memo)
        if choice is None or not current(choice):
            adopted = self._adopted(namespace, memo, key, effort, problem)
            if adopted is not None:
                return (*adopted, True)
            loaded = (self._stand_ins.loaded(memo)
                      or self._stand_ins.from_sibling(memo, key, effort, problem, self.budget))
            if self._compiles.pending(memo) and compiling.on_gpu_eagerly(a):
                # Compiling: the key's loaded stand-in runs meanwhile (its sweep's candidates compile), else what
                # needs no compile.
                running = loaded or self._meanwhile(memo, namespace, problem, mode, effort, key, kernel_map)
                return running, registry.get(running.backend), False
            if loaded is not None and not self.budget.allows():
                # Loaded and waiting for the budget: no pool, no cache read (~0.4 ms a call, 76 calls of a step).
                return loaded, registry.get(loaded.backend), False
            with self._lock:
                choice = self._choices.get(memo)
                if choice is None or not current(choice):
                    compiled = True  # a named backend compiles in its first call, as before
                    if mode.single:
                        candidate = candidate_pool(namespace, problem, mode, effort, deterministic)[0]
                    else:
                        candidate, compiled = self._decide(namespace, key, problem, mode, effort, a, b, kernel_map,
                                                           memo)
                    if isinstance(candidate, Provisional):
                        candidate = candidate.candidate
                        if not compiled and self._compiles.defer(memo, namespace, problem, [candidate], a,
                                                                 kernel_map, deterministic):
                            running = self._meanwhile(memo, namespace, problem, mode, effort, key, kernel_map)
                            return running, registry.get(running.backend), False
                        # Its kernels are loaded if it is the stand-in: the fast path above (not the reference a
                        # sweep runs while its candidates compile, nor another rank's provisional pick).
                        self._stand_ins.ran(memo, candidate)
                        return candidate, registry.get(candidate.backend), False
                    if not compiled and self._compiles.defer(memo, namespace, problem, [candidate], a, kernel_map,
                                                             deterministic):
                        running = self._meanwhile(memo, namespace, problem, mode, effort, key, kernel_map)
                        return running, registry.get(running.backend), False
                    choice = self._choices[memo] = (candidate, registry.get(candidate.backend))
                    self._waiting.settled(memo)
                    if key is not None:
                        self._stand_ins.settled(memo, key, candidate)
        return (*choice, True)

    @staticmethod
    def _memo(namespace: str, problem: ConvProblem, pin: str | Sequence[str] | None, kernel_map: KernelMap,
              settings: tuple[str | None, bool, str]) -> tuple[tuple, AlgoMode, str, TuneKey | None]:
        """(what the choice of this call is remembered under, its mode, its effort, its key or None)."""
        mode_value, deterministic, effort = settings
        mode = resolve_mode(namespace, pin, mode_value)
        # deterministic is in the key and memo: its choices are never the others'
        if mode.single:
            # A named backend's candidate depends on the layer only, never on the map (its density, its row
            # counts): keyed by the problem, every new batch's sizes added an entry, without bound.
            return (namespace, problem.layer, mode.names, deterministic), mode, "quick", None
        # The key is a function of the map and the problem: keep it with the map, so the hot
        # path (every conv call) hashes it instead of rebuilding it.
        key = kernel_map.derived(("tune_key", namespace, problem, deterministic),
                                 lambda m: make_key(namespace, problem, m, deterministic))
        return (key, mode.level, mode.names, effort), mode, effort, key

    def prepare_ahead(self, kernel_map: KernelMap, use: MapUse, recipe: tuple,
                      settings: tuple[str | None, bool, str] | None = None) -> None:
        """Prepare on a new batch's map (into its ``use``) the product a layer prepared at its first call on the
        last batch's (``recipe``: (namespace, pin, :attr:`ConvProblem.layer`), what :meth:`run` noted,
        :meth:`~sparseconv.coords.batch.MapUse.note_call`), where its choice is settled here: the layer's first
        call then finds it ready, as its next calls do, instead of keying, choosing and preparing it there. The
        map plan calls this for a batch's maps together (:func:`sparseconv.tune.prepare_planned`); anything
        unsettled or failing is left to the layer's call. ``settings``: :func:`config.product_settings` of the
        recipe's namespace, where the caller read them already."""
        try:
            namespace, pin, layer = recipe
            problem = layer_problem(kernel_map, layer, use.lone)
            if settings is None:
                settings = config.product_settings(namespace)
            memo = (namespace, problem, pin, settings)
            if memo in use.calls:
                return
            remembered, mode, effort, key = self._memo(namespace, problem, pin, kernel_map, settings)
            choice = self._choices.get(remembered)
            if choice is None or not current(choice):
                if not mode.single:
                    # undecided for this key: adopted from a timed sibling, else the layer's call tunes it
                    choice = self._adopted(namespace, remembered, key, effort, problem)
                    if choice is None:
                        return
                else:
                    # A named backend's choice (keyed by the layer) not made yet: made here as the call would (no
                    # timing).
                    *choice, settled = self._choose(namespace, problem, pin, None, None, kernel_map, settings)
                    if not settled:
                        return
            candidate, backend = choice
            if backend.prepare is not None:
                call = backend.prepare(namespace, problem, candidate.params_dict, kernel_map)
                use.calls[memo] = (self, (candidate, backend), call)
        except Exception:  # noqa: BLE001 - never costs the batch its plan: the layer's call prepares it
            return

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles queued so far (:meth:`ChoiceCompiles.defer`); False if
        ``timeout`` seconds passed first. The next call of each such layer then runs its choice."""
        return self._compiles.background.wait(timeout)

    def compiling(self) -> int:
        """How many products ran the reference (and map views torch's ops) because their kernels were
        compiling in the background and have not run them since (0: none; see :meth:`wait_for_compiles`)."""
        return self._compiles.background.queued()

    def progress(self) -> Progress:
        """Where this process's tuning stands (:class:`Progress`): what a user can look at instead of waiting."""
        with self._lock:
            settled = sum(1 for memo in self._choices if isinstance(memo[0], TuneKey))
            untimed = len(self._stand_ins)
        return Progress(settled, untimed, self._compiles.background.compiling(), self.budget.spent_s, self._adoptions)

    def _decide(self, namespace: str, key: TuneKey, problem: ConvProblem, mode: AlgoMode, effort: str,
                a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, memo: tuple = ()
                ) -> tuple[Candidate | Provisional, bool]:
        """(the choice, whether its kernels must compile in the call: not both decided by an earlier
        passing timing on this device and left uncompiled by this call's sweep)."""
        pool = candidate_pool(namespace, problem, mode, effort, key.deterministic) or [Candidate(FALLBACK)]
        if len(pool) == 1:
            return pool[0], True  # one candidate (the reference alone, or a listed backend's one set): nothing to time
        encoded = key.encode()
        evidence = Evidence.read(self.cache, namespace, encoded)
        missing = self._to_time(namespace, key, pool, effort, evidence, memo in self._sweeps)
        fresh: list[Candidate] = []
        started = time.perf_counter()
        if missing:
            stand_in = self._stand_ins.pick(namespace, key, pool, effort, evidence, a, memo, self.budget, self.cache)
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
                return Provisional(self._meanwhile(memo, namespace, problem, mode, effort, key, kernel_map)), True
            fresh = swept
            if sliced and fresh:
                # The rest of the sweep (and the re-timing of close finishers) waits for later calls.
                self.budget.spend(time.perf_counter() - started)
                return self._sweep_goes_on(memo, problem, pool, evidence, fresh,
                                           lambda: self._meanwhile(memo, namespace, problem, mode, effort, key,
                                                                   kernel_map))
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
        ran in this process if timed here), else ``otherwise()`` (:meth:`_meanwhile`)."""
        timed = self._sweeps[memo] = [*self._sweeps.get(memo, ()), *fresh]
        passing = evidence.passing(pool)
        if not passing:
            return Provisional(otherwise()), True
        best = evidence.best(passing)
        self._stand_ins.hold(memo, best, best in timed)
        return Provisional(best), best in timed

    def _meanwhile(self, memo: tuple, namespace: str, problem: ConvProblem, mode: AlgoMode, effort: str,
                   key: TuneKey | None, kernel_map: KernelMap) -> Candidate:
        """What ``memo`` runs while its kernels compile or its sweep waits: its loaded stand-in, else a candidate of
        its pool whose kernels are compiled already (:meth:`.waiting.Waiting.compiled`), else what needs no compile
        (:func:`.pools.meanwhile`)."""
        return (self._stand_ins.loaded(memo)
                or self._waiting.compiled(memo, self.cache, namespace, problem, mode, effort, key, kernel_map)
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
            missing = prior.unknown(self.cache, namespace, key, missing)
        return missing

    def _adopted(self, namespace: str, memo: tuple, key: TuneKey | None, effort: str, problem: ConvProblem
                 ) -> tuple[Candidate, registry.Backend] | None:
        """A new key's choice adopted from its family, settled untimed (:meth:`.stand_ins.StandIns.adoptable`), or
        None."""
        candidate = self._stand_ins.adoptable(namespace, memo, key, effort, problem, self.budget, self.cache,
                                              memo in self._sweeps)
        if candidate is None:
            return None
        with self._lock:
            choice = self._choices[memo] = (candidate, registry.get(candidate.backend))
            self._adoptions += 1
        return choice

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
        for batch in prior.timing_rounds(self.cache, namespace, key, pool, missing, effort, passed):
            if limit is not None and len(fresh) >= limit:
                break
            in_background = len(batch) <= SWEEP_IN_BACKGROUND or loaded
            if in_background and self._compiles.defer(memo, namespace, problem, batch, a, kernel_map,
                                                      key.deterministic):
                return None
            taken = batch if limit is None else batch[:limit - len(fresh)]
            done = dict(evidence.timings)
            evidence.timings.update(compile_and_sweep(
                namespace, problem, taken, a, b, kernel_map, self.cache, self._reported,
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
            return prior.ranked(self.cache, namespace, key, pool)[0]
        logger.warning("sparseconv: no candidate passed for %s %s; running %s", namespace, key.encode(), FALLBACK)
        return Candidate(FALLBACK)

    def choices(self) -> list[tuple[str, str, str]]:
        """(namespace, key, candidate id) of every choice this process has settled on, sorted."""
        with self._lock:
            found = {(memo[0].namespace, memo[0].encode(), candidate.id)
                     for memo, (candidate, _) in self._choices.items() if isinstance(memo[0], TuneKey)}
        return sorted(found)

    def _store(self, namespace: str, encoded: str, timings: dict[str, dict]) -> None:
        ok = {cid: t for cid, t in timings.items() if t.get("verdict") == "ok"}
        entry = {
            "timings": timings,
            "winner": pick(ok, list(ok)) if ok else FALLBACK,
            "evidence": sum(int(t.get("samples", 0)) for t in timings.values()),
            "updated": time.time(),
        }
        self.cache.put(namespace, encoded, entry)


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
