"""The CUTLASS backends: every shipped variant compiles (no GPU needed), the compile cache and the
refusals behave, and on a GPU every backend × product × dtype equals explicit_gemm."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest
import torch
from conv_cases import MODES, make_input
from sparse_reference import relative_error

from sparseconv.coords import KernelMapKey
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import cuda_jit, cutlass_gemm, cutlass_sm90, explicit, get, mask_views
from sparseconv.backends.problem import ConvProblem

needs_toolchain = pytest.mark.skipif(cuda_jit.unavailable() is not None, reason=str(cuda_jit.unavailable()))
OPS = {
    "cutlass_grouped": ("AB_gather_scatter", "ABt_gather_scatter"),
    "cutlass_implicit_gemm": ("AB_gather_scatter", "ABt_gather_scatter"),
    "cutlass_splitk_wgrad": ("AtB_gather_gather",),
}


@pytest.fixture
def allow_tf32():
    """Set torch's tf32 switch for one test (a property torch reads through, so monkeypatch cannot undo it)."""
    before = torch.backends.cuda.matmul.allow_tf32

    def set_to(value: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = value

    yield set_to
    torch.backends.cuda.matmul.allow_tf32 = before


def _problem(**overrides) -> ConvProblem:
    fields = dict(num_in=100, num_out=100, in_channels=16, out_channels=32, kernel_size=(3, 3, 3),
                  stride=(1, 1, 1), dilation=(1, 1, 1), transposed=False, generative=False,
                  dtype=torch.float16, device=torch.device("cuda"))
    return ConvProblem(**{**fields, **overrides})


@needs_toolchain
def test_every_shipped_variant_compiles_for_sm80_and_sm90():
    jobs = [(variant, arch) for arch in ("sm_80", "sm_90") for variant in cutlass_gemm.shipped_variants()]
    futures = [cuda_jit.compile_async(cutlass_gemm.SOURCE, variant, arch) for variant, arch in jobs]
    for (variant, arch), future in zip(jobs, futures):
        cubin = future.result().read_bytes()
        for name in (*cutlass_gemm.KERNELS, "sc_launch_info"):
            assert name.encode() in cubin, f"{name} missing from {variant} {arch}"


@needs_toolchain
def test_every_shipped_sm90_variant_compiles_for_sm90a():
    variants = cutlass_sm90.sm90_variants()
    assert 0 < len(variants) <= 8
    futures = [cuda_jit.compile_async(cutlass_sm90.SOURCE, v, cutlass_sm90.ARCH) for v in variants]
    for variant, future in zip(variants, futures):
        cubin = future.result().read_bytes()
        for name in (*cutlass_sm90.KERNELS, *cutlass_sm90.PACK_KERNELS, cutlass_sm90.LAUNCH_INFO):
            assert name.encode() in cubin, f"{name} missing from {variant}"


def test_arch_specific_targets_compile_through_gencode(tmp_path):
    tools = cuda_jit.Toolchain("nvcc", "13.0", tmp_path, "0")
    sm90a = cuda_jit._command(tools, tmp_path / "x.cu", {}, "sm_90a", tmp_path / "x.cubin")
    assert "-gencode=arch=compute_90a,code=sm_90a" in sm90a and not any(f.startswith("-arch") for f in sm90a)
    assert "-arch=sm_80" in cuda_jit._command(tools, tmp_path / "x.cu", {}, "sm_80", tmp_path / "x.cubin")


@needs_toolchain
def test_a_cached_cubin_is_reused_without_running_nvcc(monkeypatch):
    variant = cutlass_gemm.shipped_variants()[-1]
    first = cuda_jit.compile_async(cutlass_gemm.SOURCE, variant, "sm_80").result()

    def no_compiler(*args, **kwargs):
        raise AssertionError("nvcc ran although the cubin is cached")

    monkeypatch.setattr(cuda_jit.subprocess, "run", no_compiler)
    assert cuda_jit._compile(cutlass_gemm.SOURCE, variant, "sm_80", first) == first
    other_arch = cuda_jit.cubin_path(cutlass_gemm.SOURCE, variant, "sm_90")
    other_tile = cuda_jit.cubin_path(cutlass_gemm.SOURCE, {**variant, "SC_STAGES": 5}, "sm_80")
    assert len({first, other_arch, other_tile}) == 3


@needs_toolchain
def test_a_failed_compile_names_the_variant_and_leaves_no_file():
    variant = {**cutlass_gemm.shipped_variants()[0], "SC_ELEMENT": 7}
    path = cuda_jit.cubin_path(cutlass_gemm.SOURCE, variant, "sm_80")
    with pytest.raises(RuntimeError, match="SC_ELEMENT must be 0"):
        cuda_jit.compile_async(cutlass_gemm.SOURCE, variant, "sm_80").result()
    assert not path.exists() and not list(path.parent.glob("tmp*.cubin"))


def test_missing_nvcc_is_the_stated_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSECONV_NVCC", str(tmp_path / "no-nvcc"))
    cuda_jit._toolchain.cache_clear()
    try:
        assert "nvcc not found" in cuda_jit.unavailable()
        reason = cutlass_gemm.unsupported(_problem())
        assert reason is not None and "nvcc" in reason
    finally:
        monkeypatch.undo()
        cuda_jit._toolchain.cache_clear()


@pytest.mark.parametrize("overrides, expected", [
    ({"device": torch.device("cpu")}, "CUDA devices only"),
    ({"in_channels": 13}, "in_channels=13"),
    ({"dtype": torch.float32, "out_channels": 6}, "multiples of 4"),
    ({"dtype": torch.float64}, "float16, bfloat16 or float32"),
])
def test_problems_the_cutlass_backends_refuse_say_why(overrides, expected, allow_tf32):
    allow_tf32(True)
    assert expected in cutlass_gemm.unsupported(_problem(**overrides))


@pytest.mark.parametrize("overrides, expected", [
    ({"device": torch.device("cpu")}, "cutlass_sm90 runs on CUDA devices only"),
    ({"dtype": torch.float32}, "float16 or bfloat16, not torch.float32"),
    ({"in_channels": 13}, "in_channels=13"),
])
def test_problems_cutlass_sm90_refuses_say_why(overrides, expected):
    assert expected in cutlass_sm90.unsupported(_problem(**overrides))


def test_cutlass_sm90_runs_on_sm90_only(monkeypatch):
    monkeypatch.setattr(cutlass_gemm, "unsupported", lambda problem: None)  # as if nvcc and CuPy were here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "sm_90a (wgmma: H100/H200) only, this GPU is sm_89" in cutlass_sm90.unsupported(_problem())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cutlass_sm90.unsupported(_problem()) is None


def test_float32_without_tf32_is_refused(allow_tf32):
    allow_tf32(False)
    assert "allow_tf32" in cutlass_gemm.unsupported(_problem(dtype=torch.float32))


def test_pinning_a_cutlass_backend_where_it_cannot_run_raises_the_reason():
    mode = next(m for m in MODES if m.name == "submanifold_k3")
    x = make_input(mode, 8, "cpu", dtype=torch.float32, n=30, extent=5)
    weight = torch.randn(27, 8, 8)
    with pytest.raises(ValueError, match="cutlass_grouped.*CUDA devices only"):
        sparse_conv3d(x, weight, kernel_size=3, fwd_algo="cutlass_grouped")
    with pytest.raises(ValueError, match="cutlass_sm90.*CUDA devices only"):
        sparse_conv3d(x.replace(feats=x.feats.half()), weight.half(), kernel_size=3, fwd_algo="cutlass_sm90")


# ------------------------------------------------------------- host-side tables (CPU) ----------

def _cpu_map(name: str):
    mode = next(m for m in MODES if m.name == name)
    x = make_input(mode, 4, "cpu", dtype=torch.float32, n=400, extent=12)
    size = mode.kernel_size if isinstance(mode.kernel_size, tuple) else (mode.kernel_size,) * 3
    key = KernelMapKey(x.coord_id, size, (mode.stride,) * 3, (1, 1, 1), mode.transposed, mode.generative)
    return x.cache.kernel_map(key)[0]


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "dgrad"])
def test_grouped_gather_table_and_tile_offsets_match_the_neighbour_table(forward):
    kernel_map = _cpu_map("submanifold_k3")
    table, order, sources = cutlass_gemm.gather_table(kernel_map, forward)
    plain = kernel_map.neighbors if forward else kernel_map.transposed_neighbors
    expected = plain[order.long()].t()
    assert torch.equal(table, torch.where(expected >= 0, expected, torch.full_like(expected, sources)))
    assert sorted(order.tolist()) == list(range(plain.shape[0]))
    for lo, hi in mask_views.offset_groups(kernel_map.kernel_volume, 2):  # cutlass_sm90's offset groups
        group_table, group_order, _ = cutlass_gemm.gather_table(kernel_map, forward, (lo, hi))
        expected = plain[group_order.long(), lo:hi].t()
        assert torch.equal(group_table, torch.where(expected >= 0, expected, torch.full_like(expected, sources)))
        assert torch.equal(group_order.long(), mask_views.sorted_rows(kernel_map, forward, True, (lo, hi)))
    block_m = 32
    active = mask_views.tile_offsets(kernel_map, forward, True, block_m)
    offsets, counts = mask_views.active_lists(kernel_map, forward, True, block_m)
    assert active.shape[0] == offsets.shape[0] == -(-plain.shape[0] // block_m)
    for tile in range(active.shape[0]):
        slots = table[:, tile * block_m:(tile + 1) * block_m]
        used = (slots != sources).any(1)
        assert active[tile].tolist() == used.tolist()
        assert offsets[tile, : counts[tile]].tolist() == torch.nonzero(used).flatten().tolist()


@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_wgrad_chunks_cover_every_pair_once_within_its_offset(chunk):
    kernel_map = _cpu_map("submanifold_k3")
    chunks, first_chunk = cutlass_gemm._chunks(kernel_map, chunk)
    first_pair = torch.tensor([0, *kernel_map.pair_counts]).cumsum(0).tolist()
    first_chunk = first_chunk.tolist()
    assert len(first_chunk) == kernel_map.kernel_volume + 1 and first_chunk[-1] == chunks.shape[0]
    covered = []
    for k in range(kernel_map.kernel_volume):
        for first, count in chunks[first_chunk[k]:first_chunk[k + 1]].tolist():
            assert 0 < count <= chunk and first_pair[k] <= first and first + count <= first_pair[k + 1]
            covered += range(first, first + count)
    assert covered == list(range(kernel_map.num_pairs))


def test_one_pair_per_row_maps_are_recognised_and_tiled():
    up = _cpu_map("transposed_k2_s2")
    assert cutlass_gemm.one_pair_per_row(up, True) == (True, True)
    assert cutlass_gemm.one_pair_per_row(_cpu_map("strided_k2_s2"), False)[0]
    assert not cutlass_gemm.one_pair_per_row(_cpu_map("submanifold_k3"), True)[0]
    tiles = cutlass_gemm._pair_blocks(up, 16)
    covered = [p for k, first, count in tiles.tolist() for p in range(first, first + count)]
    assert covered == list(range(up.num_pairs)) and int(tiles[:, 2].max()) <= 16
    ptr = up.pairs[2].tolist()
    assert all(ptr[k] <= first and first + count <= ptr[k + 1] for k, first, count in tiles.tolist())


# ------------------------------------------------------------------------------- GPU ------------

CASES = [m for m in MODES if m.name in ("submanifold_k3", "strided_k2_s2", "transposed_k2_s2", "transposed_k3_s2",
                                        "generative_k3_s1")]
TOLERANCE = {torch.float32: 3e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(cutlass_gemm, "new_output",
                        lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype, device=like.device))


def _gpu_case(mode, c_in: int, c_out: int, dtype: torch.dtype):
    """A fresh random layer of ``mode`` on the GPU: (its problem, kernel map, operands by namespace)."""
    x = make_input(mode, c_in, "cuda", dtype=dtype, n=6000, extent=40)
    key = KernelMapKey(x.coord_id, mode.kernel_size if isinstance(mode.kernel_size, tuple) else (mode.kernel_size,) * 3,
                       (mode.stride,) * 3, (1, 1, 1), mode.transposed, mode.generative)
    kernel_map, _ = x.cache.kernel_map(key)
    weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device="cuda", dtype=dtype) / c_in ** 0.5
    grad_out = torch.randn(kernel_map.num_out, c_out, device="cuda", dtype=dtype)
    operands = {
        "AB_gather_scatter": (x.feats, weight),
        "ABt_gather_scatter": (grad_out, weight),
        "AtB_gather_gather": (x.feats, grad_out),
    }
    problem = dataclasses.replace(_problem(), num_in=kernel_map.num_in, num_out=kernel_map.num_out,
                                  in_channels=c_in, out_channels=c_out, kernel_size=kernel_map.kernel_size,
                                  transposed=mode.transposed, generative=mode.generative, dtype=dtype,
                                  device=x.device)
    return problem, kernel_map, operands


