"""The per-process memo of choices and parsed modes: fast repeats, never a stale answer."""

from __future__ import annotations

import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, fast, registered, slow

import sparseconv.tune
import sparseconv.tune.tuner
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit
from sparseconv.ops.dispatch import check_algo
from sparseconv.backends.problem import NAMESPACES

SUBMANIFOLD = MODES[1]


def conv(x, record=None, **pins):
    feats = x.feats.clone().requires_grad_()
    weight = torch.randn(27, 4, 5, requires_grad=True)
    out = sparse_conv3d(x.replace(feats), weight, record=record, **pins)
    out.feats.backward(torch.randn_like(out.feats))
    return record


@pytest.fixture
def x():
    return make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)


def test_a_repeated_pinned_call_builds_its_candidate_once(monkeypatch, x):
    built = Calls()
    pool = sparseconv.tune.tuner.candidate_pool

    def counting_pool(namespace, *args):
        built.add("pool", namespace)
        return pool(namespace, *args)

    monkeypatch.setattr(sparseconv.tune.tuner, "candidate_pool", counting_pool)
    pins = {f"{p}_algo": "explicit_gemm" for p in ("fwd", "dgrad", "wgrad")}
    for _ in range(3):
        conv(x, **pins)
    assert [built.of("pool", ns) for ns in NAMESPACES] == [1, 1, 1]


def test_an_environment_mode_changed_after_the_first_call_is_honoured(monkeypatch, x):
    calls = Calls()
    with registered(slow(calls, delay_s=0.0)):
        monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "explicit_gemm")
        monkeypatch.setenv("SPARSECONV_DGRAD_ALGO_MODE", "explicit_gemm")
        assert conv(x, {})["ABt_gather_scatter"] == "explicit_gemm"
        monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "fake_slow")
        monkeypatch.setenv("SPARSECONV_DGRAD_ALGO_MODE", "fake_slow")
        record = conv(x, {})
        assert record["AB_gather_scatter"] == record["ABt_gather_scatter"] == "fake_slow"
        monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "[explicit_gemm, fake_slow]")
        monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
        monkeypatch.delenv("SPARSECONV_DGRAD_ALGO_MODE")
        record = conv(x, {})
    # effort none takes the pool's first by heuristic, then name: explicit_gemm before fake_slow
    assert record["AB_gather_scatter"] == "explicit_gemm" and record["ABt_gather_scatter"] != "fake_slow"


def test_a_pin_changed_between_calls_on_one_map_is_honoured(x):
    calls = Calls()
    with registered(slow(calls, delay_s=0.0)):
        assert conv(x, {}, fwd_algo="explicit_gemm")["AB_gather_scatter"] == "explicit_gemm"
        assert conv(x, {}, fwd_algo="fake_slow")["AB_gather_scatter"] == "fake_slow"
        assert conv(x, {}, fwd_algo=["fake_slow"])["AB_gather_scatter"] == "fake_slow"
    assert calls.of("fake_slow", "AB_gather_scatter") == 2


def test_an_unregistered_or_replaced_pinned_backend_is_not_remembered(x):
    first, second = Calls(), Calls()
    wgrad_only = frozenset({"AtB_gather_gather"})  # kept out of the forward and dgrad pools
    with registered(slow(first, "fake_pinned", delay_s=0.0, ops=wgrad_only)):
        conv(x, wgrad_algo="fake_pinned")
        assert check_algo("fake_pinned", "AtB_gather_gather") == "fake_pinned"
    with pytest.raises(ValueError, match="wgrad_algo: unknown algorithm 'fake_pinned'"):
        check_algo("fake_pinned", "AtB_gather_gather")
    with pytest.raises(ValueError, match="wgrad_algo: unknown algorithm 'fake_pinned'"):
        conv(x, wgrad_algo="fake_pinned")
    with registered(slow(second, "fake_pinned", delay_s=0.0, ops=wgrad_only)):
        conv(x, wgrad_algo="fake_pinned")
    assert first.of("fake_pinned") == 1 and second.of("fake_pinned") == 1


