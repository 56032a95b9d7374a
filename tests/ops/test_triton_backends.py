"""The Triton backends equal explicit_gemm for every product, dtype and awkward channel count.

On a machine without a GPU they run under TRITON_INTERPRET=1 (set in conftest) on tiny
problems; with one, the same tests run on CUDA at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, make_input
from sparse_reference import relative_error

from sparseconv.coords import KernelMapKey
from sparseconv.coords import kernel_map as kernel_map_module
from sparseconv.backends import explicit, get, implicit_triton, mask_triton, mask_views, planned_views
from sparseconv.backends.triton_launch import Bound
from sparseconv.backends.problem import ConvProblem
from sparseconv.ops.batch import kernel_map as map_request

CASES = [m for m in MODES if m.name in ("submanifold_k3", "strided_k2_s2", "transposed_k2_s2", "transposed_k3_s2",
                                        "generative_k3_s1")]
TOLERANCE = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
OPS = {
    "mask_implicit_gemm": ("AB_gather_scatter", "ABt_gather_scatter"),
    "implicit_gemm": ("AB_gather_scatter", "ABt_gather_scatter"),
    "splitk_wgrad": ("AtB_gather_gather",),
}


def _problem(x, kernel_map, c_in, c_out, dtype, mode) -> ConvProblem:
    return ConvProblem(kernel_map.num_in, kernel_map.num_out, c_in, c_out, kernel_map.kernel_size, (1, 1, 1),
                       (1, 1, 1), mode.transposed, mode.generative, dtype, x.device)


def _input_and_map(mode, channels: int, device, dtype, n: int, extent: int):
    """(input SparseTensor, its kernel map for ``mode``)."""
    x = make_input(mode, channels, device, dtype=dtype, n=n, extent=extent)
    size = mode.kernel_size if isinstance(mode.kernel_size, tuple) else (mode.kernel_size,) * 3
    key = KernelMapKey(x.coord_id, size, (mode.stride,) * 3, (1, 1, 1), mode.transposed, mode.generative)
    return x, map_request(x.cache, key)[0]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(mask_triton, "new_output",
                        lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype, device=like.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels", [(3, 13), (16, 4)], ids=lambda c: f"c{c[0]}x{c[1]}")
@pytest.mark.parametrize("mode", CASES, ids=str)
def test_triton_backends_match_explicit_gemm(mode, channels, dtype, device, poisoned_outputs):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter computes in numpy, which has no bfloat16 (GPU only)")
    c_in, c_out = channels
    x, kernel_map = _input_and_map(mode, c_in, device, dtype, n=40 if device == "cpu" else 4000,
                                   extent=6 if device == "cpu" else 30)
    weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device=device, dtype=dtype) / c_in ** 0.5
    grad_out = torch.randn(kernel_map.num_out, c_out, device=device, dtype=dtype)
    operands = {
        "AB_gather_scatter": (x.feats, weight),
        "ABt_gather_scatter": (grad_out, weight),
        "AtB_gather_gather": (x.feats, grad_out),
    }
    problem = _problem(x, kernel_map, c_in, c_out, dtype, mode)
    for name, namespaces in OPS.items():
        backend = get(name)
        assert backend.supports(problem) is None
        for namespace in namespaces:
            a, b = operands[namespace]
            params = {**backend.params_space[0], "split": 2}  # exercise the split-K atomics too
            out = backend.run(namespace, problem, params, a, b, kernel_map)
            ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
            assert out.dtype == dtype and out.shape == ref.shape
            assert bool(torch.isfinite(out).all()), f"{name} {namespace}: unwritten or non-finite output"
            assert relative_error(out, ref) < TOLERANCE[dtype], f"{name} {namespace}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("channels", [(32, 64), (96, 96), (128, 256), (256, 32)], ids=lambda c: f"c{c[0]}x{c[1]}")
def test_triton_backends_match_explicit_gemm_at_wide_channels(channels, dtype, poisoned_outputs):
    test_triton_backends_match_explicit_gemm(CASES[0], channels, dtype, "cuda", poisoned_outputs)


def _check_tile(name: str, params: dict, second_mode: str, device) -> None:
    """``name`` with ``params`` against explicit_gemm, forward and dgrad, 96 -> 40 channels (tails),
    on the submanifold map and on ``second_mode``'s."""
    backend = get(name)
    for mode in (CASES[0], next(m for m in CASES if m.name == second_mode)):
        x, kernel_map = _input_and_map(mode, 96, device, torch.float16, n=60 if device == "cpu" else 6000,
                                       extent=7 if device == "cpu" else 40)
        weight = torch.randn(kernel_map.kernel_volume, 96, 40, device=device, dtype=torch.float16) / 96 ** 0.5
        grad_out = torch.randn(kernel_map.num_out, 40, device=device, dtype=torch.float16)
        problem = _problem(x, kernel_map, 96, 40, torch.float16, mode)
        for namespace, a in (("AB_gather_scatter", x.feats), ("ABt_gather_scatter", grad_out)):
            out = backend.run(namespace, problem, params, a, weight, kernel_map)
            ref = explicit.run(namespace, problem, {}, a.double(), weight.double(), kernel_map)
            assert bool(torch.isfinite(out).all()), f"{mode} {namespace}: unwritten output"
            assert relative_error(out, ref) < TOLERANCE[torch.float16], f"{mode} {namespace}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", mask_triton.SPACE,
                         ids=lambda p: "m{block_m}n{block_n}k{block_k}w{num_warps}s{num_stages}-sort{sort}-splits{splits}".format(**p)
                         + ("" if mask_triton.planned(p) else "-table"))
