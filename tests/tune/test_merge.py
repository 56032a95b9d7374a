"""The tune cache's merge rule: the measured-fastest entry wins and no candidate's timing is lost."""

from __future__ import annotations

import pytest

from sparseconv.tune.merge import merge


def timed(ms: float | None, version: int = 1, verdict: str = "ok", samples: int = 5, **extra) -> dict:
    return {"ms": ms, "version": version, "verdict": verdict, "samples": samples, **extra}


def entry(timings: dict, evidence: int = 10, updated: float = 100.0, **extra) -> dict:
    return {"timings": timings, "evidence": evidence, "updated": updated, **extra}


def merged(held: dict, offered: dict) -> dict:
    into = {("ns", "k"): held}
    merge(into, {("ns", "k"): offered})
    return into[("ns", "k")]


@pytest.mark.parametrize("fast_first", [True, False], ids=["fast-held", "fast-offered"])
def test_the_measured_fastest_entry_wins_over_more_evidence_and_a_later_update(fast_first):
    fast = entry({"a": timed(1.0), "b": timed(2.0)}, evidence=3, updated=1.0, rank=0)
    slow = entry({"a": timed(1.5), "b": timed(2.5)}, evidence=90, updated=9.0, rank=1)
    result = merged(fast, slow) if fast_first else merged(slow, fast)
    assert result["rank"] == 0
    assert result["timings"]["a"]["ms"] == 1.0 and result["timings"]["b"]["ms"] == 2.0


def test_candidates_timed_by_different_ranks_are_all_kept():
    rank0 = entry({"a": timed(2.0), "b": timed(None, verdict="failed", samples=0)})
    rank1 = entry({"c": timed(1.0)})
    result = merged(rank0, rank1)
    assert set(result["timings"]) == {"a", "b", "c"}
    assert result["winner"] == "c" and result["evidence"] == 10
    assert merged(rank1, rank0)["timings"] == result["timings"]


def test_host_time_counts_in_which_timing_is_fastest():
    gpu_fast_host_bound = entry({"a": timed(0.5, host_ms=3.0)})
    balanced = entry({"a": timed(1.0, host_ms=1.0)})
    assert merged(gpu_fast_host_bound, balanced)["timings"]["a"]["ms"] == 1.0


def test_a_newer_backend_version_replaces_a_faster_stale_timing():
    stale = entry({"a": timed(0.1, version=1), "b": timed(5.0)})
    fresh = entry({"a": timed(3.0, version=2)}, evidence=1)
    result = merged(stale, fresh)
    assert result["timings"]["a"]["version"] == 2 and result["timings"]["b"]["ms"] == 5.0


def test_a_guard_failure_outweighs_a_pass_of_the_same_version():
    passed = entry({"a": timed(0.1), "b": timed(1.0)})
    failed = entry({"a": timed(None, verdict="wrong", samples=0, reason="relative error")})
    for result in (merged(passed, failed), merged(failed, passed)):
        assert result["timings"]["a"]["verdict"] == "wrong" and result["winner"] == "b"


def test_equal_entries_leave_the_holder_in_place():
    held = entry({"a": timed(1.0)})
    into = {("ns", "k"): held}
    assert merge(into, {("ns", "k"): entry({"a": timed(1.0)}, evidence=1)}) == []
    assert into[("ns", "k")] is held


def test_autotune_entries_keep_the_fastest_config():
    slow = {"winner": "x", "timings": [["x", 2.0], ["y", 3.0]], "evidence": 50, "updated": 9.0}
    fast = {"winner": "y", "timings": [["x", 2.5], ["y", 1.0]], "evidence": 5, "updated": 1.0}
    assert merged(slow, fast)["winner"] == "y" and merged(fast, slow)["winner"] == "y"
