"""The tuner: modes, strict names, effort, guard, failures, cache reuse, logging."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, fast, registered, slow, wrong

import sparseconv.tune
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit

SUBMANIFOLD = MODES[1]


def conv(record=None, x=None, **pins):
    x = x or make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
    feats = x.feats.clone().requires_grad_()
    weight = torch.randn(27, 4, 5, requires_grad=True)
    out = sparse_conv3d(x.replace(feats), weight, record=record, **pins)
    out.feats.backward(torch.randn_like(out.feats))
    return x, feats, weight, out


def entries(namespace=None):
    return sparseconv.tune.get_tuner().cache.items(namespace)


def test_single_name_from_env_runs_without_timing(monkeypatch):
    calls = Calls()
    monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "fake_slow")
    with registered(slow(calls)):
        record = {}
        conv(record)
    assert record["AB_gather_scatter"] == "fake_slow" and calls.of("fake_slow", "AB_gather_scatter") == 1
    assert entries("AB_gather_scatter") == [] and len(entries("AtB_gather_gather")) == 1


def _two_speeds(calls: Calls) -> Backend:
    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(f"fake_speeds[{params['delay_s']}]", namespace)
        time.sleep(params["delay_s"])
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    return Backend("fake_speeds", frozenset({"AB_gather_scatter"}), run,
                   params_space=({"delay_s": 0.02}, {"delay_s": 0.0}))


@pytest.mark.parametrize("pin", [["fake_speeds"], "[fake_speeds]"], ids=["python-list", "bracketed"])
def test_a_list_of_one_backend_tunes_its_parameters(pin):
    calls = Calls()
    with registered(_two_speeds(calls)):
        record = {}
        conv(record, fwd_algo=pin)
    assert record["AB_gather_scatter"] == "fake_speeds[delay_s=0.0]"
    assert calls.of("fake_speeds[0.02]") >= 1 and len(entries("AB_gather_scatter")) == 1


def test_a_bare_name_runs_the_backends_first_parameters_untimed():
    calls = Calls()
    with registered(_two_speeds(calls)):
        record = {}
        conv(record, fwd_algo="fake_speeds")
    assert record["AB_gather_scatter"] == "fake_speeds[delay_s=0.02]"
    assert calls.of("fake_speeds[0.02]") == 1 and calls.of("fake_speeds[0.0]") == 0
    assert entries("AB_gather_scatter") == []


def test_kwarg_pin_overrides_env_and_is_honoured_in_backward(monkeypatch):
    calls = Calls()
    monkeypatch.setenv("SPARSECONV_DGRAD_ALGO_MODE", "explicit_gemm")
    with registered(slow(calls)):
        record = {}
        conv(record, dgrad_algo="fake_slow", wgrad_algo="fake_slow")
    assert record["ABt_gather_scatter"] == record["AtB_gather_gather"] == "fake_slow"
    assert calls.of("fake_slow", "ABt_gather_scatter") == calls.of("fake_slow", "AtB_gather_gather") == 1


@pytest.mark.parametrize("variable, source", [("SPARSECONV_FWD_ALGO_MODE", "SPARSECONV_FWD_ALGO_MODE"),
                                              ("SPARSECONV_WGRAD_ALGO_MODE", "SPARSECONV_WGRAD_ALGO_MODE")])
def test_unknown_name_in_env_names_the_variable_and_the_closest_match(monkeypatch, variable, source):
    monkeypatch.setenv(variable, "[explicit_gemm, explicit_gemm_grupped]")
    with pytest.raises(ValueError, match=rf"{source}: unknown algorithm 'explicit_gemm_grupped'.*did you mean 'explicit_gemm_grouped'"):
        conv()


def test_unsupported_backend_is_an_error_alone_and_skipped_in_a_list(caplog):
    calls = Calls()
    unsupported = slow(calls, "fake_gpu_only", supports=lambda problem: "needs a CUDA device")
    with registered(unsupported):
        with pytest.raises(ValueError, match="fwd_algo: algorithm 'fake_gpu_only' cannot run this problem: needs a CUDA device"):
            conv(fwd_algo="fake_gpu_only")
        with caplog.at_level(logging.INFO, logger="sparseconv"):
            record = {}
            conv(record, fwd_algo=["fake_gpu_only", "explicit_gemm"])
    assert record["AB_gather_scatter"] == "explicit_gemm" and calls.of("fake_gpu_only") == 0
    assert "skipping fake_gpu_only: needs a CUDA device" in caplog.text


def test_list_mode_times_only_the_listed_candidates():
    calls = Calls()
    with registered(slow(calls), fast(calls)):
        record = {}
        conv(record, fwd_algo="[fake_slow, explicit_gemm]")
    assert calls.of("fake_fast", "AB_gather_scatter") == 0 and calls.of("fake_slow", "AB_gather_scatter") > 1
    assert record["AB_gather_scatter"] == "explicit_gemm"
    (_, _, entry), = entries("AB_gather_scatter")
    assert set(entry["timings"]) == {"fake_slow", "explicit_gemm"}


def test_auto_picks_the_fastest_correct_candidate_and_results_stay_right():
    calls = Calls()
    with registered(slow(calls), fast(calls), wrong(calls), wrong(calls, "fake_nan", how="nan"),
                    wrong(calls, "fake_broken", how="raise")):
        record = {}
        x, feats, weight, out = conv(record)
    assert record == {ns: "fake_fast" for ns in ("AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather")}
    torch.testing.assert_close(out.feats, explicit.forward(x.feats, weight, out.cache.kernel_map(
        next(iter(out.cache._maps)))[0]))
    verdicts = {cid: t["verdict"] for _, _, e in entries("AB_gather_scatter") for cid, t in e["timings"].items()}
    assert verdicts["fake_wrong"] == "wrong" and verdicts["fake_nan"] == "wrong" and verdicts["fake_broken"] == "failed"
    assert verdicts["fake_fast"] == verdicts["fake_slow"] == verdicts["explicit_gemm"] == "ok"
    hosts = {cid: t.get("host_ms") for _, _, e in entries("AB_gather_scatter") for cid, t in e["timings"].items()}
    assert hosts["fake_slow"] >= 9.0 and hosts["fake_fast"] < hosts["fake_slow"]  # it sleeps 10 ms a call
    reasons = {cid: t.get("reason", "") for _, _, e in entries("AB_gather_scatter") for cid, t in e["timings"].items()}
    assert "relative error" in reasons["fake_wrong"] and "non-finite" in reasons["fake_nan"]
    assert "fake compile error" in reasons["fake_broken"]


def test_close_candidates_are_decided_by_host_time():
    """Within CLOSE of the fastest median, the candidate that costs the host least wins (a small
    layer's calls can be host-bound); past CLOSE, or without host times, the fastest does."""
    from sparseconv.tune.evidence import pick

    timings = {"cupy": {"ms": 0.246, "host_ms": 0.19}, "triton": {"ms": 0.257, "host_ms": 0.08},
               "far": {"ms": 0.300, "host_ms": 0.01}, "old": {"ms": 0.250}}
    assert pick(timings, ["cupy", "triton", "far"]) == "triton"
    assert pick(timings, ["far", "cupy"]) == "cupy"  # 22% slower: host time does not buy that
    assert pick(timings, ["old", "cupy"]) == "cupy"  # a stored entry without a host time counts as the costliest
    assert pick({"a": {"ms": 1.0}, "b": {"ms": 1.02}}, ["b", "a"]) == "a"


def test_a_call_costs_its_host_time_where_that_is_longer():
    """A small layer: the GPU finishes one candidate's call sooner, but issuing it takes the host
    longer than the other candidate's whole call, so back-to-back calls of the other run faster."""
    from sparseconv.tune.evidence import cost, pick

    timings = {"gpu_fast": {"ms": 0.030, "host_ms": 0.090}, "host_light": {"ms": 0.050, "host_ms": 0.040},
               "large": {"ms": 2.0, "host_ms": 0.1}}
    assert cost(timings["gpu_fast"]) == 0.090 and cost(timings["host_light"]) == 0.050
    assert cost(timings["large"]) == 2.0 and cost({"ms": 0.2}) == 0.2
    assert pick(timings, ["gpu_fast", "host_light"]) == "host_light"
    assert pick({"a": {"ms": 1.0, "host_ms": 0.1}, "b": {"ms": 1.2, "host_ms": 0.05}}, ["b", "a"]) == "a"


def test_when_every_listed_candidate_fails_explicit_gemm_runs(caplog):
    calls = Calls()
    with registered(wrong(calls), wrong(calls, "fake_broken", how="raise")):
        with caplog.at_level(logging.WARNING, logger="sparseconv"):
            record = {}
            x, feats, weight, out = conv(record, fwd_algo=["fake_wrong", "fake_broken"])
    assert record["AB_gather_scatter"] == "explicit_gemm"
    assert "no candidate passed" in caplog.text


def test_cached_timings_are_reused_and_a_new_backend_only_times_itself():
    calls = Calls()
    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
    with registered(slow(calls)):
        conv(x=x)
    first = {ns: e for ns, _, e in entries()}
    sparseconv.tune.reset()
    calls_before = calls.of("fake_slow")
    with registered(slow(calls), fast(calls)):
        record = {}
        conv(record, x=x)
    assert calls.of("fake_slow") == calls_before  # its cached timings lose to fake_fast: not run again
    assert calls.of("fake_fast") > 3 and record["AB_gather_scatter"] == "fake_fast"
    for namespace, _, entry in entries():
        old = first[namespace]["timings"]
        assert {cid: t for cid, t in entry["timings"].items() if cid in old} == old
        assert entry["evidence"] > first[namespace]["evidence"]


def test_a_new_backend_version_makes_only_its_timings_stale():
    calls = Calls()
    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
    with registered(slow(calls, version=1)):
        conv(x=x)
    sparseconv.tune.reset()
    with registered(slow(calls, version=2)):
        before = calls.of("fake_slow")
        conv(x=x)
        assert calls.of("fake_slow") - before > 3
    versions = {e["timings"]["fake_slow"]["version"] for _, _, e in entries()}
    assert versions == {2}


def test_effort_none_picks_by_heuristic_without_timing(monkeypatch):
    calls = Calls()
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    with registered(slow(calls, heuristic=lambda problem: 5.0)):
        record = {}
        conv(record)
    assert record["AB_gather_scatter"] == "fake_slow" and calls.of("fake_slow") == 3
    assert entries() == []


def test_effort_full_widens_auto_to_every_parameter_set(monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "full")
    conv()
    (_, _, entry), = entries("AB_gather_scatter")
    assert {cid for cid in entry["timings"] if cid.startswith("explicit_gemm_grouped")} == {
        f"explicit_gemm_grouped[max_waste={w}]" for w in (0.25, 0.0, 0.1, 0.5, 1.0)}


def test_bad_effort_is_rejected(monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "fast")
    with pytest.raises(ValueError, match=r"SPARSECONV_AUTOTUNE_EFFORT must be one of \('none', 'quick', 'full'\)"):
        conv()


def test_autotune_log_shows_a_table_and_the_winner(monkeypatch, caplog):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_LOG", "1")
    with caplog.at_level(logging.INFO, logger="sparseconv"):
        conv()
    assert "sparseconv autotune AB_gather_scatter" in caplog.text
    assert "median ms" in caplog.text and "winner:" in caplog.text


def test_module_reports_the_algorithms_it_ran():
    from sparseconv.nn import SparseConv3d

    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32)
    layer = SparseConv3d(4, 4, 3, wgrad_algo="explicit_gemm_grouped")
    layer(x.replace(x.feats.requires_grad_())).feats.sum().backward()
    assert layer.algorithms["AtB_gather_gather"] == "explicit_gemm_grouped[max_waste=0.25]"
    assert set(layer.algorithms) == {"AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather"}