def test_every_mask_tile_matches_explicit_gemm(params, device, poisoned_outputs):
    """Each tile of the space walks its tiles' active-offset lists correctly, in one offset group
    or several (the later ones adding), or the table's rows and the offsets it finds in them (``plan``
    False), tails included (96 reduce channels are not a multiple of BLOCK_K = 64, 40 outputs not of
    BLOCK_N)."""
    if device == "cpu" and mask_triton.planned(params) and mask_triton.SPACE.index(params) % 5:
        pytest.skip("the interpreter runs every fifth set over views (both sorts, 1-3 groups, BLOCK_K 32 and 64) and "
                    "every set over the table; the GPU all")
    if device == "cpu" and not mask_triton.planned(params) and params["block_n"] == 16 and params["block_m"] != 16:
        pytest.skip("the interpreter runs one 16-wide table tile (both orders; 16-channel steps are its slowest); "
                    "the GPU all")
    _check_tile("mask_implicit_gemm", params, "transposed_k3_s2", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", implicit_triton.GEMM_SPACE,
                         ids=lambda p: "p{block_p}n{block_n}k{block_k}w{num_warps}s{num_stages}".format(**p))
def test_every_implicit_gemm_tile_matches_explicit_gemm(params, device, poisoned_outputs):
    """Each pair tile of implicit_gemm, on a map with several pairs per output row (atomics into
    fp32) and on the transposed k2 s2 map (one pair per row: plain stores into the poisoned
    output), forward and dgrad, with channel tails (96 reduce channels, 40 output columns)."""
    if device == "cpu" and params is not implicit_triton.GEMM_SPACE[-1]:
        pytest.skip("the interpreter runs the widest tile (the others run in the tests above); the GPU all")
    _check_tile("implicit_gemm", params, "transposed_k2_s2", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", implicit_triton.WGRAD_SPACE,
                         ids=lambda p: "p{block_p}m{block_m}n{block_n}w{num_warps}-split{split}".format(**p))
def test_every_wgrad_tile_matches_explicit_gemm(params, device, poisoned_outputs):
    """Each tile and split of splitk_wgrad, on the submanifold map (many pairs per offset) and the
    transposed k2 s2 one (one pair per output row), with tails in both weight dimensions (72 -> 264
    channels: not multiples of 64 or of 256); unsplit, it writes every element of a poisoned dW."""
    if device == "cpu" and (params["block_n"] < 256 or params["split"] not in (1, 4)):
        pytest.skip("the interpreter runs the 256-column tiles at splits 1 and 4 (the others run above); the GPU all")
    backend = get("splitk_wgrad")
    for mode in (CASES[0], next(m for m in CASES if m.name == "transposed_k2_s2")):
        x, kernel_map = _input_and_map(mode, 72, device, torch.float16, n=60 if device == "cpu" else 6000,
                                       extent=7 if device == "cpu" else 40)
        grad_out = torch.randn(kernel_map.num_out, 264, device=device, dtype=torch.float16)
        problem = _problem(x, kernel_map, 72, 264, torch.float16, mode)
        out = backend.run("AtB_gather_gather", problem, params, x.feats, grad_out, kernel_map)
        ref = explicit.run("AtB_gather_gather", problem, {}, x.feats.double(), grad_out.double(), kernel_map)
        assert out.shape == ref.shape and out.dtype == torch.float16
        assert relative_error(out, ref) < TOLERANCE[torch.float16], f"{mode}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [m for m in MODES if m.name in ("submanifold_k3", "submanifold_k5", "strided_k2_s2",
                                                                 "strided_k3_s2", "generative_k3_s1")], ids=str)
def test_pair_lists_of_the_kernels_are_the_maps_own(mode, device, monkeypatch):
    """The two-launch pair lists every backend reads on a GPU: the same pairs in the same order (by
    offset, then by output row) and the same offset pointers as the torch ops' (the reference),
    every entry of the uninitialised lists written; rows not a multiple of a block, 27 and 125 offsets."""
    x, kernel_map = _input_and_map(mode, 4, device, torch.float32, n=300 if device == "cpu" else 7000,
                                   extent=9 if device == "cpu" else 40)
    monkeypatch.setattr(kernel_map, "kernels", None)  # the torch ops build the reference
    expected = kernel_map.pairs
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda size, **kw: full(tuple(size) if isinstance(size, tuple) else (size,),
                                                                 -7, **kw))  # poisoned
    built = mask_views.pair_lists(kernel_map)
    monkeypatch.undo()
    assert built is not None and kernel_map.num_pairs > 0
    for name, got, want in zip(("in_idx", "out_idx", "offset_ptr"), built, expected):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("device", DEVICES)
