"""implicit_gemm (forward, dgrad) and splitk_wgrad (wgrad): pair-stationary fused Triton kernels.

implicit_gemm: one launch over (offset, block of pairs, column block); each program gathers
its pairs' rows, multiplies by W_k (W_kᵀ for dgrad, read through strides) and atomically adds
into an fp32 output, so the gather and the scatter never touch memory as separate passes.
splitk_wgrad: dW_k = A[in_k]ᵀ · B[out_k], the pairs of each offset split ``split`` ways so
that the long reductions of large scenes fill the GPU; the splits meet through fp32 atomics in a
workspace that the last split of each tile stores from and leaves zeroed (:func:`split_sums`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from ..coords.kernel_map import KernelMap
from .problem import ConvProblem
from . import mask_triton, mask_views
from . import triton_kernels as tk
from .cuda_launch import current_stream, index_of
from .triton_launch import Bound, launch, warm
from .registry import Backend, never_deterministic, register


def _max_pairs(kernel_map: KernelMap) -> int:
    return max(kernel_map.pair_counts, default=0)


def run_gemm(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap):
    kernels = tk.kernels()
    a, w = a.contiguous(), b.contiguous()
    in_idx, out_idx, offset_ptr = kernel_map.pairs
    forward = namespace == "AB_gather_scatter"
    gather, scatter, rows = (in_idx, out_idx, kernel_map.num_out) if forward else (out_idx, in_idx, kernel_map.num_in)
    single, covered = mask_views.one_pair_per_row(kernel_map, forward)
    out_dim = w.shape[2] if forward else w.shape[1]
    if single:  # nothing to accumulate: store in a's dtype, no fp32 buffer, atomics or cast pass
        out = mask_triton.new_output((rows, out_dim), a) if covered else a.new_zeros((rows, out_dim))
    else:
        out = torch.zeros((rows, out_dim), dtype=torch.float32, device=a.device)
    longest = _max_pairs(kernel_map)
    if longest and out_dim:
        args, options = _gemm_launch(forward, w.shape[1], w.shape[2], a.dtype, single, params,
                                     a, w, gather, scatter, offset_ptr, out)
        grid = (kernel_map.kernel_volume, tk.cdiv(longest, options["BLOCK_P"]),
                tk.cdiv(out_dim, options["BLOCK_N"]))
        launch(kernels.pairs_gemm, grid, *args, **options)
    return out.to(a.dtype)


def _gemm_launch(forward: bool, c_in: int, c_out: int, dtype: torch.dtype, single: bool, params: Mapping,
                 *tensors) -> tuple[tuple, dict]:
    """pairs_gemm's arguments after ``tensors`` (a, w, gather, scatter, offset_ptr, out) and its
    options: one place for :func:`run_gemm` and :func:`precompile_gemm`."""
    if forward:
        sizes = (c_in, c_out, c_in * c_out, c_out, 1)
    else:  # W_k^T read through strides
        sizes = (c_out, c_in, c_in * c_out, 1, c_out)
    options = dict(BLOCK_P=int(params["block_p"]), BLOCK_N=int(params["block_n"]), BLOCK_K=int(params["block_k"]),
                   PRECISION=tk.precision(dtype), ATOMIC=not single, **tk.launch_options(params))
    return (*tensors, *sizes), options


def precompile_gemm(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap) -> None:
    """Compile :func:`run_gemm`'s kernel for this call without running it (Backend.precompile)."""
    if problem.device.type != "cuda":
        return
    forward = namespace == "AB_gather_scatter"
    single = mask_views.one_pair_per_row(kernel_map, forward)[0]
    index = torch.int64  # KernelMap.pairs
    mask_views.precompile_pairs(problem.device, kernel_map.kernel_volume)
    args, options = _gemm_launch(forward, problem.in_channels, problem.out_channels, problem.dtype, single, params,
                                 problem.dtype, problem.dtype, index, index, index,
                                 problem.dtype if single else torch.float32)
    warm(tk.kernels().pairs_gemm, problem.device, *args, **options)


def run_wgrad(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap):
    a, b = a.contiguous(), b.contiguous()
    return _prepared_wgrad(kernel_map, params, a.shape[1], b.shape[1], a.dtype)(a, b)


def prepare_wgrad(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap):
    """:func:`run_wgrad` as a function of contiguous (a, b) (Backend.prepare)."""
    return _prepared_wgrad(kernel_map, params, problem.in_channels, problem.out_channels, problem.dtype)


def _prepared_wgrad(kernel_map: KernelMap, params: Mapping, c_in: int, c_out: int, dtype: torch.dtype):
    key = ("wgrad_product", c_in, c_out, dtype, tuple(params.items()))
    return kernel_map.derived(key, lambda m: _wgrad_product(m, params, c_in, c_out, dtype, key))


