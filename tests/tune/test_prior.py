"""The cost model: a planted law is recovered, held-out keys are ranked well, no data falls back,
and the tuner times only the model's top picks under effort quick."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time

import numpy as np
import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, VirtualClock, registered

import sparseconv.tune
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit
from sparseconv.tune import prior, waiting
from sparseconv.tune.cache import TuneCache
from sparseconv.tune.configs import Candidate
from sparseconv.tune.key import TuneKey, device_identity

DEVICE = "cuda FAKE GPU sm90 132SM"
FWD = "AB_gather_scatter"
# log2 ms = intercept + slopes . (log2 N_in, log2 N_out, log2 pairs/offset, log2 C_in, log2 C_out, log2 K, down,
# up, generative): "small" wins small layers, "large" large ones, "wide" many channels; they cross in the grid.
LAWS = {
    "small": (-24.0, (0.1, 1.0, 0.1, 0.5, 0.5, 0.8, 0.0, 0.0, 0.0)),
    "large": (-21.0, (0.1, 0.8, 0.1, 0.5, 0.5, 0.7, 0.2, 0.0, 0.0)),
    "wide": (-21.6, (0.1, 1.0, 0.1, 0.3, 0.3, 0.8, 0.0, 0.3, 0.0)),
    "slow": (-22.0, (0.1, 1.0, 0.1, 0.5, 0.5, 0.8, 0.0, 0.0, 0.0)),
}


def law(cid: str, encoded: str) -> float:
    """The planted log2 ms of ``cid`` at a key (cand ids may carry params: their backend's law)."""
    intercept, slopes = LAWS[cid.split("[", 1)[0]]
    return intercept + sum(s * v for s, v in zip(slopes, prior.key_features(encoded).values))


def random_key(rng: random.Random, namespace: str = FWD, device: str = DEVICE, dtype: str = "float16") -> str:
    n = rng.randrange(20, 38)
    geometry = rng.choice(["s1x1x1", "s2x2x2", "t2x2x2"])
    return TuneKey(namespace, n + rng.choice([-1, 0, 1]), n, rng.randrange(2, 9), rng.choice([16, 32, 64, 128, 256]),
                   rng.choice([16, 32, 64, 128, 256]), rng.choice([8, 27]), geometry, dtype, device).encode()


def entry(encoded: str, candidates, noise: float, rng: random.Random) -> dict:
    timings = {}
    for cid in candidates:
        ms = 2.0 ** (law(cid, encoded) + rng.gauss(0.0, noise))
        timings[cid] = {"backend": cid.split("[", 1)[0], "params": [], "version": 1, "ms": ms,
                        "host_ms": 1e-4, "samples": 10, "verdict": "ok"}
    return {"timings": timings, "winner": min(timings, key=lambda c: timings[c]["ms"]), "evidence": 10,
            "updated": time.time()}


def synthetic(count: int, seed: int = 0, noise: float = 0.02, candidates=tuple(LAWS), **key_args) -> list:
    rng = random.Random(seed)
    keys = {random_key(rng, **key_args) for _ in range(count)}
    return [(FWD if "namespace" not in key_args else key_args["namespace"], k, entry(k, candidates, noise, rng))
            for k in sorted(keys)]


def test_a_planted_log_linear_law_is_recovered_on_unseen_keys():
    train, unseen = synthetic(150, seed=1, noise=0.01), synthetic(40, seed=2, noise=0.0)
    model = prior.CostModel.fit(train)
    for namespace, encoded, _ in unseen:
        predicted = model.predict(namespace, encoded, list(LAWS))
        assert set(predicted) == set(LAWS)
        for cid, ms in predicted.items():
            assert abs(math.log2(ms) - law(cid, encoded)) < 0.05, (cid, encoded)
    # The slope itself: doubling C_out multiplies "wide"'s time by 2**0.3.
    base = TuneKey(FWD, 30, 30, 4, 64, 64, 27, "s1x1x1", "float16", DEVICE)
    wider = TuneKey(FWD, 30, 30, 4, 64, 128, 27, "s1x1x1", "float16", DEVICE)
    ratio = model.predict(FWD, wider.encode(), ["wide"])["wide"] / model.predict(FWD, base.encode(), ["wide"])["wide"]
    assert ratio == pytest.approx(2.0 ** 0.3, rel=0.02)


def test_a_refit_reads_only_the_entries_that_changed_and_fits_as_a_fresh_fit(monkeypatch):
    rows = synthetic(120, seed=7, noise=0.02)
    parsed, read = {}, []
    entry_samples = prior._entry_samples
    monkeypatch.setattr(prior, "_entry_samples", lambda *args: read.append(args[1]) or entry_samples(*args))
    prior.CostModel.fit(rows, parsed=parsed)
    assert len(read) == len(rows)
    namespace, encoded, old = rows[5]
    changed = {**old, "timings": {**old["timings"], "wide": {**old["timings"]["wide"], "ms": 1e3}}}
    rows[5] = (namespace, encoded, changed)  # a new timing stored: a new entry object (TuneCache.put copies)
    read.clear()
    memoised = prior.CostModel.fit(rows, parsed=parsed)
    assert read == [encoded]
    fresh = prior.CostModel.fit(rows)
    for _, key, _ in synthetic(20, seed=8, noise=0.0):
        assert memoised.predict(FWD, key, list(LAWS)) == pytest.approx(fresh.predict(FWD, key, list(LAWS)), rel=1e-12)
    read.clear()
    prior.CostModel.fit(rows, versions={"wide": 99}, parsed=parsed)  # other versions: every entry read again
    assert len(read) == len(rows)


def test_host_time_bounds_the_predicted_cost():
    rows = synthetic(60, seed=3, noise=0.0)
    for _, _, e in rows:
        e["timings"]["small"]["host_ms"] = 5.0  # host-bound everywhere: its cost never drops below 5 ms
    predicted = prior.CostModel.fit(rows).predict(FWD, TuneKey(FWD, 20, 20, 4, 16, 16, 8, "s1x1x1", "float16",
                                                                 DEVICE).encode(), ["small"])
    assert predicted["small"] == pytest.approx(5.0, rel=0.01)


def test_without_enough_data_the_pool_keeps_its_heuristic_order(tmp_path):
    cache = TuneCache(tmp_path / "c.msgpack")
    key = TuneKey(FWD, 30, 30, 4, 64, 64, 27, "s1x1x1", "float16", DEVICE)
    pool = [Candidate("slow"), Candidate("small"), Candidate("wide"), Candidate("large")]
    assert prior.ranked(cache, FWD, key, pool) == pool  # no data at all
    assert list(prior.timing_rounds(cache, FWD, key, pool, pool, "quick", lambda: False)) == [pool]
    for namespace, encoded, e in synthetic(prior.MIN_KEYS - 1, seed=5):
        cache.put(namespace, encoded, e)
    assert prior.ranked(cache, FWD, key, pool) == pool  # too few keys
    for namespace, encoded, e in synthetic(40, seed=6, dtype="bfloat16"):
        cache.put(namespace, encoded, e)
    assert prior.ranked(cache, FWD, key, pool) == pool  # enough keys, of another dtype
    for namespace, encoded, e in synthetic(40, seed=7, device="cuda OTHER GPU sm80 108SM"):
        cache.put(namespace, encoded, e)
    assert prior.ranked(cache, FWD, key, pool) == pool  # enough keys, of another device
    for namespace, encoded, e in synthetic(40, seed=8):
        cache.put(namespace, encoded, e)
    ranked = prior.ranked(cache, FWD, key, pool)
    assert ranked != pool and ranked[-1] == Candidate("slow")


def test_the_model_is_refitted_when_its_data_grew_by_a_share_not_at_every_new_key(tmp_path, monkeypatch):
    fits = []
    fit = prior.CostModel.fit.__func__
    monkeypatch.setattr(prior.CostModel, "fit", classmethod(lambda cls, *a, **k: fits.append(1) or fit(cls, *a, **k)))
    cache = TuneCache(tmp_path / "c.msgpack")
    rows = synthetic(200, seed=12)
    for namespace, encoded, e in rows[:100]:
        cache.put(namespace, encoded, e)
    key = TuneKey(FWD, 30, 30, 4, 64, 64, 27, "s1x1x1", "float16", DEVICE)
    pool = [Candidate(c) for c in LAWS]
    prior.ranked(cache, FWD, key, pool)
    assert len(fits) == 1
    grow = max(1, math.ceil(prior.REFIT_SHARE * 100))
    for namespace, encoded, e in rows[100:100 + grow - 1]:  # a few new keys, as each unseen point cloud brings
        cache.put(namespace, encoded, e)
        prior.ranked(cache, FWD, key, pool)
    assert len(fits) == 1
    namespace, encoded, e = rows[100 + grow - 1]
    cache.put(namespace, encoded, e)
    prior.ranked(cache, FWD, key, pool)
    assert len(fits) == 2
    with registered(Backend(name="newcomer", ops=frozenset({FWD}), run=explicit.run)):  # other backends: refitted
        prior.ranked(cache, FWD, key, pool)
    assert len(fits) == 3


def test_a_fit_inside_a_call_sets_off_no_collection_of_the_heap_and_leaves_the_collector_as_it_was(tmp_path,
                                                                                                   monkeypatch):
    import gc

    cache = TuneCache(tmp_path / "c.msgpack")
    for namespace, encoded, e in synthetic(300, seed=13):
        cache.put(namespace, encoded, e)
    key = TuneKey(FWD, 30, 30, 4, 64, 64, 27, "s1x1x1", "float16", DEVICE)
    fitting, collections = [], []
    fit = prior.CostModel.fit.__func__

    def fit_watched(cls, *args, **kwargs):
        fitting.append(1)
        try:
            return fit(cls, *args, **kwargs)
        finally:
            fitting.pop()

    monkeypatch.setattr(prior.CostModel, "fit", classmethod(fit_watched))
    collect = lambda phase, info: phase == "start" and fitting and collections.append(info["generation"])  # noqa: E731
    thresholds = gc.get_threshold()
    gc.callbacks.append(collect)
    try:
        gc.set_threshold(50, 2, 2)  # a busy heap: a fit's rows would set off collections of every generation
        assert prior.ranked(cache, FWD, key, [Candidate(c) for c in LAWS])[0].id in LAWS  # fitted here
        assert collections == [] and gc.isenabled()
        gc.disable()
        prior.model_of(TuneCache(tmp_path / "d.msgpack"), FWD)
        assert not gc.isenabled()  # a collector the application switched off stays off
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(collect)


def test_quick_times_the_top_picks_and_unknown_candidates_then_the_rest_only_if_none_passed(tmp_path):
    cache = TuneCache(tmp_path / "c.msgpack")
    for namespace, encoded, e in synthetic(40, seed=9):
        cache.put(namespace, encoded, e)
    key = TuneKey(FWD, 30, 30, 4, 64, 64, 27, "s1x1x1", "float16", DEVICE)
    pool = [Candidate(n) for n in ("slow", "small", "wide", "large", "new")]  # "new": never timed anywhere
    rounds = prior.timing_rounds(cache, FWD, key, pool, pool, "quick", lambda: True)
    first = next(rounds)
    assert Candidate("new") in first and Candidate("slow") not in first and len(first) == prior.QUICK_TOP + 1
    assert list(rounds) == []  # a pick passed: the rest stay untimed
    rounds = list(prior.timing_rounds(cache, FWD, key, pool, pool, "quick", lambda: False))
    assert rounds[1] == [Candidate("slow")]
    assert list(prior.timing_rounds(cache, FWD, key, pool, pool, "full", lambda: False)) == [pool]


# ---------------------------------------------------------------- in the tuner -----------------

def _speeds(calls: Calls, clock: VirtualClock, wrong: frozenset = frozenset(), **fields) -> Backend:
    """Six parameter sets whose calls cost 1, 5, ..., 21 ms on ``clock``; those in ``wrong`` return noise;
    ``fields``: more Backend fields."""
    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(f"fake_speeds[{params['level']}]", namespace)
        clock.advance(1e-3 + params["level"] * 4e-3)
        out = explicit.run(namespace, problem, params, a, b, kernel_map)
        return torch.randn_like(out) if params["level"] in wrong else out

    return Backend("fake_speeds", frozenset({FWD}), run, params_space=tuple({"level": i} for i in range(6)), **fields)


def _seed_cache(fastest: int = 0) -> None:
    """Timings of the fake's six sets at many keys of this machine, the slower the further from ``fastest``."""
    rng = random.Random(0)
    cache = sparseconv.tune.get_tuner().cache
    device = device_identity(torch.device("cpu"))
    for _ in range(3 * prior.MIN_KEYS):
        encoded = random_key(rng, device=device, dtype="float32")
        ms = 2.0 ** (law("small", encoded))
        timings = {f"fake_speeds[level={i}]": {"backend": "fake_speeds", "params": [["level", i]], "version": 1,
                                               "ms": ms * (1 + abs(i - fastest)), "samples": 10, "verdict": "ok"} for i in range(6)}
        cache.put(FWD, encoded, {"timings": timings, "winner": f"fake_speeds[level={fastest}]", "evidence": 60,
                                 "updated": time.time()})


def _conv(**pins):
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=300)
    weight = torch.randn(27, 4, 5)
    record: dict = {}
    sparse_conv3d(x, weight, record=record, **pins)
    return record


