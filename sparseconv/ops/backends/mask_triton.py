"""mask_implicit_gemm: one output-stationary Triton launch over all offsets (no atomics, deterministic).

Each program owns a tile of output rows and walks the K offsets, gathering its rows'
neighbours and skipping offsets that no row of the tile has. Rows are visited sorted by their
neighbour bitmask (``sort=True``) so that neighbouring programs see similar masks and skip the
same offsets. dgrad runs the same kernel over the transposed neighbour table with W_kᵀ.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from ...coords.kernel_map import KernelMap
from ..problem import ConvProblem
from . import triton_kernels as tk
from .registry import Backend, register


def transposed_table(kernel_map: KernelMap) -> torch.Tensor:
    """(N_in, K) int32: the output row that input row i feeds through offset k, or -1."""
    table = torch.full((kernel_map.num_in, kernel_map.kernel_volume), -1, dtype=torch.int32,
                       device=kernel_map.neighbors.device)
    in_idx, out_idx, offset_ptr = kernel_map.pairs
    offsets = torch.repeat_interleave(torch.arange(kernel_map.kernel_volume, device=in_idx.device),
                                      torch.diff(offset_ptr))
    table[in_idx, offsets] = out_idx.to(torch.int32)
    return table


def product_table(kernel_map: KernelMap, forward: bool) -> torch.Tensor:
    """The neighbour table an output-stationary product walks: the map's own for forward,
    the transposed one for dgrad (rows are then input rows)."""
    return kernel_map.neighbors if forward else kernel_map.derived("transposed_table", transposed_table)


def sorted_rows(kernel_map: KernelMap, forward: bool, sort: bool) -> torch.Tensor:
    """(rows,) int32 visiting order of the product's rows (by neighbour mask if ``sort``), cached on the map."""
    return kernel_map.derived(("mask_rows" if forward else "mask_rows_t", sort),
                              lambda m: row_order(product_table(m, forward), sort))


def one_pair_per_row(kernel_map: KernelMap, forward: bool) -> tuple[bool, bool]:
    """(every output row of the product has at most one pair, every row has exactly one).

    True for the transposed k2 s2 conv (each fine voxel has one coarse parent) and the dgrad of
    the strided one: nothing to accumulate, so backends may store instead of adding.
    """
    def build(m: KernelMap) -> tuple[bool, bool]:
        per_row = (product_table(m, forward) >= 0).sum(1)
        return bool((per_row <= 1).all()), bool((per_row == 1).all())

    return kernel_map.derived(("one_pair_per_row", forward), build)


def row_order(table: torch.Tensor, sort: bool) -> torch.Tensor:
    """(N,) int32 order of rows: by neighbour bitmask (first 63 offsets) if ``sort``."""
    n = table.shape[0]
    if not sort or n == 0:
        return torch.arange(n, dtype=torch.int32, device=table.device)
    bits = table[:, :63] >= 0
    weights = torch.pow(2, torch.arange(bits.shape[1], device=table.device, dtype=torch.int64))
    return torch.argsort((bits.to(torch.int64) * weights).sum(1)).to(torch.int32)


def new_output(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """The kernel writes every element (tests poison this buffer to prove it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def tile_offsets(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int) -> torch.Tensor:
    """(tiles, K) bool: True where some row of the tile of ``block_m`` visited rows has a neighbour
    through that offset (cached on the map per tile height)."""
    def build(m: KernelMap) -> torch.Tensor:
        table = product_table(m, forward)
        rows = sorted_rows(m, forward, sort)
        tiles = -(-rows.numel() // block_m)
        present = torch.zeros((tiles * block_m, table.shape[1]), dtype=torch.bool, device=table.device)
        present[: rows.numel()] = table[rows.long()] >= 0
        return present.view(tiles, block_m, table.shape[1]).any(1)

    return kernel_map.derived(("tile_offsets", forward, sort, block_m), build)


def active_lists(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((tiles, K) int32 offsets each tile uses, first ``count`` of each row valid; (tiles,) int32 count)."""
    def build(m: KernelMap) -> tuple[torch.Tensor, torch.Tensor]:
        used = tile_offsets(m, forward, sort, block_m)
        order = torch.argsort((~used).to(torch.int8), dim=1, stable=True)
        return order.to(torch.int32).contiguous(), used.sum(1, dtype=torch.int32)

    return kernel_map.derived(("active_lists", forward, sort, block_m), build)


def _run_rows(a, w, kernel_map, forward, sort, reduce_dim, out_dim, strides, params) -> torch.Tensor:
    kernels = tk.kernels()
    table, rows = product_table(kernel_map, forward), sorted_rows(kernel_map, forward, sort)
    out = new_output((table.shape[0], out_dim), a)
    if out.numel() == 0:
        return out.zero_()
    bm, bn, bk = int(params["block_m"]), int(params["block_n"]), int(params["block_k"])
    offsets, counts = active_lists(kernel_map, forward, sort, bm)
    grid = (counts.numel() * kernels.triton.cdiv(out_dim, bn),)
    kernels.rows_gemm[grid](
        a, w, table, rows, offsets, counts, out, table.shape[0], reduce_dim, out_dim, table.shape[1], *strides,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=tk.precision(a.dtype), **tk.launch_options(params),
    )
    return out


def run(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap):
    a, w = a.contiguous(), b.contiguous()
    c_in, c_out = w.shape[1], w.shape[2]
    sort = bool(params.get("sort", True))
    if namespace == "AB_gather_scatter":
        return _run_rows(a, w, kernel_map, True, sort, c_in, c_out, (c_in * c_out, c_out, 1), params)
    return _run_rows(a, w, kernel_map, False, sort, c_out, c_in, (c_in * c_out, 1, c_out), params)


SPACE = tuple(
    {"block_m": m, "block_n": n, "block_k": k, "num_warps": nw, "num_stages": st, "sort": s}
    for (m, n, k, nw, st), s in itertools.product(
        [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3),
         (64, 32, 32, 4, 2), (128, 128, 64, 8, 3), (32, 64, 32, 4, 2), (128, 64, 64, 4, 4),
         (64, 256, 32, 8, 3), (128, 256, 32, 8, 3)],
        [True, False],
    )
)


def pool(problem: ConvProblem, level: str) -> list[Mapping]:
    wide = max(problem.in_channels, problem.out_channels) > 64
    auto = [SPACE[6 if wide else 0], SPACE[2 if wide else 8], SPACE[10 if wide else 2]]
    if wide:
        # On the H200 the 'all' pool beat these three by up to 20% at C = 256 on 370k voxels
        # (bench_layers, 2026-11-21): give wide layers the deeper-K and wide-N tiles too.
        auto += [SPACE[14], SPACE[4]]
    if max(problem.in_channels, problem.out_channels) > 128:
        auto += [SPACE[16], SPACE[18]]  # one column tile over all 256 outputs: each gather read once
    return tk.pool_on(problem, level, SPACE, auto)


MASK_IMPLICIT_GEMM = register(
    Backend(
        name="mask_implicit_gemm",
        ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}),
        run=run,
        params_space=SPACE,
        supports=tk.unsupported,
        pool=pool,
        heuristic=lambda problem: 2.0 if problem.device.type == "cuda" else -5.0,
        version=2,  # 2: one pipelined loop over (offset, channel block) per tile
    )
)
