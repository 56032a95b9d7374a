"""mask_implicit_gemm: output-stationary Triton launches over all offsets (no atomics, deterministic).

Each program owns a tile of output rows and runs one loop over the offsets some row of its
tile has (a per-tile list) and their channel blocks, gathering its rows' neighbours. Rows are
visited sorted by their neighbour bitmask (``sort=True``) so that a tile's rows share offsets.
With ``splits`` > 1 the offsets are cut into groups, each with its own row order and launch
(the later ones add to the output): shorter masks sort into denser tiles, for one extra
read and write of the output per group and one more rounding to its dtype (the tuner's guard
compares every candidate with the reference). dgrad runs the same kernel with W_kᵀ over a forward
table too: the adjoint's (a strided or transposed map's transposed table), or a submanifold map's
own with the offsets mirrored (:func:`_product_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..coords.kernel_map import KernelMap
from .problem import ConvProblem
from . import mask_views
from . import triton_kernels as tk
from .triton_launch import Bound, warm
from .mask_views import offset_groups, sorted_rows, tile_plan
from .registry import Backend, always_deterministic, register


def new_output(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The kernel writes every element (tests poison this buffer to prove it). ``new_empty``: ~2 µs
    less host time than ``torch.empty`` with the dtype and device given (H200 host)."""
    return like.new_empty(shape)


def _rows_product(kernel_map: KernelMap, params: Mapping, reduce_dim: int, out_dim: int,
                  strides: tuple[int, int, int], dtype: torch.dtype, mirrored: bool = False, recipe: tuple = ()
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product over ``kernel_map``'s own (forward) table as a function of (a, w): one launch per
    offset group, the first storing every row, the later ones adding theirs (rows are re-sorted per
    group, so each group's tiles are dense in the offsets they visit). Everything but the operands and the output (views, grid, sizes,
    options) is fixed here, once per (map, product, parameters): the layers on one map call it.
    ``mirrored``: a submanifold dgrad over the forward views, offset k reading W_{K-1-k} (see :func:`_product_of`).
    ``recipe``: what fixes the launches but for the map's views and sizes (the product's view key on
    the map it was asked of, whose kernel volume, device and mirroring): a new batch's map binds its views into the first
    product made under it (:data:`_TEMPLATES`) instead of making the launches anew."""
    kernels = tk.kernels()
    table = kernel_map.neighbors
    num_rows = table.shape[0]
    bm, bn = int(params["block_m"]), int(params["block_n"])
    sort = bool(params.get("sort", True))
    groups = offset_groups(table.shape[1], int(params.get("splits", 1)))
    if mirrored:
        groups = _mirror(groups, table.shape[1])
    if recipe:
        recipe = (*recipe, mirrored, table.shape[1], table.device)
    template = _TEMPLATES.get(recipe) if recipe else None
    launches = []
    if num_rows and out_dim and not planned(params):
        # No tile plan: the tiles are the table's rows (in its order, or sorted by mask), their offsets
        # found by the kernel.
        grid = (tk.cdiv(num_rows, bm) * tk.cdiv(out_dim, bn),)
        table = table.contiguous()
        order = sorted_rows(kernel_map, True, True, groups[0]) if sort else table  # (unread when not sorted)
        if template is not None:
            launches.append(template.launches[0].bind(grid, {2: table, 3: order, 5: num_rows}))
        else:
            args, options = _table_launch(params, dtype, (None, None, table, order, None), num_rows, reduce_dim,
                                          out_dim, table.shape[1], strides)
            launches.append(Bound(kernels.table_gemm, grid, args, options, varying=(0, 1, 4)))
    elif num_rows and out_dim:
        for step, group in enumerate(groups):
            rows = sorted_rows(kernel_map, True, sort, group, groups)
            _, offsets, counts, slots = tile_plan(kernel_map, True, sort, bm, group)
            grid = (counts.numel() * tk.cdiv(out_dim, bn),)
            if template is not None:
                launches.append(template.launches[step].bind(grid, {2: slots, 3: rows, 4: offsets, 5: counts,
                                                                     7: num_rows}))
                continue
            args, options = _rows_launch(params, dtype, step, (None, None, slots, rows, offsets, counts, None),
                                         num_rows, reduce_dim, out_dim, offsets.shape[1], strides)
            launches.append(Bound(kernels.rows_gemm, grid, args, options, varying=(0, 1, 6)))
    last = table.shape[1] - 1 if mirrored else None
    if recipe and template is None and launches:
        views = _VIEWS if planned(params) else _TABLE
        _TEMPLATES[recipe] = _RowsProduct(0, out_dim, tuple(launch.template(views) for launch in launches), last)
    return _RowsProduct(num_rows, out_dim, tuple(launches), last)


_TEMPLATES: dict[tuple, _RowsProduct] = {}
"""The first product made under each recipe (see :func:`_rows_product`), its launches without the
map's views: a network makes a few dozen, one per (layer shape, product, parameters, direction)."""