def test_pair_counts_of_several_maps_in_one_launch_and_of_one_alone_are_each_maps_own(device):
    """The map plan's pair counts from one launch over several tables (27, 125 and 8 offsets, rows
    not a multiple of a block): each map's, as torch counts them, from a 16-byte aligned start."""
    maps = [_input_and_map(mode, 2, device, torch.float32, n=n, extent=9 if device == "cpu" else 40)[1]
            for mode, n in ((CASES[0], 300), (next(m for m in MODES if m.name == "submanifold_k5"), 257),
                            (CASES[1], 411))]
    counts, starts = planned_views.pair_counts(maps)
    assert counts.dtype == torch.int64 and all(start % 2 == 0 for start in starts), "16-byte aligned starts"
    for kernel_map, start in zip(maps, starts):
        expected = (kernel_map.neighbors >= 0).sum(0)
        assert torch.equal(counts[start: start + kernel_map.kernel_volume], expected) and expected.sum() > 0
    for kernel_map in maps:  # one map alone: the one-table kernel
        counts, starts = planned_views.pair_counts([kernel_map])
        assert starts == [0] and torch.equal(counts, (kernel_map.neighbors >= 0).sum(0))


@pytest.mark.parametrize("device", DEVICES)
def test_views_whose_kernels_are_not_compiled_yet_are_built_by_torch_the_same(device):
    """A cold process's first batch: while the compile gate says a view kernel is not compiled (it compiles
    in the background), pair counts, pair lists and the fused norm come from torch's ops, equal to the
    kernels' (the counts and lists exactly; the norm's one rounding against torch's three), launching none."""
    from sparseconv.backends import triton_launch
    from sparseconv.backends import compiling as background_compiles
    from sparseconv.ops.features import channel_affine

    _, cold = _input_and_map(CASES[0], 2, device, torch.float32, n=300, extent=9 if device == "cpu" else 40)
    feats = torch.randn(70, 24, device=device, dtype=torch.float16)
    residual, shift = torch.randn_like(feats), torch.randn(24, device=device).half()
    scale = torch.rand(24, device=device).half() + 0.5
    launched = []
    with pytest.MonkeyPatch.context() as compiling:
        compiling.setattr(triton_launch, "_READY", set())
        compiling.setattr(triton_launch, "_COMPILED", {})
        compiling.setattr(background_compiles, "kernel_ready", lambda *a: False)
        compiling.setattr(triton_launch, "_launch", lambda kernel, *a: launched.append(kernel))
        counts, pairs = cold.offset_counts, cold.pairs
        fused = channel_affine(feats, scale, shift, residual, relu=True)
        assert launched == [] and planned_views.pair_counts([cold]) is None and mask_views.pair_lists(cold) is None
    assert torch.equal(fused, (torch.addcmul(shift, feats, scale) + residual).relu_())
    warm = kernel_map_module.KernelMap(cold.neighbors, cold.num_in, cold.kernel_size, cold.identity_offset)
    assert torch.equal(planned_views.pair_counts([warm])[0], counts)
    for got, want in zip(mask_views.pair_lists(warm), pairs):
        assert torch.equal(got, want)
    reference = (feats.float() * scale.float() + shift.float() + residual.float()).relu()
    assert torch.allclose(channel_affine(feats, scale, shift, residual, relu=True).float(), reference, atol=1e-2)
    assert torch.allclose(fused.float(), reference, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_split_wgrad_leaves_its_sums_zeroed_for_the_next_launch(device, poisoned_outputs):
    """Split launches add into the stream's fp32 sums, and the last split of each tile stores dW and
    zeroes its part: launches of other shapes and maps after each other (each writing a poisoned
    dW) stay right only if every launch leaves the sums and tickets as it found them."""
    backend = get("splitk_wgrad")
    params = next(p for p in implicit_triton.WGRAD_SPACE if p["split"] == 4 and (device != "cpu" or p["block_n"] == 256))
    for mode, c_in, c_out in [(CASES[0], 24, 40), (CASES[1], 72, 264), (CASES[0], 24, 40)]:
        x, kernel_map = _input_and_map(mode, c_in, device, torch.float16, n=60 if device == "cpu" else 6000,
                                       extent=7 if device == "cpu" else 40)
        grad_out = torch.randn(kernel_map.num_out, c_out, device=device, dtype=torch.float16)
        problem = _problem(x, kernel_map, c_in, c_out, torch.float16, mode)
        out = backend.run("AtB_gather_gather", problem, params, x.feats, grad_out, kernel_map)
        ref = explicit.run("AtB_gather_gather", problem, {}, x.feats.double(), grad_out.double(), kernel_map)
        assert relative_error(out, ref) < TOLERANCE[torch.float16], f"{mode} {c_in}x{c_out}"
        sums, tickets = implicit_triton.split_sums(x.feats.device, 1, 1)  # the launch's: cuda:0, not cuda
        assert sums.numel() >= kernel_map.kernel_volume * c_in * c_out
        assert not sums.any() and not tickets.any(), "a launch left its sums or tickets set"


@pytest.mark.gpu
def test_features_at_any_alignment_and_channel_count_in_any_order(poisoned_outputs):
    """Triton compiles a kernel per specialisation (16-byte aligned pointers, integers divisible by
    16) and reuses it: features at a 2-byte offset and channel counts not divisible by 16, each
    after the other kind, must still be right."""
    mode = CASES[0]
    backend = get("mask_implicit_gemm")
    for c_in, c_out, shift in [(48, 32, 0), (48, 32, 1), (40, 24, 1), (40, 24, 0)] * 2:
        x, kernel_map = _input_and_map(mode, c_in, "cuda", torch.float16, n=4000, extent=30)
        storage = torch.empty(x.feats.numel() + 8, device="cuda", dtype=torch.float16)
        feats = storage[shift: shift + x.feats.numel()].view_as(x.feats).copy_(x.feats)
        assert (feats.data_ptr() % 16 == 0) == (shift == 0)
        weight = torch.randn(27, c_in, c_out, device="cuda", dtype=torch.float16) / c_in ** 0.5
        problem = _problem(x, kernel_map, c_in, c_out, torch.float16, mode)
        out = backend.run("AB_gather_scatter", problem, backend.params_space[0], feats, weight, kernel_map)
        ref = explicit.run("AB_gather_scatter", problem, {}, feats.double(), weight.double(), kernel_map)
        assert relative_error(out, ref) < TOLERANCE[torch.float16], (c_in, c_out, shift)


@pytest.mark.parametrize("channels", [32, 96, 256])
@pytest.mark.parametrize("name", sorted(OPS))
def test_each_wider_pool_level_contains_the_narrower(name, channels):
    backend = get(name)
    problem = ConvProblem(300_000, 300_000, channels, channels, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False,
                          torch.float16, torch.device("cuda"))  # pools only read the problem: no GPU needed
    ids = {level: [tuple(sorted(p.items())) for p in backend.candidates_params(problem, level)]
           for level in ("auto", "trimmed", "all")}
    assert ids["auto"] and set(ids["auto"]) <= set(ids["trimmed"]) <= set(ids["all"])
    assert len(set(ids["trimmed"])) == len(ids["trimmed"])


def test_rows_sort_by_mask_with_the_rarest_offset_most_significant():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    frequency = torch.tensor([0.9, 0.05, 0.5, 0.3])  # offset 1 is the rarest, then 3, 2, 0
    table = torch.where(torch.rand(500, 4, generator=g) < frequency, torch.arange(500)[:, None], -1)
    order = mask_views.row_order(table, True).long()
    assert sorted(order.tolist()) == list(range(500))
    bits = (table[order] >= 0).long()
    key = bits[:, 1] * 8 + bits[:, 3] * 4 + bits[:, 2] * 2 + bits[:, 0]  # by count: 1, 3, 2, 0
    assert bool((key[1:] >= key[:-1]).all()), "rows are not in mask order, rarest offset first"
    ties = key[1:] == key[:-1]
    assert bool((order[1:][ties] > order[:-1][ties]).all()), "equal masks keep their row order"
    assert mask_views.row_order(table, False).tolist() == list(range(500))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name", ["submanifold_k3", "strided_k2_s2", "transposed_k2_s2"])
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "dgrad"])
def test_fused_tile_views_equal_the_torch_reference(device, mode_name, forward, monkeypatch):
    # The mask views (row order, tile offsets, offset lists, gather slots) come from two Triton
    # kernels; the torch ops they replaced stay as the reference and the path without Triton.
    from sparseconv.coords import KernelMap

    mode = next(m for m in MODES if m.name == mode_name)
    x = make_input(mode, 4, device, dtype=torch.float32, n=300, extent=10)
    size = mode.kernel_size if isinstance(mode.kernel_size, tuple) else (mode.kernel_size,) * 3
    built = x.cache.kernel_map(KernelMapKey(x.coord_id, size, (mode.stride,) * 3, (1, 1, 1), mode.transposed,
                                            mode.generative))[0]
    copies = []
    for _ in range(2):
        copy = KernelMap(built.neighbors, built.num_in, built.kernel_size, built.identity_offset)
        copy.__dict__["transposed_neighbors"] = built.transposed_neighbors
        copies.append(copy)
    fused, plain = copies
    for block_m, splits in ((16, 1), (32, 2), (64, 3)):
        groups = mask_views.offset_groups(built.kernel_volume, splits)  # the fused orders: one sort for all
        for group in groups:
            views = []
            for kernel_map, use_triton in ((fused, True), (plain, False)):
                monkeypatch.setattr(mask_views, "fused", lambda table, flag=use_triton: flag)
                views.append([mask_views.sorted_rows(kernel_map, forward, True, group, groups),
                              mask_views.tile_offsets(kernel_map, forward, True, block_m, group),
                              *mask_views.active_lists(kernel_map, forward, True, block_m, group),
                              *mask_views.tile_slots(kernel_map, forward, True, block_m, group)])
            for got, expected in zip(*views):
                assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_a_lone_maps_row_order_ranks_its_offsets_by_the_plans_estimate_and_the_product_stays_exact(device,
                                                                                                    poisoned_outputs):
    # A lone map's own pairs are not counted in most batches: its row order ranks the offsets by an earlier
    # batch's counts (the map plan offers them: kernel_map.RANKS_VIEW). Any ranking is a correct order: the product
    # equals explicit_gemm's.
    from sparseconv.coords import KernelMap
    from sparseconv.coords.kernel_map import RANKS_VIEW

    mode = CASES[0]
    x, built = _input_and_map(mode, 16, device, torch.float32, n=300 if device == "cpu" else 6000,
                              extent=10 if device == "cpu" else 40)
    hinted, reference = (KernelMap(built.neighbors, built.num_in, built.kernel_size, built.identity_offset)
                         for _ in range(2))
    ranks = torch.randperm(built.kernel_volume, device=device)  # an order of the offsets unlike the map's counts
    hinted.offer(RANKS_VIEW, ranks)
    reference.__dict__["offset_counts"] = ranks  # the same ranking, as the map's own counts
    order = mask_views.sorted_rows(hinted, True, True)
    assert "offset_counts" not in hinted.__dict__, "the hinted map's pairs were counted"
    assert torch.equal(order, mask_views.sorted_rows(reference, True, True))
    assert sorted(order.tolist()) == list(range(built.num_out))
    weight = torch.randn(built.kernel_volume, 16, 8, device=device) / 4
    problem = _problem(x, hinted, 16, 8, torch.float32, mode)
    params = next(p for p in mask_triton.SPACE if not mask_triton.planned(p) and p.get("sort", True))
    out = get("mask_implicit_gemm").run("AB_gather_scatter", problem, params, x.feats, weight, hinted)
    ref = explicit.run("AB_gather_scatter", problem, {}, x.feats.double(), weight.double(), built)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("channels", [(16, 16), (4, 16), (16, 32), (32, 32)], ids=lambda c: f"c{c[0]}x{c[1]}")