@pytest.mark.parametrize("effort", ["quick", "full"])
def test_the_tuner_times_only_the_models_top_picks_under_quick(monkeypatch, effort, clock):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", effort)
    calls = Calls()
    with registered(_speeds(calls, clock)):
        _seed_cache()
        record = _conv(fwd_algo=["fake_speeds"])
    timed = {i for i in range(6) if calls.of(f"fake_speeds[{i}]")}
    assert timed == ({0, 1, 2} if effort == "quick" else set(range(6)))
    assert record[FWD] in {f"fake_speeds[level={i}]" for i in timed}


@pytest.mark.parametrize("effort", ["quick", "full"])
def test_a_recorded_decision_stands_under_quick_when_a_refitted_model_ranks_others_first(monkeypatch, effort, clock):
    calls = Calls()
    with registered(_speeds(calls, clock)):
        _seed_cache()
        _conv(fwd_algo=["fake_speeds"])
        cache = sparseconv.tune.get_tuner().cache
        ((key, stored),) = [(k, e) for _, k, e in cache.items(FWD) if len(e["timings"]) < 6]  # the conv's key
        # As a process with other data would have decided it: level 4 alone timed (and passed).
        cache.put(FWD, key, {**stored, "timings": {"fake_speeds[level=4]": stored["timings"]["fake_speeds[level=0]"]},
                             "winner": "fake_speeds[level=4]"})
        sparseconv.tune.reset()
        calls.counts.clear()
        monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", effort)
        record = _conv(fwd_algo=["fake_speeds"])
    timed = {i for i in range(6) if calls.of(f"fake_speeds[{i}]")}
    if effort == "quick":
        assert record[FWD] == "fake_speeds[level=4]" and sum(calls.counts.values()) == 1  # the run: nothing timed
    else:
        assert timed >= {0, 1, 2, 3, 5}  # full times every candidate the entry lacks