@pytest.mark.gpu
@needs_toolchain
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("channels", [(16, 32), (96, 64), (128, 256), (256, 8)], ids=lambda c: f"c{c[0]}x{c[1]}")
@pytest.mark.parametrize("mode", CASES, ids=str)
def test_cutlass_backends_match_explicit_gemm(mode, channels, dtype, poisoned_outputs, allow_tf32):
    allow_tf32(True)
    problem, kernel_map, operands = _gpu_case(mode, *channels, dtype)
    for name, namespaces in OPS.items():
        backend = get(name)
        assert backend.supports(problem) is None
        for namespace in namespaces:
            a, b = operands[namespace]
            out = backend.run(namespace, problem, {}, a, b, kernel_map)
            ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
            assert out.dtype == dtype and out.shape == ref.shape
            assert bool(torch.isfinite(out).all()), f"{name} {namespace}: unwritten or non-finite output"
            assert relative_error(out, ref) < TOLERANCE[dtype], f"{name} {namespace}"


@pytest.mark.gpu
@needs_toolchain
def test_every_inner_cutlass_config_matches_explicit_gemm():
    """The autotuner may pick any tile: each one must be right, not only the winner."""
    mode = CASES[0]
    x = make_input(mode, 64, "cuda", dtype=torch.float16, n=6000, extent=40)
    key = KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)
    kernel_map, _ = x.cache.kernel_map(key)
    weight = torch.randn(27, 64, 64, device="cuda", dtype=torch.float16) / 8
    grad_out = torch.randn(kernel_map.num_out, 64, device="cuda", dtype=torch.float16)
    problem = dataclasses.replace(_problem(), num_in=kernel_map.num_in, num_out=kernel_map.num_out,
                                  in_channels=64, out_channels=64)
    cutlass_gemm.prefetch(torch.float16, x.device)
    for tile in cutlass_gemm.TILES:
        for forward, (a, namespace) in ((True, (x.feats, "AB_gather_scatter")), (False, (grad_out, "ABt_gather_scatter"))):
            ref = explicit.run(namespace, problem, {}, a.double(), weight.double(), kernel_map)
            out = torch.full(ref.shape, float("nan"), dtype=torch.float16, device="cuda")
            source = torch.cat([a, a.new_zeros((1, a.shape[1]))])
            cutlass_gemm._grouped.__wrapped__(tile, source, weight, out, kernel_map, forward)
            assert relative_error(out, ref) < 5e-3, f"grouped {tile} {namespace}"
            out = cutlass_gemm._pairs.__wrapped__(tile, a, weight, kernel_map, forward)
            assert relative_error(out, ref) < 5e-3, f"pairs {tile} {namespace}"
    up = next(m for m in MODES if m.name == "transposed_k2_s2")
    y = make_input(up, 64, "cuda", dtype=torch.float16, n=6000, extent=40)
    up_map, _ = y.cache.kernel_map(KernelMapKey(y.coord_id, (2, 2, 2), (2, 2, 2), (1, 1, 1), True, False))
    assert cutlass_gemm.one_pair_per_row(up_map, True) == (True, True)
    up_weight = torch.randn(8, 64, 64, device="cuda", dtype=torch.float16) / 8
    up_ref = explicit.run("AB_gather_scatter", problem, {}, y.feats.double(), up_weight.double(), up_map)
    for tile in cutlass_gemm.TILES:
        out = torch.full(up_ref.shape, float("nan"), dtype=torch.float16, device="cuda")
        cutlass_gemm._single.__wrapped__(tile, y.feats, up_weight, out, up_map, True)
        assert relative_error(out, up_ref) < 5e-3, f"single {tile}"
    ref = explicit.run("AtB_gather_gather", problem, {}, x.feats.double(), grad_out.double(), kernel_map)
    for tile in cutlass_gemm.WGRAD_TILES:
        out = cutlass_gemm._wgrad.__wrapped__(tile, x.feats, grad_out, kernel_map)
        assert relative_error(out, ref) < 5e-3, f"wgrad {tile}"