def test_a_backend_that_joins_later_answers_to_its_pin_at_once(x):
    calls = Calls()
    conv(x, fwd_algo="explicit_gemm")

    def run(namespace, problem, params, a, b, kernel_map):
        calls.add("fake_late", namespace)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    with registered(Backend("fake_late", frozenset(NAMESPACES), run)):
        conv(x, fwd_algo="fake_late")
    assert calls.of("fake_late", "AB_gather_scatter") == 1


def test_choices_do_not_survive_a_tuner_reset(x):
    calls = Calls()
    with registered(slow(calls), fast(calls)):
        conv(x)
        swept = calls.of("fake_slow")
        conv(x)
        assert calls.of("fake_slow") == swept  # remembered: no sweep, fake_fast runs
        sparseconv.tune.get_tuner().cache.clear()
        conv(x)
        assert calls.of("fake_slow") == swept  # clearing the file alone keeps this process's choices
        sparseconv.tune.reset()
        sparseconv.tune.get_tuner().cache.clear()
        conv(x)
        assert calls.of("fake_slow") > swept  # a fresh tuner with an empty cache sweeps again


def test_a_new_batch_has_the_forward_products_of_the_last_batchs_layers_prepared_ahead(monkeypatch):
    # The map plan prepares, on a new batch's maps, the forward products the last batch's layers prepared at
    # their first calls: those first calls then take the prepared product (and run as the next calls do).
    from sparseconv.coords import plan, prebuild

    monkeypatch.setattr(plan, "_history", {})
    prepared = []  # (map, namespace) of each preparation; the maps' own lists below (ids of dead maps recur)

    def prepare(namespace, problem, params, kernel_map):
        prepared.append(namespace)
        kernel_map.__dict__.setdefault("prepared_here", []).append(namespace)
        return lambda a, b: explicit.run(namespace, problem, params, a, b, kernel_map)

    in_plan = []
    build = prebuild.build

    def counted_prebuild(*args):
        start = len(prepared)
        built = build(*args)
        in_plan.append(len(prepared) - start)
        return built

    monkeypatch.setattr(prebuild, "build", counted_prebuild)
    pins = {f"{p}_algo": "fake_prepared" for p in ("fwd", "dgrad", "wgrad")}
    weights = [torch.randn(27, 4, 4, requires_grad=True), torch.randn(8, 4, 4, requires_grad=True)]

    def step(seed):
        torch.manual_seed(seed)
        x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
        x = x.replace(x.feats.requires_grad_())
        y = sparse_conv3d(x, weights[0], kernel_size=3, **pins)
        z = sparse_conv3d(y, weights[1], kernel_size=2, stride=2, **pins)
        z.feats.sum().backward()
        maps = x.cache.kernel_maps()
        return [m.__dict__.get("prepared_here", []).count(namespace) for m in maps for namespace in NAMESPACES]

    with registered(slow(Calls(), name="fake_prepared", delay_s=0.0, prepare=prepare)):
        step(0)  # the first batch: its layers prepare their products themselves; the plan records them
        assert in_plan == []
        # Each product prepared once a map: the forward ones (2) in the plan, the backward ones by the layers.
        assert step(1) == [1, 1, 1, 1, 1, 1] and in_plan == [2]
        # A batch whose layers found their forward products prepared passes the recipes on.
        assert step(2) == [1, 1, 1, 1, 1, 1] and in_plan == [2, 2]


def test_a_pinned_layer_on_new_batches_keeps_one_remembered_choice():
    # A named backend's choice does not depend on the row counts: new batches (new sizes) must not each
    # add a remembered choice (a long run would grow the memo without bound).
    tuner = sparseconv.tune.get_tuner()
    pins = {f"{p}_algo": "explicit_gemm" for p in ("fwd", "dgrad", "wgrad")}
    sizes = []
    for n in (200, 260, 320):
        x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=n)
        conv(x, **pins)
        sizes.append(len(tuner._choices))
    assert sizes[0] >= 3 and sizes[1] == sizes[0] and sizes[2] == sizes[0]
