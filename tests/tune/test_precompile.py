"""Parallel compile before a sweep: every timed candidate's hook runs, concurrently, and a failing
one disqualifies its candidate in one log line."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, registered

import sparseconv.tune
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit
from sparseconv.backends.registry import always_deterministic

FWD = "AB_gather_scatter"
LEVELS = 4


def _compiling(calls: Calls, barrier: threading.Barrier | None = None, broken: frozenset = frozenset()) -> Backend:
    """LEVELS parameter sets whose hook waits at ``barrier`` (so they pass only if they run at once);
    those in ``broken`` fail to compile with a long compiler dump."""
    threads: set[str] = set()

    def precompile(namespace, problem, params, kernel_map):
        calls.add(f"compile[{params['level']}]", namespace)
        threads.add(threading.current_thread().name)
        if params["level"] in broken:
            raise RuntimeError("ptxas fatal: out of registers\n" + "IR DUMP LINE\n" * 500)
        if barrier is not None:
            barrier.wait()

    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(f"run[{params['level']}]", namespace)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    backend = Backend("fake_compiled", frozenset({FWD}), run, params_space=tuple({"level": i} for i in range(LEVELS)),
                      precompile=precompile, deterministic=always_deterministic)
    calls.threads = threads
    return backend


def _conv(x=None) -> dict:
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200) if x is None else x
    record: dict = {}
    sparse_conv3d(x, torch.randn(27, 4, 5), record=record, fwd_algo=["fake_compiled"])
    return record


def test_every_timed_candidate_is_compiled_concurrently_before_it_runs():
    calls = Calls()
    # Every hook must be inside wait() at once for any to pass: a sequential loop breaks the barrier.
    barrier = threading.Barrier(LEVELS, timeout=20)
    with registered(_compiling(calls, barrier)):
        record = _conv()
    assert not barrier.broken
    assert [calls.of(f"compile[{i}]") for i in range(LEVELS)] == [1] * LEVELS
    assert all(calls.of(f"run[{i}]") >= 1 for i in range(LEVELS))
    assert len(calls.threads) == LEVELS and threading.current_thread().name not in calls.threads
    assert record[FWD].startswith("fake_compiled[")


def test_a_failing_compile_disqualifies_its_candidate_in_one_log_line(caplog):
    calls = Calls()
    with registered(_compiling(calls, broken=frozenset({1}))), caplog.at_level(logging.INFO, "sparseconv"):
        record = _conv()
    assert calls.of("run[1]") == 0 and all(calls.of(f"run[{i}]") >= 1 for i in (0, 2, 3))
    assert record[FWD] != "fake_compiled[level=1]"
    lines = [r.getMessage() for r in caplog.records if "fake_compiled[level=1]" in r.getMessage()]
    assert len(lines) == 1 and "ptxas fatal: out of registers" in lines[0] and "IR DUMP" not in caplog.text
    (entry,) = [e for _, _, e in sparseconv.tune.get_tuner().cache.items(FWD)]
    stored = entry["timings"]["fake_compiled[level=1]"]
    assert stored["verdict"] == "failed" and stored["ms"] is None
    assert stored["reason"] == "RuntimeError while compiling: ptxas fatal: out of registers"


def test_backends_without_a_hook_are_timed_as_before():
    calls = Calls()
    backend = _compiling(calls)
    with registered(Backend(backend.name, backend.ops, backend.run, params_space=backend.params_space)):
        _conv()
    assert sum(calls.of(f"compile[{i}]") for i in range(LEVELS)) == 0
    assert all(calls.of(f"run[{i}]") >= 1 for i in range(LEVELS))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in MODES if m.name in ("submanifold_k3", "strided_k2_s2", "transposed_k2_s2")],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_precompiled_triton_kernels_are_the_ones_the_run_launches(mode, dtype):
    """After the hooks of every Triton candidate, running them compiles nothing more: the hooks
    pass what the runs pass (dtypes, alignment, the integers Triton specialises on)."""
    from sparseconv.coords import KernelMapKey
    from sparseconv.backends import get, triton_kernels
    from sparseconv.backends.problem import ConvProblem
    from sparseconv.tune.configs import Candidate
    from sparseconv.tune.precompile import precompile

    def compiled() -> int:
        kernels = triton_kernels.kernels()
        return sum(len(cache[0]) for name in ("rows_gemm", "pairs_gemm", "pairs_wgrad", "row_masks", "tile_plan",
                                              "pair_blocks", "pair_lists")
                   for cache in getattr(kernels, name).device_caches.values())

    c_in, c_out = 32, 48
    x = make_input(mode, c_in, "cuda", dtype=dtype, n=3001, extent=30)
    size = (mode.kernel_size,) * 3
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, size, (mode.stride,) * 3, (1, 1, 1), mode.transposed,
                                                 mode.generative))[0]
    problem = ConvProblem(kernel_map.num_in, kernel_map.num_out, c_in, c_out, size, (mode.stride,) * 3, (1, 1, 1),
                          mode.transposed, mode.generative, dtype, x.device)
    weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device="cuda", dtype=dtype)
    grad_out = torch.randn(kernel_map.num_out, c_out, device="cuda", dtype=dtype)
    operands = {"AB_gather_scatter": (x.feats, weight), "ABt_gather_scatter": (grad_out, weight),
                "AtB_gather_gather": (x.feats, grad_out)}
    for name in ("mask_implicit_gemm", "implicit_gemm", "splitk_wgrad"):
        backend = get(name)
        for namespace in sorted(backend.ops):
            candidates = [Candidate.of(name, p) for p in backend.candidates_params(problem, "trimmed")]
            assert precompile(namespace, problem, candidates, kernel_map) == {}
            before = compiled()
            for candidate in candidates:
                backend.run(namespace, problem, candidate.params_dict, *operands[namespace], kernel_map)
            torch.cuda.synchronize()
            assert compiled() == before, (name, namespace)


def _background_backend(calls: Calls) -> Backend:
    """fake_compiled whose hook is a module-level function (a worker process can import it)."""
    import background_fakes

    backend = _compiling(calls)
    return Backend(backend.name, backend.ops, backend.run, params_space=backend.params_space,
                   precompile=background_fakes.precompile, deterministic=always_deterministic)


def _decided_in_an_earlier_process(calls: Calls, x, monkeypatch) -> None:
    """Tune fake_compiled on ``x`` (the sweep compiles in the call, in this process), then forget
    the process's tuner, as a new process with that cache file would."""
    with registered(_background_backend(calls)), monkeypatch.context() as patch:
        patch.setenv("SPARSECONV_BACKGROUND_COMPILE", "0")
        assert _conv(x)[FWD].startswith("fake_compiled[")
    sparseconv.tune.reset()