@pytest.mark.gpu
@needs_toolchain
def test_cutlass_wgrad_sums_its_chunks_in_a_fixed_order():
    """Many chunks an offset (chunk 7 pairs): two runs give the same bits, and the right sum."""
    problem, kernel_map, operands = _gpu_case(CASES[0], 64, 32, torch.float16)
    a, b = operands["AtB_gather_gather"]
    tile = dataclasses.replace(cutlass_gemm.WGRAD_TILES[0], chunk=7)
    first, second = (cutlass_gemm._wgrad.__wrapped__(tile, a, b, kernel_map) for _ in range(2))
    assert torch.equal(first, second)
    ref = explicit.run("AtB_gather_gather", problem, {}, a.double(), b.double(), kernel_map)
    assert relative_error(first, ref) < 5e-3


@pytest.mark.gpu
@needs_toolchain
def test_cutlass_launches_from_a_new_thread():
    """A thread whose only CUDA work came from torch's caches may have no current context: the
    driver launch binds the device's primary one and the products stay right."""
    problem, kernel_map, operands = _gpu_case(CASES[0], 32, 32, torch.float16)
    results = {}

    def products() -> None:
        for name, namespaces in OPS.items():
            for namespace in namespaces:
                results[name, namespace] = get(name).run(namespace, problem, {}, *operands[namespace], kernel_map)
        torch.cuda.synchronize()

    worker = threading.Thread(target=products)
    worker.start()
    worker.join()
    assert len(results) == 5
    for (name, namespace), out in results.items():
        a, b = operands[namespace]
        ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
        assert relative_error(out, ref) < 5e-3, f"{name} {namespace}"