def test_over_the_timing_budget_a_new_key_runs_the_models_pick_untimed_and_is_timed_once_it_refills(monkeypatch, clock):
    from sparseconv.tune import decide, tuner as tuner_module
    from sparseconv.tune.budget import TimingBudget

    pools = []
    pool_of = tuner_module.candidate_pool
    for module in (tuner_module, decide):
        monkeypatch.setattr(module, "candidate_pool", lambda *args: pools.append(1) or pool_of(*args))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=300)
    weight = torch.randn(27, 4, 5)
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)  # the pool's order (by id) puts level 0 first
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(share=0.0, burst=0.0)  # spent, and never refilled
        for i in range(2):
            record: dict = {}
            sparse_conv3d(x, weight, record=record, fwd_algo=["fake_speeds"])
            assert record[FWD] == "fake_speeds[level=4]"  # the model's pick, not the pool's first
            if i == 0:
                pools.clear()
        assert not pools  # a waiting key's later calls build no pool and read no cache
        assert sum(calls.counts.values()) == 2  # the two forwards: nothing timed
        assert all(len(e["timings"]) == 6 for _, _, e in tuner.cache.items(FWD))  # the seeded keys alone
        assert tuner.choices() == []  # not settled: a later call times it
        tuner.budget = TimingBudget(burst=1.0, per_call=None)  # refilled, a sweep in one call
        record = _conv(fwd_algo=["fake_speeds"])
    timed = {i for i in range(6) if calls.of(f"fake_speeds[{i}]") > (2 if i == 4 else 0)}
    assert timed == {3, 4, 5}  # timed now: the model's top picks
    assert record[FWD] == "fake_speeds[level=3]" and [c[2] for c in tuner.choices()] == [record[FWD]]
    assert tuner.budget.spent_s > 0


