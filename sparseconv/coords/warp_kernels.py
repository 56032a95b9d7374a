"""The warp-lang kernels of the coordinate hash tables, defined on first use (importing sparseconv
must not start Warp): inserts (one set, one set with the input checks, the floors of a set at several strides, the
voxels a generative conv makes) and neighbour queries (one map, several maps at once). :mod:`.hashing` launches them.

One file, over the house's ~400 lines: Warp builds and loads its kernels per Python module (one cache entry, one
load a device), so the kernels of a second file would be a second build and load on every cold start."""

from __future__ import annotations

import os
import sys
import tempfile
from types import SimpleNamespace

import torch

from .keys import BATCH_MAX, COORD_BITS, COORD_MIN

NO_DRIVER = "Warp CUDA warning: Could not find or load the NVIDIA CUDA driver"
"""What Warp's native library prints to stderr at its start on every machine without an NVIDIA driver."""


def define() -> SimpleNamespace:
    """Import warp and define the kernels (once, through :func:`sparseconv.coords.warp_launch.kernels`)."""
    import warp as wp

    wp.config.log_level = wp.LOG_WARNING
    _init(wp)
    # Nothing differentiates these kernels: without their adjoints a cold start compiles about half the code.
    wp.set_module_options({"enable_backward": False})

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
    def claim_slot(key: wp.int64, table_keys: wp.array(dtype=wp.int64), base: wp.int64, mask: wp.int64) -> wp.int64:
        """Put ``key`` in the table at ``base`` of the arrays (``mask + 1`` slots): its slot if this call
        filled it, -2 - its slot if the key was there already, -1 if the table is full."""
        slot = home_slot(key, mask)
        probes = wp.int64(0)
        while probes <= mask:
            previous = wp.atomic_cas(table_keys, base + slot, wp.int64(-1), key)
            if previous == wp.int64(-1):
                return slot
            if previous == key:
                return wp.int64(-2) - slot
            slot = (slot + wp.int64(1)) & mask
            probes += wp.int64(1)
        return wp.int64(-1)

    @wp.func
    def insert_key(key: wp.int64, row: wp.int32, table_keys: wp.array(dtype=wp.int64),
                   table_values: wp.array(dtype=wp.int32), base: wp.int64, mask: wp.int64) -> wp.bool:
        """Insert ``key`` -> ``row`` into the table at ``base`` of the arrays (``mask + 1`` slots);
        True if the key was there already (a duplicate row)."""
        claimed = claim_slot(key, table_keys, base, mask)
        if claimed >= wp.int64(0):
            table_values[base + claimed] = row
        # Exactly one insert of a key finds the slot empty: every other one is a duplicate.
        return claimed < wp.int64(-1)

    @wp.func
    def shifted_key(coords: wp.array2d(dtype=wp.int32), row: wp.int64, offsets: wp.array2d(dtype=wp.int32),
                    k: wp.int64) -> wp.int64:
        """The key of ``coords[row]`` moved by ``offsets[k]`` (-1 if that leaves the packable range)."""
        x = wp.int32(coords[row, 1] + offsets[k, 0])  # wp in the body: Warp reads the annotations with it
        return pack(coords[row, 0], x, coords[row, 2] + offsets[k, 1], coords[row, 3] + offsets[k, 2])

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
        # range, flags[1] by a row off its stride's grid, flags[2] by a repeated row; flags[3] becomes
        # the largest batch index.
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
            return
        if insert_key(key, wp.int32(i), table_keys, table_values, wp.int64(0), mask):
            flags[2] = wp.int64(1)
        # flags[3]: the largest batch index. Read first: once the largest is in, no thread contends.
        if wp.int64(b) > flags[3]:
            wp.atomic_max(flags, 3, wp.int64(b))

    @wp.kernel
    def query_neighbors(
        coords: wp.array2d(dtype=wp.int32),
        first: wp.int64,
        offsets: wp.array2d(dtype=wp.int32),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        mask: wp.int64,
        neighbors: wp.array2d(dtype=wp.int32),
        step: wp.int32,
        mirrored: wp.int32,
    ):
        # Thread (i, j): row first + i's offsets j, j + step, ...: on a GPU one offset a thread (launched (rows, K),
        # step K); on a CPU, where "threads" run one after the other and each pays its own setup, a row's offsets
        # in one thread (launched (rows, 1), step 1): 128 -> 99 ms for a 92k-voxel 3^3 table on one core.
        # ``mirrored``: a set's table against itself through offsets symmetric about a centre (2H + 1 of them, the
        # first H given): each neighbour r found through k also has this row as its neighbour through 2H - k,
        # written there, and the centre is the row itself. No two threads write one entry (a set's rows are
        # unique: one row at most reaches r through k), so ranges of rows may run at once.
        i, j = wp.tid()
        row = first + wp.int64(i)
        count = offsets.shape[0]
        if mirrored != 0 and j == 0:
            neighbors[row, count] = wp.int32(row)
        k = j
        while k < count:
            found = lookup(shifted_key(coords, row, offsets, wp.int64(k)), table_keys, table_values, wp.int64(0), mask)
            neighbors[row, k] = found
            if mirrored != 0 and found >= 0:
                neighbors[wp.int64(found), 2 * count - k] = wp.int32(row)
            k += step

    @wp.func
    def floor_slot(key: wp.int64, table_keys: wp.array(dtype=wp.int64), base: wp.int64, mask: wp.int64) -> wp.int64:
        """The slot of ``key`` in the table at ``base`` (``mask + 1`` slots), inserted if absent; -1 if full."""
        claimed = claim_slot(key, table_keys, base, mask)
        if claimed < wp.int64(-1):
            return wp.int64(-2) - claimed
        return claimed

    @wp.kernel
    def floor_insert(
        keys: wp.array(dtype=wp.int64),
        masks: wp.array(dtype=wp.int64),
        table_keys: wp.array(dtype=wp.int64),
        first: wp.array(dtype=wp.int32),
        mask: wp.int64,
        slots: wp.array(dtype=wp.int32),
    ):
        # Thread (l, i): input row i's cell at level l (its key AND masks[l]) into level l's table (the
        # mask + 1 slots from l * (mask + 1)); the slot's value keeps the cell's first row as n - row,
        # the largest (first filled with -1). slots[l * n + i]: the slot (from the level's base; -1 if full),
        # which the kernels after read instead of probing the table again.
        level, i = wp.tid()
        n = wp.int64(keys.shape[0])
        base = wp.int64(level) * (mask + wp.int64(1))
        slot = floor_slot(keys[i] & masks[level], table_keys, base, mask)
        slots[wp.int64(level) * n + wp.int64(i)] = wp.int32(slot)
        if slot >= wp.int64(0):
            wp.atomic_max(first, base + slot, wp.int32(n - wp.int64(i)))

    @wp.kernel
    def floor_firsts(
        slots: wp.array(dtype=wp.int32),
        n: wp.int64,
        first: wp.array(dtype=wp.int32),
        mask: wp.int64,
        marks: wp.array(dtype=wp.int32),
    ):
        # marks[l * n + i] = 1 where row i is its level-l cell's first row (after floor_insert, whose slots it
        # reads), else 0.
        level, i = wp.tid()
        at = wp.int64(level) * n + wp.int64(i)
        slot = wp.int64(slots[at])
        marks[at] = wp.where(slot >= wp.int64(0)
                             and first[wp.int64(level) * (mask + wp.int64(1)) + slot] == wp.int32(n - wp.int64(i)),
                             wp.int32(1), wp.int32(0))

    @wp.func
    def ranked_row(ranks: wp.array(dtype=wp.int32), at: wp.int64) -> wp.int64:
        """The row of entry ``at`` where it is its cell's first (its inclusive rank one above the entry
        before's): its rank among every cell, else -1."""
        row = wp.int64(0)
        if at > wp.int64(0):
            row = wp.int64(ranks[at - wp.int64(1)])
        if wp.int64(ranks[at]) == row:
            return wp.int64(-1)
        return row

    @wp.func
    def write_cell(key: wp.int64, row: wp.int64, out_keys: wp.array(dtype=wp.int64),
                   out_coords: wp.array2d(dtype=wp.int32)):
        """A cell's packed key and its [batch, x, y, z] at ``row`` of the set's arrays."""
        out_keys[row] = key
        field = coord_span - wp.int64(1)
        out_coords[row, 0] = wp.int32(key >> (wp.int64(3) * coord_bits))
        out_coords[row, 1] = wp.int32(((key >> (wp.int64(2) * coord_bits)) & field) - coord_bias)
        out_coords[row, 2] = wp.int32(((key >> coord_bits) & field) - coord_bias)
        out_coords[row, 3] = wp.int32((key & field) - coord_bias)

    @wp.kernel
    def floor_compact(
        keys: wp.array(dtype=wp.int64),
        masks: wp.array(dtype=wp.int64),
        slots: wp.array(dtype=wp.int32),
        mask: wp.int64,
        ranks: wp.array(dtype=wp.int32),
        out_keys: wp.array(dtype=wp.int64),
        out_coords: wp.array2d(dtype=wp.int32),
        table_values: wp.array(dtype=wp.int32),
        set_bases: wp.array(dtype=wp.int64),
        set_capacities: wp.array(dtype=wp.int64),
    ):
        # ranks: the marks' inclusive prefix sums over all levels, level after level. The first row of
        # each cell (its rank one above the entry before's) writes the cell at its rank among every
        # level's cells, unpacked, and its rank within its level's set into its table slot (floor_insert's
        # slots; that slot's first-row value is read no more). Where set_bases is given (a fixed layout:
        # floor_sets_into), level l's set is written from row set_bases[l] instead, at most set_capacities[l]
        # rows of it: a cell past them is not written and its slot holds -1 (found as absent, never a row past
        # them).
        level, i = wp.tid()
        n = wp.int64(keys.shape[0])
        row = ranked_row(ranks, wp.int64(level) * n + wp.int64(i))
        if row < wp.int64(0):
            return
        start = wp.int64(0)  # the cells of the levels before
        if level > 0:
            start = wp.int64(ranks[wp.int64(level) * n - wp.int64(1)])
        key = keys[i] & masks[level]
        slot = wp.int64(level) * (mask + wp.int64(1)) + wp.int64(slots[wp.int64(level) * n + wp.int64(i)])
        local = row - start
        if set_bases.shape[0] > 0:
            if local >= set_capacities[level]:
                table_values[slot] = wp.int32(-1)
                return
            row = set_bases[level] + local
        write_cell(key, row, out_keys, out_coords)
        table_values[slot] = wp.int32(local)

    @wp.func
    def generated(key: wp.int64, offsets: wp.array2d(dtype=wp.int32), k: wp.int64, sx: wp.int64, sy: wp.int64,
                  sz: wp.int64) -> wp.int64:
        """The key of ``key``'s voxel moved by ``offsets[k]`` where it lies on the grid of multiples of (sx, sy,
        sz); -1 off the grid, -2 on it but out of the packable range."""
        field = coord_span - wp.int64(1)
        x = ((key >> (wp.int64(2) * coord_bits)) & field) - coord_bias + wp.int64(offsets[k, 0])
        y = ((key >> coord_bits) & field) - coord_bias + wp.int64(offsets[k, 1])
        z = (key & field) - coord_bias + wp.int64(offsets[k, 2])
        if x % sx != wp.int64(0) or y % sy != wp.int64(0) or z % sz != wp.int64(0):  # (C's %: 0 for multiples)
            return wp.int64(-1)
        moved = pack(wp.int32(key >> (wp.int64(3) * coord_bits)), wp.int32(x), wp.int32(y), wp.int32(z))
        if moved < wp.int64(0):
            return wp.int64(-2)
        return moved

    @wp.kernel
    def generate_cells(
        keys: wp.array(dtype=wp.int64),
        offsets: wp.array2d(dtype=wp.int32),
        sx: wp.int64,
        sy: wp.int64,
        sz: wp.int64,
        table_keys: wp.array(dtype=wp.int64),
        first: wp.array(dtype=wp.int32),
        mask: wp.int64,
        out: wp.array(dtype=wp.int32),
        mark: wp.int32,
    ):
        # Thread (k, i): input row i moved by offset k, where on the grid. Inserting (mark 0): into the table,
        # the slot's value keeping the voxel's first candidate (k * n + i, the smallest) as total - it, the
        # largest (first filled with -1), and out[0] = 1 where a candidate on the grid leaves the packable
        # range. Marking (mark 1, after): out[k * n + i] = 1 where the candidate is its voxel's first, else 0.
        k, i = wp.tid()
        n = wp.int64(keys.shape[0])
        at = wp.int64(k) * n + wp.int64(i)
        total = wp.int64(offsets.shape[0]) * n
        key = generated(keys[i], offsets, wp.int64(k), sx, sy, sz)
        slot = wp.int64(-1)
        if key >= wp.int64(0):
            slot = floor_slot(key, table_keys, wp.int64(0), mask)
        if mark == wp.int32(0):
            if key == wp.int64(-2):
                out[0] = wp.int32(1)
            if slot >= wp.int64(0):
                wp.atomic_max(first, slot, wp.int32(total - at))
        else:
            out[at] = wp.where(slot >= wp.int64(0) and first[slot] == wp.int32(total - at), wp.int32(1), wp.int32(0))

    @wp.kernel
    def generate_compact(
        keys: wp.array(dtype=wp.int64),
        offsets: wp.array2d(dtype=wp.int32),
        sx: wp.int64,
        sy: wp.int64,
        sz: wp.int64,
        table_keys: wp.array(dtype=wp.int64),
        mask: wp.int64,
        ranks: wp.array(dtype=wp.int32),
        out_keys: wp.array(dtype=wp.int64),
        out_coords: wp.array2d(dtype=wp.int32),
        table_values: wp.array(dtype=wp.int32),
    ):
        # ranks: generate_cells' marks' inclusive prefix sums. Each voxel's first candidate writes it at its
        # rank, unpacked, and that rank into its table slot (its first-candidate value is read no more).
        k, i = wp.tid()
        row = ranked_row(ranks, wp.int64(k) * wp.int64(keys.shape[0]) + wp.int64(i))
        if row < wp.int64(0):
            return
        key = generated(keys[i], offsets, wp.int64(k), sx, sy, sz)
        write_cell(key, row, out_keys, out_coords)
        table_values[floor_slot(key, table_keys, wp.int64(0), mask)] = wp.int32(row)

    @wp.func
    def map_lookup(coords: wp.array2d(dtype=wp.int32), row: wp.int64, offsets: wp.array2d(dtype=wp.int32),
                   k: wp.int64, table_keys: wp.array(dtype=wp.int64), table_values: wp.array(dtype=wp.int32),
                   base: wp.int64, mask: wp.int64) -> wp.int32:
        key = wp.int64(shifted_key(coords, row, offsets, k))  # wp in the body: Warp reads the annotations with it
        return lookup(key, table_keys, table_values, base, mask)

    @wp.kernel
    def query_maps(
        coords: wp.array2d(dtype=wp.int32),
        coarse_coords: wp.array2d(dtype=wp.int32),
        offsets: wp.array2d(dtype=wp.int32),
        table_keys: wp.array(dtype=wp.int64),
        table_values: wp.array(dtype=wp.int32),
        coarse_keys: wp.array(dtype=wp.int64),
        coarse_values: wp.array(dtype=wp.int32),
        neighbors: wp.array(dtype=wp.int32),
        maps: wp.array2d(dtype=wp.int64),
        transposed: wp.array(dtype=wp.int32),
    ):
        # Several kernel maps in one launch, thread (i, k) for offset k of the i-th output row of all
        # (threads past a map's kernel volume idle). maps[m] = (the first of those rows that is map m's,
        # where its rows start in its coordinates, its offsets in offsets, its source table in its table
        # arrays, that table's slots - 1, where its (rows, volume) neighbour table starts in neighbors,
        # where its transposed table starts in transposed or -1, its kernel volume, and which arrays:
        # bit 0 set for its rows in coarse_coords, bit 1 for its table in coarse_keys / coarse_values).
        #
        # The maps' rows are read from this small array (cached after the first reads), not passed
        # as vector arguments: read even at constant indices, eight by-value vectors made the
        # launch 2.0-2.5x as long as the lookups alone (96 against 39 us for a 92k-row 3^3 map,
        # 376 against 184 for a 373k-row one, H100, 2026-11-26).
        i, k = wp.tid()
        index = wp.int64(i)
        m = int(0)
        for candidate in range(1, maps.shape[0]):
            if index >= maps[candidate, 0]:
                m = candidate
        volume = maps[m, 7]
        offset = wp.int64(k)
        if offset >= volume:
            return
        local = index - maps[m, 0]
        row = maps[m, 1] + local
        at = maps[m, 2] + offset
        which = maps[m, 8]
        found = wp.int32(-1)
        if which == wp.int64(0):
            found = map_lookup(coords, row, offsets, at, table_keys, table_values, maps[m, 3], maps[m, 4])
        elif which == wp.int64(1):
            found = map_lookup(coarse_coords, row, offsets, at, table_keys, table_values, maps[m, 3], maps[m, 4])
        elif which == wp.int64(2):
            found = map_lookup(coords, row, offsets, at, coarse_keys, coarse_values, maps[m, 3], maps[m, 4])
        else:
            found = map_lookup(coarse_coords, row, offsets, at, coarse_keys, coarse_values, maps[m, 3], maps[m, 4])
        neighbors[maps[m, 5] + local * volume + offset] = found
        # The transposed table (source rows, volume), where asked for (base >= 0, filled with -1):
        # within an offset a source row feeds at most one output row, so no two threads meet.
        transposed_base = maps[m, 6]
        if found >= wp.int32(0) and transposed_base >= wp.int64(0):
            transposed[transposed_base + wp.int64(found) * volume + offset] = wp.int32(local)

    return SimpleNamespace(wp=wp, insert=insert, query_neighbors=query_neighbors, insert_checked=insert_checked,
                           query_maps=query_maps, floor_insert=floor_insert,
                           floor_firsts=floor_firsts, floor_compact=floor_compact, generate_cells=generate_cells,
                           generate_compact=generate_compact)


def _init(wp) -> None:
    """``wp.init()``; where torch finds no CUDA device, without :data:`NO_DRIVER`, which a CPU-only user can do
    nothing about (Warp has no option for it: its native code writes to the process's stderr). Anything else
    written to stderr meanwhile goes through."""
    if torch.cuda.is_available():
        wp.init()
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            wp.init()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        text = caught.read().decode(errors="replace")
    kept = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(NO_DRIVER))
    if kept:
        sys.stderr.write(kept)
