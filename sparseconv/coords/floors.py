"""The floors of a coordinate set at power-of-two strides, with their hash tables (:func:`floor_sets`), and the
same into fixed buffers with no host read (:func:`floor_sets_into`: a graphed pass's batches,
:mod:`.fixed`); a coarse set of a batch is a floor of its input (:mod:`.prebuild`, :mod:`.cache`)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from . import warp_launch
from .hashing import MAX_LEVELS, CoordHashTable, floor_capacity
from .keys import EMPTY_KEY, unpack_keys


class FloorSets(NamedTuple):
    """The coordinate sets of :func:`floor_sets`, set after set in one array each."""

    keys: torch.Tensor
    """(M,) int64 packed keys."""
    coords: torch.Tensor
    """(M, 4) int32, the keys unpacked."""
    counts: list[int]
    """Each set's rows (on the host)."""
    table: CoordHashTable
    """Every set's table: set ``l``'s is the ``capacity`` slots from ``l * capacity`` of its arrays."""
    capacity: int
    slots: torch.Tensor
    """(L * N,) int32, level after level: the slot of each input row's cell in its level's table (from the level's
    first slot), whose value is the cell's row in its set (:meth:`cells`)."""

    def cells(self, level: int) -> torch.Tensor:
        """(N,) int32: each input row's row in set ``level`` (the cell it lies in)."""
        n = self.slots.shape[0] // len(self.counts)
        values = self.table.values[level * self.capacity: (level + 1) * self.capacity]
        return values[self.slots[level * n: (level + 1) * n].long()]


def floor_sets(keys: torch.Tensor, masks: torch.Tensor) -> FloorSets:
    """The floors of a coordinate set at several strides, with their hash tables: three Warp launches, a
    prefix sum and one host read (every set's size), where torch's ``unique`` sorted the keys (~10 launches
    and a sync on a GPU). keys: (N,) int64 packed keys of unique rows; masks: (L,) int64 on their device,
    :func:`floor_mask` of each stride (at most :data:`MAX_LEVELS`).

    Set ``l`` holds each cell of ``keys & masks[l]`` once, in the order of the cell's first row in
    ``keys`` (the smallest row index, so the order is repeatable: the threads' atomics pick a maximum,
    not a winner). Each table has :func:`~.hashing.floor_capacity` slots of the input's row count: the cells are
    counted only after the inserts."""
    n, levels = keys.shape[0], masks.shape[0]
    if not 0 < levels <= MAX_LEVELS:
        raise ValueError(f"floor_sets takes 1 to {MAX_LEVELS} masks, got {levels}")
    capacity = floor_capacity(n)
    table = _floor_table(levels, capacity, keys.device)
    if n == 0:
        empty = torch.empty((0,), dtype=torch.int64, device=keys.device)
        return FloorSets(empty, unpack_keys(empty), [0] * levels, table, capacity,
                         torch.empty((0,), dtype=torch.int32, device=keys.device))
    device = keys.device
    # marks and slots in one allocation
    marks, slots = torch.empty((2, levels * n), dtype=torch.int32, device=device).unbind()
    marks = _floor_ranks(keys, masks, table, capacity, marks, slots)
    ends = marks[n - 1:: n].tolist()  # the one host read: where each set ends
    counts = [end - start for start, end in zip([0, *ends], ends)]
    total = ends[-1]
    # Two allocations where one buffer cut into the keys and the coords took four views
    unique = torch.empty((total,), dtype=torch.int64, device=device)
    coords = torch.empty((total, 4), dtype=torch.int32, device=device)
    none = torch.empty((0,), dtype=torch.int64, device=device)  # (packed by rank, not into a fixed layout)
    warp_launch.launch(warp_launch.kernels().floor_compact, (levels, n),
                       [keys, masks, slots, capacity - 1, marks, unique, coords, table.values, none, none], device)
    return FloorSets(unique, coords, counts, table, capacity, slots)


def _floor_table(levels: int, capacity: int, device: torch.device, into: torch.Tensor | None = None) -> CoordHashTable:
    """Every level's table of :func:`floor_sets` (``capacity`` slots each) in one allocation and one fill
    (``into``'s, where given): each level's keys (-1 = empty) and, as int32 behind them, its slots' values,
    which hold each cell's first row until the compaction writes its rank there."""
    size = levels * capacity * 3 // 2
    buffer = torch.full((size,), EMPTY_KEY, dtype=torch.int64, device=device) if into is None else into.fill_(EMPTY_KEY)
    return _table_in(buffer, levels, capacity)


def _table_in(buffer: torch.Tensor, levels: int, capacity: int) -> CoordHashTable:
    table_keys, values = buffer.split_with_sizes((levels * capacity, buffer.shape[0] - levels * capacity))
    return CoordHashTable(table_keys, values.view(torch.int32))


