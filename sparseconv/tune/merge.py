"""How two tune-cache entries for one (namespace, key) become one: the measured-fastest wins.

Several processes (a job's ranks, runs on one machine, ``cache merge``) time the same keys, and
their entries meet when a writer merges its own with the file's. Last-writer-wins would let a
slow rank's sweep replace a fast one's; instead each candidate keeps its best timing of both,
and the entry-level fields come from :func:`_wins`'s winner.
"""

from __future__ import annotations

import math
from typing import Any


def _versions(entry: dict) -> dict[str, int]:
    timings = entry.get("timings")
    if not isinstance(timings, dict):
        return {}
    return {cid: t["version"] for cid, t in timings.items() if isinstance(t, dict) and isinstance(t.get("version"), int)}


def _cost(record: Any) -> float:
    """Milliseconds a timed candidate costs (the tuner's cost(): GPU or host time, whichever is
    longer); infinite for one that was not timed ok."""
    if not isinstance(record, dict) or record.get("verdict") != "ok" or record.get("ms") is None:
        return math.inf
    return max(record["ms"], record.get("host_ms") or 0.0)


def _fastest(entry: dict) -> float:
    """The least measured cost in ``entry`` (a tuner entry or @autotune's [[config, ms]]), or inf."""
    timings = entry.get("timings")
    if isinstance(timings, dict):
        return min(map(_cost, timings.values()), default=math.inf)
    if isinstance(timings, list):
        return min((t[1] for t in timings if isinstance(t, list) and len(t) == 2 and _is_ms(t[1])), default=math.inf)
    return math.inf


def _is_ms(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _wins(challenger: dict, holder: dict) -> bool:
    """Whether ``challenger`` replaces ``holder``: timings of a newer backend version, else the
    measured-fastest, else more evidence, then the later ``updated``; ties keep the holder.

    Versions come first because a re-timed changed backend has fewer samples than the stale
    entry it replaces whenever the sweep ran on a busier machine, and must still replace it.
    """
    mine, theirs = _versions(challenger), _versions(holder)
    shared = mine.keys() & theirs.keys()
    if any(mine[c] > theirs[c] for c in shared):
        return True
    if any(mine[c] < theirs[c] for c in shared):
        return False
    fast, held_fast = _fastest(challenger), _fastest(holder)
    if fast != held_fast:
        return fast < held_fast
    return (challenger["evidence"], challenger["updated"]) > (holder["evidence"], holder["updated"])


def _record_rank(record: Any) -> tuple:
    """Orders two timings of one candidate: newer backend version, then a 'wrong' verdict (a
    guard failure anywhere outweighs a pass elsewhere), then timed ok, then the faster."""
    if not isinstance(record, dict):
        return (-1, 0, 0.0)
    version = record.get("version")
    verdict = {"wrong": 2, "ok": 1}.get(record.get("verdict"), 0)
    return (version if isinstance(version, int) else -1, verdict, -_cost(record) if verdict == 1 else 0.0)


def _combined(challenger: dict, holder: dict) -> dict:
    """The entry for a key both hold: the winner of :func:`_wins`, with each candidate's timing
    the better of the two (so ranks that timed different candidates of a key lose none)."""
    base = challenger if _wins(challenger, holder) else holder
    mine, theirs = challenger.get("timings"), holder.get("timings")
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return base
    timings = dict(theirs)
    for cid, record in mine.items():
        if cid not in timings or _record_rank(record) > _record_rank(timings[cid]):
            timings[cid] = record
    if timings == base["timings"]:
        return base
    ok = [cid for cid in timings if _cost(timings[cid]) < math.inf]
    samples = (t.get("samples") for t in timings.values() if isinstance(t, dict))
    return {
        **base,
        "timings": timings,
        # What `cache show` prints; the tuner picks again from the timings.
        "winner": min(ok, key=lambda cid: _cost(timings[cid])) if ok else base.get("winner"),
        "evidence": sum(s for s in samples if isinstance(s, int) and not isinstance(s, bool) and s > 0),
        "updated": max(challenger["updated"], holder["updated"]),
    }


def merge(into: dict[tuple[str, str], dict], other: dict[tuple[str, str], dict]) -> list[tuple[str, str]]:
    """Merge each entry of ``other`` into ``into`` by (namespace, key) (:func:`_combined`); returns the
    keys whose entry changed."""
    taken = []
    for key, entry in other.items():
        held = into.get(key)
        merged = entry if held is None else _combined(entry, held)
        if merged is not held:
            into[key] = merged
            taken.append(key)
    return taken
