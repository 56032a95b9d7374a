"""Open-addressing hash table over packed voxel keys, as warp-lang kernels for CPU and CUDA.

A key packs ``[batch, x, y, z]`` into one non-negative int64 (see :func:`pack_coords`); the
table is two flat arrays (keys, values) of power-of-two capacity with linear probing. The same
kernels run on ``cpu`` and ``cuda:N``; on CUDA they are launched on torch's current stream so
they are ordered with the surrounding torch work without extra synchronisation.
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass
from typing import NamedTuple
from types import SimpleNamespace

import torch

# Bit budget of a packed key: 12 batch bits + 3 x 17 coordinate bits = 63 bits, so every valid
# key is a non-negative int64 and -1 can mark an empty slot.
BATCH_BITS = 12
COORD_BITS = 17
BATCH_MAX = (1 << BATCH_BITS) - 1
COORD_MIN = -(1 << (COORD_BITS - 1))
COORD_MAX = (1 << (COORD_BITS - 1)) - 1
EMPTY_KEY = -1
MAX_LEVELS = 8
"""Coordinate sets whose tables one :func:`insert_levels` launch builds."""
MAX_MAPS = 16
"""Kernel maps one :func:`query_maps` launch queries."""


def range_violation(coords: torch.Tensor) -> str | None:
    """coords: (N, 4) integer -> None if every row can be packed, else what is out of range."""
    if coords.shape[0] == 0:
        return None
    return range_violation_of(coords.amin(dim=0).tolist(), coords.amax(dim=0).tolist())


def range_violation_of(lo: list[int], hi: list[int]) -> str | None:
    """:func:`range_violation` from the per-column minima and maxima [batch, x, y, z], read already."""
    if lo[0] < 0 or hi[0] > BATCH_MAX:
        return f"batch indices span [{lo[0]}, {hi[0]}], supported [0, {BATCH_MAX}]"
    if min(lo[1:]) < COORD_MIN or max(hi[1:]) > COORD_MAX:
        return (
            f"x, y, z span [{min(lo[1:])}, {max(hi[1:])}], supported [{COORD_MIN}, {COORD_MAX}] "
            "(in voxel units of stride 1)"
        )
    return None


def pack_coords(coords: torch.Tensor) -> torch.Tensor:
    """coords: (N, 4) integer [batch, x, y, z], already range-checked -> (N,) int64 keys.

    The fields do not overlap, so shifting each into place is multiplying by its power of two and
    or-ing them is summing: three torch ops (a new coordinate set's host time) instead of eleven."""
    shifts, bias = _packing(coords.device)
    return torch.mul(coords, shifts).sum(1).add_(bias)


@functools.cache
def _packing(device: torch.device) -> tuple[torch.Tensor, int]:
    """(the (4,) int64 multipliers of [batch, x, y, z], the packed key of the bias -COORD_MIN on x, y, z)."""
    shifts = [1 << (3 * COORD_BITS), 1 << (2 * COORD_BITS), 1 << COORD_BITS, 1]
    return torch.tensor(shifts, dtype=torch.int64, device=device), -COORD_MIN * sum(shifts[1:])


@functools.cache
def floor_mask(stride: tuple[int, int, int]) -> int:
    """The int64 mask whose AND floors every coordinate field of a packed key to a multiple of
    ``stride`` (powers of two that divide the bias -COORD_MIN; the result stays in range)."""
    low = sum((s - 1) << (COORD_BITS * (2 - axis)) for axis, s in enumerate(stride))
    return ~low


def unpack_keys(keys: torch.Tensor) -> torch.Tensor:
    """keys: (N,) int64 from :func:`pack_coords` -> (N, 4) int32 [batch, x, y, z].

    Each field is a shift, a mask and a bias: one broadcast op each over the four columns (four
    ops on a new coordinate set instead of thirteen)."""
    shifts, fields, biases = _unpacking(keys.device)
    return keys[:, None].bitwise_right_shift(shifts).bitwise_and_(fields).add_(biases).to(torch.int32)


@functools.cache
def _unpacking(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shifts, field masks, biases), (4,) int64 each, of [batch, x, y, z] in a packed key."""
    field = (1 << COORD_BITS) - 1
    values = ([3 * COORD_BITS, 2 * COORD_BITS, COORD_BITS, 0], [BATCH_MAX, field, field, field], [0, *[COORD_MIN] * 3])
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in values)


@functools.cache
def _kernels():
    """Import warp and define the kernels on first use: importing sparseconv must not start Warp."""
    import warp as wp

    wp.config.log_level = wp.LOG_WARNING
    wp.init()

    coord_bits = wp.constant(wp.int64(COORD_BITS))
    coord_bias = wp.constant(wp.int64(-COORD_MIN))
    coord_span = wp.constant(wp.int64(1 << COORD_BITS))
    batch_span = wp.constant(wp.int64(BATCH_MAX + 1))

    @wp.func
    def pack(b: wp.int32, x: wp.int32, y: wp.int32, z: wp.int32) -> wp.int64:
        # Out-of-range neighbours (a kernel offset stepping past the coordinate range) have no key.
        bx = wp.int64(x) + coord_bias
        by = wp.int64(y) + coord_bias
        bz = wp.int64(z) + coord_bias
        if b < 0 or wp.int64(b) >= batch_span:
            return wp.int64(-1)
        if bx < wp.int64(0) or bx >= coord_span or by < wp.int64(0) or by >= coord_span:
            return wp.int64(-1)
        if bz < wp.int64(0) or bz >= coord_span:
            return wp.int64(-1)
        return (
            (wp.int64(b) << (wp.int64(3) * coord_bits))
            | (bx << (wp.int64(2) * coord_bits))
            | (by << coord_bits)
            | bz
        )

    @wp.func
    def home_slot(key: wp.int64, mask: wp.int64) -> wp.int64:
        # Fibonacci hashing: neighbouring voxels differ in low key bits, which the multiply
        # spreads over the high bits that the xor-shift then folds back down.
        h = wp.uint64(key) * wp.uint64(0x9E3779B97F4A7C15)
        h = h ^ (h >> wp.uint64(31))
        return wp.int64(h) & mask

    @wp.func
    def insert_key(key: wp.int64, row: wp.int32, table_keys: wp.array(dtype=wp.int64),
                   table_values: wp.array(dtype=wp.int32), base: wp.int64, mask: wp.int64) -> wp.bool:
        """Insert ``key`` -> ``row`` into the table at ``base`` of the arrays (``mask + 1`` slots);
        True if the key was there already (a duplicate row)."""
        slot = home_slot(key, mask)
        probes = wp.int64(0)
        while probes <= mask:
            previous = wp.atomic_cas(table_keys, base + slot, wp.int64(-1), key)
            if previous == wp.int64(-1):
                table_values[base + slot] = row
                return False
            if previous == key:
                # Exactly one insert of a key finds the slot empty: every other one is a duplicate.
                return True
            slot = (slot + wp.int64(1)) & mask
            probes += wp.int64(1)
        return False

    @wp.func
    def lookup(key: wp.int64, table_keys: wp.array(dtype=wp.int64), table_values: wp.array(dtype=wp.int32),
               base: wp.int64, mask: wp.int64) -> wp.int32:
        """The row of ``key`` in the table at ``base`` (``mask + 1`` slots), -1 if absent or no key."""
        if key < wp.int64(0):
            return wp.int32(-1)
        slot = home_slot(key, mask)
        probes = wp.int64(0)
        while probes <= mask:
            stored = table_keys[base + slot]
            if stored == key:
                return table_values[base + slot]
            if stored == wp.int64(-1):
                return wp.int32(-1)
            slot = (slot + wp.int64(1)) & mask
            probes += wp.int64(1)
        return wp.int32(-1)

    @wp.kernel
    def insert(
        keys: wp.array(dtype=wp.int64),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        mask: wp.int64,
    ):
        i = wp.tid()
        # Keys are unique (checked by the caller), so each slot's value has one writer.
        insert_key(keys[i], wp.int32(i), table_keys, table_values, wp.int64(0), mask)

    @wp.kernel
    def insert_checked(
        coords: wp.array2d(dtype=wp.int32),
        sx: wp.int32,
        sy: wp.int32,
        sz: wp.int32,
        keys: wp.array(dtype=wp.int64),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        mask: wp.int64,
        flags: wp.array(dtype=wp.int64),
    ):
        # A new SparseTensor's checks and its hash table in one pass: flags[0] is set (1) by a row out of
        # range, flags[1] by a row off its stride's grid, flags[2] by a repeated row.
        i = wp.tid()
        b = coords[i, 0]
        x = coords[i, 1]
        y = coords[i, 2]
        z = coords[i, 3]
        if x % sx != 0 or y % sy != 0 or z % sz != 0:
            flags[1] = wp.int64(1)
        key = pack(b, x, y, z)
        keys[i] = key
        if key < wp.int64(0):
            flags[0] = wp.int64(1)
        elif insert_key(key, wp.int32(i), table_keys, table_values, wp.int64(0), mask):
            flags[2] = wp.int64(1)

    @wp.kernel
    def query_neighbors(
        coords: wp.array2d(dtype=wp.int32),
        offsets: wp.array2d(dtype=wp.int32),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        mask: wp.int64,
        neighbors: wp.array2d(dtype=wp.int32),
    ):
        i, k = wp.tid()
        key = pack(
            coords[i, 0],
            coords[i, 1] + offsets[k, 0],
            coords[i, 2] + offsets[k, 1],
            coords[i, 3] + offsets[k, 2],
        )
        found = lookup(key, table_keys, table_values, wp.int64(0), mask)
        neighbors[i, k] = found

    # Written out in each annotation: Warp evaluates annotations against the module's globals and
    # the kernel's closure, which holds only the names its body reads.
    levels_vector = wp.types.vector(length=MAX_LEVELS, dtype=wp.int64)
    maps_vector = wp.types.vector(length=MAX_MAPS, dtype=wp.int64)

    @wp.kernel
    def insert_levels(
        keys: wp.array(dtype=wp.int64),
        starts: wp.types.vector(length=MAX_LEVELS, dtype=wp.int64),
        levels: wp.int64,
        bases: wp.types.vector(length=MAX_LEVELS, dtype=wp.int64),
        masks: wp.types.vector(length=MAX_LEVELS, dtype=wp.int64),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
    ):
        # Several coordinate sets' tables in one launch: keys of set l start at starts[l], and its
        # table holds masks[l] + 1 slots from bases[l] of the shared arrays.
        i = wp.int64(wp.tid())
        level = wp.int64(0)
        while level + wp.int64(1) < levels and i >= starts[level + wp.int64(1)]:
            level += wp.int64(1)
        insert_key(keys[i], wp.int32(i - starts[level]), table_keys, table_values, bases[level], masks[level])

    @wp.kernel
    def query_maps(
        coords: wp.array2d(dtype=wp.int32),
        offsets: wp.array2d(dtype=wp.int32),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        neighbors: wp.array(dtype=wp.int32),
        volume: wp.int64,
        maps: wp.int64,
        starts: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
        row_bases: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
        offset_bases: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
        table_bases: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
        table_masks: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
        out_bases: wp.types.vector(length=MAX_MAPS, dtype=wp.int64),
    ):
        # Several kernel maps of one kernel volume in one launch, thread (i, k) for offset k of the
        # i-th output row of all: map m's rows are numbered from starts[m] and lie from row_bases[m]
        # of coords, its offsets from offset_bases[m], its source table from table_bases[m], its
        # (rows, volume) neighbour table from out_bases[m] of neighbors.
        i, k = wp.tid()
        index = wp.int64(i)
        m = wp.int64(0)
        while m + wp.int64(1) < maps and index >= starts[m + wp.int64(1)]:
            m += wp.int64(1)
        local = index - starts[m]
        row = row_bases[m] + local
        offset = offset_bases[m] + wp.int64(k)
        key = pack(
            coords[row, 0],
            coords[row, 1] + offsets[offset, 0],
            coords[row, 2] + offsets[offset, 1],
            coords[row, 3] + offsets[offset, 2],
        )
        found = lookup(key, table_keys, table_values, table_bases[m], table_masks[m])
        neighbors[out_bases[m] + local * volume + wp.int64(k)] = found

    return SimpleNamespace(wp=wp, insert=insert, query_neighbors=query_neighbors, insert_checked=insert_checked,
                           insert_levels=insert_levels, query_maps=query_maps, levels_vector=levels_vector,
                           maps_vector=maps_vector)


def _launch(kernel, dim, inputs, device: torch.device) -> None:
    """Launch a Warp kernel on ``device`` (tensors in ``inputs`` as Warp array descriptors, other
    values plain ints), on CUDA on torch's current stream.

    ``wp.launch`` resolves the device, module and hooks and packs every argument on each call.
    Instead the first launch of a kernel on a device (per thread) is recorded
    (``record_cmd=True``) and later ones set that command's size and arguments and launch it:
    113 -> 74 us a neighbour-query launch on a 2-core CPU, kernel included (2026-11-25; a MinkUNet
    pass makes 14 Warp launches).
    """
    wp = _kernels().wp
    args = [_descriptor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    stream = _warp_stream(device) if device.type == "cuda" else None
    recorded = getattr(_RECORDED, "commands", None)
    if recorded is None:
        recorded = _RECORDED.commands = {}
    command = recorded.get((kernel, device))
    if command is None:
        command = recorded[(kernel, device)] = wp.launch(
            kernel, dim=dim, inputs=args, device=_warp_device(device) if stream is not None else "cpu",
            record_cmd=True)
    else:
        command.set_dim(dim)
        for index, arg in enumerate(args):
            command.set_param_at_index_from_ctype(index, arg)
    command.launch(stream)


_RECORDED = threading.local()
"""Per thread, (kernel, device) -> its recorded ``wp.Launch``: a command's arguments are set in
place before it launches, so two threads must not share one (autograd runs backward on its own)."""


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
_STREAMS: dict[tuple[int, int], object] = {}


@functools.lru_cache(maxsize=64)
def _warp_device(device: torch.device):
    return _kernels().wp.device_from_torch(device)


def _warp_stream(device: torch.device):
    """The Warp stream wrapping torch's current stream on ``device`` (made once per stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~20x cheaper than torch.cuda.current_stream
    key = (index, raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) > 256:  # streams made and dropped in a loop: do not hold them all
            _STREAMS.clear()
        stream = _STREAMS[key] = _kernels().wp.stream_from_torch(torch.cuda.current_stream(index))
    return stream


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
        (3,) int64 flags): flags[0] is 1 if some row is out of the packable range (its key is then
        -1), flags[1] if some x, y, z is not a multiple of ``stride``, flags[2] if some row is
        repeated; -1 where not. The table and keys are valid only if no flag is set.
        """
        n = coords.shape[0]
        capacity = _capacity(n)
        # One allocation, one fill: the empty table (-1 keys), the keys (all written) and the flags (-1 = clear).
        buffer = torch.full((capacity + n + 3,), EMPTY_KEY, dtype=torch.int64, device=coords.device)
        table = cls(buffer[:capacity], _values(capacity, buffer.device))
        keys, flags = buffer[capacity: capacity + n], buffer[capacity + n:]
        _launch(_kernels().insert_checked, n, [coords.contiguous(), *stride, keys, table.keys, table.values, capacity - 1, flags],
                coords.device)
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


def insert_sets(keys: torch.Tensor, starts: list[int], table_keys: torch.Tensor, table_values: torch.Tensor,
                bases: list[int], capacities: list[int]) -> None:
    """Insert several coordinate sets into their tables in one launch.

    keys: (N,) int64 unique within each set, set ``l`` from ``starts[l]``; set ``l``'s table is
    ``capacities[l]`` (a power of two) slots from ``bases[l]`` of ``table_keys`` (int64, filled
    with -1) and ``table_values`` (int32). At most :data:`MAX_LEVELS` sets."""
    if len(starts) > MAX_LEVELS:
        raise ValueError(f"insert_sets takes at most {MAX_LEVELS} sets, got {len(starts)}")
    if keys.shape[0] == 0:
        return
    kernels = _kernels()
    vector = functools.partial(_padded_vector, kernels.levels_vector, MAX_LEVELS)
    _launch(kernels.insert_levels, keys.shape[0],
            [keys, vector(starts), len(starts), vector(bases), vector([c - 1 for c in capacities]),
             table_keys, table_values], keys.device)


class MapQuery(NamedTuple):
    """One kernel map of a :func:`query_many` launch: its output rows ``coords[row_base:row_base +
    rows]``, its offsets ``offsets[offset_base:offset_base + volume]``, its source table at
    ``table_base`` of the table arrays (``capacity`` slots) and its (rows, volume) neighbour table
    at ``out_base`` of the flat output."""

    row_base: int
    rows: int
    offset_base: int
    volume: int
    table_base: int
    capacity: int
    out_base: int


def query_many(coords: torch.Tensor, offsets: torch.Tensor, table_keys: torch.Tensor, table_values: torch.Tensor,
               neighbors: torch.Tensor, queries: list[MapQuery]) -> None:
    """Several kernel maps' neighbour tables in one launch (at most :data:`MAX_MAPS`, all of one
    kernel volume): what :meth:`CoordHashTable.neighbors` computes for each ``query``, written into
    ``neighbors`` (flat int32). coords: (R, 4) int32; offsets: (sum of volumes, 3) int32."""
    if len(queries) > MAX_MAPS or len({q.volume for q in queries}) > 1:
        raise ValueError(f"query_many takes at most {MAX_MAPS} maps of one kernel volume, got "
                         f"{[q.volume for q in queries]}")
    starts = [0, *itertools.accumulate(q.rows for q in queries)]
    if not queries or starts[-1] == 0 or queries[0].volume == 0:
        return
    kernels = _kernels()
    vector = functools.partial(_padded_vector, kernels.maps_vector, MAX_MAPS)
    _launch(kernels.query_maps, (starts[-1], queries[0].volume),
            [coords, offsets, table_keys, table_values, neighbors, queries[0].volume, len(queries),
             vector(starts[:-1]), vector([q.row_base for q in queries]), vector([q.offset_base for q in queries]),
             vector([q.table_base for q in queries]), vector([q.capacity - 1 for q in queries]),
             vector([q.out_base for q in queries])], coords.device)


def _padded_vector(kind, length: int, values: list[int]):
    """A Warp int64 vector argument holding ``values`` (zeros after them)."""
    return kind(*values, *[0] * (length - len(values)))
