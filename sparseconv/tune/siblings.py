"""A layer's keys on other batches' maps: the choices a process settled on timings, by family.

A key's family (:attr:`~.key.TuneKey.family`, with the memo's mode) is the one layer at every size: its keys differ
only in their bucketed row counts and density (:attr:`~.key.TuneKey.sizes`). A new key an unseen point cloud brings
takes the choice of its nearest timed sibling: adopted as settled within one bucket
(:meth:`.stand_ins.StandIns.adoptable`), run as a loaded stand-in a few buckets away
(:meth:`.stand_ins.StandIns.from_sibling`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..backends import registry
from ..backends.problem import ConvProblem
from .configs import Candidate
from .key import TuneKey


class Siblings:
    """{family: {sizes: the candidate settled there on timings (this process's or the records')}}; not thread-safe
    by itself: the tuner records under its lock, and a lookup reads one dict."""

    def __init__(self) -> None:
        self._by_family: dict[tuple, dict[tuple[int, int, int], Candidate]] = {}

    def record(self, memo: tuple, key: TuneKey, candidate: Candidate) -> None:
        """``candidate`` settled on timings for ``key`` (remembered under ``memo``: the key and its mode)."""
        self._by_family.setdefault((key.family, *memo[1:]), {})[key.sizes] = candidate

    def nearest(self, memo: tuple, key: TuneKey, problem: ConvProblem, spread: Callable[[Sequence[int]], int],
                within: int) -> Candidate | None:
        """The candidate of ``key``'s nearest recorded sibling (by ``spread`` of the bucket gaps, max or sum, then
        their sum) if that is at most ``within`` and its backend supports ``problem``; else None."""
        siblings = self._by_family.get((key.family, *memo[1:]))
        if not siblings:
            return None
        here = key.sizes
        gaps = {sizes: [abs(x - y) for x, y in zip(sizes, here)] for sizes in siblings}
        nearest = min(gaps, key=lambda sizes: (spread(gaps[sizes]), sum(gaps[sizes])))
        if spread(gaps[nearest]) > within:
            return None
        candidate = siblings[nearest]
        return candidate if registry.get(candidate.backend).supports(problem) is None else None