def test_a_decided_choice_compiles_in_a_worker_process_while_the_reference_runs(tmp_path, monkeypatch):
    import os

    import background_fakes

    from sparseconv.backends import compiling

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)  # the CPU stands in for a GPU here
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    monkeypatch.setenv(background_fakes.RELEASE, str(tmp_path / "release"))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    (tmp_path / "release").touch()  # the sweep's compiles in this process need not wait
    _decided_in_an_earlier_process(calls, x, monkeypatch)
    (tmp_path / "release").unlink()
    weight = torch.randn(27, 4, 5, dtype=torch.float32)
    kernel_map = x.cache.kernel_map(sparseconv.coords.KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                                                                   False, False))[0]
    expected = explicit.run(FWD, None, {}, x.feats, weight, kernel_map)
    with registered(_background_backend(calls)):
        seen = []
        for _ in range(3):  # compiling: the reference runs, and the compile was queued once
            record = {}
            out = sparse_conv3d(x, weight, record=record, fwd_algo=["fake_compiled"])
            seen.append(record[FWD])
            torch.testing.assert_close(out.feats, expected)
        assert seen == ["explicit_gemm"] * 3
        assert not sparseconv.tune.wait_for_compiles(timeout=0.5)  # held until released
        (tmp_path / "release").touch()
        assert sparseconv.tune.wait_for_compiles(timeout=60)
        record = {}
        out = sparse_conv3d(x, weight, record=record, fwd_algo=["fake_compiled"])
    assert record[FWD].startswith("fake_compiled[")
    torch.testing.assert_close(out.feats, expected)
    compiled = (tmp_path / "compiled.log").read_text().split()
    # the sweep's LEVELS compiles here, then the choice's once in a worker process, then loaded here from the
    # compilers' caches before the job counts as done
    assert len(compiled) == LEVELS + 2 and compiled[:LEVELS] == [str(os.getpid())] * LEVELS
    assert compiled[-2] != str(os.getpid()) and compiled[-1] == str(os.getpid())