def _one_layer():
    """A call of one conv layer on inputs fixed for the test (one key), returning the forward's candidate id."""
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=300)
    weight = torch.randn(27, 4, 5)

    def algorithm() -> str:
        record: dict = {}
        sparse_conv3d(x, weight, record=record, fwd_algo=["fake_speeds"])
        return record[FWD]

    return algorithm


def test_a_waiting_key_keeps_its_loaded_stand_in_while_its_sweep_compiles(monkeypatch, clock):
    from sparseconv.tune.budget import TimingBudget

    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(share=0.0, burst=0.0)
        assert algorithm() == algorithm() == "fake_speeds[level=4]"  # the stand-in, loaded
        tuner.budget = TimingBudget(burst=1.0, per_call=None)
        # The budget allows a sweep, whose kernels compile in the background first (as on a GPU): the stand-in
        # runs meanwhile, not the reference, in the call that queued them and in those while they compile.
        with monkeypatch.context() as compiling:
            compiling.setattr(tuner._compiles, "defer", lambda *args: True)
            assert algorithm() == "fake_speeds[level=4]"
            compiling.setattr(tuner._compiles, "pending", lambda memo: True)
            compiling.setattr(sparseconv.tune.tuner.compiling, "on_gpu_eagerly", lambda a: True)
            assert algorithm() == "fake_speeds[level=4]"
        assert sum(calls.counts.values()) == 4  # nothing timed yet
        assert algorithm() == "fake_speeds[level=3]"  # compiled: timed, and the winner settled
        assert [c[2] for c in tuner.choices()] == ["fake_speeds[level=3]"]


