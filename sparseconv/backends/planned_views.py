"""The map plan's view builders: the views the last batches' layers used on each map, built for all of
a new batch's maps at once and offered to them (:meth:`KernelMap.offer`), equal to what :mod:`.mask_views`
builds for one layer: the forward row orders with one mask launch and one sort (:func:`build_planned_orders`),
the forward tile plans with one launch per tile height (:func:`build_planned_tile_plans`, after the orders it
reads), and every map's pairs per offset in one launch (:func:`pair_counts`). Nothing is registered here:
:data:`sparseconv.ops.batch.BUILDERS` names these as the batch's builders (:class:`sparseconv.coords.batch.Builders`).
"""

from __future__ import annotations

import itertools

import torch

from ..coords.kernel_map import KernelMap
from . import triton_kernels as tk
from .mask_views import (
    MASK_ROWS, PLAN_VIEW, PLANNED_SHIFT, ROWS_VIEW, block_width, fused, launch_tile_plan, pair_block, plan_layout,
    plan_views, product_table, rows_key, sorted_rows,
)
from .triton_launch import launch, launch_ready


def build_planned_orders(wanted: list[tuple[KernelMap, list]]) -> None:
    """The plan's view builder (:attr:`sparseconv.coords.batch.Builders.views`): the forward row
    orders (``mask_rows`` views) the last batches' layers used on each new map, built by ONE mask
    launch and ONE sort for all (int64 keys, the order's index above its mask bits), where each
    layer would have sorted on its own (~14 launches and ~85 µs of host time a sort on an H100
    host; a mask launch per order until 2026-11-26, ~20 a street1 pass). Offered to the maps
    (:meth:`KernelMap.offer`): a layer takes one only if its tuned choice asks for it. Equal to
    what :func:`sorted_rows` builds."""
    parts = []
    for kernel_map, keys in wanted:
        table = kernel_map.neighbors
        if not (table.shape[0] and fused(table)):
            continue
        for key in keys:
            if (isinstance(key, tuple) and len(key) == 4 and key == rows_key(True, key[2], key[3])
                    and 0 < key[3] - key[2] <= PLANNED_SHIFT):
                parts.append((kernel_map, key))
    if len(parts) < 2:
        return  # one sort either way
    # Each order's keys start 16-byte aligned, so each order (a slice of the sorted indices) does too.
    sizes = [-(-m.neighbors.shape[0] // 2) * 2 for m, _ in parts]
    bases = [0, *itertools.accumulate(sizes)]
    device = parts[0][0].neighbors.device
    keys = torch.empty(bases[-1], dtype=torch.int64, device=device)
    # One launch for every order (tables and counts by address: the maps hold them, and the
    # allocator reuses them only after this launch, in stream order), the entry's index its tag.
    meta, first = [], 0
    for (kernel_map, key), base, size in zip(parts, bases, sizes):
        table = kernel_map.neighbors
        meta.append([first, table.data_ptr(), kernel_map.offset_counts.data_ptr(), table.shape[0], table.stride(0),
                     key[2], key[3] - key[2], base, size])
        first += -(-size // MASK_ROWS)
    kernels = tk.kernels()
    meta_tensor = torch.tensor(meta, dtype=torch.int64).to(device, non_blocking=True)
    launch(kernels.row_masks_many, (first,), meta_tensor, keys, len(parts), BLOCK=MASK_ROWS,
              WIDTH=block_width(max(key[3] - key[2] for _, key in parts)), SHIFT=PLANNED_SHIFT)
    order = torch.sort(keys, stable=True).indices
    # Positions -> rows in one launch on the same meta table (torch's repeat_interleave of the starts
    # wrote each part from one thread: 112-278 µs of GPU time a pass, H200, street1 to street4).
    launch(kernels.orders_from_positions, (first,), meta_tensor, order, len(parts), BLOCK=MASK_ROWS)
    for (kernel_map, key), base in zip(parts, bases):
        kernel_map.offer(key, order[base: base + kernel_map.neighbors.shape[0]])



def build_planned_tile_plans(wanted: list[tuple[KernelMap, list]]) -> None:
    """The plan's view builder for tile plans (after :func:`build_planned_orders`, whose orders they
    read): every forward :func:`tile_plan` the last batches' layers used on the new maps, built by one
    ``tile_plans`` launch per tile height, where each layer made a launch of its own (~70 µs of host
    time each on an H100 host; a MinkUNet training step builds ~29). Each plan has a :class:`_PlanBuffer`
    of its own, offered with it as releasable (:meth:`KernelMap.offer`): after the map's last forward
    product of a training pass their memory goes, and a dgrad that reads a plan has that one rebuilt
    (a U-Net holds every coarse level's plans at its memory peak, the fine end of its decoder,
    otherwise; restoring a map's plans together put all of the fine map's, 117 MiB at street4, back
    at that peak for the one its first dgrad reads). Equal to what tile_plan builds."""
    parts: dict[int, list] = {}  # by tile height
    for kernel_map, keys in wanted:
        for key in keys:
            if not (isinstance(key, tuple) and len(key) == 6 and key[0] == PLAN_VIEW):
                continue
            _, forward, sort, block_m, lo, hi = key
            if not forward:
                # A dgrad's plan (a strided map's is its adjoint's forward plan, which a transposed
                # conv needs in the forward pass anyway) is left to backward: made here, it would add
                # to the forward pass's memory peak (+0.46 GB of 3.6 on street4, H100), and an
                # inference pass between training steps would make it for nothing.
                continue
            table = product_table(kernel_map, forward)
            if not (table.shape[0] and fused(table) and table.dtype == torch.int32 and table.is_contiguous()):
                continue
            rows = sorted_rows(kernel_map, forward, sort, (lo, hi))
            if rows.dtype != torch.int64:
                continue
            parts.setdefault(block_m, []).append((kernel_map, key, table, rows, -(-rows.numel() // block_m), hi - lo))
    if not parts:
        return  # (a CPU's maps: torch's ops build their views, and a CPU-only install has no Triton to import)
    kernels = tk.kernels()
    for block_m, group in parts.items():
        meta, first = [], 0
        for kernel_map, key, table, rows, tiles, width in group:
            # Each plan in a buffer of its own (its parts 16-byte aligned, plan_layout): a dgrad that
            # reads one plan of a released map has that one restored, not the map's others with it.
            counts, slots, used, size = plan_layout(tiles, width, block_m)
            flat = torch.empty(size, dtype=torch.int32, device=table.device)
            buffer = _PlanBuffer(flat, plan_views(flat, tiles, width, block_m), table, rows, key[4], block_m)
            kernel_map.offer(key, _PlannedViews(buffer.views, buffer), releasable=buffer.nbytes >= RELEASE_BYTES)
            start = flat.data_ptr()  # the kernel writes by address (int32 units below, 4 bytes each)
            meta.append([first, table.data_ptr(), rows.data_ptr(), rows.numel(), table.stride(0), key[4], width,
                         start, start + 4 * counts, start + 4 * slots, start + 4 * used, 0])  # 96 bytes a row
            first += tiles
        if len(group) == 1:  # the one-plan kernel: no table of addresses to copy to the device
            buffer.build()
            continue
        meta_tensor = torch.tensor(meta, dtype=torch.int64).to(group[0][2].device, non_blocking=True)
        # The kernel reads the tables and orders and writes the plans by address: the maps hold them
        # (and the allocator reuses them only after this launch, in stream order).
        launch(kernels.tile_plans, (first,), meta_tensor, len(group), BLOCK_M=block_m,
               WIDTH=block_width(max(width for *_, width in group)))



class _PlannedViews(tuple):
    """A planned tile plan's views (what :func:`tile_plan` returns), with the :class:`_PlanBuffer` that
    holds them: :meth:`release` frees its memory, :meth:`restore` rebuilds it (the view objects
    stay: their storage is resized, as FSDP frees and refills parameters)."""

    def __new__(cls, views, buffer: _PlanBuffer):
        self = super().__new__(cls, views)
        self.buffer = buffer
        return self

    def release(self) -> None:
        self.buffer.release()

    def restore(self) -> None:
        self.buffer.restore()


RELEASE_BYTES = 1 << 20
"""A plan smaller than this stays through the forward pass: its memory is little, and its rebuild a
launch in backward like a larger one's (all rebuilds together: a step 0.985-1.023x as long as without
releases, H200, street1 to street4)."""


class _PlanBuffer:
    """One planned tile plan's int32 buffer, its views (slices of it: :func:`tile_plan`'s), and what
    builds the plan again into it: the product's table and row order (the map holds them), the offset
    group's start, the tile height."""

    __slots__ = ("flat", "views", "table", "rows", "lo", "block_m", "released")

    def __init__(self, flat: torch.Tensor, views: tuple, table: torch.Tensor, rows: torch.Tensor, lo: int,
                 block_m: int) -> None:
        self.flat, self.views, self.table, self.rows, self.lo, self.block_m = flat, views, table, rows, lo, block_m
        self.released = False

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def release(self) -> None:
        """Free the memory (the views keep their shapes; nothing may read them until :meth:`restore`)."""
        if not self.released:
            self.released = True
            self.flat.untyped_storage().resize_(0)

    def restore(self) -> None:
        """New memory for the buffer (the views, its slices, follow it), and the plan built into it."""
        if not self.released:
            return
        self.flat.untyped_storage().resize_(self.nbytes)
        self.released = False
        self.build()

    def build(self) -> None:
        """The plan into the buffer (what :func:`tile_plan` launches)."""
        launch_tile_plan(self.table, self.rows, self.views, self.lo, self.block_m)


def pair_counts(maps: list[KernelMap]) -> tuple[torch.Tensor, list[int]] | None:
    """The map plan's pair counts (:attr:`sparseconv.coords.kernel_map.MapKernels.pair_counts`): every map's
    pairs per offset in one launch on a GPU (tables by address; one map's by its arguments), where
    torch took two ops a map and a concatenation (~27 a street1 pass; one map's sum alone ~60 µs of
    host time, H200), and each map's start in them (16-byte aligned: the
    mask kernels take a map's counts as a pointer, and Triton compiles a kernel per alignment);
    None where the kernels do not run (see :func:`fused`) or are not compiled yet (:func:`launch_ready`)."""
    tables = [m.neighbors for m in maps]
    if not all(fused(t) and t.dtype == torch.int32 and t.is_contiguous() for t in tables):
        return None
    widest = max(t.shape[1] for t in tables)
    block = pair_block(widest)  # one block height for all: the widest table's
    if len(tables) == 1:  # no table of addresses to copy to the device: the one-table kernel
        (rows, width), = (t.shape for t in tables)
        out = torch.zeros(width, dtype=torch.int64, device=tables[0].device)
        if rows and not launch_ready((tk.kernels, "pair_counts"), (-(-rows // block),), tables[0], out, rows, width,
                                     BLOCK=block, WIDTH=block_width(width)):
            return None
        return out, [0]
    meta, first, starts = [], 0, [0]
    for table in tables:
        rows, width = table.shape
        meta.append([first, table.data_ptr(), rows, width, starts[-1]])
        first += max(1, -(-rows // block))
        starts.append(starts[-1] + -(-width // 2) * 2)
    out = torch.zeros(starts[-1], dtype=torch.int64, device=tables[0].device)
    meta_tensor = torch.tensor(meta, dtype=torch.int64).to(out.device, non_blocking=True)
    if not launch_ready((tk.kernels, "pair_counts_many"), (first,), meta_tensor, out, len(tables), BLOCK=block,
                        WIDTH=block_width(widest)):
        return None
    return out, starts[:-1]


def pair_counts_on_gpu(maps: list[KernelMap]) -> tuple[torch.Tensor, list[int]] | None:
    """The maps' pair counter (a plan's maps; a lone map's :attr:`~KernelMap.offset_counts`): :func:`pair_counts`
    on a GPU (on the CPU the interpreter would run a program at a time; the tests call it directly)."""
    return pair_counts(maps) if maps and maps[0].neighbors.is_cuda else None


VIEW_KINDS = frozenset({ROWS_VIEW, PLAN_VIEW})
"""The first items of the keys of the views these builders make (:attr:`sparseconv.coords.batch.Builders.view_kinds`):
what the map plan records of the views a batch's layers used."""