def _floor_ranks(keys: torch.Tensor, masks: torch.Tensor, table: CoordHashTable, capacity: int, marks: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """The inserts of every level's cells into ``table`` and each (level, row)'s inclusive rank among every level's
    cells where it is its cell's first row: ``marks`` ((levels * N,) int32, level after level, as the kernels index),
    and into ``slots`` (the same layout) each row's cell's slot. The kernels after the insert read the slots (the
    insert's probes, once a row and level) instead of probing the table again."""
    kernels, device, n = warp_launch.kernels(), keys.device, keys.shape[0]
    warp_launch.launch(kernels.floor_insert, (masks.shape[0], n),
                       [keys, masks, table.keys, table.values, capacity - 1, slots], device)
    warp_launch.launch(kernels.floor_firsts, (masks.shape[0], n), [slots, n, table.values, capacity - 1, marks], device)
    # In place, over all levels at once: each cell's rank among every level's cells, which is its row in the
    # sets laid out set after set (street4's 4 levels: 6 MB). One scan of the whole array is CUB's; torch
    # scanned a (levels, n) view row by row in 487 µs of GPU time at street4 (H200), this takes a few.
    return marks.cumsum_(0)


class FixedFloors(NamedTuple):
    """Buffers of :func:`floor_sets_into`, made once for inputs of at most ``rows`` rows and sets of at most
    ``capacities`` rows (:meth:`allocate`): the sets' keys and coordinates at fixed offsets, set after set."""

    keys: torch.Tensor
    """(sum of capacities,) int64 packed keys."""
    coords: torch.Tensor
    """(sum of capacities, 4) int32; rows past a set's count hold -1 (a batch index no key has)."""
    bases: list[int]
    """Where each set starts in :attr:`keys` and :attr:`coords`."""
    capacities: list[int]
    table_buffer: torch.Tensor
    """Every level's table (:func:`_floor_table`), ``capacity`` slots each."""
    capacity: int
    marks: torch.Tensor
    slots: torch.Tensor
    """(levels * rows,) int32: :attr:`FloorSets.slots` of the last floors."""
    layout: torch.Tensor
    """(2, levels) int64 on the device: the bases, then the capacities (the compaction reads them)."""

    @classmethod
    def allocate(cls, rows: int, capacities: list[int], device: torch.device) -> FixedFloors:
        levels, total = len(capacities), sum(capacities)
        if not 0 < levels <= MAX_LEVELS:
            raise ValueError(f"floor_sets_into takes 1 to {MAX_LEVELS} sets, got {levels}")
        bases = list(itertools.accumulate(capacities, initial=0))[:-1]
        capacity = floor_capacity(rows)
        layout = torch.tensor([bases, capacities], dtype=torch.int64).to(device)
        return cls(torch.empty((total,), dtype=torch.int64, device=device),
                   torch.empty((total, 4), dtype=torch.int32, device=device), bases, list(capacities),
                   torch.empty((levels * capacity * 3 // 2,), dtype=torch.int64, device=device), capacity,
                   *torch.empty((2, levels * max(rows, 1)), dtype=torch.int32, device=device).unbind(), layout)

    def table(self) -> CoordHashTable:
        """The levels' tables (valid after :func:`floor_sets_into`): level ``l``'s is the :attr:`capacity` slots
        from ``l * capacity``; a value is the row in its set."""
        return _table_in(self.table_buffer, len(self.bases), self.capacity)


def floor_sets_into(keys: torch.Tensor, masks: torch.Tensor, floors: FixedFloors) -> torch.Tensor:
    """:func:`floor_sets` into fixed buffers with no host read (what a captured pass's batch is built with): set
    ``l`` (its cells in the same order) at rows ``floors.bases[l]`` on of ``floors.coords`` and ``floors.keys``,
    at most ``floors.capacities[l]`` of its rows (a cell past them is not written and its table finds it
    absent), rows past its count -1. keys: (N,) int64 packed keys of unique rows, N at most the rows the
    buffers were made for; masks: (L,) int64 as :func:`floor_sets`'. Returns (L,) int64 on the device: where
    each set ends among every set's cells (its count: the difference to the one before; none is read here)."""
    n, levels = keys.shape[0], masks.shape[0]
    if levels != len(floors.bases) or n > floors.marks.shape[0] // levels:
        raise ValueError(f"floor_sets_into: buffers for {len(floors.bases)} sets of inputs of at most "
                         f"{floors.marks.shape[0] // len(floors.bases)} rows, got {levels} masks and {n} keys")
    table = _floor_table(levels, floors.capacity, keys.device, into=floors.table_buffer)
    floors.coords.fill_(-1)
    if n == 0:
        return torch.zeros((levels,), dtype=torch.int64, device=keys.device)
    slots = floors.slots[: levels * n]
    marks = _floor_ranks(keys, masks, table, floors.capacity, floors.marks[: levels * n], slots)
    warp_launch.launch(warp_launch.kernels().floor_compact, (levels, n),
                       [keys, masks, slots, floors.capacity - 1, marks, floors.keys, floors.coords, table.values,
                        floors.layout[0], floors.layout[1]], keys.device)
    return marks[n - 1:: n].to(torch.int64)