def test_a_lone_maps_pool_times_the_16_wide_table_tiles_where_no_channel_count_exceeds_16(channels):
    # Tiles without a plan at 16 channels each way for narrow layers (about twice as fast there), the wider
    # ones elsewhere; maps that are not lone time no table tiles. (On a GPU: the CPU times no Triton candidate.)
    narrow = max(channels) <= 16
    for lone in (True, False):
        problem = ConvProblem(100, 100, *channels, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                              torch.device("cuda"), lone)
        table = [p for p in mask_triton.pool(problem, "auto") if not mask_triton.planned(p)]
        tiles = {(p["block_m"], p["block_n"], p["block_k"], p["num_warps"], p["num_stages"]) for p in table}
        expected = [mask_triton.TABLE_TILES[t] for t in (mask_triton.NARROW_TABLE_TILES if narrow
                                                          else mask_triton.WIDE_TABLE_TILES)]
        assert tiles == (set(expected) if lone else set())
        assert all(not lone or (tile[1] == 16) == narrow for tile in tiles)
        assert len(table) == (2 * len(expected) if lone else 0)  # sorted and in the table's order


@pytest.mark.parametrize("channels, narrow, wide", [((16, 16), True, False), ((4, 16), True, False),
                                                    ((4, 32), True, True), ((32, 16), True, True),
                                                    ((32, 32), False, True), ((16, 64), False, True)])