def _seed_levels(levels, fastest: int = 0) -> None:
    """:func:`_seed_cache` with only ``levels`` timed at each key (the others unknown to the cost model)."""
    cache = sparseconv.tune.get_tuner().cache
    _seed_cache(fastest)
    for namespace, encoded, stored in list(cache.items(FWD)):
        cache.put(namespace, encoded, {**stored, "timings": {f"fake_speeds[level={i}]": stored["timings"][
            f"fake_speeds[level={i}]"] for i in levels}})


def _background(monkeypatch, tuner) -> list:
    """Kernels compile in the background (as on a GPU): a list of the candidate ids queued there, each list
    compiling at its first queueing and compiled at the next."""
    from sparseconv.tune import tuner as tuner_module

    monkeypatch.setattr(tuner_module.compiling, "in_background", lambda a, deterministic: not deterministic)
    queued: list = []

    def defer(memo, namespace, problem, candidates, a, kernel_map, deterministic):
        queued.append(tuple(c.id for c in candidates))
        return queued.count(queued[-1]) == 1

    monkeypatch.setattr(tuner._compiles, "defer", defer)
    return queued


def test_where_kernels_compile_in_the_background_a_recorded_key_runs_its_best_at_once_and_times_the_rest_later(
        monkeypatch, clock):
    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock)):
        _seed_levels(range(5), fastest=4)  # level 5: unknown to the cost model, timed wherever met
        algorithm()  # this key's records (on the CPU, timed in the call)
        cache = sparseconv.tune.get_tuner().cache
        ((key, stored),) = [(k, e) for _, k, e in cache.items(FWD) if "fake_speeds[level=5]" in e["timings"]]
        # As shipped tunings older than level 5 would hold the key: level 4 passed, level 5 untimed.
        cache.put(FWD, key, {**stored, "timings": {"fake_speeds[level=4]": stored["timings"]["fake_speeds[level=4]"]},
                             "winner": "fake_speeds[level=4]"})
        sparseconv.tune.reset()
        calls.counts.clear()
        tuner = sparseconv.tune.get_tuner()
        queued = _background(monkeypatch, tuner)
        # The budget allows timing, yet the first calls neither time nor compile in the call: the records' best
        # compiles in the background while the reference runs, then runs itself.
        assert algorithm() == "explicit_gemm"
        assert algorithm() == "fake_speeds[level=4]"
        assert queued == [("fake_speeds[level=4]",)] * 2 and sum(calls.counts.values()) == 1
        assert tuner.choices() == [] and tuner.budget.spent_s == 0
        assert sparseconv.tune.progress() == (0, 1, 0, 0.0, 0)  # one product running a pick untimed
        # A later call queues the candidate the records lack and runs the stand-in; once it compiled, a call
        # times it and settles the winner.
        assert algorithm() == "fake_speeds[level=4]"
        assert queued[2:] == [("fake_speeds[level=5]",)] and not calls.of("fake_speeds[5]")
        assert algorithm() == "fake_speeds[level=4]"
        assert calls.of("fake_speeds[5]") and tuner.budget.spent_s > 0
        assert [c[2] for c in tuner.choices()] == ["fake_speeds[level=4]"]
        done = sparseconv.tune.progress()
        assert (done.settled, done.untimed, done.compiling) == (1, 0, 0) and done.timed_s == tuner.budget.spent_s