@pytest.mark.gpu
@needs_toolchain
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cutlass_runs_on_a_device_other_than_the_current_one():
    with torch.cuda.device(1):  # "cuda" is the second GPU while the case is built
        problem, kernel_map, operands = _gpu_case(CASES[0], 32, 32, torch.float16)
    assert torch.cuda.current_device() == 0 and problem.device.index == 1
    for name, namespaces in OPS.items():
        for namespace in namespaces:
            a, b = operands[namespace]
            out = get(name).run(namespace, problem, {}, a, b, kernel_map)
            ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
            assert out.device == a.device and relative_error(out, ref) < 5e-3, f"{name} {namespace}"



def test_cli_status_says_why_the_family_is_unavailable(monkeypatch, tmp_path, capsys):
    from sparseconv.__main__ import main

    monkeypatch.setenv("SPARSECONV_NVCC", str(tmp_path / "no-nvcc"))
    cuda_jit._toolchain.cache_clear()
    try:
        assert main(["cutlass", "status"]) == 1
        assert "nvcc not found" in capsys.readouterr().out
        assert main(["cutlass", "build", "--arch", "sm_90"]) == 1
    finally:
        monkeypatch.undo()
        cuda_jit._toolchain.cache_clear()


@needs_toolchain
def test_cli_build_fills_the_cubin_cache_without_a_gpu(monkeypatch, capsys):
    from sparseconv.__main__ import main

    monkeypatch.setattr(cutlass_gemm, "TILES", cutlass_gemm.TILES[-1:])
    assert main(["cutlass", "build", "--arch", "sm_80", "--dtypes", "float16"]) == 0
    assert "1 of 1 variants ready" in capsys.readouterr().out
    variant = cutlass_gemm.defines(cutlass_gemm.TILES[0], torch.float16)
    assert cuda_jit.cubin_path(cutlass_gemm.SOURCE, variant, "sm_80").is_file()


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="cutlass_sm90 needs an sm_90 GPU (H100/H200)")