@pytest.mark.parametrize("how", ["switched off", "deterministic"])
def test_a_decided_choice_compiles_in_the_call_where_the_background_does_not_apply(how, tmp_path, monkeypatch):
    import background_fakes

    from sparseconv.backends import compiling

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    if how == "switched off":
        monkeypatch.setenv("SPARSECONV_BACKGROUND_COMPILE", "0")
    else:  # a deterministic run's choices are its own (keys apart): tuned deterministic too
        monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "1")
    _decided_in_an_earlier_process(calls, x, monkeypatch)
    before = len((tmp_path / "compiled.log").read_text().split())
    with registered(_background_backend(calls)):
        record = _conv(x)
    assert record[FWD].startswith("fake_compiled[")  # the first call runs the choice itself
    assert len((tmp_path / "compiled.log").read_text().split()) == before  # compiled by its run, no hook


def test_warmup_waits_for_the_background_and_leaves_every_choice_compiled(tmp_path, monkeypatch):
    import os

    import background_fakes

    from sparseconv.nn import SparseConv3d
    from sparseconv.backends import compiling

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    _decided_in_an_earlier_process(calls, x, monkeypatch)
    with registered(_background_backend(calls)):
        conv = SparseConv3d(4, 5, 3, bias=False, fwd_algo=["fake_compiled"])
        sparseconv.warmup(conv, x)
        assert not sparseconv.tune.get_tuner().compiling()
        record = {}
        sparse_conv3d(x, conv.weight.detach(), record=record, fwd_algo=["fake_compiled"])
    assert record[FWD].startswith("fake_compiled[")
    compiled = (tmp_path / "compiled.log").read_text().split()
    assert compiled[-2] != str(os.getpid()) and compiled[-1] == str(os.getpid())  # compiled in a worker, loaded here


def test_background_jobs_that_compile_the_same_kernels_are_one_job(tmp_path, monkeypatch):
    import os

    import background_fakes

    from sparseconv.backends.compiling import Background

    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    monkeypatch.setenv(background_fakes.RELEASE, str(tmp_path / "release"))
    background = Background(workers=2)
    args = (FWD, None, {}, None)
    assert not background.ready("layer 1", background_fakes.precompile, args, compiles="kernel A")
    assert background.finished == 0 and not background.compiled("kernel A")  # queued, not compiled
    assert not background.ready("layer 2", background_fakes.precompile, args, compiles="kernel A")
    assert not background.ready("layer 3", background_fakes.precompile, args, compiles="kernel B")
    (tmp_path / "release").touch()
    assert background.wait(timeout=60)
    assert [background.ready(k, background_fakes.precompile, args, "kernel A") for k in ("layer 1", "layer 2")] == [True] * 2
    assert background.ready("layer 3", background_fakes.precompile, args, compiles="kernel B")
    assert not background.queued()
    assert background.finished == 2 and background.compiled("kernel A") and not background.compiled("kernel C")
    compiled = (tmp_path / "compiled.log").read_text().split()  # kernel A once, kernel B once, each loaded here
    assert len(compiled) == 4 and compiled.count(str(os.getpid())) == 2


def test_a_sweep_waits_for_its_candidates_to_compile_in_the_background(tmp_path, monkeypatch):
    import os

    import background_fakes

    from sparseconv.backends import compiling
    from sparseconv.tune import decide

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)
    monkeypatch.setattr(decide, "SWEEP_IN_BACKGROUND", LEVELS)  # as if LEVELS were the cost model's picks
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    monkeypatch.setenv(background_fakes.RELEASE, str(tmp_path / "release"))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    with registered(_background_backend(calls)):
        assert [_conv(x)[FWD] for _ in range(2)] == ["explicit_gemm"] * 2  # nothing timed yet: the reference
        assert sum(calls.of(f"run[{i}]") for i in range(LEVELS)) == 0
        (tmp_path / "release").touch()
        assert sparseconv.tune.wait_for_compiles(timeout=60)
        record = _conv(x)  # compiled: timed now, and the winner runs
    assert record[FWD].startswith("fake_compiled[")
    assert all(calls.of(f"run[{i}]") >= 1 for i in range(LEVELS))
    pids = (tmp_path / "compiled.log").read_text().split()
    workers = [p for p in pids if p != str(os.getpid())]
    assert len(workers) == LEVELS  # each candidate once in a worker (then its disk-cached load here)