def test_where_kernels_compile_in_the_background_a_key_without_records_compiles_its_sweep_first(monkeypatch, clock):
    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        queued = _background(monkeypatch, tuner)
        assert algorithm() == "explicit_gemm"  # the reference while the sweep compiles
        assert len(queued) == 1 and set(queued[0]) == {f"fake_speeds[level={i}]" for i in (3, 4, 5)}
        assert not calls.counts
        assert algorithm() == "fake_speeds[level=3]"  # compiled: timed and settled
        assert {i for i in range(6) if calls.of(f"fake_speeds[{i}]")} == {3, 4, 5}


def test_while_a_keys_sweep_compiles_it_runs_the_best_ranked_candidate_compiled_already_not_the_reference(
        monkeypatch, clock):
    from sparseconv.tune import tuner as tuner_module

    monkeypatch.setattr(tuner_module.compiling, "in_background", lambda a, deterministic: not deterministic)
    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        compiling = [True]
        monkeypatch.setattr(tuner._compiles, "defer", lambda *args: compiling[0])
        compiled: set = set()  # what finished background jobs compiled (for this product or another)
        monkeypatch.setattr(tuner._compiles, "kernels", lambda namespace, problem, c, kernel_map: (c.id,))
        monkeypatch.setattr(tuner._compiles.background, "compiled", lambda kernel: kernel in compiled)
        background = tuner._compiles.background
        assert algorithm() == "explicit_gemm"  # nothing compiled yet: the reference
        compiled.add("fake_speeds[level=1]")
        assert algorithm() == "explicit_gemm"  # no job finished since the last look: not looked up again
        background.finished += 1
        assert algorithm() == "fake_speeds[level=1]"
        compiled.add("fake_speeds[level=4]")
        background.finished += 1
        assert algorithm() == "fake_speeds[level=4]"  # the cost model ranks it first
        assert not calls.of("fake_speeds[3]") and tuner.choices() == []  # nothing timed while the sweep compiles
        compiling[0] = False
        assert algorithm() == "fake_speeds[level=3]"  # its sweep compiled: timed and settled
        assert {i for i in range(6) if calls.of(f"fake_speeds[{i}]") > (1 if i in (1, 4) else 0)} == {3, 4, 5}
        assert not len(tuner._waiting)  # settled: nothing kept for it


def test_inside_a_waived_stretch_a_new_key_is_timed_at_once_where_kernels_compile_in_the_background(monkeypatch, clock):
    from sparseconv.tune import tuner as tuner_module

    monkeypatch.setattr(tuner_module.compiling, "in_background", lambda a, deterministic: not deterministic)
    calls = Calls()
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        monkeypatch.setattr(tuner._compiles, "defer", lambda *args: False)  # compiled
        with tuner.budget.waived():  # as sparseconv.warmup and a graph's capture run
            record = _conv(fwd_algo=["fake_speeds"])
    assert {i for i in range(6) if calls.of(f"fake_speeds[{i}]")} == {3, 4, 5}
    assert [c[2] for c in tuner.choices()] == [record[FWD]] == ["fake_speeds[level=3]"]