def test_a_side_of_16_channels_or_fewer_times_the_16_deep_tiles_over_views(channels, narrow, wide):
    # Tiles 16 channels deep where a side has at most 16 (alone up to 16 on both sides, beside the 32-deep ones
    # up to 32 on the other); not from 64 on, nor at 32 both sides.
    problem = ConvProblem(100, 100, *channels, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float16,
                          torch.device("cuda"))
    deep = {p["block_k"] for p in mask_triton.pool(problem, "auto") if mask_triton.planned(p)}
    assert (16 in deep) == narrow and (bool(deep - {16})) == wide


def _plan_parts(views) -> list:
    """A tile plan's (used flags, offsets, counts, slots), the flags as bools (a fused plan keeps their bytes,
    and its padding, in int32)."""
    used, offsets, counts, slots = views
    return [mask_views._as_flags(used, *offsets.shape), offsets, counts, slots]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_submanifold_dgrad_runs_over_the_forward_plan_with_mirrored_weights(device, splits, poisoned_outputs):
    # A submanifold map's dgrad runs over forward views of the mirrored offset groups (offset k
    # reading W_{K-1-k}): the forward's own plans where its groups are symmetric (1 and 3 groups of
    # 27), forward-direction plans of the mirrored groups built for it where they are not (2 groups),
    # never a transposed table; it equals the reference either way.
    mode = next(m for m in MODES if m.name == "submanifold_k3")
    c_in, c_out, dtype = 5, 7, torch.float32
    x, kernel_map = _input_and_map(mode, c_in, device, dtype, n=60 if device == "cpu" else 4000,
                                   extent=6 if device == "cpu" else 30)
    weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device=device, dtype=dtype)
    grad_out = torch.randn(kernel_map.num_out, c_out, device=device, dtype=dtype)
    problem = _problem(x, kernel_map, c_in, c_out, dtype, mode)
    params = {**mask_triton._params(0, True, splits), "block_m": 16 if device == "cpu" else 64}
    mask_triton.run("AB_gather_scatter", problem, params, x.feats, weight, kernel_map)
    plans = {key for key in kernel_map._derived if key[0] == "tile_plan"}
    out = mask_triton.run("ABt_gather_scatter", problem, params, grad_out, weight, kernel_map)
    ref = explicit.run("ABt_gather_scatter", problem, {}, grad_out.double(), weight.double(), kernel_map)
    assert bool(torch.isfinite(out).all()) and relative_error(out, ref) < TOLERANCE[dtype]
    own = {key for key in kernel_map._derived if key[0] == "tile_plan"} - plans
    assert "transposed_neighbors" not in kernel_map.__dict__
    assert all(forward for _, forward, *_ in own)
    mirrored = {(27 - hi, 27 - lo) for lo, hi in mask_views.offset_groups(27, splits)}
    assert {(lo, hi) for *_, lo, hi in own} == (mirrored if splits == 2 else set())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [m for m in CASES if m.name in ("submanifold_k3", "transposed_k3_s2")], ids=str)
