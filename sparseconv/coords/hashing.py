"""Open-addressing hash table over packed voxel keys, as warp-lang kernels for CPU and CUDA.

A key packs ``[batch, x, y, z]`` into one non-negative int64 (see :func:`.keys.pack_coords`); the
table is two flat arrays (keys, values) of power-of-two capacity with linear probing. The same
kernels run on ``cpu`` and ``cuda:N``; on CUDA they are launched on torch's current stream so
they are ordered with the surrounding torch work without extra synchronisation.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .host_copy import current_stream
from .keys import EMPTY_KEY, pack_coords, unpack_keys

MAX_LEVELS = 8
"""Coordinate sets one :func:`floor_sets` call makes (a MinkUNet's encoder makes four)."""
MAX_MAPS = 16
"""Kernel maps one :func:`query_many` launch queries (its kernel finds a row's map by a scan over them)."""


@functools.cache
def _kernels():
    """The Warp kernels (:mod:`.warp_kernels`), defined on first use: importing sparseconv must not start Warp."""
    from . import warp_kernels

    return warp_kernels.define()


def _launch(kernel, dim, inputs, device: torch.device) -> None:
    """Launch a Warp kernel on ``device`` (tensors in ``inputs`` as Warp array descriptors, other
    values plain ints), on CUDA on torch's current stream.

    ``wp.launch`` resolves the device, module and hooks and packs every argument on each call.
    Instead the first launch of a kernel on a device (per thread) is recorded
    (``record_cmd=True``) and later ones rewrite that command's launch bounds and arguments in
    place (:class:`_Replay`) and launch it: 38 -> ~15 µs of host time a launch on an H200 host
    (a MinkUNet training step makes 6, a lone layer on a new tensor 2).
    """
    recorded = getattr(_RECORDED, "commands", None)
    if recorded is None:
        recorded = _RECORDED.commands = {}
    replay = recorded.get((kernel, device))
    stream = _warp_stream(device) if device.type == "cuda" else None
    if replay is None:
        wp = _kernels().wp
        args = [_descriptor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        command = wp.launch(kernel, dim=dim, inputs=args, device=_warp_device(device) if stream is not None else "cpu",
                            record_cmd=True)
        recorded[(kernel, device)] = _Replay.of(command, inputs, dim)
        command.launch(stream)
        return
    replay(dim, inputs, stream)


class _Replay:
    """A recorded Warp launch (``wp.Launch``) replayed with new bounds and arguments written into its
    own parameter structures, where ``set_dim`` and ``set_param_at_index_from_ctype`` build new
    ones (~5 µs and ~4 µs a tensor on an H200 host): the array descriptors' bytes packed in place,
    the integers' values set, the bounds' extents set. Made only where those writes give the bytes
    Warp's own packing gives for the recording's arguments (:meth:`of`); else the command's own
    setters run."""

    __slots__ = ("command", "packers", "kernel_dim")

    def __init__(self, command, packers, kernel_dim: int | None) -> None:
        self.command, self.packers, self.kernel_dim = command, packers, kernel_dim

    @classmethod
    def of(cls, command, inputs, dim) -> _Replay:
        packers, kernel_dim = [], None
        try:
            params = command.params
            bounds = params[0]
            for index, value in enumerate(inputs):
                param = params[index + 1]
                if isinstance(value, torch.Tensor):
                    view = memoryview(param).cast("B")
                    if len(view) < _ARRAY.size or bytes(view) != bytes(_packed(value, len(view))):
                        raise TypeError("another array layout")
                    packers.append(_packer(view, value.dim(), value.element_size()))
                elif isinstance(value, int) and not isinstance(value, bool) and getattr(param, "value", None) == value:
                    packers.append(None)
                else:
                    raise TypeError("another scalar")
            extents = (dim,) if isinstance(dim, int) else tuple(dim)
            if (len(bounds.shape) == len(extents) and tuple(bounds.shape) == extents
                    and bounds.size == math.prod(extents) and bounds.coord_mult == 1):
                kernel_dim = len(extents)
        except (TypeError, AttributeError, ValueError):
            packers = None
        return cls(command, packers, kernel_dim)

    def __call__(self, dim, inputs, stream) -> None:
        command, packers = self.command, self.packers
        if packers is None:  # Warp's own setters
            command.set_dim(dim)
            for index, value in enumerate(inputs):
                command.set_param_at_index_from_ctype(index, _descriptor(value) if isinstance(value, torch.Tensor)
                                                      else value)
            command.launch(stream)
            return
        extents = (dim,) if isinstance(dim, int) else dim
        if len(extents) == self.kernel_dim and max(extents) < _TID_LIMIT:
            bounds = command.bounds
            for axis, extent in enumerate(extents):
                bounds.shape[axis] = extent
            bounds.size = math.prod(extents)
        else:  # another rank of launch, or extents Warp must check (wp.tid() is 32-bit)
            command.set_dim(dim)
        params = command.params
        for index, value in enumerate(inputs):
            pack = packers[index]
            if pack is None:
                params[index + 1].value = value
            else:
                pack(value)
        command.launch(stream)


_TID_LIMIT = 1 << 31
_ARRAY = struct.Struct("<QQ4i4iHH")
"""Warp's ``array_t`` (data, grad, shape[4], strides[4] in bytes, ndim, flags), checked against Warp's
own packing of each recorded launch's arrays (:meth:`_Replay.of`)."""


def _packer(view: memoryview, ndim: int, element_size: int) -> Callable[[torch.Tensor], None]:
    """What writes a launch parameter's array descriptor into ``view`` for a tensor of ``ndim`` dimensions
    and ``element_size`` bytes (a kernel's parameter has one dtype and rank): its data pointer, shape and
    strides alone, over a recording that :meth:`_Replay.of` checked (no gradient, the rank, no flags, zero
    padding), and for one or two dimensions without the general path's tuples (~2 µs a tensor of ~5)."""
    fields = struct.Struct(f"<Q8x{ndim}i{4 * (4 - ndim)}x{ndim}i")
    if ndim == 1:
        def pack(tensor: torch.Tensor) -> None:
            fields.pack_into(view, 0, tensor.data_ptr(), tensor.shape[0], tensor.stride(0) * element_size)
    elif ndim == 2:
        def pack(tensor: torch.Tensor) -> None:
            rows, cols = tensor.shape
            row, col = tensor.stride()
            fields.pack_into(view, 0, tensor.data_ptr(), rows, cols, row * element_size, col * element_size)
    else:
        def pack(tensor: torch.Tensor) -> None:
            fields.pack_into(view, 0, tensor.data_ptr(), *tensor.shape, *[s * element_size for s in tensor.stride()])
    return pack


def _pack_into(view: memoryview, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s array descriptor (what :func:`_descriptor` builds) into ``view``."""
    shape, size = tensor.shape, tensor.element_size()
    pad = (0,) * (4 - len(shape))
    _ARRAY.pack_into(view, 0, tensor.data_ptr(), 0, *shape, *pad, *[s * size for s in tensor.stride()], *pad,
                     len(shape), 0)


def _packed(tensor: torch.Tensor, length: int) -> bytearray:
    """:func:`_pack_into` into a zeroed buffer of ``length`` bytes (the structure's padding stays zero)."""
    buffer = bytearray(length)
    _pack_into(memoryview(buffer), tensor)
    return buffer


_RECORDED = threading.local()
"""Per thread, (kernel, device) -> its recorded ``wp.Launch`` (a :class:`_Replay`): a command's arguments
are set in place before it launches, so two threads must not share one (autograd runs backward on its own)."""


def _descriptor(tensor: torch.Tensor):
    """The Warp array descriptor of ``tensor`` (what ``wp.from_torch(return_ctype=True)`` returns,
    without its per-call dtype lookup and gradient handling: ~3x cheaper)."""
    made = _descriptor_type()
    if made is None:
        return _kernels().wp.from_torch(tensor, return_ctype=True)
    size = tensor.element_size()
    return made(tensor.data_ptr(), 0, tensor.dim(), tensor.shape, [s * size for s in tensor.stride()])


@functools.cache
def _descriptor_type():
    """Warp's descriptor class if building one directly gives what from_torch gives, else None."""
    wp = _kernels().wp
    sample = torch.arange(6, dtype=torch.int32).view(2, 3)[:, 1:]
    reference = wp.from_torch(sample, return_ctype=True)
    made = type(reference)
    try:
        built = made(sample.data_ptr(), 0, sample.dim(), sample.shape, [s * 4 for s in sample.stride()])
    except TypeError:
        return None
    return made if bytes(built) == bytes(reference) else None  # a ctypes structure: its bytes are its fields


# wp.stream_from_torch builds a new wp.Stream on every call: the wrapper is kept per torch stream.
_STREAMS: dict[int, tuple[torch.cuda.Stream, object]] = {}


@functools.lru_cache(maxsize=64)
def _warp_device(device: torch.device):
    return _kernels().wp.device_from_torch(device)


def _warp_stream(device: torch.device):
    """The Warp stream wrapping torch's current stream on ``device`` (made once per stream)."""
    torch_stream = current_stream(device.index if device.index is not None else torch.cuda.current_device())
    kept = _STREAMS.get(id(torch_stream))  # by identity: current_stream keeps one object per stream
    if kept is None or kept[0] is not torch_stream:
        if len(_STREAMS) > 256:  # streams made and dropped in a loop: do not hold them all
            _STREAMS.clear()
        kept = _STREAMS[id(torch_stream)] = (torch_stream, _kernels().wp.stream_from_torch(torch_stream))
    return kept[1]


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
            _launch(_kernels().insert, n, [packed, keys, table.values, keys.shape[0] - 1], coords.device)
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
        _launch(_kernels().insert_checked, n,
                [coords.contiguous(), *stride, keys, table.keys, table.values, capacity - 1, flags], coords.device)
        return table, keys, flags

    def neighbors(self, coords: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """coords: (M, 4) int32, offsets: (K, 3) int32 -> (M, K) int32 row of coords[i] + offsets[k], -1 if absent."""
        m, k = coords.shape[0], offsets.shape[0]
        out = torch.empty((m, k), dtype=torch.int32, device=coords.device)
        if m and k:
            query = _kernels().query_neighbors
            _launch(
                query,
                (m, k),
                [
                    coords.contiguous(),
                    offsets.to(device=coords.device, dtype=torch.int32).contiguous(),
                    self.keys,
                    self.values,
                    self.keys.shape[0] - 1,
                    out,
                ],
                coords.device,
            )
        return out


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
    # One allocation, one fill: every level's keys (-1 = empty) and, as int32 behind them, its slots'
    # values, which hold each cell's first row until the compaction writes its rank there.
    buffer = torch.full((levels * capacity * 3 // 2,), EMPTY_KEY, dtype=torch.int64, device=keys.device)
    table_keys, values = buffer.split_with_sizes((levels * capacity, buffer.shape[0] - levels * capacity))
    table = CoordHashTable(table_keys, values.view(torch.int32))
    if n == 0:
        empty = torch.empty((0,), dtype=torch.int64, device=keys.device)
        return FloorSets(empty, unpack_keys(empty), [0] * levels, table, capacity)
    kernels, device = _kernels(), keys.device
    marks = torch.empty((levels * n,), dtype=torch.int32, device=device)  # level after level, as the kernels index
    _launch(kernels.floor_insert, (levels, n), [keys, masks, table.keys, table.values, capacity - 1], device)
    _launch(kernels.floor_firsts, (levels, n), [keys, masks, table.keys, table.values, capacity - 1, marks], device)
    # In place, over all levels at once: each cell's rank among every level's cells, which is its row in the
    # sets laid out set after set (street4's 4 levels: 6 MB). One scan of the whole array is CUB's; torch
    # scanned a (levels, n) view row by row in 487 µs of GPU time at street4 (H200), this takes a few.
    marks.cumsum_(0)
    ends = marks[n - 1:: n].tolist()  # the one host read: where each set ends
    counts = [end - start for start, end in zip([0, *ends], ends)]
    total = ends[-1]
    # Two allocations where one buffer cut into the keys and the coords took four views
    unique = torch.empty((total,), dtype=torch.int64, device=device)
    coords = torch.empty((total, 4), dtype=torch.int32, device=device)
    _launch(kernels.floor_compact, (levels, n),
            [keys, masks, table.keys, capacity - 1, marks, unique, coords, table.values], device)
    return FloorSets(unique, coords, counts, table, capacity)


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
    kernels, device, grid = _kernels(), keys.device, [int(s) for s in stride]
    marks = torch.empty((volume * n + 1,), dtype=torch.int32, device=device)  # the candidates' marks, then the flag
    flag = marks[-1:]
    flag.fill_(0)
    for out, mark in ((flag, 0), (marks[:-1], 1)):  # insert, then mark each voxel's first candidate
        _launch(kernels.generate_cells, (volume, n), [keys, offsets, *grid, table.keys, table.values, capacity - 1,
                                                      out, mark], device)
    ranks = marks[:-1]
    ranks.cumsum_(0)
    total, out_of_range = marks[-2:].tolist()  # the one host read
    unique = torch.empty((total,), dtype=torch.int64, device=device)
    coords = torch.empty((total, 4), dtype=torch.int32, device=device)
    if total:
        _launch(kernels.generate_compact, (volume, n),
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
    _launch(_kernels().query_maps, (starts[-1], volume),
            [coords[0], coords[-1], offsets, fine.keys, fine.values, coarse.keys, coarse.values, neighbors,
             _rows_on(coords[0].device, rows),
             transposed if transposed is not None else neighbors],  # never written without a base
            coords[0].device)


def _rows_on(device: torch.device, rows: list[list[int]]) -> torch.Tensor:
    """(len(rows), fields) int64 on ``device``: a launch's per-set or per-map bounds. The copy from the
    host does not wait for the stream (a pageable buffer is staged), so it costs the host ~13 us."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table if device.type == "cpu" else table.to(device, non_blocking=True)