@pytest.mark.parametrize("setting", ["full", "deterministic"])
def test_effort_full_and_deterministic_mode_time_a_new_key_even_over_the_budget(monkeypatch, setting, clock):
    from sparseconv.tune.budget import TimingBudget

    if setting == "full":
        monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "full")
    else:
        previous = sparseconv.set_deterministic(True)
    calls = Calls()
    try:
        with registered(_speeds(calls, clock, deterministic=lambda namespace, params: True)):
            _seed_cache()
            sparseconv.tune.get_tuner().budget = TimingBudget(share=0.0, burst=0.0)
            _conv(fwd_algo=["fake_speeds"])
    finally:
        if setting == "deterministic":
            sparseconv.set_deterministic(previous)
    assert sum(calls.counts.values()) > 1  # timed in the call


def test_the_model_is_fitted_on_the_shipped_tunings_beneath_an_empty_cache(monkeypatch, tmp_path, clock):
    from sparseconv.tune import shipped

    calls = Calls()
    with registered(_speeds(calls, clock)):
        _seed_cache()
        cache = sparseconv.tune.get_tuner().cache
        folder = tmp_path / "shipped"
        folder.mkdir()
        shipped.write(folder / shipped.device_file_name(device_identity(torch.device("cpu"))),
                      {(ns, key): entry for ns, key, entry in cache.items()})
        assert cache.wait_for_writes(30)  # (the puts handed their write to the cache's writer thread)
        cache.path.unlink()
        monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tmp_path / "empty-cache"))
        monkeypatch.setattr(shipped, "data_dir", lambda: folder)
        monkeypatch.setenv("SPARSECONV_SHIPPED_TUNINGS", "1")
        sparseconv.tune.reset()
        assert sparseconv.tune.get_tuner().cache.items() == []
        _conv(fwd_algo=["fake_speeds"])  # a key the shipped file does not hold
    assert {i for i in range(6) if calls.of(f"fake_speeds[{i}]")} == {0, 1, 2}
    shipped.forget()


def test_the_tuner_times_the_rest_when_no_top_pick_passes(caplog, clock):
    calls = Calls()
    with (registered(_speeds(calls, clock, wrong=frozenset({0, 1, 2}))),
          caplog.at_level(logging.INFO, "sparseconv.tune")):
        _seed_cache()
        record = _conv(fwd_algo=["fake_speeds"])
    assert all(calls.of(f"fake_speeds[{i}]") for i in range(6))
    assert record[FWD] in {"fake_speeds[level=3]", "fake_speeds[level=4]", "fake_speeds[level=5]"}
    assert "no pick passed" in caplog.text


def test_effort_none_runs_the_models_first_pick_untimed(monkeypatch, clock):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    calls = Calls()
    with registered(_speeds(calls, clock)):
        _seed_cache(fastest=4)  # the pool's order (by id) puts level 0 first
        record = _conv(fwd_algo=["fake_speeds"])
    assert record[FWD] == "fake_speeds[level=4]"
    assert sum(calls.counts.values()) == 1  # the forward itself: nothing timed


def test_no_data_fallback_in_the_tuner_is_the_heuristic_order(monkeypatch, clock):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    with registered(_speeds(Calls(), clock)):
        record = _conv(fwd_algo=["fake_speeds"])
    assert record[FWD] == "fake_speeds[level=0]"  # equal heuristic scores: the pool is in id order


def test_key_features_read_an_encoded_key():
    key = TuneKey(FWD, 30, 28, 6, 32, 64, 27, "t2x2x2g", "bfloat16", "cuda NVIDIA H100 | odd name sm90 132SM")
    features = prior.key_features(key.encode())
    assert features.dtype == "bfloat16" and features.device == key.device
    assert np.allclose(features.values, (15, 14, 14 - 3, 5, 6, math.log2(27), 0, 1, 1))
    assert prior.key_features("autotune:op=x|dtype=float16") is None
    flagged = dataclasses.replace(key, deterministic=True, lone=True)  # flags after the device are not the device
    assert prior.key_features(flagged.encode()) == features