def test_a_sweep_of_more_than_the_cost_models_picks_compiles_in_the_call(tmp_path, monkeypatch):
    import background_fakes

    from sparseconv.backends import compiling
    from sparseconv.tune import decide

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    monkeypatch.setattr(decide, "SWEEP_IN_BACKGROUND", LEVELS - 1)  # no model: all LEVELS candidates are timed at once
    with registered(_background_backend(Calls())):
        assert _conv()[FWD].startswith("fake_compiled[")  # timed and chosen in the first call


def test_the_cutlass_backends_compile_one_set_of_tiles_per_dtype_whatever_the_layer():
    # Their hook compiles every tile of the dtype: background jobs of any of their layers are one.
    import dataclasses

    from sparseconv.backends import get
    from sparseconv.backends.problem import ConvProblem

    small = ConvProblem(100, 90, 16, 32, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                        torch.device("cuda", 0))
    large = dataclasses.replace(small, num_in=50_000, num_out=20_000, in_channels=96, out_channels=64,
                                kernel_size=(2, 2, 2), stride=(2, 2, 2))
    gemm = {get(name).compiles(namespace, problem, {})
            for name in ("cutlass_grouped", "cutlass_implicit_gemm", "cutlass_splitk_wgrad")
            for namespace in get(name).ops for problem in (small, large)}
    assert len(gemm) == 1
    assert get("cutlass_grouped").compiles(FWD, dataclasses.replace(small, dtype=torch.bfloat16), {}) not in gemm
    sm90 = {get("cutlass_sm90").compiles(FWD, problem, {}) for problem in (small, large)}
    assert len(sm90) == 1 and not sm90 & gemm


def test_a_rank_beside_one_timing_a_key_runs_the_reference_then_compiles_the_published_choice_in_a_worker(
        tmp_path, monkeypatch):
    # Ranks of a job: another rank claimed this key and times it. On a GPU this rank must not
    # compile anything in the call meanwhile (a DDP step would wait for every such compile), and
    # the choice the other rank publishes compiles in a worker process while the reference runs.
    import os

    import background_fakes

    from sparseconv.backends import compiling
    from sparseconv.tune import distributed

    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)  # the CPU stands in for a GPU here
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    monkeypatch.setenv(background_fakes.RELEASE, str(tmp_path / "release"))
    published = {FWD: ""}  # "": claimed by another rank, not published yet
    monkeypatch.setattr(distributed, "claim", lambda namespace, key: published.get(namespace))
    calls = Calls()
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    weight = torch.randn(27, 4, 5, dtype=torch.float32)
    kernel_map = x.cache.kernel_map(sparseconv.coords.KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                                                                   False, False))[0]
    expected = explicit.run(FWD, None, {}, x.feats, weight, kernel_map)

    def conv() -> str:
        record = {}
        out = sparse_conv3d(x, weight, record=record, fwd_algo=["fake_compiled"])
        torch.testing.assert_close(out.feats, expected)
        return record[FWD]

    with registered(_background_backend(calls)):
        assert [conv() for _ in range(2)] == ["explicit_gemm"] * 2  # the other rank is still timing
        assert not (tmp_path / "compiled.log").exists() and sum(calls.of(f"run[{i}]") for i in range(LEVELS)) == 0
        published[FWD] = "fake_compiled[level=2]"
        assert conv() == "explicit_gemm"  # its kernels compile in a worker, held until released
        assert not sparseconv.tune.wait_for_compiles(timeout=0.5)
        (tmp_path / "release").touch()
        assert sparseconv.tune.wait_for_compiles(timeout=60)
        assert conv() == "fake_compiled[level=2]"
    compiled = (tmp_path / "compiled.log").read_text().split()  # in a worker, then loaded here
    assert len(compiled) == 2 and compiled[0] != str(os.getpid()) and compiled[1] == str(os.getpid())