def test_a_pool_of_only_the_reference_is_not_timed():
    # A kernel of volume 2 leaves grouping out of the auto pool on the CPU: explicit_gemm alone remains.
    x = make_input(MODES[0], 4, "cpu", dtype=torch.float32)
    record = {}
    sparse_conv3d(x, torch.randn(2, 4, 4), kernel_size=(1, 1, 2), record=record)
    assert record["AB_gather_scatter"] == "explicit_gemm" and entries() == []


def test_the_guard_accepts_correct_half_results_of_subnormal_size_and_rejects_wrong_ones():
    from sparseconv.tune.guard import check_output

    # An fp16 network's gradients without loss scaling: ~1e-6, subnormal in half precision.
    reference = torch.randn(4096, 64, dtype=torch.float32) * 1e-6
    rounded = reference.to(torch.float16)  # what a correct fp32-accumulating kernel stores
    relative = float((rounded.double() - reference.double()).norm() / reference.double().norm())
    assert relative > 5e-3  # the plain relative bound would reject it
    assert check_output(rounded, reference, torch.float16) is None
    assert check_output(rounded.flip(0), reference, torch.float16) is not None  # rows swapped
    assert check_output(rounded * 1.5, reference, torch.float16) is not None
    # Values of normal size get no such slack: a 1% error fails.
    normal = torch.randn(4096, 64)
    assert check_output(normal.to(torch.float16), normal, torch.float16) is None
    assert check_output((normal * 1.01).to(torch.float16), normal, torch.float16) is not None