_VIEWS = (2, 3, 4, 5)
"""The positions of the map's views (slots, rows, offsets, counts) in rows_gemm's arguments."""
_TABLE = (2, 3)
"""The positions of the map's table and row order in table_gemm's arguments."""


def planned(params: Mapping) -> bool:
    """Whether a parameter set runs over the map's views (a row order and tile plans: ``rows_gemm``),
    rather than over its table alone (``plan=False``: ``table_gemm``, sorting nothing)."""
    return bool(params.get("plan", True))


class _RowsProduct:
    """:func:`_rows_product`'s function of (a, w). An object with slots, not a closure: a step makes
    ~50 of them, and each closure cell is another object for Python's collector to promote.
    ``last``: for a mirrored product, the last offset, whose weight the launches start from (they
    step through W backwards: a negative offset stride)."""

    __slots__ = ("num_rows", "out_dim", "launches", "last")

    def __init__(self, num_rows: int, out_dim: int, launches: tuple, last: int | None = None) -> None:
        self.num_rows, self.out_dim, self.launches, self.last = num_rows, out_dim, launches, last

    def __call__(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = new_output((self.num_rows, self.out_dim), a)
        if not self.launches:
            return out.zero_()
        if self.last is not None:
            w = w[self.last]
        for launch in self.launches:
            launch(a, w, out)
        return out


def _rows_launch(params: Mapping, dtype: torch.dtype, step: int, tensors: tuple, num_rows: int, reduce_dim: int,
                 out_dim: int, list_len: int, strides: tuple) -> tuple[tuple, dict]:
    """rows_gemm's arguments and options (one place for :func:`_rows_product` and :func:`precompile`)."""
    options = dict(BLOCK_M=int(params["block_m"]), BLOCK_N=int(params["block_n"]), BLOCK_K=int(params["block_k"]),
                   PRECISION=tk.precision(dtype), ACCUMULATE=step > 0, **tk.launch_options(params))
    return (*tensors, num_rows, reduce_dim, out_dim, list_len, *strides), options


def _table_launch(params: Mapping, dtype: torch.dtype, tensors: tuple, num_rows: int, reduce_dim: int, out_dim: int,
                  width: int, strides: tuple) -> tuple[tuple, dict]:
    """table_gemm's arguments and options (one place for :func:`_rows_product` and :func:`precompile`)."""
    options = dict(BLOCK_M=int(params["block_m"]), BLOCK_N=int(params["block_n"]), BLOCK_K=int(params["block_k"]),
                   WIDTH=mask_views.block_width(width), PRECISION=tk.precision(dtype),
                   ORDERED=bool(params.get("sort", True)), **tk.launch_options(params))
    return (*tensors, num_rows, reduce_dim, out_dim, width, *strides), options


def _product(namespace: str, c_in: int, c_out: int) -> tuple[bool, int, int, tuple[int, int, int]]:
    """(forward, reduce dim, out dim, W strides) of ``namespace``: dgrad reads W_k^T through strides."""
    if namespace == "AB_gather_scatter":
        return True, c_in, c_out, (c_in * c_out, c_out, 1)
    return False, c_out, c_in, (c_in * c_out, 1, c_out)


def precompile(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap) -> None:
    """Compile the kernels :func:`run` launches for this call (the views' and the product's) without
    running them (Backend.precompile)."""
    if problem.device.type != "cuda":
        return
    kernels, dtype, i32, i64 = tk.kernels(), problem.dtype, torch.int32, torch.int64
    forward, reduce_dim, out_dim, strides = _product(namespace, problem.in_channels, problem.out_channels)
    num_rows = kernel_map.num_out if forward else kernel_map.num_in
    volume = kernel_map.kernel_volume  # both neighbour tables are (rows, K) with row stride K
    if num_rows == 0 or out_dim == 0:
        return
    if not planned(params):
        sort = bool(params.get("sort", True))
        if sort:  # the row order (one group of every offset)
            mask_views.precompile(problem.device, num_rows, volume, [(0, volume)], True, None)
        args, options = _table_launch(params, dtype, (dtype, dtype, i32, i64 if sort else i32, dtype), num_rows,
                                      reduce_dim, out_dim, volume, strides)
        warm(kernels.table_gemm, problem.device, *args, **options)
        return
    bm, sort = int(params["block_m"]), bool(params.get("sort", True))
    groups = offset_groups(volume, int(params.get("splits", 1)))
    mask_views.precompile(problem.device, num_rows, volume, groups, sort, bm)
    for step, (lo, hi) in enumerate(groups):
        args, options = _rows_launch(params, dtype, step, (dtype, dtype, i32, i64, i32, i32, dtype),
                                     num_rows, reduce_dim, out_dim, hi - lo, strides)
        warm(kernels.rows_gemm, problem.device, *args, **options)


def run(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap):
    a, w = a.contiguous(), b.contiguous()
    return _prepared(kernel_map, namespace, params, w.shape[1], w.shape[2], a.dtype)(a, w)


def prepare(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap):
    """:func:`run` as a function of contiguous (a, w) (Backend.prepare)."""
    return _prepared(kernel_map, namespace, params, problem.in_channels, problem.out_channels, problem.dtype)


def _prepared(kernel_map: KernelMap, namespace: str, params: Mapping, c_in: int, c_out: int, dtype: torch.dtype):
    key = ("rows_product", namespace, c_in, c_out, dtype, tuple(params.items()))
    return kernel_map.derived(key, lambda m: _product_of(m, namespace, params, c_in, c_out, dtype, key), product=True)


def _product_of(kernel_map: KernelMap, namespace: str, params: Mapping, c_in: int, c_out: int, dtype: torch.dtype,
                recipe: tuple = ()):
    forward, reduce_dim, out_dim, strides = _product(namespace, c_in, c_out)
    mirrored = False
    if not forward and kernel_map.identity_offset is None:
        # The transposed table is the adjoint's forward table (see sorted_rows): run on the adjoint.
        # The product keeps the adjoint's views it launches with, not the adjoint (which refers to
        # this map: a cycle would keep both maps' tables until a full garbage collection).
        kernel_map = kernel_map.transposed()
    elif not forward:
        # A submanifold map's transposed table is its own with the offsets mirrored (row i meets row
        # j through k exactly when j meets i through K-1-k), so dgrad, gin_i = sum_k gout[T_ik] W_k^T,
        # is gin_i = sum_k gout[N_ik] W_{K-1-k}^T: the forward product over the forward views of the
        # mirrored offset groups, offset k reading W_{K-1-k} (a pointer to W_{K-1} and a negative
        # offset stride). Where the forward layers tuned to the same tile height and groups, those
        # views are theirs; elsewhere they are built here, and the next batch's map plan builds
        # them ahead with the forward's (no transposed table, at the cost of holding these plans
        # through the forward pass: in the benchmark MinkUNet, those of four coarse maps).
        strides, mirrored = (-strides[0], *strides[1:]), True
    return _rows_product(kernel_map, params, reduce_dim, out_dim, strides, dtype, mirrored, recipe)


def _mirror(groups: list[tuple[int, int]], volume: int) -> list[tuple[int, int]]:
    """The offset groups of the mirrored offsets (k -> K-1-k), in the same order."""
    return [(volume - hi, volume - lo) for lo, hi in groups]


TILES = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3),
         (64, 32, 32, 4, 2), (128, 128, 64, 8, 3), (32, 64, 32, 4, 2), (128, 64, 64, 4, 4),
         (64, 256, 32, 8, 3), (128, 256, 32, 8, 3),
         # 5 stages: Triton then keeps 3 gathered tiles in flight instead of 2 (the gather rows take
         # a stage of their own), by the buffers it allocates for sm_90 (Triton 3.9, compiled offline).
         (64, 128, 32, 4, 5), (64, 128, 64, 4, 5), (128, 128, 64, 8, 5), (128, 256, 64, 8, 5),
         (64, 256, 32, 4, 5), (128, 256, 32, 8, 5), (64, 64, 64, 4, 5),
         # 16 channels wide (BLOCK_K, and BLOCK_N but the last): layers of 16 channels or fewer on a side.
         (64, 16, 16, 2, 3), (128, 16, 16, 4, 3), (32, 16, 16, 1, 2), (64, 16, 16, 4, 3), (64, 32, 16, 2, 3)]