def _wgrad_product(kernel_map: KernelMap, params: Mapping, c_in: int, c_out: int, dtype: torch.dtype,
                   recipe: tuple = ()):
    """dW (K, C_in, C_out) as a function of (a, b), everything else fixed once per (map, parameters).
    Split, the splits add into the stream's zeroed fp32 sums and the last split of each tile stores
    its sum in a's dtype (:func:`split_sums`); unsplit, each program stores its own. One launch
    either way: no zero fill, no cast pass. ``recipe``: as mask_triton's (the product's view key on
    the map): a new batch's map binds its pair lists into the first launch made under it."""
    volume, bound, split, tiles = kernel_map.kernel_volume, None, int(params["split"]), 0
    if kernel_map.num_pairs and c_in and c_out:
        in_idx, out_idx, offset_ptr = kernel_map.pairs
        recipe = (*recipe, volume, in_idx.device) if recipe else ()
        template = _TEMPLATES.get(recipe) if recipe else None
        if template is not None:
            bound = template.bind(template.grid, {2: in_idx, 3: out_idx, 4: offset_ptr})
            tiles = template.grid[1]
        else:
            kernels = tk.kernels()
            args, options = _wgrad_launch(c_in, c_out, dtype, params, None, None, in_idx, out_idx, offset_ptr, None,
                                          None, None)
            tiles = tk.cdiv(c_in, options["BLOCK_M"]) * tk.cdiv(c_out, options["BLOCK_N"])
            bound = Bound(kernels.pairs_wgrad, (volume, tiles, split), args, options, varying=(0, 1, 5, 6, 7))
            if recipe:
                _TEMPLATES[recipe] = bound.template((2, 3, 4))

    return _WgradProduct(bound, (volume, c_in, c_out), split > 1, volume * tiles)


_TEMPLATES: dict[tuple, Bound] = {}
"""The first wgrad launch made under each recipe, without the map's pair lists (see
mask_triton's templates)."""


class _WgradProduct:
    """:func:`_wgrad_product`'s function of (a, b); an object with slots, not a closure (see
    mask_triton's ``_RowsProduct``)."""

    __slots__ = ("launch", "shape", "split", "tickets")

    def __init__(self, launch, shape: tuple[int, int, int], split: bool, tickets: int) -> None:
        self.launch, self.shape, self.split, self.tickets = launch, shape, split, tickets

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.launch is None:
            return a.new_zeros(self.shape)
        dw = mask_triton.new_output(self.shape, a)
        sums, tickets = split_sums(a.device, dw.numel(), self.tickets) if self.split else (dw, dw)
        self.launch(a, b, dw, sums, tickets)
        return dw


_SPLIT_SUMS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_sums(device: torch.device, entries: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sums, int32 tickets), zeroed, of at least these sizes, for the current stream of
    ``device``: split launches add into the sums, and the last split of each tile takes its sum out
    and resets its ticket, leaving both zeroed for the next launch on the stream (launches on one
    stream run one after the other; each stream has its own pair)."""
    stream = current_stream(index_of(device)) if device.type == "cuda" else None
    held = _SPLIT_SUMS.get((device, stream))
    if held is None or held[0].numel() < entries or held[1].numel() < tickets:
        entries, tickets = max(entries, held[0].numel() if held else 0), max(tickets, held[1].numel() if held else 0)
        held = _SPLIT_SUMS[device, stream] = (torch.zeros(entries, dtype=torch.float32, device=device),
                                              torch.zeros(tickets, dtype=torch.int32, device=device))
    return held


def _wgrad_launch(c_in: int, c_out: int, dtype: torch.dtype, params: Mapping, *tensors) -> tuple[tuple, dict]:
    """pairs_wgrad's arguments after ``tensors`` (a, b, in_idx, out_idx, offset_ptr, dw, sums, tickets)
    and its options."""
    split = int(params["split"])
    options = dict(BLOCK_P=int(params["block_p"]), BLOCK_M=int(params["block_m"]), BLOCK_N=int(params["block_n"]),
                   PRECISION=tk.precision(dtype), ATOMIC=split > 1, **tk.launch_options(params))
    return (*tensors, c_in, c_out, split), options


def precompile_wgrad(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap) -> None:
    """Compile :func:`run_wgrad`'s kernel for this call without running it (Backend.precompile)."""
    if problem.device.type != "cuda":
        return
    index, split = torch.int64, int(params["split"]) > 1  # KernelMap.pairs; see _wgrad_product
    mask_views.precompile_pairs(problem.device, kernel_map.kernel_volume)
    args, options = _wgrad_launch(problem.in_channels, problem.out_channels, problem.dtype, params,
                                  problem.dtype, problem.dtype, index, index, index, problem.dtype,
                                  torch.float32 if split else problem.dtype, torch.int32 if split else problem.dtype)
    warm(tk.kernels().pairs_wgrad, problem.device, *args, **options)


