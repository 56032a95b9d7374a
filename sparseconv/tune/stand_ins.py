"""What a key runs untimed: its stand-in while its candidates wait to be timed (the cheapest its records passed, the
cost model's pick, or a settled sibling's choice), and a new key's choice adopted from a sibling timed one bucket away.

The tuner (:class:`~.tuner.Tuner`) asks here before it times anything in a call; the timing budget (:mod:`.budget`)
and the records (the cache, the shipped tunings) decide. Not thread-safe by itself: the tuner calls under its lock
where it writes, and a lookup reads one dict.
"""

from __future__ import annotations

import torch

from ..backends import compiling
from ..backends.problem import ConvProblem
from . import prior
from .budget import TimingBudget
from .cache import TuneCache
from .configs import Candidate
from .evidence import Evidence
from .key import TuneKey
from .siblings import Siblings

ADOPT_BUCKETS = 1
"""How far (half-octave buckets, in each of the row counts and the density) a key timed here may be for a new key of
its family to adopt its choice untimed (:meth:`StandIns.adoptable`)."""

SIBLING_BUCKETS = 4
"""How far (half-octave buckets of row counts and density, summed) a settled key of a new key's family may be for
its choice to stand in (:meth:`StandIns.from_sibling`): a layer twice as large, or half as full."""


class StandIns:
    """The tuner's untimed runs: per memo, the stand-in run until the key is timed and whether its kernels are loaded
    (it has run here); and the choices settled on timings, by family (:class:`.siblings.Siblings`)."""

    def __init__(self) -> None:
        self._held: dict[tuple, tuple[Candidate, bool]] = {}
        self.siblings = Siblings()

    def __len__(self) -> int:
        """Keys running a stand-in now."""
        return len(self._held)

    def memos(self) -> list[tuple]:
        """The memos running a stand-in now."""
        return list(self._held)

    def loaded(self, memo: tuple) -> Candidate | None:
        """The stand-in of ``memo`` (:meth:`pick`) if its kernels are loaded (it has run), else None."""
        held = self._held.get(memo)
        return held[0] if held is not None and held[1] else None

    def hold(self, memo: tuple, candidate: Candidate, loaded: bool) -> None:
        """``candidate`` stands in for ``memo`` (``loaded``: its kernels ran here)."""
        self._held[memo] = (candidate, loaded)

    def ran(self, memo: tuple, candidate: Candidate) -> None:
        """``candidate`` is about to run for ``memo``: if it is the stand-in, its kernels are loaded from now on."""
        if self._held.get(memo, (None,))[0] == candidate:
            self._held[memo] = (candidate, True)

    def timed(self, memo: tuple) -> None:
        """``memo``'s candidates were timed: no stand-in any more."""
        self._held.pop(memo, None)

    def settled(self, memo: tuple, key: TuneKey, candidate: Candidate) -> None:
        """``key`` (under ``memo``) settled on ``candidate``: its family learns it, and its stand-in goes."""
        self.siblings.record(memo, key, candidate)
        self._held.pop(memo, None)

    def pick(self, namespace: str, key: TuneKey, pool: list[Candidate], effort: str, evidence: Evidence,
             a: torch.Tensor, memo: tuple, budget: TimingBudget, cache: TuneCache) -> Candidate | None:
        """What a key with candidates to time runs instead of timing them in this call, untimed: the cheapest
        candidate its records passed (this cache's or the shipped tunings'), else the cost model's first pick.

        A key whose records passed a candidate, where kernels compile in the background (a GPU, eagerly:
        :func:`compiling.in_background`), never times at its first calls: it runs that candidate (the reference
        while its kernels compile) and a later call, once it is loaded and the timing budget allows, queues the
        candidates the records lack to the background compiles and times them when compiled, the stand-in
        running meanwhile. Timed at once, a shipped key's four candidates the shipped tunings lacked cost a cold
        process's first pass 4 of its 8.7 s at 91k (H200, 2026-11-28), compiled and timed in the call. A key
        without records keeps its sweep (compiled in the background first, the reference running meanwhile):
        run through a stand-in first, each such key compiled twice and was timed later, inside the passes a
        user times (street1's unseen-cloud rounds, 12.5 -> 24.6 ms median). Elsewhere the stand-in runs only
        while the budget is spent (:mod:`.budget`). None (time it now) under effort full (tuning ahead), in
        deterministic mode (which kernel ran would depend on the clock), with neither records nor a fitted
        model to pick from, or inside :meth:`.budget.TimingBudget.waived` (a moment chosen to tune)."""
        if effort != "quick" or key.deterministic or budget.waiving:
            return None
        held = self._held.get(memo)
        recorded = evidence.passing(pool)
        first_calls = ((held is None or not held[1]) and bool(recorded)
                       and compiling.in_background(a, key.deterministic))
        if not first_calls and budget.allows():
            return None
        if held is None:
            if recorded:
                choice = evidence.best(recorded)
            else:
                costs = prior.predicted(cache, namespace, key, pool)
                if not costs:
                    return None
                choice = min((c for c in pool if c.id in costs), key=lambda c: costs[c.id])
            held = self._held[memo] = (choice, False)
        return held[0]

    def adoptable(self, namespace: str, memo: tuple, key: TuneKey | None, effort: str, problem: ConvProblem,
                  budget: TimingBudget, cache: TuneCache, sweeping: bool) -> Candidate | None:
        """A new key at most :data:`ADOPT_BUCKETS` from a key of its family settled on timings here, in each of its
        row counts and its density: that key's choice, settled for this one untimed (a choice, not a stand-in: no
        sweep follows); else None. Within a bucket sizes 1.4x apart share a winner already (:mod:`.key`), and the
        next bucket's centre is that far: on unseen point clouds most new keys are one bucket from a timed one, and
        timing them took ~6 ms of every street1 inference (H200). Adopted choices serve no further key (no chains
        of adoptions), and are not written to the cache. None where the key has records of its own (the cache's or
        the shipped tunings'), under effort full, in deterministic mode, inside :meth:`.budget.TimingBudget.waived`, or
        while the key's own sweep goes on (``sweeping``). The caller settles it."""
        if key is None or effort != "quick" or key.deterministic or budget.waiving or sweeping or memo in self._held:
            return None
        candidate = self.siblings.nearest(memo, key, problem, max, ADOPT_BUCKETS)
        if candidate is None or cache.get(namespace, key.encode()) is not None:
            return None
        return candidate

    def from_sibling(self, memo: tuple, key: TuneKey | None, effort: str, problem: ConvProblem,
                     budget: TimingBudget) -> Candidate | None:
        """A new key's stand-in from its family (the same layer's keys on other batches' maps, :attr:`TuneKey.family`):
        the choice this process settled for the nearest of its keys in buckets, at most :data:`SIBLING_BUCKETS`
        away, kept as ``memo``'s loaded stand-in; else None. Its kernels are loaded (they ran here) and need no
        compile (none specialises on row counts), so a key an unseen point cloud brings runs at once what its
        neighbour settled on, not the reference or explicit_gemm_table while the model's picks compile; its sweep
        still runs, in later calls within the timing budget. None for a key with a stand-in already, under
        effort full, in deterministic mode or inside :meth:`.budget.TimingBudget.waived` (as :meth:`pick`)."""
        if key is None or memo in self._held or effort != "quick" or key.deterministic or budget.waiving:
            return None
        candidate = self.siblings.nearest(memo, key, problem, sum, SIBLING_BUCKETS)
        if candidate is not None:
            self._held[memo] = (candidate, True)
        return candidate
