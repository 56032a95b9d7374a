"""What the cache knows of one key, as a decision reads it, and how timed candidates are ranked.

A key's entry holds a timing per candidate (this machine's file over the shipped tunings beneath it);
a timing counts while it is of its backend's current ``version`` (a changed backend is timed again,
alone), and a candidate passed if its current timing's verdict is ``ok`` (it matched ``explicit_gemm``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..backends import registry
from .cache import TuneCache
from .configs import Candidate
from .timing import CLOSE


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


class Evidence:
    """One key's timings by candidate id (``timings``, updated as a sweep times more)."""

    __slots__ = ("timings",)

    def __init__(self, timings: dict[str, dict]) -> None:
        self.timings = timings

    @classmethod
    def read(cls, cache: TuneCache, namespace: str, encoded: str) -> Evidence:
        """The key's timings in ``cache`` (none if it has no entry)."""
        entry = cache.get(namespace, encoded) or {}
        return cls(dict(entry.get("timings", {})))

    def current(self, candidate: Candidate) -> dict | None:
        """The candidate's timing if it is of its backend's current version, else None."""
        timing = self.timings.get(candidate.id)
        return timing if timing is not None and timing.get("version") == registry.get(candidate.backend).version else None

    def passed(self, candidate: Candidate) -> bool:
        return (self.current(candidate) or {}).get("verdict") == "ok"

    def any_passed(self, pool: Sequence[Candidate]) -> bool:
        return any(self.passed(c) for c in pool)

    def untimed(self, pool: Sequence[Candidate]) -> list[Candidate]:
        """The candidates of ``pool`` without a current timing."""
        return [c for c in pool if self.current(c) is None]

    def stale(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Those of ``candidates`` timed, but by another version of their backend."""
        return [c for c in candidates if c.id in self.timings]

    def best(self, passing: Sequence[Candidate]) -> Candidate:
        """The winner (:func:`pick`) among ``passing``, candidates that passed (non-empty)."""
        winner = pick(self.timings, [c.id for c in passing])
        return next(c for c in passing if c.id == winner)

    def passing(self, pool: Sequence[Candidate]) -> list[Candidate]:
        """The candidates of ``pool`` that passed, cheapest first (:func:`cost`)."""
        return sorted((c for c in pool if self.passed(c)), key=lambda c: cost(self.timings[c.id]))