GEMM_SPACE = tuple(
    {"block_p": p, "block_n": n, "block_k": k, "num_warps": nw, "num_stages": st}
    for p, n, k, nw, st in [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 32, 32, 4, 2),
                            (256, 64, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 3), (32, 32, 32, 4, 2),
                            (128, 256, 64, 8, 3)]
)
WGRAD_SPLITS = (1, 4, 16, 64)
WGRAD_SPACE = tuple(
    {"block_p": p, "block_m": m, "block_n": n, "split": s, "num_warps": nw, "num_stages": 3}
    for (p, m, n, nw), s in itertools.product(
        [(64, 32, 32, 4), (64, 64, 64, 4), (128, 64, 64, 8), (32, 128, 128, 8),
         # 128 x 256: at 256 channels each pair's input row is read by 2 column tiles and its
         # gradient row by 1, instead of 4 and 4 with the 64 x 64 tile.
         (32, 128, 256, 8), (64, 128, 256, 8)], WGRAD_SPLITS)
)


def gemm_pool(problem: ConvProblem, level: str) -> list[Mapping]:
    """At 256 output columns and more, also a tile as wide as the row: each pair's input row is
    gathered once instead of once per column block (the transposed k2 s2 layer, where every
    output row has one pair, moves little else)."""
    widest = max(problem.in_channels, problem.out_channels)
    auto = [GEMM_SPACE[2] if widest > 64 else GEMM_SPACE[0], GEMM_SPACE[1]]
    return tk.pool_on(problem, level, GEMM_SPACE, auto + [GEMM_SPACE[8]] * (widest >= 256))


def wgrad_pool(problem: ConvProblem, level: str) -> list[Mapping]:
    # Few pairs per offset want few splits; a large scene needs many to fill 132 SMs.
    pairs_per_offset = max(problem.num_in, problem.num_out)
    split = 64 if pairs_per_offset > 200_000 else 16 if pairs_per_offset > 20_000 else 4
    tile = 2 if max(problem.in_channels, problem.out_channels) > 64 else 1
    auto = [_wgrad_params(tile, split), _wgrad_params(tile, 4)]
    if problem.in_channels >= 128 and problem.out_channels >= 256:
        # H200, street4 fp16 C = 256 up2 (tuner timings, L2 flushed): 0.257 ms against 0.292 for
        # the best narrow tile and 0.246 for cutlass_splitk_wgrad; at split 4 and with 32 pairs a
        # step it took 0.31-0.51 ms, so only this one is in the auto pool.
        auto.append(_wgrad_params(5, 16))
    return tk.pool_on(problem, level, WGRAD_SPACE, auto)


def _wgrad_params(tile: int, split: int) -> Mapping:
    """The WGRAD_SPACE set of tile ``tile`` (its tile list's index) at ``split``."""
    return WGRAD_SPACE[tile * len(WGRAD_SPLITS) + WGRAD_SPLITS.index(split)]


IMPLICIT_GEMM = register(
    Backend(
        name="implicit_gemm",
        ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}),
        run=run_gemm,
        params_space=GEMM_SPACE,
        supports=tk.unsupported,
        pool=gemm_pool,
        heuristic=lambda problem: 1.0 if problem.device.type == "cuda" else -5.0,
        version=2,  # 2: stores instead of atomics where each output row has one pair
        # The offsets of a row meet through fp32 atomics in whatever order their programs run. (Maps
        # of one pair per row store instead, but that is the map's, not the parameters', to say.)
        deterministic=never_deterministic,
        precompile=precompile_gemm,
        warms_kernels=True,
    )
)

def wgrad_bridge(problem: ConvProblem) -> Mapping:
    """The 64 x 64 tile in 16 splits, the shipped H200 tunings' commonest wgrad winner (29 of 124 fp16 keys): one
    kernel per channel alignment for every layer (Backend.bridge)."""
    return _wgrad_params(1, 16)


SPLITK_WGRAD = register(
    Backend(
        name="splitk_wgrad",
        ops=frozenset({"AtB_gather_gather"}),
        run=run_wgrad,
        prepare=prepare_wgrad,
        params_space=WGRAD_SPACE,
        supports=tk.unsupported,
        pool=wgrad_pool,
        heuristic=lambda problem: 2.0 if problem.device.type == "cuda" else -5.0,
        # Split-K chunks meet through fp32 atomics; one chunk (split 1) stores its sum.
        deterministic=lambda namespace, params: int(params["split"]) == 1,
        precompile=precompile_wgrad,
        warms_kernels=True,
        bridge=wgrad_bridge,
    )
)
