"""The views of a kernel map that the mask kernels read (mask_implicit_gemm, and the CUTLASS
row kernels): each product's row order (rows sorted by neighbour bitmask over an offset group, so
that a tile's rows share offsets) and tile plan (per tile of visited rows: the offsets it uses,
their count, and its rows' sources per listed offset), cached on the map. Each is one Triton launch
on a GPU (or under its interpreter), ~10 torch ops otherwise (the reference); for a planned batch,
the map plan's view builders (:mod:`.planned_views`) make every map's orders with one sort and its
forward tile plans with one launch per tile height.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence

import torch

from .. import config
from ..coords.kernel_map import KernelMap
from . import triton_kernels as tk
from .triton_launch import launch, launch_ready, warm


def product_table(kernel_map: KernelMap, forward: bool) -> torch.Tensor:
    """The neighbour table an output-stationary product walks: the map's own for forward,
    the transposed one for dgrad (rows are then input rows)."""
    return kernel_map.neighbors if forward else kernel_map.transposed_neighbors


@functools.lru_cache(maxsize=256)
def offset_groups(kernel_volume: int, splits: int) -> tuple[tuple[int, int], ...]:
    """``splits`` contiguous [start, stop) ranges of offsets, as even as possible (empty ones dropped)."""
    bounds = [round(i * kernel_volume / splits) for i in range(splits + 1)]
    return tuple((lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo)


def sorted_rows(kernel_map: KernelMap, forward: bool, sort: bool, group: tuple[int, int] | None = None,
                groups: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """(rows,) int64 visiting order of the product's rows, by their neighbour mask over the offsets
    of ``group`` (default: all) if ``sort``; cached on the map. ``groups``: every group of the
    caller's split (``group`` among them), whose orders are then built together, one sort for all."""
    lo, hi = group or (0, kernel_map.kernel_volume)
    if not forward:
        # A dgrad walks the transposed table: its adjoint's forward table, whose views a transposed
        # (or strided) conv of the network built already. A submanifold map's transposed table is
        # its own with the offsets mirrored (k -> K-1-k): a row's mask is its forward mask with
        # the bits permuted, so the forward order groups equal masks just as well (any order is
        # correct; the order only makes tiles dense).
        if kernel_map.identity_offset is not None:
            volume = kernel_map.kernel_volume
            mirrored = None if groups is None else [(volume - b, volume - a) for a, b in groups]
            return sorted_rows(kernel_map, True, sort, (volume - hi, volume - lo), mirrored)
        return sorted_rows(kernel_map.transposed(), True, sort, group, groups)

    def build(m: KernelMap) -> torch.Tensor:
        table = product_table(m, forward)
        if not (sort and table.shape[0] and fused(table)):
            return row_order(table[:, lo:hi], sort)
        together = [(lo, hi)] if groups is None else sorted(groups)  # a dgrad's mirrored groups run backwards
        if (lo, hi) not in together or not _together(together):
            together = [(lo, hi)]
        # Per-offset counts are the map's pair counts in either direction: no pass over the table.
        orders = fused_row_orders(table, together, m.ranking_counts())
        for other, order in zip(together, orders):
            if other != (lo, hi):
                m.derived(rows_key(sort, *other), lambda _, order=order: order)
        return orders[together.index((lo, hi))]

    return kernel_map.derived(rows_key(sort, lo, hi), build)


ROWS_VIEW, PLAN_VIEW = "mask_rows", "tile_plan"
"""The kinds (first items) of the map's view keys of :func:`sorted_rows` and :func:`tile_plan`."""


def rows_key(sort: bool, lo: int, hi: int) -> tuple:
    """The map's view key of :func:`sorted_rows`'s forward order (a dgrad's is its adjoint's or a
    mirrored group's forward order)."""
    return (ROWS_VIEW, sort, lo, hi)