def test_while_a_choice_compiles_a_gpu_product_runs_what_needs_no_compile():
    """explicit_gemm_table on a GPU (a few launches a product, no scatter), the reference elsewhere."""
    from sparseconv.backends.problem import ConvProblem
    from sparseconv.tune.pools import meanwhile

    def problem(kernel: int, device: str) -> ConvProblem:
        return ConvProblem(1000, 1000, 32, 32, (kernel,) * 3, (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                           torch.device(device))

    assert meanwhile(problem(3, "cuda")).id == "explicit_gemm_table"
    assert meanwhile(problem(2, "cuda")).id == "explicit_gemm_table"
    assert meanwhile(problem(3, "cpu")).id == "explicit_gemm"


def test_background_compiles_are_one_job_per_triton_kernel_shared_across_layers():
    """A Triton backend's hook is recorded, not run: each kernel it would compile is one job, keyed as a map view's
    kernel is keyed, so layers whose channels specialise alike (here 32 -> 64 and 64 -> 128: both multiples of 16)
    queue no new job, and a layer whose channels do not (24 -> 40) queues only the kernels that differ."""
    from sparseconv.backends import triton_launch
    from sparseconv.backends.compiling import MapShape
    from sparseconv.backends.problem import ConvProblem
    from sparseconv.backends import registry
    from sparseconv.tune.configs import Candidate
    from sparseconv.tune.precompile import ChoiceCompiles

    class Recording:
        def __init__(self):
            self.compiles = []

        def ready(self, key, hook, args, compiles, caller, priority):
            assert hook is triton_launch.warm_kernel and compiles[0] == "view" and caller == key[0]
            self.compiles.append(compiles)
            return False

        def pending(self, key):
            return True

    def layer(c_in, c_out):
        problem = ConvProblem(5000, 5000, c_in, c_out, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                              torch.device("cuda", 0))
        return problem, MapShape(5000, 5000, (3, 3, 3), 27, 13, False, False)

    candidate = Candidate.of("mask_implicit_gemm", {"block_k": 32, "block_m": 64, "block_n": 64, "num_stages": 3,
                                                    "num_warps": 4, "sort": True, "splits": 2})
    compiles = ChoiceCompiles()
    compiles.background = Recording()
    seen = []
    for c_in, c_out in ((32, 64), (64, 128), (24, 40)):
        problem, shape = layer(c_in, c_out)
        before = set(compiles.background.compiles)
        jobs = compiles._jobs(candidate, registry.get("mask_implicit_gemm"), (FWD, problem, dict(candidate.params_dict),
                                                                                shape), ("size-less", c_in, c_out))
        assert compiles.queue(("memo", c_in, c_out), FWD, problem, [candidate], _FakeMap(shape))
        seen.append(set(compiles.background.compiles) - before)
        assert len(jobs) > 2  # the views' kernels and two offset groups' products
        names = [key[1][0] for _, _, key in jobs]
        assert names.count("rows_gemm") == 2 and "pair_counts" in names
    assert seen[1] == set()  # nothing new for 64 -> 128
    assert seen[2] and all(key[1][0] == "rows_gemm" for key in seen[2])  # only the products specialise anew
    # Once those jobs finished, a layer they cover counts as compiled (64 -> 128 shares 32 -> 64's kernels), one
    # whose kernels specialise otherwise does not, and looking queues nothing.
    done = set(compiles.background.compiles)
    compiles.background.compiled = lambda key: key in done
    assert compiles.all_compiled(compiles.kernels(FWD, *(lambda p, s: (p, candidate, _FakeMap(s)))(*layer(64, 128))))
    assert not compiles.all_compiled(compiles.kernels(FWD, *(lambda p, s: (p, candidate, _FakeMap(s)))(*layer(6, 10))))
    assert set(compiles.background.compiles) == done


def test_ahead_queues_a_candidates_kernels_and_returns_what_they_compile():
    """ChoiceCompiles.ahead returns the kernel keys it queued (what kernels() names), so the waiting product that
    queued a bridge need not make them again; () and nothing queued for a backend without a precompile hook."""
    from sparseconv.backends.compiling import MapShape
    from sparseconv.backends.problem import ConvProblem
    from sparseconv.tune.configs import Candidate
    from sparseconv.tune.precompile import ChoiceCompiles

    class Ahead:
        def __init__(self):
            self.queued = []

        def ahead(self, hook, args, compiles):
            self.queued.append(compiles)

    problem = ConvProblem(5000, 5000, 32, 64, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                          torch.device("cuda", 0))
    kernel_map = _FakeMap(MapShape(5000, 5000, (3, 3, 3), 27, 13, False, False))
    candidate = Candidate.of("mask_implicit_gemm", {"block_k": 32, "block_m": 64, "block_n": 64, "num_stages": 3,
                                                    "num_warps": 4, "sort": False, "splits": 1})
    compiles = ChoiceCompiles()
    compiles.background = Ahead()
    returned = compiles.ahead(FWD, problem, candidate, kernel_map)
    assert returned and list(returned) == compiles.background.queued
    assert returned == compiles.kernels(FWD, problem, candidate, kernel_map)
    assert compiles.ahead(FWD, problem, Candidate("explicit_gemm"), kernel_map) == ()
    assert len(compiles.background.queued) == len(returned)


def test_a_networks_bridges_are_a_few_kernels_for_all_its_layers():
    """Every product's bridge (pools.bridge) for 39 layers of varied channels (4 -> 32 up to 384 -> 256, multiples of
    16 or not), submanifold, strided and transposed, needs a handful of kernel jobs per namespace, where their tuned
    tiles made ~90 for a street MinkUNet: each job compiles a kernel that serves many layers."""
    from sparseconv.backends import registry
    from sparseconv.backends.compiling import MapShape
    from sparseconv.backends.problem import NAMESPACES, ConvProblem
    from sparseconv.tune.pools import bridge
    from sparseconv.tune.precompile import ChoiceCompiles, _sizeless

    compiles, jobs = ChoiceCompiles(), {namespace: set() for namespace in NAMESPACES}
    layers = 0
    for size, stride, transposed, identity in (((3, 3, 3), 1, False, 13), ((2, 2, 2), 2, False, None),
                                               ((2, 2, 2), 2, True, None)):
        for c_in, c_out in ((4, 32), (32, 32), (32, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256),
                            (256, 128), (128, 96), (96, 96), (384, 256), (160, 96)):
            problem = ConvProblem(5000, 4000, c_in, c_out, size, (stride,) * 3, (1, 1, 1), transposed, False,
                                  torch.float16, torch.device("cuda", 0))
            shape = MapShape(5000, 4000, size, size[0] ** 3, identity, False, False)
            layers += 1
            for namespace in NAMESPACES:
                candidate = bridge(namespace, problem)
                backend = registry.get(candidate.backend)
                args = (namespace, problem, dict(candidate.params_dict), shape)
                jobs[namespace] |= {key for _, _, key in compiles._jobs(candidate, backend, args,
                                                                         _sizeless(namespace, problem, shape))}
    assert layers == 39
    assert all(1 <= len(keys) <= 6 for keys in jobs.values()), {ns: len(keys) for ns, keys in jobs.items()}


class _FakeMap:
    """What MapShape.of reads of a kernel map."""

    def __init__(self, shape):
        for name, value in shape._asdict().items():
            setattr(self, name, value)


def test_a_product_waiting_on_several_kernels_counts_once_as_compiling(monkeypatch):
    import queue

    from sparseconv.backends.compiling import Background

    background = Background(workers=1)
    monkeypatch.setattr(background, "_start", lambda: queue.Queue())  # queued, never run
    assert not background.ready(("product", 0), print, (), "kernel a", caller="product")
    assert not background.ready(("product", 1), print, (), "kernel b", caller="product")
    assert not background.ready(("view", "c"), print, (), "kernel c")
    assert not background.ready(("other product", 0), print, (), "kernel a", caller="other product")  # shares a's job
    assert background.queued() == 3
    assert background.compiling() == 3
    background._compiling["kernel a"].set_result(None)  # a compiled: "other product" waits no more, but has not taken it
    assert (background.queued(), background.compiling()) == (3, 2)
    assert background.ready(("other product", 0), print, (), "kernel a", caller="other product")
    assert (background.queued(), background.compiling()) == (2, 2)


def test_background_jobs_start_highest_priority_first_and_a_job_is_raised_by_its_highest_caller(monkeypatch):
    import queue

    from sparseconv.backends.compiling import Background

    background = Background(workers=1)
    waiting = queue.PriorityQueue()
    monkeypatch.setattr(background, "_start", lambda: waiting)  # queued, never run
    background.ready("small layer", print, (), "kernel a", priority=10.0)
    background.ready("view", print, (), "kernel v")  # views: first
    background.ready("large layer", print, (), "kernel b", priority=1000.0)
    background.ready("medium layer", print, (), "kernel c", priority=100.0)
    background.ready("larger layer", print, (), "kernel a", priority=5000.0)  # a's job, raised
    background.ready("tiny layer", print, (), "kernel c", priority=1.0)  # c's job, not lowered
    order = []
    while not waiting.empty():
        _, _, job, _ = waiting.get()
        if job not in order:  # (the entry a raised job left behind is skipped by the feeding thread)
            order.append(job)
    assert order == [background._compiling[name] for name in ("kernel v", "kernel a", "kernel b", "kernel c")]


def test_a_job_queued_ahead_starts_before_every_layers_own_is_shared_with_them_and_waited_on_by_none(monkeypatch):
    import queue

    from sparseconv.backends.compiling import Background

    background = Background(workers=1)
    waiting = queue.PriorityQueue()
    monkeypatch.setattr(background, "_start", lambda: waiting)  # queued, never run
    background.ready("large layer", print, (), "kernel b", priority=1e12)
    background.ahead(print, (), "bridge kernel")
    background.ahead(print, (), "bridge kernel")  # queued already: one entry
    assert not background.ready("small layer", print, (), "bridge kernel", priority=1.0)  # the bridge's job, shared
    assert background.queued() == 2  # the layers; nothing waits on the bridge itself
    entries = []
    while not waiting.empty():
        entries.append(waiting.get()[2])
    assert entries == [background._compiling["bridge kernel"], background._compiling["kernel b"]]
    background._compiling["bridge kernel"].set_result(None)
    assert background.compiled("bridge kernel") and background.wait(timeout=0) is False  # kernel b still waited on


def test_prestarted_workers_start_before_any_job_and_take_the_first_jobs(tmp_path, monkeypatch):
    import background_fakes

    from sparseconv.backends import compiling

    spawned = []
    spawn = compiling._spawn_worker
    monkeypatch.setattr(compiling, "_spawn_worker", lambda: spawned.append(1) or spawn())
    monkeypatch.setenv(background_fakes.LOG, str(tmp_path / "compiled.log"))
    background = compiling.Background(workers=2)
    background.prestart()
    deadline = time.monotonic() + 30
    while len(spawned) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(spawned) == 2  # started with no job queued
    background.prestart()  # started already: nothing more
    args = (FWD, None, {}, None)
    assert not background.ready("layer 1", background_fakes.precompile, args, compiles="kernel A")
    assert background.wait(timeout=60) and background.ready("layer 1", background_fakes.precompile, args, "kernel A")
    assert len(spawned) == 2  # the job ran on a prestarted worker


@pytest.mark.parametrize("case", ["cpu", "switched off", "deterministic", "cuda"])
def test_a_batchs_first_map_request_prestarts_the_workers_only_where_background_compiles_apply(case, monkeypatch):
    from sparseconv.backends import compiling
    from sparseconv.ops import batch

    started = []
    monkeypatch.setattr(compiling, "_prestarted", False)
    monkeypatch.setattr(compiling.background(), "prestart", lambda: started.append(1))
    if case == "switched off":
        monkeypatch.setenv("SPARSECONV_BACKGROUND_COMPILE", "0")
    if case == "deterministic":
        monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "1")
    device = torch.device("cpu" if case == "cpu" else "cuda", 0 if case != "cpu" else None)
    for _ in range(2):
        compiling.prestart(device)
    assert started == ([1] if case == "cuda" else [])
    x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=50)  # a CPU batch's map request starts nothing
    monkeypatch.setattr(compiling, "_prestarted", False)
    started.clear()
    batch.kernel_map(x.cache, sparseconv.coords.KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False,
                                                             False))
    assert started == []