def _prepared(calls: Calls, fail: list) -> Backend:
    """explicit_gemm, counting its runs, preparations and prepared calls; a prepared call raises while
    ``fail`` is non-empty."""
    def run(namespace, problem, params, a, b, kernel_map):
        calls.add("run", namespace)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    def prepare(namespace, problem, params, kernel_map):
        calls.add("prepare", namespace)

        def product(a, b):
            calls.add("prepared", namespace)
            if fail:
                raise RuntimeError("fake launch failure")
            return explicit.run(namespace, problem, params, a, b, kernel_map)
        return product

    return Backend("fake_prepared", frozenset({"AB_gather_scatter"}), run, prepare=prepare)


def test_a_settled_choice_runs_its_prepared_call_until_the_settings_or_backend_change(monkeypatch):
    """A layer's first call on a map prepares its call and makes it (no run), and its later calls go
    to the prepared call kept with the map; another setting picks again (and the kept entry serves
    once it is back); a re-registered backend prepares anew; a prepared call that raises goes
    through run (the failing preparation is not kept), with the right result each time."""
    calls, fail = Calls(), []
    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float64, n=200)
    weight = torch.randn(27, 4, 5, dtype=torch.float64)

    def forward(expected_algo, **pins):
        record = {}
        with torch.no_grad():
            out = sparse_conv3d(x, weight, record=record, **pins).feats
            ref = sparse_conv3d(x, weight, fwd_algo="explicit_gemm").feats
        assert record["AB_gather_scatter"] == expected_algo and torch.allclose(out, ref)

    monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "fake_prepared")
    with registered(_prepared(calls, fail)):
        forward("fake_prepared")
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (0, 1, 1)
        forward("fake_prepared")
        forward("fake_prepared")
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (0, 1, 3)
        monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "explicit_gemm")
        forward("explicit_gemm")
        monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "fake_prepared")
        forward("fake_prepared")
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (0, 1, 4)
        fail.append(True)
        forward("fake_prepared")  # the kept call raises, and so does a new preparation's: run instead
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (1, 2, 6)
        fail.clear()
        forward("fake_prepared")  # nothing was kept: prepared again, and kept
        forward("fake_prepared")
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (1, 3, 8)
    with registered(_prepared(calls, fail)):  # another backend object under the name
        forward("fake_prepared")
        assert (calls.of("run"), calls.of("prepare"), calls.of("prepared")) == (1, 4, 9)


def test_a_lone_maps_candidates_are_timed_building_their_views_on_each_call():
    # A map serving one product a batch (MapUse.lone) builds its views for that product alone:
    # the sweep times each candidate on the map without its views, as a new batch's map is, so a
    # candidate needing costly views pays for them; other maps are timed with their views kept.
    seen = []

    def run(namespace, problem, params, a, b, kernel_map):
        seen.append((problem.lone, ("fake_view",) in kernel_map._derived))
        kernel_map.derived(("fake_view",), lambda m: None)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    backend = Backend("fake_views", frozenset({"AB_gather_scatter"}), run, params_space=({"v": 0}, {"v": 1}))
    weight = torch.randn(27, 4, 5)
    with registered(backend), torch.no_grad():
        for seed in range(3):
            torch.manual_seed(seed)
            x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
            seen.clear()
            sparse_conv3d(x, weight, fwd_algo=["fake_views"])
            lone, timed = seen[0][0], seen[1:]
            if seed == 0:  # the first batch (no history), tuned with the views kept between timed calls
                assert not lone and any(kept for _, kept in timed)
    assert lone and len(timed) > 4 and not any(kept for _, kept in timed)
    assert any(key.endswith("|lone") for _, key, _ in entries("AB_gather_scatter"))