def fused(table: torch.Tensor) -> bool:
    """Whether the views of ``table`` are built by the Triton kernels (one launch each) rather
    than by torch ops (~10 each, the reference): on CUDA with Triton, or under its interpreter."""
    return table.is_cuda and _triton_available() or (table.device.type == "cpu" and config.triton_interpret())


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_row_orders(table: torch.Tensor, groups: Sequence[tuple[int, int]], counts: torch.Tensor
                     ) -> list[torch.Tensor]:
    """:func:`row_order` of ``table[:, lo:hi]`` for each (lo, hi) of ``groups`` (:func:`_together`:
    at most three adjacent groups, in offset order) by one mask kernel and one
    sort: group g's keys carry g above their mask bits, so the sorted keys are the groups' orders
    one after the other (a sort call costs the host ~80 µs on an H100 whatever the length).
    ``counts``: the table's (K,) pairs per offset, which set each group's bit order (rarest most
    significant; the kernel ranks them itself). The whole table, not a slice: Triton specialises
    pointers on 16-byte alignment, and a slice at an odd offset would be another compile."""
    rows, parts = table.shape[0], len(groups)
    # Each group's part of the keys (and so of the sorted indices) starts 16-byte aligned.
    stride = rows if parts == 1 else -(-rows // 2) * 2
    keys = torch.empty(parts * stride, dtype=_key_dtype(groups), device=table.device)
    kernels = tk.kernels()
    args, options = _masks_launch(table, counts, keys, rows, table.stride(0), stride, groups)
    launch(kernels.row_masks, (tk.cdiv(stride, MASK_ROWS), parts), *args, **options)
    order = torch.sort(keys, stable=True).indices
    if parts == 1:
        return [order]
    order = torch.remainder(order, stride)  # group g's indices start at g * stride
    return [order[g * stride: g * stride + rows] for g in range(parts)]


MASK_ROWS = 128


def _together(groups: Sequence[tuple[int, int]]) -> bool:
    """Whether :func:`fused_row_orders` orders ``groups`` in one launch and sort: up to three
    adjacent ones (the kernel takes their four bounds) whose widest mask leaves room for the group
    index in 63 bits."""
    adjacent = all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    return adjacent and len(groups) <= 3 and (len(groups) == 1 or max(hi - lo for lo, hi in groups) <= 61)


def _key_dtype(groups: Sequence[tuple[int, int]]) -> torch.dtype:
    """The narrowest integer holding a key of :func:`fused_row_orders`: the widest group's mask bits
    (at most 63) and the group index above them (fewer bits, fewer radix passes of the sort)."""
    total = _bits(groups) + (len(groups) - 1).bit_length()
    return torch.int16 if total <= 15 else torch.int32 if total <= 31 else torch.int64


def _bits(groups: Sequence[tuple[int, int]]) -> int:
    return min(max(hi - lo for lo, hi in groups), 63)


def _masks_launch(table, counts, keys, rows: int, row_stride: int, stride: int,
                  groups: Sequence[tuple[int, int]]) -> tuple[tuple, dict]:
    """row_masks' arguments and options (one place for :func:`fused_row_orders` and
    :func:`precompile`)."""
    bounds = [lo for lo, _ in groups] + [groups[-1][1]]
    bounds += [bounds[-1]] * (4 - len(bounds))
    return ((table, counts, keys, rows, row_stride, stride, *bounds),
            dict(BLOCK=MASK_ROWS, WIDTH=block_width(max(hi - lo for lo, hi in groups)), BITS=_bits(groups)))


PLANNED_SHIFT = 40
"""Where :func:`.planned_views.build_planned_orders` puts an order's index in its sort keys: above
every mask it orders (groups at most this wide; wider ones are left to the layers)."""


def block_width(width: int) -> int:
    """The kernels' block width for ``width`` offsets: the power of two tl.arange needs (at least 16)."""
    # (not triton.next_power_of_2: a constexpr function in recent Triton, ~4 us a call on the host)
    return max(16, 1 << max(width - 1, 0).bit_length())


def pair_lists(kernel_map: KernelMap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:attr:`KernelMap.pairs` of a map with its own (contiguous) table, by two Triton launches and
    a cumsum (torch's: a compaction and ~8 ops); None where the torch ops build them (no Triton, an
    adjoint: its source's lists swapped, kernels not compiled yet: :func:`launch_ready`). A batch's maps on a
    GPU build their pairs so (:func:`pair_lists_on_gpu`): every backend reading a map's pairs gets these there."""
    table = kernel_map.neighbors
    if not (fused(table) and table.is_contiguous()):
        return None
    rows, volume = table.shape
    device = table.device
    width, block = block_width(volume), pair_block(volume)
    blocks = max(1, tk.cdiv(rows, block))
    total = kernel_map.num_pairs
    # One allocation for the lists, the offsets' starts and the blocks' counts (int32), each part 16-byte
    # aligned (Triton compiles a kernel per pointer alignment): three torch ops fewer a map.
    lists, starts = -(-total // 2) * 2, -(-(volume + 1) // 2) * 2
    buffer = torch.empty(2 * lists + starts + -(-width * blocks // 4) * 2, dtype=torch.int64, device=device)
    in_idx, _, out_idx, _, offset_ptr, _, counts = buffer.split_with_sizes(
        (total, lists - total, total, lists - total, volume + 1, starts - volume - 1, buffer.shape[0] - 2 * lists - starts))
    counts = counts.view(torch.int32)[: width * blocks].view(width, blocks)
    if not launch_ready((tk.kernels, "pair_blocks"), (blocks,), table, counts, rows, volume, blocks, BLOCK=block,
                        WIDTH=width):
        return None
    # Each offset's counts along a row: torch scans an innermost dimension in parallel, where its scan
    # of (blocks, width) down the blocks took 151 µs of GPU time for street4's input map (H200).
    # int32, as counted: torch's default widens integers to int64, one more launch (a map holds < 2**31 pairs)
    before = torch.cumsum(counts, 1, dtype=torch.int32)
    if not launch_ready((tk.kernels, "pair_lists"), (blocks,), table, before, in_idx, out_idx, offset_ptr, rows, volume,
                        blocks, BLOCK=block, WIDTH=width):
        return None
    return in_idx, out_idx, offset_ptr


def pair_block(volume: int) -> int:
    """Rows a pair-list program takes: about 4096 table entries."""
    return max(16, 4096 // block_width(volume))


def pair_lists_on_gpu(kernel_map: KernelMap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The maps' pair-list kernel (:attr:`~sparseconv.coords.kernel_map.MapKernels.pair_lists`): :func:`pair_lists`
    on a GPU. Not under the interpreter on the CPU, which runs a program at a time (slower there than torch's
    ops; the tests call it directly)."""
    return pair_lists(kernel_map) if kernel_map.neighbors.is_cuda else None


def one_pair_per_row(kernel_map: KernelMap, forward: bool) -> tuple[bool, bool]:
    """(every output row of the product has at most one pair, every row has exactly one).

    True for the transposed k2 s2 conv (each fine voxel has one coarse parent) and the dgrad of
    the strided one: nothing to accumulate, so backends may store instead of adding. Read from
    how the map was built (no scan, no host sync); (False, False) where that does not say.
    """
    once = kernel_map.each_output_once if forward else kernel_map.each_input_once
    return once, once


def row_order(table: torch.Tensor, sort: bool) -> torch.Tensor:
    """(N,) int64 order of rows: if ``sort``, by neighbour bitmask read with the rarest offset as
    the most significant bit (up to 63 offsets, the rarest ones), ties in row order.

    Lexicographic order keeps a tile's rows equal in the leading bits; the bits that vary inside
    a tile are the trailing ones, and a rare offset varies little. Rarest-first against offset
    order: 58% against 52% of a 128-row tile's multiply-adds on real rows for street4's
    submanifold map, 45% against 42% for room2's (CPU, the benchmark scenes)."""
    n = table.shape[0]
    if not sort or n == 0:
        return torch.arange(n, dtype=torch.int64, device=table.device)
    present = table >= 0
    return bitmask_order(present, torch.argsort(present.sum(0), stable=True)[:63])


def bitmask_order(present: torch.Tensor, bit_order: torch.Tensor) -> torch.Tensor:
    """(N,) int64 order of the rows of ``present`` (N, offsets) bool by their bitmask over the
    offsets ``bit_order`` (at most 63), the first one most significant; ties in row order."""
    weights = torch.pow(2, torch.arange(len(bit_order) - 1, -1, -1, device=present.device, dtype=torch.int64))
    return torch.argsort((present[:, bit_order].to(torch.int64) * weights).sum(1), stable=True)


def tile_offsets(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int,
                 group: tuple[int, int] | None = None) -> torch.Tensor:
    """(tiles, offsets of ``group``) bool: True where some row of the tile of ``block_m`` visited
    rows has a neighbour through that offset (cached on the map per tile height and group)."""
    used, offsets, _, _ = tile_plan(kernel_map, forward, sort, block_m, group)
    return _as_flags(used, *offsets.shape)


def active_lists(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int,
                 group: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """((tiles, offsets of ``group``) int32 offsets each tile uses (used ones first, each part in
    offset order), the first ``count`` of each row valid; (tiles,) int32 count)."""
    return tile_plan(kernel_map, forward, sort, block_m, group)[1:3]


def tile_slots(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int,
               group: tuple[int, int] | None = None) -> torch.Tensor:
    """The gather rows each tile reads, laid out in the order it reads them: a flat int32 array
    holding, tile after tile and for each slot of the tile's offset list (active offsets first),
    the ``block_m`` source rows of its visited rows (-1 = none, also past the last row). Every tile
    keeps a slot for each offset of ``group``, so tile ``t``'s part starts at ``t * width * block_m``."""
    return tile_plan(kernel_map, forward, sort, block_m, group)[3]


def tile_plan(kernel_map: KernelMap, forward: bool, sort: bool, block_m: int, group: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tile view of one (direction, order, tile height, group), built together and cached on
    the map: :func:`tile_offsets`, :func:`active_lists` (2), :func:`tile_slots`."""
    lo, hi = group or (0, kernel_map.kernel_volume)
    if not forward and kernel_map.identity_offset is None:  # the adjoint's forward plan (see sorted_rows)
        return tile_plan(kernel_map.transposed(), True, sort, block_m, group)

    def build(m: KernelMap) -> tuple[torch.Tensor, ...]:
        rows = sorted_rows(m, forward, sort, group)
        table = product_table(m, forward)
        width, device = hi - lo, table.device
        tiles = -(-rows.numel() // block_m)
        # Every tile keeps room for all offsets of the group (its unused list slots hold -1 and
        # are never read): compacting to the listed ones needed their total on the host, a sync.
        if fused(table):
            # One launch and one buffer for the lists, counts, slots and the used flags (each torch
            # op costs the host ~10-20 µs on a new map; this view is rebuilt for every new point
            # cloud). Each part starts 16-byte aligned: Triton specialises pointers on it (an
            # unaligned one is another compile, and loses vector loads).
            flat = torch.empty(plan_layout(tiles, width, block_m)[3], dtype=torch.int32, device=device)
            views = plan_views(flat, tiles, width, block_m)
            if tiles:
                launch_tile_plan(table, rows, views, lo, block_m)
            return views
        # The visited rows' sources, padded with "none" to whole tiles: the lists and the slots both read it.
        padded = torch.full((tiles * block_m, width), -1, dtype=torch.int32, device=device)
        padded[: rows.numel()] = table[rows, lo:hi]
        used = (padded >= 0).view(tiles, block_m, width).any(1)
        offsets = (torch.argsort((~used).to(torch.int8), dim=1, stable=True) + lo).to(torch.int32).contiguous()
        # (tiles, list slot, row in tile): the source row of each visited row through the listed offset
        per_tile = padded.view(tiles, block_m, width).gather(
            2, (offsets.long() - lo).unsqueeze(1).expand(-1, block_m, -1)).transpose(1, 2)
        return used, offsets, used.sum(1, dtype=torch.int32), per_tile.reshape(-1)

    views = kernel_map.derived((PLAN_VIEW, forward, sort, block_m, lo, hi), build)
    restore = getattr(views, "restore", None)  # a planned plan, released after its forward products
    if restore is not None:
        restore()
    return views


def plan_layout(tiles: int, width: int, block_m: int) -> tuple[int, int, int, int]:
    """Where the counts, slots and used flags of one tile plan's buffer start, and its size, in
    int32s (the lists start it): each part 16-byte aligned, as Triton specialises pointers on it."""
    counts = _aligned(tiles * width)
    slots = counts + _aligned(tiles)
    used = slots + tiles * width * block_m
    return counts, slots, used, used + _aligned(-(-tiles * width // 4))


def plan_views(flat: torch.Tensor, tiles: int, width: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(used, offsets, counts, slots) of a tile plan held in ``flat`` (laid out by
    :func:`plan_layout`, starting 16-byte aligned): what :func:`tile_plan` returns, but ``used`` as the
    int32 part that holds its bytes (:func:`tile_offsets` reads it as bools, the one reader)."""
    counts, slots, used, size = plan_layout(tiles, width, block_m)
    # One split for the parts and their pads, and one view (each view a torch op of ~5-10 µs of host
    # time in a step: a new batch makes ~25 plans, and its backward restores ~50)
    lists, _, per_tile, _, sources, flags = flat.split_with_sizes(
        (tiles * width, counts - tiles * width, tiles, slots - counts - tiles, used - slots, size - used))
    return flags, lists.view(tiles, width), per_tile, sources


def _as_flags(used: torch.Tensor, tiles: int, width: int) -> torch.Tensor:
    """A tile plan's (tiles, width) bool used flags (a fused plan holds their bytes in int32, :func:`plan_views`)."""
    if used.dtype == torch.bool:
        return used
    return used.view(torch.bool)[: tiles * width].view(tiles, width)


def _aligned(count: int) -> int:
    """``count`` int32s rounded up to whole 16-byte units."""
    return -(-count // 4) * 4


def launch_tile_plan(table: torch.Tensor, rows: torch.Tensor, views: tuple, lo: int, block_m: int) -> None:
    """The ``tile_plan`` launch writing ``views`` (:func:`plan_views`' (used, offsets, counts, slots))
    for the visiting order ``rows`` of ``table``'s offsets from ``lo``."""
    used, offsets, counts, slots = views
    # The kernel writes the flags' bytes through the int32 part that holds them (a bool view: one op more)
    args, options = _plan_launch(table, rows, used, offsets, counts, slots, rows.numel(),
                                 table.stride(0), lo, offsets.shape[1], block_m)
    launch(tk.kernels().tile_plan, (offsets.shape[0],), *args, **options)


def _plan_launch(table, rows, used, offsets, counts, slots, num_rows: int, row_stride: int, lo: int, width: int,
                 block_m: int) -> tuple[tuple, dict]:
    """tile_plan's arguments and options (one place for :func:`tile_plan` and :func:`precompile`)."""
    return ((table, rows, used, offsets, counts, slots, num_rows, row_stride, lo, width),
            dict(BLOCK_M=block_m, WIDTH=block_width(width)))


def precompile_pairs(device: torch.device, volume: int) -> None:
    """Compile :func:`pair_lists`' kernels for a (rows, ``volume``) table without running them."""
    kernels, i32, i64 = tk.kernels(), torch.int32, torch.int64
    options = dict(BLOCK=pair_block(volume), WIDTH=block_width(volume))
    warm(kernels.pair_blocks, device, i32, i32, 2, volume, 2, **options)
    warm(kernels.pair_lists, device, i32, i32, i64, i64, i64, 2, volume, 2, **options)


def precompile(device: torch.device, num_rows: int, volume: int, groups: Sequence[tuple[int, int]], sort: bool,
               block_m: int | None) -> None:
    """Compile the kernels that build a product's views (row orders, tile plans of height ``block_m``
    (None: a product without them), and the same built by the map plan for all maps at once) for a
    (rows, K) table without running them."""
    kernels, i32, i64 = tk.kernels(), torch.int32, torch.int64
    if sort:
        for together in [groups] if _together(groups) else [[group] for group in groups]:
            # the table, the per-offset pair counts, the keys
            args, options = _masks_launch(i32, i64, _key_dtype(together), num_rows, volume, num_rows, together)
            warm(kernels.row_masks, device, *args, **options)
        # the same orders built by the map plan, for all maps at once (the widest group sets WIDTH:
        # this one's, or a whole table's)
        for width in {block_width(hi - lo) for lo, hi in groups if hi - lo <= PLANNED_SHIFT} | {block_width(volume)}:
            warm(kernels.row_masks_many, device, i64, i64, 2, BLOCK=MASK_ROWS, WIDTH=width, SHIFT=PLANNED_SHIFT)
        warm(kernels.orders_from_positions, device, i64, i64, 2, BLOCK=MASK_ROWS)
    # the map plan's pair counts (its widest table sets the block: this one's, a submanifold 3^3)
    warm(kernels.pair_counts_many, device, i64, i64, 2, BLOCK=pair_block(volume), WIDTH=block_width(volume))
    warm(kernels.pair_counts, device, i32, i64, 2, volume, BLOCK=pair_block(volume), WIDTH=block_width(volume))
    for lo, hi in groups if block_m is not None else ():
        width = hi - lo  # the row order below: int64 sort indices
        args, options = _plan_launch(i32, i64, i32, i32, i32, i32, num_rows, volume, lo, width, block_m)
        warm(kernels.tile_plan, device, *args, **options)
        # the same plans built by the map plan, with others of this tile height (the widest sets WIDTH)
        warm(kernels.tile_plans, device, i64, 2, BLOCK_M=block_m, WIDTH=block_width(width))