def _params(tile: int, sort: bool = True, splits: int = 1) -> dict:
    return _tile_params(TILES[tile], sort, splits)


def _tile_params(tile: tuple[int, int, int, int, int], sort: bool, splits: int) -> dict:
    """The parameter set of a (block_m, block_n, block_k, num_warps, num_stages) tile."""
    m, n, k, nw, st = tile
    return {"block_m": m, "block_n": n, "block_k": k, "num_warps": nw, "num_stages": st, "sort": sort,
            "splits": splits}


TABLE_TILES = [(16, 32, 32, 2, 2), (32, 32, 32, 2, 2), (32, 64, 32, 4, 2), (64, 32, 32, 4, 2), (64, 64, 32, 4, 3),
               (16, 16, 16, 1, 2), (32, 16, 16, 1, 2), (32, 16, 16, 2, 2), (64, 16, 16, 2, 2)]
"""Tiles without a tile plan: short ones, as a tile visits every offset any of its rows has (in the
table's order, where no sort groups rows of equal masks: fewer the fewer rows it holds). The last
four are 16 channels wide each way, for layers of at most 16 (:data:`NARROW_TABLE_TILES`)."""

WIDE_TABLE_TILES, NARROW_TABLE_TILES = range(5), range(5, 9)
"""The table tiles a lone map's pool times: the 16-wide ones where no channel count exceeds 16, else the others.
A 16 -> 16 channel lone submanifold product (H200, every table tile, 2026-11-27; the sweep's script is in git
history before 57d07f1): 55 / 74 / 143 µs against 112 / 137 / 326 for the best 32-wide tile in fp32, 38 / 51 / 81 against 59 / 75 / 131 in fp16
(street1 / room2 / street4); at 32 channels the 16-wide tiles lose (72-83 µs against 60-69 at room2 and street1)."""


