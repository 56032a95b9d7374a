"""@autotune semantics, Config round trips, and what goes into a cache key."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import sparseconv.tune
from sparseconv.backends.problem import ConvProblem
from sparseconv.tune import Candidate, Config, autotune, make_key
from sparseconv.tune.key import density_bucket, device_identity, size_bucket


SLOW_S = 0.03
"""How much slower the configs that must lose are: a margin over the timing noise of a loaded 2-core
CI machine (4 ms was not: one run timed the sleeping config the faster)."""


class Tile(NamedTuple):
    block: int
    delay_ms: float


def test_autotune_injects_the_fastest_config_pops_key_args_and_caches_per_key():
    seen = []

    @autotune(configs=[Tile(16, 2e3 * SLOW_S), Tile(32, 0.0), Tile(64, 1e3 * SLOW_S)], key=["M"], num_warmup=0, num_timing=2)
    def kernel(config, x, scale=1.0):
        seen.append(config)
        time.sleep(config.delay_ms / 1e3)
        return x * scale

    out = kernel(torch.ones(3), scale=2.0, M=128)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert seen[-1] == Tile(32, 0.0) and len(seen) == 3 * 2 + 1
    kernel(torch.ones(3), M=128)
    assert len(seen) == 3 * 2 + 2  # cached: no timing
    kernel(torch.ones(3), M=256)
    assert len(seen) == (3 * 2 + 2) + (3 * 2 + 1)  # a new key is tuned
    with pytest.raises(TypeError, match=r"missing autotune key argument\(s\) \['M'\]"):
        kernel(torch.ones(3))


def test_autotune_winner_survives_in_the_cache_file():
    @dataclass(frozen=True)
    class Split(Config):
        factor: int

    calls = []

    def make():
        @autotune(configs=[Split(1), Split(4)], key=["N"], num_warmup=0, num_timing=2)
        def kernel(config, x):
            calls.append(config)
            time.sleep(SLOW_S if config.factor == 1 else 0.0)
            return x

        return kernel

    make()(torch.zeros(1), N=7)
    sparseconv.tune.reset()
    calls.clear()
    make()(torch.zeros(1), N=7)
    assert calls == [Split(4)]


@pytest.mark.parametrize("winner", ["Split(4)", [["factor", 4]], {1: 4, "a": 1}, None])
def test_a_malformed_stored_winner_is_timed_again_not_a_crash(winner):
    @dataclass(frozen=True)
    class Split(Config):
        factor: int

    @autotune(configs=[Split(1), Split(4)], key=["N"], num_warmup=0, num_timing=2)
    def kernel(config, x):
        time.sleep(SLOW_S if config.factor == 1 else 0.0)
        return x * config.factor

    cache = sparseconv.tune.get_tuner().cache
    cache_key = f"{device_identity(torch.device('cpu'))}|N=7"
    cache.put(kernel.autotune_namespace, cache_key, {"winner": winner, "evidence": 1, "updated": time.time()})
    assert torch.equal(kernel(torch.ones(1), N=7), torch.full((1,), 4.0))


def test_config_round_trips_through_json_and_files(tmp_path):
    candidate = Candidate.of("explicit_gemm_grouped", {"max_waste": 0.5})
    assert Candidate.from_json(candidate.to_json()) == candidate
    candidate.save(tmp_path / "c.json")
    assert Candidate.load(tmp_path / "c.json") == candidate
    assert candidate.id == "explicit_gemm_grouped[max_waste=0.5]"
    with pytest.raises(ValueError, match="unknown fields"):
        Candidate.from_dict({"backend": "x", "colour": 1})


def _problem(**changes) -> ConvProblem:
    fields = dict(num_in=10_000, num_out=5_000, in_channels=16, out_channels=32, kernel_size=(3, 3, 3),
                  stride=(2, 2, 2), dilation=(1, 1, 1), transposed=False, generative=False,
                  dtype=torch.float32, device=torch.device("cpu"))
    fields.update(changes)
    return ConvProblem(**fields)


class _Map:
    """A map's sizes and nothing else (no views: what the key reads is built each call)."""

    num_pairs, num_out, kernel_volume = 30_000, 5_000, 27

    def derived(self, key, build):
        return build(self)

    def fill(self):
        return self.num_pairs, self.num_out * self.kernel_volume


def test_key_holds_bucketed_sizes_channels_geometry_dtype_and_device():
    key = make_key("AB_gather_scatter", _problem(), _Map())
    assert (key.num_in, key.num_out) == (size_bucket(10_000), size_bucket(5_000))
    assert key.density == density_bucket(30_000, 5_000 * 27) and key.geometry == "s2x2x2"
    assert key.device == device_identity(torch.device("cpu")) and key.dtype == "float32"
    dgrad = make_key("ABt_gather_scatter", _problem(), _Map())
    assert (dgrad.num_in, dgrad.num_out, dgrad.in_channels, dgrad.out_channels) == (
        key.num_out, key.num_in, 32, 16)
    distinct = {make_key("AB_gather_scatter", _problem(**c), _Map()).encode() for c in (
        {}, {"num_in": 40_000}, {"in_channels": 17}, {"transposed": True}, {"dtype": torch.bfloat16},
        {"kernel_size": (3, 3, 1)})}
    assert len(distinct) == 6


def test_buckets_are_half_octaves():
    assert size_bucket(1024) == 20 and size_bucket(1100) == 20 and size_bucket(1500) == 21 and size_bucket(0) == -1
    assert density_bucket(1, 1) == 0 and density_bucket(1, 4) == 4 and density_bucket(0, 10) == 20


def test_a_timing_sample_is_the_mean_of_its_back_to_back_calls():
    from sparseconv.tune.timing import Timer, TimingPlan

    calls = []
    delays = iter([0.0, 0.03, 0.0, 0.03, 0.0, 0.03])  # per sample: one fast call, one slow

    def fn():
        calls.append(1)
        time.sleep(next(delays))

    ms, samples, host = Timer(torch.device("cpu"), TimingPlan(warmup=0, repeats=3, flush_l2=False, calls=2)).measure(fn)
    assert samples == 3 and len(calls) == 6
    assert 13.0 <= ms < 30.0  # (0 + 30 ms) / 2 per call, not the slow call alone nor the sum
    assert host == ms  # on the CPU, issuing a call is running it
    with pytest.raises(ValueError, match="calls must be >= 1"):
        TimingPlan(warmup=0, repeats=1, flush_l2=False, calls=0)


def test_a_lone_maps_key_takes_its_fill_from_the_last_batch_without_reading_its_counts():
    from sparseconv.coords import KernelMap
    from sparseconv.coords.kernel_map import FILL_VIEW

    table = torch.tensor([[0, -1, 1], [1, 0, -1]], dtype=torch.int32)
    kernel_map = KernelMap(table, 2, (3, 1, 1), identity_offset=1)
    kernel_map.offer(FILL_VIEW, (10, 1000))  # as the map plan offers the last batch's
    problem = _problem(num_in=2, num_out=2, kernel_size=(3, 1, 1), stride=(1, 1, 1), lone=True)
    key = make_key("AB_gather_scatter", problem, kernel_map)
    assert key.density == density_bucket(10, 1000) != density_bucket(4, 6)
    assert "pair_counts" not in kernel_map.__dict__ and key.lone and key.encode().endswith("|lone")