@pytest.mark.gpu
@needs_toolchain
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels", [(16, 32), (96, 64), (128, 256), (256, 8), (72, 40)],
                         ids=lambda c: f"c{c[0]}x{c[1]}")
@pytest.mark.parametrize("mode", CASES, ids=str)
def test_cutlass_sm90_matches_explicit_gemm(mode, channels, dtype, poisoned_outputs):
    problem, kernel_map, operands = _gpu_case(mode, *channels, dtype)
    backend = get("cutlass_sm90")
    assert backend.supports(problem) is None
    for namespace in ("AB_gather_scatter", "ABt_gather_scatter"):
        a, weight = operands[namespace]
        ref = explicit.run(namespace, problem, {}, a.double(), weight.double(), kernel_map)
        for params in backend.params_space:
            out = backend.run(namespace, problem, params, a, weight, kernel_map)
            assert out.dtype == dtype and out.shape == ref.shape
            assert bool(torch.isfinite(out).all()), f"{namespace} {params}: unwritten or non-finite output"
            assert relative_error(out, ref) < TOLERANCE[dtype], f"{namespace} {params}"


@pytest.mark.gpu
@needs_toolchain
@needs_sm90
@pytest.mark.parametrize("blocks", [None, 1, 5], ids=lambda b: f"blocks{b or 'SMs'}")
def test_every_cutlass_sm90_tile_matches_explicit_gemm(blocks, monkeypatch):
    """The autotuner may pick any tile: each one must be right, not only the winner; and the
    persistent blocks must be right however many tiles each takes (1 block: all, in one ring)."""
    if blocks is not None:
        monkeypatch.setattr(cutlass_sm90, "_multiprocessors", lambda device_index: blocks)
    mode = CASES[0]
    x = make_input(mode, 64, "cuda", dtype=torch.bfloat16, n=6000, extent=40)
    kernel_map, _ = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))
    weight = torch.randn(27, 64, 192, device="cuda", dtype=torch.bfloat16) / 8
    grad_out = torch.randn(kernel_map.num_out, 192, device="cuda", dtype=torch.bfloat16)
    problem = dataclasses.replace(_problem(), num_in=kernel_map.num_in, num_out=kernel_map.num_out,
                                  in_channels=64, out_channels=192, dtype=torch.bfloat16)
    cutlass_sm90.prefetch(torch.bfloat16)
    for tile, splits in itertools.product(cutlass_sm90.TILES, (1, 2)):
        groups = tuple(mask_views.offset_groups(27, splits))
        for forward, a, namespace in ((True, x.feats, "AB_gather_scatter"), (False, grad_out, "ABt_gather_scatter")):
            ref = explicit.run(namespace, problem, {}, a.double(), weight.double(), kernel_map)
            out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            cutlass_sm90._rows.__wrapped__(tile, a, weight, out, kernel_map, forward, groups)
            assert relative_error(out, ref) < 2e-2, f"{tile} splits={splits} {namespace}"
