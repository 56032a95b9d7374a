"""What a product waiting for its kernels runs meanwhile, when that can be a compiled candidate.

While a product's tuned kernels compile in the background (:mod:`.precompile`), the tuner (:class:`~.tuner.Tuner`)
asks here for a candidate of its pool whose kernels are compiled already: the first of the :data:`INSTEAD` the cost
model ranks first, else its namespace's bridge (:func:`.pools.bridge`), whose few kernels the first look queues ahead
of every layer's own. What needs no compile (:func:`.pools.meanwhile`) is the tuner's answer where none is.
Not thread-safe by itself: one product's entry is written by the call that looks it up.
"""

from __future__ import annotations

from ..backends import compiling
from ..backends.problem import ConvProblem
from ..coords.kernel_map import KernelMap
from . import prior
from .cache import TuneCache
from .configs import Candidate
from .key import TuneKey
from .pools import AlgoMode, bridge, candidate_pool, meanwhile
from .precompile import ChoiceCompiles

INSTEAD = 8
"""How many of a waiting product's candidates, ranked by predicted cost, :meth:`Waiting.compiled` looks among for
one compiled already."""


class Waiting:
    """Per waiting product (a tuner memo): the candidates to look among and what the last look found."""

    def __init__(self, compiles: ChoiceCompiles) -> None:
        self._compiles = compiles
        # memo -> (background jobs finished when looked, candidates with their kernel keys, the compiled one)
        self._held: dict[tuple, tuple[int, list[tuple[Candidate, tuple]], Candidate | None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def settled(self, memo: tuple) -> None:
        """``memo`` has its choice: nothing to look up for it any more."""
        self._held.pop(memo, None)

    def compiled(self, memo: tuple, cache: TuneCache, namespace: str, problem: ConvProblem, mode: AlgoMode,
                 effort: str, key: TuneKey | None, kernel_map: KernelMap) -> Candidate | None:
        """The first of ``memo``'s pool by predicted cost, among the :data:`INSTEAD` it ranks first and ahead of what
        needs no compile, whose kernels a finished background job compiled (for this product or another one needing
        the same kernels: a cold network's products share a few dozen kernels), else the namespace's bridge, whose
        kernels the first look queues ahead of all others; None if there is none. Looked up again only when a
        background job has finished since."""
        if key is None:
            return None
        finished = self._compiles.background.finished
        held = self._held.get(memo)
        if held is not None and held[0] == finished:
            return held[2]
        try:
            among = self._among(cache, namespace, problem, mode, effort, key, kernel_map) if held is None else held[1]
            found = next((c for c, kernels in among if self._compiles.all_compiled(kernels)), None)
        except Exception:  # noqa: BLE001 - never costs the call: what needs no compile runs instead
            among, found = [], None
        self._held[memo] = (finished, among, found)
        return found

    def _among(self, cache: TuneCache, namespace: str, problem: ConvProblem, mode: AlgoMode, effort: str,
               key: TuneKey, kernel_map: KernelMap) -> list[tuple[Candidate, tuple]]:
        """A product's first look: the candidates to look among, with the kernel keys each needs; the bridge's are
        queued ahead."""
        fallback = meanwhile(problem)
        ranked = prior.ranked(cache, namespace, key, candidate_pool(namespace, problem, mode, effort, key.deterministic))
        among = ranked[:ranked.index(fallback) if fallback in ranked else len(ranked)][:INSTEAD]
        kernels = {}
        generic = bridge(namespace, problem) if compiling.applies(problem.device, key.deterministic) else None
        if generic is not None and (mode.level is not None or generic.backend in mode.names):
            # Last: a few kernels for every layer, queued first; the tuned ones win once compiled.
            kernels[generic] = self._compiles.ahead(namespace, problem, generic, kernel_map)
            among = among if generic in among else [*among, generic]
        return [(c, kernels[c] if c in kernels else self._compiles.kernels(namespace, problem, c, kernel_map))
                for c in among]
