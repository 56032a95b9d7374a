"""Open-addressing hash table over packed voxel keys, as warp-lang kernels for CPU and CUDA.

A key packs ``[batch, x, y, z]`` into one non-negative int64 (see :func:`.keys.pack_coords`); the
table is two flat arrays (keys, values) of power-of-two capacity with linear probing. The same
kernels run on ``cpu`` and ``cuda:N``; on CUDA they are launched on torch's current stream so
they are ordered with the surrounding torch work without extra synchronisation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import parallel
from . import warp_launch
from .keys import EMPTY_KEY, pack_coords, unpack_keys

MAX_LEVELS = 8
"""Coordinate sets one :func:`floor_sets` call makes (a MinkUNet's encoder makes four)."""
MAX_MAPS = 16
"""Kernel maps one :func:`query_many` launch queries (its kernel finds a row's map by a scan over them)."""


def _capacity(rows: int) -> int:
    """Table slots for ``rows`` keys: a power of two, load factor <= 0.5 (linear-probe chains stay
    short, ~1.5 probes a hit)."""
    return max(16, 1 << (2 * max(rows, 1) - 1).bit_length())


def _values(capacity: int, device: torch.device) -> torch.Tensor:
    """A table's row-index slots. No fill: a value is read only where its slot's key matched,
    i.e. after its insert wrote it."""
    return torch.empty((capacity,), dtype=torch.int32, device=device)


@dataclass(frozen=True)
class CoordHashTable:
    """Hash table of one coordinate set: keys (capacity,) int64, values (capacity,) int32 row indices."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def build(cls, coords: torch.Tensor, packed: torch.Tensor | None = None) -> CoordHashTable:
        """coords: (N, 4) int32 unique rows -> table mapping each row's key to its row index.

        packed: their (N,) int64 :func:`pack_coords` keys, if the caller has them already."""
        n = coords.shape[0]
        keys = torch.full((_capacity(n),), EMPTY_KEY, dtype=torch.int64, device=coords.device)
        table = cls(keys, _values(keys.shape[0], keys.device))
        if n:
            packed = (pack_coords(coords) if packed is None else packed).contiguous()
            warp_launch.launch(warp_launch.kernels().insert, n, [packed, keys, table.values, keys.shape[0] - 1], coords.device)
        return table

    @classmethod
    def build_checked(cls, coords: torch.Tensor, stride: tuple[int, int, int]
                      ) -> tuple[CoordHashTable, torch.Tensor, torch.Tensor]:
        """A new coordinate set's checks, keys and table in one kernel (no sort, no host sync).

        coords: (N, 4) int32, N > 0. Returns (the table, the (N,) int64 :func:`pack_coords` keys,
        (4,) int64 flags): flags[0] is 1 if some row is out of the packable range (its key is then
        -1), flags[1] if some x, y, z is not a multiple of ``stride``, flags[2] if some row is
        repeated, -1 where not; flags[3] is the largest batch index of the rows in range. The table
        and keys are valid only if none of the first three is set.
        """
        n = coords.shape[0]
        capacity = _capacity(n)
        # One allocation, one fill: the empty table (-1 keys; its int32 values behind them, read only where a
        # key matched), the keys (all written) and the flags (-1 = clear).
        slots = capacity * 3 // 2
        buffer = torch.full((slots + n + 4,), EMPTY_KEY, dtype=torch.int64, device=coords.device)
        table_keys, values, keys, flags = buffer.split_with_sizes((capacity, slots - capacity, n, 4))  # one op
        table = cls(table_keys, values.view(torch.int32))
        warp_launch.launch(warp_launch.kernels().insert_checked, n,
                [coords.contiguous(), *stride, keys, table.keys, table.values, capacity - 1, flags], coords.device)
        return table, keys, flags

    def neighbors(self, coords: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """coords: (M, 4) int32, offsets: (K, 3) int32 -> (M, K) int32 row of coords[i] + offsets[k], -1 if absent."""
        out = torch.empty((coords.shape[0], offsets.shape[0]), dtype=torch.int32, device=coords.device)
        self._query(coords, offsets, out, False)
        return out

    def self_neighbors(self, coords: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """:meth:`neighbors` of this table's own set ``coords`` (N, 4) int32 (its rows, in the order the table holds
        them) through offsets (K, 3) int32 symmetric about a zero centre (K odd; offset K-1-k is minus offset k:
        a submanifold map's): the first half is looked up and the rest follows from it (row r meets row i
        through K-1-k exactly when i meets r through k), about half the lookups. -> (N, K) int32, -1 if absent."""
        out = torch.full((coords.shape[0], offsets.shape[0]), -1, dtype=torch.int32, device=coords.device)
        self._query(coords, offsets[: offsets.shape[0] // 2], out, True)
        return out

    def _query(self, coords: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, mirrored: bool) -> None:
        """query_neighbors of ``coords``' rows through ``offsets`` into ``out`` (``mirrored``: see the kernel), on a
        CPU in row ranges at once (:func:`_in_row_ranges`)."""
        m, k = coords.shape[0], offsets.shape[0]
        if not m or not (k or mirrored):
            return
        query, coords = warp_launch.kernels().query_neighbors, coords.contiguous()
        offsets = offsets.to(device=coords.device, dtype=torch.int32).contiguous()
        step = QUERY_STEP_CPU if coords.device.type == "cpu" else max(k, 1)  # (a row's offsets in one thread on a CPU)

        def launch(first: int, last: int) -> None:
            warp_launch.launch(query, (last - first, step), [coords, first, offsets, self.keys, self.values,
                                                             self.keys.shape[0] - 1, out, step, int(mirrored)],
                               coords.device)

        _in_row_ranges(launch, m, k, coords.device)


def _floor_capacity(rows: int) -> int:
    """Slots of each :func:`floor_sets` table for an input set of ``rows``: a power of two above 1.25 ``rows``
    (the cells are counted only after the inserts: a set of every row its own cell fills it to at most 0.8,
    a stride-2 floor of a scan ~0.3; tables of twice the rows made a MinkUNet step's peak memory 16-33 MiB
    higher, H200, room2 and street4)."""
    return max(16, 1 << (rows + rows // 4).bit_length())


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


def floor_sets(keys: torch.Tensor, masks: torch.Tensor) -> FloorSets:
    """The floors of a coordinate set at several strides, with their hash tables: three Warp launches, a
    prefix sum and one host read (every set's size), where torch's ``unique`` sorted the keys (~10 launches
    and a sync on a GPU). keys: (N,) int64 packed keys of unique rows; masks: (L,) int64 on their device,
    :func:`floor_mask` of each stride (at most :data:`MAX_LEVELS`).

    Set ``l`` holds each cell of ``keys & masks[l]`` once, in the order of the cell's first row in
    ``keys`` (the smallest row index, so the order is repeatable: the threads' atomics pick a maximum,
    not a winner). Each table has :func:`_floor_capacity` slots of the input's row count: the cells are
    counted only after the inserts."""
    n, levels = keys.shape[0], masks.shape[0]
    if not 0 < levels <= MAX_LEVELS:
        raise ValueError(f"floor_sets takes 1 to {MAX_LEVELS} masks, got {levels}")
    capacity = _floor_capacity(n)
    table = _floor_table(levels, capacity, keys.device)
    if n == 0:
        empty = torch.empty((0,), dtype=torch.int64, device=keys.device)
        return FloorSets(empty, unpack_keys(empty), [0] * levels, table, capacity)
    device = keys.device
    marks = _floor_ranks(keys, masks, table, capacity, torch.empty((levels * n,), dtype=torch.int32, device=device))
    ends = marks[n - 1:: n].tolist()  # the one host read: where each set ends
    counts = [end - start for start, end in zip([0, *ends], ends)]
    total = ends[-1]
    # Two allocations where one buffer cut into the keys and the coords took four views
    unique = torch.empty((total,), dtype=torch.int64, device=device)
    coords = torch.empty((total, 4), dtype=torch.int32, device=device)
    none = torch.empty((0,), dtype=torch.int64, device=device)  # (packed by rank, not into a fixed layout)
    warp_launch.launch(warp_launch.kernels().floor_compact, (levels, n),
                       [keys, masks, table.keys, capacity - 1, marks, unique, coords, table.values, none, none], device)
    return FloorSets(unique, coords, counts, table, capacity)


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


def _floor_ranks(keys: torch.Tensor, masks: torch.Tensor, table: CoordHashTable, capacity: int, marks: torch.Tensor
                 ) -> torch.Tensor:
    """The inserts of every level's cells into ``table`` and each (level, row)'s inclusive rank among every level's
    cells where it is its cell's first row: ``marks`` ((levels * N,) int32, level after level, as the kernels index)."""
    kernels, device, n = warp_launch.kernels(), keys.device, keys.shape[0]
    warp_launch.launch(kernels.floor_insert, (masks.shape[0], n), [keys, masks, table.keys, table.values, capacity - 1],
                       device)
    warp_launch.launch(kernels.floor_firsts, (masks.shape[0], n),
                       [keys, masks, table.keys, table.values, capacity - 1, marks], device)
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
    layout: torch.Tensor
    """(2, levels) int64 on the device: the bases, then the capacities (the compaction reads them)."""

    @classmethod
    def allocate(cls, rows: int, capacities: list[int], device: torch.device) -> FixedFloors:
        levels, total = len(capacities), sum(capacities)
        if not 0 < levels <= MAX_LEVELS:
            raise ValueError(f"floor_sets_into takes 1 to {MAX_LEVELS} sets, got {levels}")
        bases = list(itertools.accumulate(capacities, initial=0))[:-1]
        capacity = _floor_capacity(rows)
        layout = torch.tensor([bases, capacities], dtype=torch.int64).to(device)
        return cls(torch.empty((total,), dtype=torch.int64, device=device),
                   torch.empty((total, 4), dtype=torch.int32, device=device), bases, list(capacities),
                   torch.empty((levels * capacity * 3 // 2,), dtype=torch.int64, device=device), capacity,
                   torch.empty((levels * max(rows, 1),), dtype=torch.int32, device=device), layout)

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
    marks = _floor_ranks(keys, masks, table, floors.capacity, floors.marks[: levels * n])
    warp_launch.launch(warp_launch.kernels().floor_compact, (levels, n),
                       [keys, masks, table.keys, floors.capacity - 1, marks, floors.keys, floors.coords, table.values,
                        floors.layout[0], floors.layout[1]], keys.device)
    return marks[n - 1:: n].to(torch.int64)


class GeneratedSet(NamedTuple):
    """The voxels of :func:`generate_set`."""

    keys: torch.Tensor
    """(M,) int64 packed keys."""
    coords: torch.Tensor
    """(M, 4) int32, the keys unpacked."""
    table: CoordHashTable
    out_of_range: bool
    """Some voxel on the grid left the packable range (none of it is then in the set)."""


def generate_set(keys: torch.Tensor, offsets: torch.Tensor, stride: tuple[int, int, int], per_row: int
                 ) -> GeneratedSet:
    """Every voxel on the grid of multiples of ``stride`` that a row of ``keys`` moved by an offset of
    ``offsets`` reaches, once each, in the order of its first (offset, row), with its hash table: three Warp
    launches, a prefix sum and one host read (the count and a range flag), where torch's candidates, grid
    filter, range check and ``unique`` took ~10 ops and 3-4 host syncs. keys: (N,) int64 packed keys of
    unique rows; offsets: (K, 3) int32 on their device; per_row: at most how many of a row's K candidates
    lie on the grid (the table's size)."""
    n, volume = keys.shape[0], offsets.shape[0]
    capacity = _floor_capacity(n * per_row)
    # As floor_sets: one allocation, one fill (the table's -1 keys, its int32 values behind them holding
    # each voxel's first candidate until the compaction writes its rank there).
    buffer = torch.full((capacity * 3 // 2,), EMPTY_KEY, dtype=torch.int64, device=keys.device)
    table_keys, values = buffer.split_with_sizes((capacity, buffer.shape[0] - capacity))
    table = CoordHashTable(table_keys, values.view(torch.int32))
    if n == 0 or volume == 0:
        empty = torch.empty((0,), dtype=torch.int64, device=keys.device)
        return GeneratedSet(empty, unpack_keys(empty), table, False)
    kernels, device, grid = warp_launch.kernels(), keys.device, [int(s) for s in stride]
    marks = torch.empty((volume * n + 1,), dtype=torch.int32, device=device)  # the candidates' marks, then the flag
    flag = marks[-1:]
    flag.fill_(0)
    for out, mark in ((flag, 0), (marks[:-1], 1)):  # insert, then mark each voxel's first candidate
        warp_launch.launch(kernels.generate_cells, (volume, n), [keys, offsets, *grid, table.keys, table.values, capacity - 1,
                                                      out, mark], device)
    ranks = marks[:-1]
    ranks.cumsum_(0)
    total, out_of_range = marks[-2:].tolist()  # the one host read
    unique = torch.empty((total,), dtype=torch.int64, device=device)
    coords = torch.empty((total, 4), dtype=torch.int32, device=device)
    if total:
        warp_launch.launch(kernels.generate_compact, (volume, n),
                [keys, offsets, *grid, table.keys, capacity - 1, ranks, unique, coords, table.values], device)
    return GeneratedSet(unique, coords, table, bool(out_of_range))


class MapQuery(NamedTuple):
    """One kernel map of a :func:`query_many` launch: its output rows ``coords[row_base:row_base +
    rows]`` of its coordinate array, its offsets ``offsets[offset_base:offset_base + volume]``, its
    source table at ``table_base`` of its table arrays (``capacity`` slots) and its (rows, volume)
    neighbour table at ``out_base`` of the flat output."""

    row_base: int
    rows: int
    offset_base: int
    volume: int
    table_base: int
    capacity: int
    out_base: int
    transposed_base: int = -1
    """Where its transposed table (source rows, volume) starts in :func:`query_many`'s
    ``transposed`` (-1: not asked for)."""
    coarse_rows: bool = False
    """Its output rows are in the second coordinate array (:func:`query_many`), not the first."""
    coarse_table: bool = False
    """Its source table is in the second table arrays, not the first."""


def query_many(coords: Sequence[torch.Tensor], offsets: torch.Tensor, tables: Sequence[CoordHashTable],
               neighbors: torch.Tensor, queries: list[MapQuery], transposed: torch.Tensor | None = None) -> None:
    """Several kernel maps' neighbour tables in one launch (at most :data:`MAX_MAPS`): what
    :meth:`CoordHashTable.neighbors` computes for each ``query``, written into ``neighbors`` (flat
    int32). coords: one or two (R, 4) int32 arrays (a query's ``coarse_rows`` picks the second);
    offsets: (sum of volumes, 3) int32; tables: one or two (a query's ``coarse_table`` picks the
    second). ``transposed`` (flat int32, filled with -1): where a query's ``transposed_base`` is set,
    its transposed table (what :attr:`KernelMap.transposed_neighbors` holds) is written there too."""
    if len(queries) > MAX_MAPS:
        raise ValueError(f"query_many takes at most {MAX_MAPS} maps, got {len(queries)}")
    starts = [0, *itertools.accumulate(q.rows for q in queries)]
    volume = max((q.volume for q in queries), default=0)
    if starts[-1] == 0 or volume == 0:
        return
    rows = [[start, q.row_base, q.offset_base, q.table_base, q.capacity - 1, q.out_base,
             q.transposed_base if transposed is not None else -1, q.volume, q.coarse_rows + 2 * q.coarse_table]
            for start, q in zip(starts, queries)]
    fine, coarse = tables[0], tables[-1]
    device = coords[0].device

    def launch(first: int, last: int) -> None:
        # Rows first..last of all: the maps' first rows shifted by -first (a thread's index is then its row - first).
        shifted = [[start - first, *rest] for start, *rest in rows]
        warp_launch.launch(warp_launch.kernels().query_maps, (last - first, volume),
                           [coords[0], coords[-1], offsets, fine.keys, fine.values, coarse.keys, coarse.values,
                            neighbors, _rows_on(device, shifted),
                            transposed if transposed is not None else neighbors],  # never written without a base
                           device)

    _in_row_ranges(launch, starts[-1], volume, device)


def cell_neighbors(coarse: CoordHashTable, rows: int, fine: torch.Tensor, fine_stride: tuple[int, int, int],
                   kernel_size: tuple[int, int, int]) -> torch.Tensor:
    """The (rows, K) int32 neighbour table of a strided conv whose kernel is its stride (sizes 1 or 2, undilated:
    :func:`tiles_its_cells`) from ``fine`` (N, 4) int32 coordinates at ``fine_stride`` onto the coarse set of
    ``rows`` rows that ``coarse`` holds (their floors): each fine row lies in one cell, at one offset, so one
    lookup a fine row (its cell's, always found) makes the table, where a query makes one a (cell, offset), most
    of them missing (8 a cell for 1.6 fine rows a cell at street1's first stride: 14.6 -> ~5 ms on a 2-core CPU)."""
    volume = kernel_size[0] * kernel_size[1] * kernel_size[2]
    steps = [f * k for f, k in zip(fine_stride, kernel_size)]
    on = {"dtype": torch.int32, "device": fine.device}
    if all(v & (v - 1) == 0 for v in (*steps, *fine_stride)):  # powers of two: masks and shifts (a floor
        # division of int32 costs a 2-core CPU ~1 ms a 92k x 3 array)
        low = fine[:, 1:] & torch.tensor([v - 1 for v in steps], **on)
        cells = fine[:, 1:] - low
        inside = low >> torch.tensor([v.bit_length() - 1 for v in fine_stride], **on)
    else:
        cells = torch.div(fine[:, 1:], torch.tensor(steps, **on), rounding_mode="floor") * torch.tensor(steps, **on)
        inside = torch.div(fine[:, 1:] - cells, torch.tensor(fine_stride, **on), rounding_mode="floor")
    # (inside: (N, 3) in [0, k), the offset j - (k - 1) // 2 = j for sizes 1 and 2)
    offset = (inside[:, 0] * kernel_size[1] + inside[:, 1]) * kernel_size[2] + inside[:, 2]
    cell = coarse.neighbors(torch.cat([fine[:, :1], cells], dim=1), torch.zeros((1, 3), dtype=torch.int32))[:, 0]
    table = torch.full((rows * volume,), -1, dtype=torch.int32, device=fine.device)
    table[cell.long() * volume + offset] = torch.arange(fine.shape[0], dtype=torch.int32, device=fine.device)
    return table.view(rows, volume)


def tiles_its_cells(kernel_size: tuple[int, int, int], stride: tuple[int, int, int],
                    dilation: tuple[int, int, int]) -> bool:
    """Whether a regular conv's window tiles the output grid (a kernel equal to its stride, undilated, sizes 1 or
    2: larger sizes centre it, see :mod:`.kernel_map`): each input lies in the window of its own floored cell."""
    return (kernel_size == stride and all(k <= 2 for k in kernel_size) and dilation == (1, 1, 1)
            and stride != (1, 1, 1))


QUERY_STEP_CPU = 1
"""Threads per row of a CPU neighbour query (:func:`CoordHashTable.neighbors`; a GPU's: one per offset)."""

CPU_CHUNK_LOOKUPS = 1 << 18
"""Lookups below which a CPU query runs as one launch (a thread's start costs more than what it would take)."""


def _cpu_chunks(rows: int, volume: int) -> list[int]:
    """Bounds of the row ranges a CPU query runs in parallel (:func:`sparseconv.parallel.ranges`). Warp's CPU
    kernels run on the calling thread alone (2.5M lookups of a 92k-voxel 3^3 map: ~85 ms on one core of a
    2-core host); queries only read the table and write disjoint entries (a row's own, and in the transposed
    table the one source row each offset pairs it with), so ranges of rows may run at once. (Inserts may
    not: Warp's CPU atomics are plain reads and writes.)"""
    return parallel.ranges(rows, volume, CPU_CHUNK_LOOKUPS)


def _in_row_ranges(launch: Callable[[int, int], None], rows: int, volume: int, device: torch.device) -> None:
    """``launch(first, last)`` over ``rows`` rows of ``volume`` lookups each: on a CPU in :func:`_cpu_chunks`' ranges
    at once, elsewhere once over all rows."""
    bounds = _cpu_chunks(rows, volume) if device.type == "cpu" else [0, rows]
    parallel.in_parallel(launch, list(zip(bounds, bounds[1:])))


def _rows_on(device: torch.device, rows: list[list[int]]) -> torch.Tensor:
    """(len(rows), fields) int64 on ``device``: a launch's per-set or per-map bounds. The copy from the
    host does not wait for the stream (a pageable buffer is staged), so it costs the host ~13 us."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table if device.type == "cpu" else table.to(device, non_blocking=True)