def test_bench_tuner_prior_option_prints_the_accuracy_table(tmp_path, capsys, monkeypatch):
    from conftest import load_script

    path = tmp_path / "gpu.msgpack"
    cache = TuneCache(path)
    for namespace, encoded, e in synthetic(60, seed=10):
        cache.put(namespace, encoded, e)
    cache.flush(force=True)
    monkeypatch.setattr("sys.argv", ["bench_tuner.py", "--prior", str(path), "--folds", "3"])
    load_script("bench_tuner").main()
    lines = capsys.readouterr().out.splitlines()
    assert "3-fold" in lines[0] and lines[1].split()[:4] == ["namespace", "device", "keys", "scored"]
    assert lines[2].startswith(FWD) and DEVICE in lines[2]
    with pytest.raises(SystemExit, match="is not a file"):
        monkeypatch.setattr("sys.argv", ["bench_tuner.py", "--prior", str(tmp_path / "missing")])
        load_script("bench_tuner").main()


def test_while_a_keys_kernels_compile_its_bridge_is_queued_ahead_and_runs_once_compiled_until_a_ranked_one_is(
        monkeypatch, clock):
    from sparseconv.tune import tuner as tuner_module

    monkeypatch.setattr(tuner_module.compiling, "in_background", lambda a, deterministic: not deterministic)
    monkeypatch.setattr(tuner_module.compiling, "applies", lambda device, deterministic: not deterministic)
    monkeypatch.setattr(waiting, "INSTEAD", 2)  # levels 4 and 3 or 5: the bridge (level 0) is not among them
    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock, bridge=lambda problem: {"level": 0})):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        compiling = [True]
        monkeypatch.setattr(tuner._compiles, "defer", lambda *args: compiling[0])
        ahead: list = []
        monkeypatch.setattr(tuner._compiles, "ahead",
                            lambda namespace, problem, c, kernel_map: ahead.append(c.id) or (c.id,))
        compiled: set = {"fake_speeds[level=1]"}  # compiled, but neither ranked among the first nor the bridge
        monkeypatch.setattr(tuner._compiles, "kernels", lambda namespace, problem, c, kernel_map: (c.id,))
        monkeypatch.setattr(tuner._compiles.background, "compiled", lambda kernel: kernel in compiled)
        background = tuner._compiles.background
        assert algorithm() == "explicit_gemm"  # the bridge not compiled yet: the reference
        assert ahead == ["fake_speeds[level=0]"]  # queued ahead of the product's own, at the first look
        compiled.add("fake_speeds[level=0]")
        background.finished += 1
        assert algorithm() == "fake_speeds[level=0]"
        compiled.add("fake_speeds[level=4]")
        background.finished += 1
        assert algorithm() == "fake_speeds[level=4]"  # a ranked candidate compiled: ahead of the bridge
        assert ahead == ["fake_speeds[level=0]"]  # queued once
        compiling[0] = False
        assert algorithm() == "fake_speeds[level=3]"  # its sweep compiled: timed and settled


def test_no_bridge_is_queued_where_kernels_do_not_compile_in_the_background(monkeypatch, clock):
    from sparseconv.tune import tuner as tuner_module

    monkeypatch.setattr(tuner_module.compiling, "in_background", lambda a, deterministic: not deterministic)
    monkeypatch.setattr(tuner_module.compiling, "applies", lambda device, deterministic: False)
    calls = Calls()
    algorithm = _one_layer()
    with registered(_speeds(calls, clock, bridge=lambda problem: {"level": 0})):
        _seed_cache(fastest=4)
        tuner = sparseconv.tune.get_tuner()
        monkeypatch.setattr(tuner._compiles, "defer", lambda *args: True)
        ahead: list = []
        monkeypatch.setattr(tuner._compiles, "ahead", lambda *args: ahead.append(args))
        monkeypatch.setattr(tuner._compiles, "kernels", lambda namespace, problem, c, kernel_map: (c.id,))
        monkeypatch.setattr(tuner._compiles.background, "compiled", lambda kernel: True)
        # (defer says compiling, yet background compiles are off for this device: a sweep deferred elsewhere)
        assert algorithm() == "fake_speeds[level=4]"  # the best ranked candidate compiled, no bridge among them
        assert ahead == []