def _table_params(tile: int, sort: bool = False) -> dict:
    """A tile of :data:`TABLE_TILES` without a tile plan (:func:`planned` False): the rows in the table's
    order or sorted by mask, one group."""
    return {**_tile_params(TABLE_TILES[tile], sort, 1), "plan": False}


# Every tile sorted and unsorted in one pass, then sorted in 2 and 3 offset groups, then over the table alone.
SPACE = tuple([_params(t, s) for t in range(len(TILES)) for s in (True, False)]
              + [_params(t, True, g) for t in range(len(TILES)) for g in (2, 3)]
              + [_table_params(t, s) for t in range(len(TABLE_TILES)) for s in (False, True)])


# The adaptive pool, by the widest channel count: (tiles in one group, tiles in 2 groups, in 3).
# From a tile sweep on an H200 (street4 and room2 submanifold maps, 2026-11-21; the sweep script
# is in git history):
# the five-stage tiles lead from C = 128 up (C = 256: 128x256x64 in 2 groups, 0.97 ms against
# 1.50 ms for the best three-stage tile); at C <= 64 the short tiles stay ahead.
POOL_TILES = {
    256: ([13, 11, 14, 12, 10, 5], [13, 11, 14, 12], [13, 11]),
    128: ([11, 12, 10, 7, 5, 3], [11, 12, 10], [11, 12]),
    64: ([7, 16, 4, 0, 1], [7, 0], [7]),
    # A side of 16 channels or fewer (a stem's input, a detection backbone's first stage): the 16-wide tiles,
    # about 1.3-1.5x faster in fp16 and 2-4x in fp32 at 16 -> 16 channels, forward and dgrad; beside the
    # 64-level tiles at 32 channels on the other side (4 -> 32 and 16 -> 32: 1.03-1.25x forward; dgrad,
    # whose reduction is the 32, is close either way). H200, street1 and room2, 2026-11-27
    # (that tile sweep, 2026-11-27; room2's 4 -> 32 dgrad: 65.5 µs in 2 groups of 64x16x16 against 79.4).
    16: ([17, 18, 19, 20], [17, 20], [17]),
    32: ([7, 16, 4, 0, 1, 21, 17], [7, 0, 21, 17], [7]),
}


