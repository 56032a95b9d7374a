"""A key's sweep spread over its calls (the process's default budget): a call times at most one candidate, the
best timed so far runs in the calls between, and the key settles on the winner once all are timed."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, VirtualClock, registered

import sparseconv.tune
from sparseconv.backends import Backend, explicit
from sparseconv.ops import sparse_conv3d
from sparseconv.tensor import SparseTensor
from sparseconv.tune import budget as budget_module
from sparseconv.tune.budget import TimingBudget
from sparseconv.tune.key import TuneKey

FWD = "AB_gather_scatter"
COSTS_MS = (3.0, 1.0, 2.0, 4.0)  # fake_levels[level=1] is the fastest; level 2 returns noise when ``wrong``


def _levels(calls: Calls, clock: VirtualClock, wrong: frozenset = frozenset()) -> Backend:
    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(f"fake_levels[{params['level']}]", namespace)
        clock.advance(1e-3 * COSTS_MS[params["level"]])
        out = explicit.run(namespace, problem, params, a, b, kernel_map)
        return torch.randn_like(out) if params["level"] in wrong else out

    return Backend("fake_levels", frozenset({FWD}), run, params_space=tuple({"level": i} for i in range(4)))


@pytest.fixture
def layer():
    """One conv layer on fixed inputs (one key): a call returns (the forward's candidate id, its output is right)."""
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=300)
    weight = torch.randn(27, 4, 5)
    reference = sparse_conv3d(x, weight, fwd_algo="explicit_gemm").feats

    def call() -> tuple[str, bool]:
        record: dict = {}
        out = sparse_conv3d(x, weight, record=record, fwd_algo=["fake_levels"]).feats
        return record[FWD], torch.allclose(out, reference, rtol=1e-4, atol=1e-4)

    return call


def _timed() -> set[int]:
    """The levels with a timing record in the cache (a candidate the guard rejected has one too)."""
    entries = [e for _, _, e in sparseconv.tune.get_tuner().cache.items(FWD)]
    return {int(cid[len("fake_levels[level="):-1]) for e in entries for cid in e["timings"]}


def test_the_defaults_time_one_candidate_a_call_and_a_few_at_once():
    assert budget_module.PER_CALL == 1 and TimingBudget().per_call == 1
    assert 0.005 <= budget_module.BURST_S <= 0.05  # a few GPU candidates at once, not a second of them


def test_a_new_keys_sweep_takes_one_candidate_a_call_running_the_best_so_far_then_settles(layer, clock):
    calls = Calls()
    with registered(_levels(calls, clock, wrong=frozenset({2}))):
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(burst=1e9)  # never spent: only the per-call limit spreads the sweep
        seen = []
        for _ in range(4):
            seen.append((*layer(), len(_timed())))
            assert tuner.choices() == []  # not settled while candidates are left
        # One more candidate timed each call; the best that passed so far runs, and every output is right
        # (level 2's noise was caught by the guard, never returned).
        assert seen == [("fake_levels[level=0]", True, 1), ("fake_levels[level=1]", True, 2),
                        ("fake_levels[level=1]", True, 3), ("fake_levels[level=1]", True, 4)]
        entry = next(e for _, _, e in tuner.cache.items(FWD))
        assert entry["timings"]["fake_levels[level=2]"]["verdict"] == "wrong"
        assert len(entry["timings"]) == 4  # each timing stored as it came: a killed process keeps them
        before = dict(calls.counts)
        assert layer() == ("fake_levels[level=1]", True)  # nothing left: the winner settles
        assert [c[2] for c in tuner.choices()] == ["fake_levels[level=1]"]
        assert sum(calls.counts.values()) - sum(before.values()) == 1  # the run itself: no timing
        assert layer() == ("fake_levels[level=1]", True)


def test_a_spread_sweep_waits_while_the_budget_is_spent_running_its_best_so_far(layer, clock):
    calls = Calls()
    with registered(_levels(calls, clock)):
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(burst=1e9)
        layer(), layer()
        assert _timed() == {0, 1}
        tuner.budget = TimingBudget(share=0.0, burst=0.0)  # spent, never refilled
        before = sum(calls.counts.values())
        assert [layer() for _ in range(3)] == [("fake_levels[level=1]", True)] * 3
        assert sum(calls.counts.values()) - before == 3 and _timed() == {0, 1}  # untimed runs
        tuner.budget = TimingBudget(burst=1e9)
        layer(), layer(), layer()
        assert _timed() == {0, 1, 2, 3} and [c[2] for c in tuner.choices()] == ["fake_levels[level=1]"]


def test_warmup_and_effort_full_still_time_a_key_in_one_call(monkeypatch, layer, clock):
    calls = Calls()
    with registered(_levels(calls, clock)):
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(burst=1e9)
        with tuner.budget.waived():
            assert layer() == ("fake_levels[level=1]", True)
        assert _timed() == {0, 1, 2, 3} and len(tuner.choices()) == 1
    sparseconv.tune.reset()
    calls = Calls()
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "full")
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tuner.cache.path.parent / "other"))
    with registered(_levels(calls, clock)):
        sparseconv.tune.get_tuner().budget = TimingBudget(burst=1e9)
        assert layer() == ("fake_levels[level=1]", True)
        assert _timed() == {0, 1, 2, 3}


