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
"""Coordinate sets one :func:`~.floors.floor_sets` call makes (a MinkUNet's encoder makes four)."""
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


def floor_capacity(rows: int) -> int:
    """Slots of each :func:`~.floors.floor_sets` table for an input set of ``rows``: a power of two above 1.25 ``rows``
    (the cells are counted only after the inserts: a set of every row its own cell fills it to at most 0.8,
    a stride-2 floor of a scan ~0.3; tables of twice the rows made a MinkUNet step's peak memory 16-33 MiB
    higher, H200, room2 and street4)."""
    return max(16, 1 << (rows + rows // 4).bit_length())


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
    capacity = floor_capacity(n * per_row)
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
                   kernel_size: tuple[int, int, int], found: torch.Tensor | None = None) -> torch.Tensor:
    """The (rows, K) int32 neighbour table of a strided conv whose kernel is its stride (sizes 1 or 2, undilated:
    :func:`tiles_its_cells`) from ``fine`` (N, 4) int32 coordinates at ``fine_stride`` onto the coarse set of
    ``rows`` rows that ``coarse`` holds (their floors): each fine row lies in one cell, at one offset, so one
    lookup a fine row (its cell's, always found) makes the table, where a query makes one a (cell, offset), most
    of them missing (8 a cell for 1.6 fine rows a cell at street1's first stride: 14.6 -> ~5 ms on a 2-core CPU).
    ``found``: (N,) each fine row's coarse row where known (the floors that made the coarse set: no lookup)."""
    volume = kernel_size[0] * kernel_size[1] * kernel_size[2]
    steps = [f * k for f, k in zip(fine_stride, kernel_size)]
    on = {"dtype": torch.int32, "device": fine.device}
    if all(v & (v - 1) == 0 for v in (*steps, *fine_stride)):  # powers of two: masks and shifts (a floor
        # division of int32 costs a 2-core CPU ~1 ms a 92k x 3 array)
        low = fine[:, 1:] & torch.tensor([v - 1 for v in steps], **on)
        cells = fine[:, 1:] - low if found is None else None
        inside = low >> torch.tensor([v.bit_length() - 1 for v in fine_stride], **on)
    else:
        cells = torch.div(fine[:, 1:], torch.tensor(steps, **on), rounding_mode="floor") * torch.tensor(steps, **on)
        inside = torch.div(fine[:, 1:] - cells, torch.tensor(fine_stride, **on), rounding_mode="floor")
    # (inside: (N, 3) in [0, k), the offset j - (k - 1) // 2 = j for sizes 1 and 2)
    offset = (inside[:, 0] * kernel_size[1] + inside[:, 1]) * kernel_size[2] + inside[:, 2]
    if found is None:
        found = coarse.neighbors(torch.cat([fine[:, :1], cells], dim=1), torch.zeros((1, 3), dtype=torch.int32))[:, 0]
    table = torch.full((rows * volume,), -1, dtype=torch.int32, device=fine.device)
    table[found.long() * volume + offset] = torch.arange(fine.shape[0], dtype=torch.int32, device=fine.device)
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