def pool(problem: ConvProblem, level: str) -> list[Mapping]:
    widest = max(problem.in_channels, problem.out_channels)
    narrowest = min(problem.in_channels, problem.out_channels)
    width = 256 if widest > 128 else 128 if widest > 64 else 64
    if narrowest <= 16 and widest <= 32:
        width = 16 if widest <= 16 else 32
    single, two, three = POOL_TILES[width]
    auto = [_params(t) for t in single]
    if problem.lone:
        # A map serving one product builds its views for that product alone: the tiles over its table
        # need none (the tuner times a lone map's candidates with their views' build, tune/sweep.py).
        tiles = NARROW_TABLE_TILES if widest <= 16 else WIDE_TABLE_TILES
        auto += [_table_params(t, s) for t in tiles for s in (False, True)]
    if problem.kernel_volume > 8:
        # Sorted by one 27-bit mask, a 64-row tile of a street scene visits offsets that only 65%
        # of its rows have; sorted per group of 9-14 offsets, 92-98% (street4; the measuring
        # script is in git history).
        auto += [_params(t, True, 2) for t in two] + [_params(t, True, 3) for t in three]
    return tk.pool_on(problem, level, SPACE, auto)


def table_tiles(problem: ConvProblem) -> list[Mapping]:
    """The parameter sets over a table alone, its rows unsorted (:data:`TABLE_TILES`: the 16-wide ones where no
    channel count exceeds 16): what a product over a fixed-size table with rows of -1 past its count runs (a
    graphed pass, :mod:`sparseconv.ops.capacity`), where a sort or a tile plan would read the map's counts."""
    tiles = NARROW_TABLE_TILES if max(problem.in_channels, problem.out_channels) <= 16 else WIDE_TABLE_TILES
    return [_table_params(t, False) for t in tiles]


def bridge(problem: ConvProblem) -> Mapping:
    """The tile over the table alone with its rows unsorted (a graphed pass's kind of product): no view to build
    per map, and one kernel per table width and channel alignment serves every layer of a network of channels in
    multiples of 16, forward and dgrad, where its gathers are cheap against explicit_gemm_table's copies
    (Backend.bridge)."""
    wide = max(problem.in_channels, problem.out_channels) > 16
    return _table_params(WIDE_TABLE_TILES[-1] if wide else NARROW_TABLE_TILES[-1], False)


MASK_IMPLICIT_GEMM = register(
    Backend(
        name="mask_implicit_gemm",
        ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}),
        run=run,
        prepare=prepare,
        params_space=SPACE,
        supports=tk.unsupported,
        pool=pool,
        heuristic=lambda problem: 2.0 if problem.device.type == "cuda" else -5.0,
        version=4,  # 2: one pipelined loop over (offset, channel block) per tile; 3: tile-major gather rows;
                    # 4: rows sorted rarest offset first (denser tiles)
        # Each row's sum is one program's, in list order; offset groups add in launch order.
        deterministic=always_deterministic,
        precompile=precompile,
        warms_kernels=True,
        bridge=bridge,
    )
)