def _block(x: int, y: int, z: int) -> SparseTensor:
    """A full x*y*z block of voxels (batch 0), 4 random channels: its keys' row and density buckets are exact."""
    grid = torch.cartesian_prod(torch.zeros(1, dtype=torch.int64), torch.arange(x), torch.arange(y), torch.arange(z))
    return SparseTensor(grid.int(), torch.randn(len(grid), 4))


def _key_call(weight: torch.Tensor):
    def call(x: SparseTensor) -> tuple[str, bool]:
        record: dict = {}
        out = sparse_conv3d(x, weight, record=record, fwd_algo=["fake_levels"]).feats
        return record[FWD], torch.allclose(out, sparse_conv3d(x, weight, fwd_algo="explicit_gemm").feats,
                                           rtol=1e-4, atol=1e-4)
    return call


def _tuned_keys(memos) -> list[TuneKey]:
    return [memo[0] for memo in memos if isinstance(memo[0], TuneKey)]


@contextlib.contextmanager
def _timed_layer(clock, base: SparseTensor):
    """A layer under fake_levels, timed whole on ``base`` (level 1 wins): yields (tuner, call, calls, its key)."""
    call, calls = _key_call(torch.randn(27, 4, 5)), Calls()
    with registered(_levels(calls, clock)):
        tuner = sparseconv.tune.get_tuner()
        tuner.budget = TimingBudget(burst=1e9, per_call=None)
        assert call(base) == ("fake_levels[level=1]", True) and len(tuner.choices()) == 1
        (key,) = _tuned_keys(tuner._choices)
        yield tuner, call, calls, key


def test_a_new_key_runs_what_its_nearest_settled_sibling_chose_untimed_then_sweeps(monkeypatch, clock):
    """A key a new point cloud brings (the layer's rows in new buckets) runs at once the choice the same layer settled
    on a map a few buckets away (loaded, nothing to compile), not the reference or a compile's wait; timed later within
    the budget. A key far from every settled one is handled as before (here, with no cost model, timed at once)."""
    from sparseconv.tune import prior

    near, far = _block(12, 12, 8), _block(4, 4, 2)  # 1152 and 32 voxels, against 512
    with _timed_layer(clock, _block(8, 8, 8)) as (tuner, call, _, settled_key):
        tuner.budget = TimingBudget(share=0.0, burst=0.0)  # spent, never refilled
        monkeypatch.setattr(prior, "predicted", lambda *args, **kwargs: {})  # no cost model to pick from
        timed = len(_timed_entries())
        assert call(near) == ("fake_levels[level=1]", True)  # the sibling's winner, untimed
        (near_key,) = _tuned_keys(tuner._stand_ins.memos())
        gaps = [abs(x - y) for x, y in zip(near_key.sizes, settled_key.sizes)]
        assert near_key.family == settled_key.family and max(gaps) == 2 and sum(gaps) <= 4, (near_key, settled_key)
        assert len(_timed_entries()) == timed  # nothing timed for it
        call(far)  # 8 buckets away: no sibling; with no model to pick from it is timed in the call
        assert len(_timed_entries()) == timed + 1
        tuner.budget = TimingBudget(burst=1e9)  # refilled: the near key's own sweep runs, one candidate a call
        for _ in range(5):
            assert call(near)[1]
        # base's and near's (far's sweep goes on)
        assert len(tuner.choices()) == 2 and len(_timed_entries()) == timed + 2
        assert {key: choice for _, key, choice in tuner.choices()}[near_key.encode()] == "fake_levels[level=1]"


def test_a_new_key_one_bucket_from_a_timed_one_adopts_its_choice_and_is_never_timed(clock):
    """Each of a new key's row counts and its density within one bucket of a key timed here: that key's choice, settled
    at once, untimed even with the budget full, and not written to the cache; a key one bucket further from the adopted
    one (two from the timed one) adopts nothing from it."""
    next_bucket, two_away = _block(10, 8, 8), _block(12, 12, 8)  # 640 and 1152 voxels, against 512
    with _timed_layer(clock, _block(8, 8, 8)) as (tuner, call, calls, timed_key):
        entries, before = len(_timed_entries()), sum(calls.counts.values())
        assert call(next_bucket) == ("fake_levels[level=1]", True)
        assert sum(calls.counts.values()) - before == 1  # the run itself: nothing timed
        adopted_key = next(k for k in _tuned_keys(tuner._choices) if k != timed_key)
        gaps = [abs(x - y) for x, y in zip(adopted_key.sizes, timed_key.sizes)]
        assert adopted_key.family == timed_key.family and max(gaps) == 1, (adopted_key, timed_key)
        assert len(tuner.choices()) == 2 and len(_timed_entries()) == entries  # settled, no entry written
        assert sparseconv.tune.progress().adopted == 1
        call(two_away)
        assert len(_timed_entries()) == entries + 1  # timed: adopted choices serve no further key


def _timed_entries() -> list:
    return [e for _, _, e in sparseconv.tune.get_tuner().cache.items(FWD)]