@pytest.mark.parametrize("table", [None, False, True], ids=["plan", "table", "sorted-table"])
def test_a_new_map_binds_its_views_into_the_first_maps_launches(device, mode, table, monkeypatch, poisoned_outputs):
    # A new batch's map (other coordinates, sizes and views) makes no launches of its own for a
    # product made on an earlier map under the same recipe: it binds its views into that product's
    # template, which holds no tensors; forward, dgrad (own table or mirrored) and wgrad equal the
    # reference on every map.
    monkeypatch.setattr(mask_triton, "_TEMPLATES", {})
    monkeypatch.setattr(implicit_triton, "_TEMPLATES", {})
    made = []
    for module in (mask_triton, implicit_triton):
        monkeypatch.setattr(module, "Bound", lambda *args, _made=made, **kw: _made.append(args[0]) or Bound(*args, **kw))
    c_in, c_out, dtype = 6, 9, torch.float32
    rows = {"params": {**(mask_triton._params(0, True, 3) if table is None else mask_triton._table_params(0, table)),
                       "block_m": 16 if device == "cpu" else 64},
            "wgrad": implicit_triton._wgrad_params(0, 4)}
    for batch, n in enumerate((60, 45, 70) if device == "cpu" else (4000, 3000, 5000)):
        x, kernel_map = _input_and_map(mode, c_in, device, dtype, n=n, extent=6 if device == "cpu" else 30)
        weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device=device, dtype=dtype)
        grad_out = torch.randn(kernel_map.num_out, c_out, device=device, dtype=dtype)
        problem = _problem(x, kernel_map, c_in, c_out, dtype, mode)
        for namespace, backend, params, a, b in (
                ("AB_gather_scatter", mask_triton, rows["params"], x.feats, weight),
                ("ABt_gather_scatter", mask_triton, rows["params"], grad_out, weight),
                ("AtB_gather_gather", implicit_triton, rows["wgrad"], x.feats, grad_out)):
            before = len(made)
            prepare = backend.prepare if backend is mask_triton else backend.prepare_wgrad
            out = prepare(namespace, problem, params, kernel_map)(a, b)
            ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
            assert bool(torch.isfinite(out).all()) and relative_error(out, ref) < TOLERANCE[dtype], f"{namespace} {batch}"
            assert (len(made) > before) == (batch == 0), f"{namespace} {batch}: launches made anew"
    held = [launch for product in mask_triton._TEMPLATES.values() for launch in product.launches]
    held += list(implicit_triton._TEMPLATES.values())
    assert held and not any(isinstance(arg, torch.Tensor) for launch in held for arg in launch.args)


def test_planned_row_orders_are_the_layers_own_from_one_sort(monkeypatch):
    # The map plan builds the row orders the last batch's layers used on its maps, for all maps with
    # one sort (planned_views.build_planned_orders); a layer then takes the order it would have built.
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMap
    from sparse_reference import random_coords

    subm = KernelMapKey(0, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)
    down = KernelMapKey(0, (2, 2, 2), (2, 2, 2), (1, 1, 1), False, False)
    split = [(0, 14), (14, 27)]
    uses = [(subm, True, split), (subm, False, split), (subm, True, [(0, 27)]), (down, True, [(0, 8)])]

    def batch():
        coords = random_coords(700, 16, batch_size=2, low=-8)
        return SparseTensor(coords, torch.randn(len(coords), 2))

    def up_of(x):  # the transposed conv back from the down conv's coordinates: the down map's adjoint
        coarse = map_request(x.cache, down)[2]
        return KernelMapKey(coarse, (2, 2, 2), (2, 2, 2), (1, 1, 1), True, False)

    def use(x):  # the views a layer of each use asks for (a dgrad's groups are mirrored)
        for key, forward, groups in uses + [(up_of(x), True, [(0, 8)])]:
            kernel_map = map_request(x.cache, key)[0]
            for group in groups:
                mask_views.sorted_rows(kernel_map, forward, True, group, groups)

    use(batch())  # builds the maps and their orders one by one, and makes the plan
    sorts = []
    original = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(a[0].numel()) or original(*a, **k))
    x = batch()
    maps = {key: map_request(x.cache, key)[0] for key in (subm, down)}  # the plan builds both, then their orders
    up = up_of(x)
    maps[up] = x.cache.batch.planned[up][0]  # the adjoint, kept for the transposed conv with its order
    assert maps[up].transpose_of is maps[down]
    assert len(sorts) == 1, "one torch.sort for every planned order"
    offered = {key: dict(m.__dict__.get("_offered", {})) for key, m in maps.items()}
    assert sorted(k[2:] for k in offered[subm]) == [(0, 13), (0, 14), (0, 27), (13, 27), (14, 27)]
    assert list(offered[down]) == list(offered[up]) == [("mask_rows", True, 0, 8)]
    for key, kernel_map in maps.items():
        copy = KernelMap(kernel_map.neighbors, kernel_map.num_in, kernel_map.kernel_size, kernel_map.identity_offset)
        copy.__dict__["offset_counts"] = kernel_map.offset_counts  # an adjoint's are its source's
        for view_key, order in offered[key].items():
            lo, hi = view_key[2:]
            expected = mask_views.sorted_rows(copy, True, True, (lo, hi))  # one group, built on its own
            assert order.dtype == expected.dtype and torch.equal(order, expected), view_key
    sorts.clear()
    use(x)
    assert not sorts, "the layers took the planned orders"
    assert all(not m.__dict__.get("_offered") for m in maps.values())


