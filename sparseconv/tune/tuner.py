"""The tuner: for each product of each conv call, which backend and parameters run.

Single-name modes run that backend untouched. Otherwise the tuner keys the product (:mod:`.key`) and remembers the
choice for the process under it: a key not settled yet is adopted from a timed sibling, runs a stand-in while its
sweep waits, or is decided from the cache file's evidence (:mod:`.decide`: the pool's candidates without a current
timing there, compiled in parallel, each guarded against ``explicit_gemm`` on the same inputs, close finishers
re-timed, agreed with the other ranks, every timing stored). A settled choice's prepared call is kept in the map's
use in its batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .. import config
from ..coords.batch import MapUse
from ..coords.kernel_map import KernelMap
from ..backends import compiling, registry
from ..backends.problem import ConvProblem, layer_problem
from .budget import TimingBudget
from .cache import TuneCache
from .choice import Progress, Provisional, current, execute
from .configs import Candidate
from .decide import Decider
from .distributed import Ranks
from .key import TuneKey, make_key
from .pools import AlgoMode, candidate_pool, resolve_mode
from .precompile import ChoiceCompiles
from .stand_ins import StandIns
from .waiting import Waiting


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
        self._compiles = compiles or ChoiceCompiles()  # no worker until a first choice compiles there
        self._stand_ins = StandIns()  # what keys run untimed
        self._adoptions = 0  # choices _adopted settled
        self._waiting = Waiting(self._compiles)  # compiled candidates for products waiting on their kernels
        self._decider = Decider(lambda: self.cache, self._compiles, ranks or Ranks(), self._stand_ins,
                                self._waiting, budget or TimingBudget())

    @property
    def budget(self) -> TimingBudget:
        """The share of wall time timing may take inside calls (the decider's: :mod:`.budget`)."""
        return self._decider.budget

    @budget.setter
    def budget(self, budget: TimingBudget) -> None:
        self._decider.budget = budget

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
                running = loaded or self._decider.running_meanwhile(memo, namespace, problem, mode, effort, key,
                                                                    kernel_map)
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
                        candidate, compiled = self._decider.decide(namespace, key, problem, mode, effort, a, b,
                                                                   kernel_map, memo)
                    if isinstance(candidate, Provisional):
                        candidate = candidate.candidate
                        if not compiled and self._compiles.defer(memo, namespace, problem, [candidate], a,
                                                                 kernel_map, deterministic):
                            running = self._decider.running_meanwhile(memo, namespace, problem, mode, effort,
                                                                      key, kernel_map)
                            return running, registry.get(running.backend), False
                        # Its kernels are loaded if it is the stand-in: the fast path above (not the reference a
                        # sweep runs while its candidates compile, nor another rank's provisional pick).
                        self._stand_ins.ran(memo, candidate)
                        return candidate, registry.get(candidate.backend), False
                    if not compiled and self._compiles.defer(memo, namespace, problem, [candidate], a, kernel_map,
                                                             deterministic):
                        running = self._decider.running_meanwhile(memo, namespace, problem, mode, effort, key,
                                                                  kernel_map)
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

    def _adopted(self, namespace: str, memo: tuple, key: TuneKey | None, effort: str, problem: ConvProblem
                 ) -> tuple[Candidate, registry.Backend] | None:
        """A new key's choice adopted from its family, settled untimed (:meth:`.stand_ins.StandIns.adoptable`), or
        None."""
        candidate = self._stand_ins.adoptable(namespace, memo, key, effort, problem, self.budget, self.cache,
                                              self._decider.sweeping(memo))
        if candidate is None:
            return None
        with self._lock:
            choice = self._choices[memo] = (candidate, registry.get(candidate.backend))
            self._adoptions += 1
        return choice

    def choices(self) -> list[tuple[str, str, str]]:
        """(namespace, key, candidate id) of every choice this process has settled on, sorted."""
        with self._lock:
            found = {(memo[0].namespace, memo[0].encode(), candidate.id)
                     for memo, (candidate, _) in self._choices.items() if isinstance(memo[0], TuneKey)}
        return sorted(found)