@pytest.mark.parametrize("device", DEVICES)
def test_planned_tile_plans_are_the_layers_own_from_one_launch_per_tile_height(monkeypatch, device):
    # The map plan builds the tile plans the last batch's layers used on its maps (after their row
    # orders) with one tile_plans launch per tile height (one tile_plan launch for a height's only
    # plan); a layer then takes the plan it would have built, and builds none itself.
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMap
    from sparseconv.backends import triton_kernels as tk
    from sparse_reference import random_coords

    subm = KernelMapKey(0, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)
    down = KernelMapKey(0, (2, 2, 2), (2, 2, 2), (1, 1, 1), False, False)
    split = [(0, 14), (14, 27)]
    # (map, forward, groups, tile height): a dgrad of the submanifold map walks its mirrored table
    uses = [(subm, True, split, 32), (subm, False, [(0, 27)], 32), (subm, True, [(0, 27)], 64), (down, True, [(0, 8)], 32)]

    def batch():
        coords = random_coords(700, 16, batch_size=2, low=-8).to(device)
        return SparseTensor(coords, torch.randn(len(coords), 2, device=device))

    def up_of(x):
        coarse = map_request(x.cache, down)[2]
        return KernelMapKey(coarse, (2, 2, 2), (2, 2, 2), (1, 1, 1), True, False)

    def use(x):
        for key, forward, groups, block_m in uses + [(up_of(x), True, [(0, 8)], 32)]:
            kernel_map = map_request(x.cache, key)[0]
            for group in groups:
                mask_views.sorted_rows(kernel_map, forward, True, group, groups)
                mask_views.tile_plan(kernel_map, forward, True, block_m, group)

    use(batch())
    launches = []
    original = mask_views.launch
    for module in (mask_views, planned_views):  # the layers' launches and the plan's
        monkeypatch.setattr(module, "launch", lambda kernel, *a, **k: launches.append(kernel) or original(kernel, *a, **k))
    x = batch()
    maps = {key: map_request(x.cache, key)[0] for key in (subm, down)}
    up = up_of(x)
    maps[up] = x.cache.batch.planned[up][0]
    kernels = tk.kernels()
    assert launches.count(kernels.tile_plans) == 1, "one launch for the 32-row plans (widths 14, 13, 8, 8)"
    assert launches.count(kernels.tile_plan) == 1, "the 64-row plan, alone at its height, by the one-plan kernel"
    offered = {key: {k: v for k, v in m.__dict__.get("_offered", {}).items() if k[0] == "tile_plan"}
               for key, m in maps.items()}
    # the dgrad's plan (False, ...) is left to backward
    assert sorted(k[1:] for k in offered[subm]) == [(True, True, 32, 0, 14), (True, True, 32, 14, 27),
                                                   (True, True, 64, 0, 27)]
    assert list(offered[down]) == list(offered[up]) == [("tile_plan", True, True, 32, 0, 8)]
    for key, kernel_map in maps.items():
        copy = KernelMap(kernel_map.neighbors, kernel_map.num_in, kernel_map.kernel_size, kernel_map.identity_offset)
        copy.__dict__["offset_counts"] = kernel_map.offset_counts
        for view_key, views in offered[key].items():
            _, forward, sort, block_m, lo, hi = view_key
            expected = mask_views.tile_plan(copy, forward, sort, block_m, (lo, hi))
            for got, want in zip(_plan_parts(views), _plan_parts(expected)):
                assert got.dtype == want.dtype and torch.equal(got, want), view_key
        # Released and restored in other memory (the freed block taken meanwhile), a map's plans of
        # both tile heights and both offset groups come back as they were, each alone when read (one
        # tile_plan launch into its buffer's new memory); the map's other plans stay released until
        # they are read.
        before = {view_key: [view.clone() for view in _plan_parts(views)] for view_key, views in offered[key].items()}
        for views in offered[key].values():
            views.release()
            assert all(view.untyped_storage().nbytes() == 0 for view in views)
        taken = torch.empty(1 << 16, dtype=torch.int32, device=device)  # the freed memory, likely
        for restored, (view_key, views) in enumerate(offered[key].items()):
            launches.clear()
            views.restore()
            assert launches == [kernels.tile_plan], view_key
            for got, want in zip(_plan_parts(views), before[view_key]):
                assert torch.equal(got, want), view_key
            for later in list(offered[key].values())[restored + 1:]:
                assert all(view.untyped_storage().nbytes() == 0 for view in later), "restored alone"
        del taken
    launches.clear()
    use(x)
    assert launches.count(kernels.tile_plan) == 1, "the layers took the planned tile plans (the dgrad's its own)"
    # The layers took plans and asked for no row order: the batches after plan their orders all the
    # same (the plan remembers two batches: the third after the lazy one is the first to rely on it).
    sorts = []
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(a[0].numel()) or sort(*a, **k))
    for _ in range(3):
        sorts.clear()
        launches.clear()
        use(batch())
        # planned: one tile_plans launch (32 rows) and one tile_plan (64); the dgrad's own: one tile_plan
        assert len(sorts) == 1 and launches.count(kernels.tile_plan) == 2 and launches.count(kernels.tile_plans) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_training_pass_frees_planned_tile_plans_after_their_maps_last_forward_product(device, monkeypatch,
                                                                                        poisoned_outputs):
    # A planned batch's tile plans would wait for backward through the rest of the forward pass (a
    # U-Net's coarse levels' through its fine decoder, where the activations peak): after a map's
    # last forward product (as many as the last batch made) their memory goes, the products holding
    # them with it, and the dgrads that read them rebuild them in new memory. Gradients equal the
    # explicit backend's, batch after batch.
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMap
    from sparseconv.nn import SparseConv3d, SparseConvTranspose3d
    from sparse_reference import random_coords

    def net(algo, wgrad):
        torch.manual_seed(0)
        pins = dict(bias=False, fwd_algo=algo, dgrad_algo=algo, wgrad_algo=wgrad)
        return torch.nn.ModuleList([SparseConv3d(3, 4, 3, **pins), SparseConv3d(4, 5, 2, 2, **pins),
                                    SparseConv3d(5, 5, 3, **pins), SparseConvTranspose3d(5, 4, 2, 2, **pins),
                                    SparseConv3d(4, 2, 3, **pins)]).to(device)

    def freed(views) -> bool:
        return all(view.untyped_storage().nbytes() == 0 for view in views)

    def forward(layers, x):
        a = layers[0](x)
        up = layers[3](layers[2](layers[1](a)))
        return layers[4](a.replace(up.feats + a.feats))

    def step(layers, coords, feats, grad):
        x = SparseTensor(coords, feats.clone().requires_grad_())
        out = forward(layers, x)
        after_forward = [freed(views) for views in held]
        out.feats.backward(grad)
        return [x.feats.grad] + [layer.weight.grad for layer in layers], after_forward

    ours, reference = net("mask_implicit_gemm", "splitk_wgrad"), net("explicit_gemm", "explicit_gemm")
    monkeypatch.setattr(planned_views, "RELEASE_BYTES", 0)  # tiny maps' plans (the GPU's too)
    held, released = [], []
    offer, release = KernelMap.offer, KernelMap.release_views
    monkeypatch.setattr(KernelMap, "offer", lambda self, key, view, releasable=False: (
        held.append(view) if releasable else None) or offer(self, key, view, releasable))
    monkeypatch.setattr(KernelMap, "release_views", lambda self: released.append(self) or release(self))
    for seed in range(3):
        torch.manual_seed(seed)
        coords = random_coords(60 if device == "cpu" else 5000, 8 if device == "cpu" else 40, low=-3, device=device)
        feats, grad = torch.randn(len(coords), 3, device=device), torch.randn(len(coords), 2, device=device)
        if seed == 2:  # inference batches between training steps (a validation pass) change nothing
            with torch.no_grad():
                for _ in range(2):
                    forward(ours, SparseTensor(coords, feats))
        held.clear(), released.clear()
        grads, after_forward = step(ours, coords, feats, grad)
        if seed:  # planned from the batches before: every map's plans went after its last forward product
            assert held and all(after_forward)
            # the input's and the coarse submanifold maps, the strided map and its adjoint
            assert len({id(kernel_map) for kernel_map in released}) == 4
            assert not all(freed(views) for views in held), "the dgrads rebuilt the plans they read"
        else:
            assert not held and not released
        expected, _ = step(reference, coords, feats, grad)
        for layers in (ours, reference):
            layers.zero_grad(set_to_none=True)
        for got, want in zip(grads, expected):
            assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [(4, 32), (16, 8)], ids=lambda c: f"c{c[0]}x{c[1]}")
@pytest.mark.parametrize("mode", CASES, ids=str)
def test_each_products_bridge_matches_explicit_gemm(mode, channels, device, poisoned_outputs):
    from sparseconv.backends.problem import NAMESPACES
    from sparseconv.tune.pools import bridge

    c_in, c_out = channels
    dtype = torch.float16 if device == "cuda" else torch.float32
    x, kernel_map = _input_and_map(mode, c_in, device, dtype, n=40 if device == "cpu" else 4000,
                                   extent=6 if device == "cpu" else 30)
    weight = torch.randn(kernel_map.kernel_volume, c_in, c_out, device=device, dtype=dtype) / c_in ** 0.5
    grad_out = torch.randn(kernel_map.num_out, c_out, device=device, dtype=dtype)
    operands = dict(zip(NAMESPACES, ((x.feats, weight), (grad_out, weight), (x.feats, grad_out))))
    problem = _problem(x, kernel_map, c_in, c_out, dtype, mode)
    for namespace in NAMESPACES:
        candidate = bridge(namespace, problem)
        assert candidate is not None, namespace  # a Triton backend of every product has one
        backend = get(candidate.backend)
        assert namespace in backend.ops and dict(candidate.params) in [dict(p) for p in backend.params_space]
        a, b = operands[namespace]
        out = backend.run(namespace, problem, candidate.params_dict, a, b, kernel_map)
        ref = explicit.run(namespace, problem, {}, a.double(), b.double(), kernel_map)
        assert out.dtype == dtype and out.shape == ref.shape
        assert bool(torch.isfinite(out).all()), f"{candidate.id} {namespace}: unwritten or non-finite output"
        assert relative_error(out, ref) < TOLERANCE[dtype], f"{candidate.id} {namespace}"
