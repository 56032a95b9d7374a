"""Triton kernels that build views of a kernel map (defined by :func:`.triton_kernels.kernels`, which imports Triton
on first use): the mask kernels' row masks (``row_masks``, ``row_masks_many``: several maps' orders' keys in one
launch, then ``orders_from_positions``) and tile plans (``tile_plan``, ``tile_plans``), a map's pair counts
(``pair_counts``, ``pair_counts_many``) and its pair lists (``pair_blocks``, then ``pair_lists``): one launch
each where torch needed about ten ops. Their callers: :mod:`.mask_views`, :mod:`.planned_views`.
"""

from __future__ import annotations


def define(triton, tl) -> dict:
    """The view kernels, by name (``triton``, ``triton.language``: imported by the caller)."""

    @triton.jit
    def _entry(meta_ptr, entries, FIELDS: tl.constexpr):
        """A batched launch's entry for this program: (its FIELDS int64 of the meta table, its
        index, the program's block within it); the entry is the last whose first block (field 0)
        the program's id is at or past."""
        block = tl.program_id(0).to(tl.int64)
        e = tl.program_id(0) * 0
        for q in range(1, entries):
            e = tl.where(tl.load(meta_ptr + q * FIELDS) <= block, q, e)
        meta = meta_ptr + e.to(tl.int64) * FIELDS
        return meta, e, block - tl.load(meta)

    @triton.jit
    def _rarity(count_ptr, lo, width, WIDTH: tl.constexpr):
        """rank[k]: how many offsets of [lo, lo + width) are rarer than k (fewer pairs,
        ``count_ptr[k]``; ties by offset): a WIDTH x WIDTH compare instead of an argsort launch and
        three torch ops per view on the host."""
        k = tl.arange(0, WIDTH)
        j = tl.arange(0, WIDTH)
        count_k = tl.load(count_ptr + lo + k, mask=k < width, other=0)
        count_j = tl.load(count_ptr + lo + j, mask=j < width, other=0)
        rarer = (count_j[None, :] < count_k[:, None]) | ((count_j[None, :] == count_k[:, None]) & (j[None, :] < k[:, None]))
        return tl.sum((rarer & (j[None, :] < width)).to(tl.int32), axis=1)

    @triton.jit
    def _masks(table_ptr, r, rows, row_stride, lo, width, bit, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Per row of ``r``: the sum (the OR: distinct powers of two) of 1 << bit[k] over the offsets
        k of [lo, lo + width) it has a neighbour through (offsets whose bit is negative left out)."""
        k = tl.arange(0, WIDTH)
        ok = (r[:, None] < rows) & (k[None, :] < width)
        present = tl.load(table_ptr + r[:, None].to(tl.int64) * row_stride + lo + k[None, :], mask=ok, other=-1) >= 0
        one = tl.full((BLOCK, WIDTH), 1, tl.int64)
        return tl.sum(tl.where(present & (bit[None, :] >= 0), one << tl.maximum(bit, 0).to(tl.int64)[None, :], 0), axis=1)

    @triton.jit
    def _table_fields(meta):
        """Fields 1-6 of a batched entry over a neighbour table (the planned row orders' and tile
        plans'): the int32 table, an int64 array of the entry (the pair counts, the row order), the
        table's rows and row stride, and its offset range's start and width."""
        return (tl.load(meta + 1).to(tl.pointer_type(tl.int32)), tl.load(meta + 2).to(tl.pointer_type(tl.int64)),
                tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6))

    @triton.jit
    def _plan_tile(table_ptr, order_ptr, used_ptr, list_ptr, count_ptr, slots_ptr, tile, rows, row_stride, lo,
                   width, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
        """One tile of BLOCK_M visited rows: which offsets of [lo, lo + width) it uses, their list
        (used first, each part in offset order) and count, and per list slot its rows' sources."""
        tile = tile.to(tl.int64)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.arange(0, WIDTH)
        row = tl.load(order_ptr + i, mask=i < rows, other=0)
        ok = (i[:, None] < rows) & (k[None, :] < width)
        source = tl.load(table_ptr + row[:, None].to(tl.int64) * row_stride + lo + k[None, :], mask=ok, other=-1)
        used = (tl.max(source, axis=0) >= 0).to(tl.int32)
        count = tl.sum(used, axis=0)
        unused = tl.where(k < width, 1 - used, 0)
        slot = tl.where(used > 0, tl.cumsum(used, axis=0) - 1, count + tl.cumsum(unused, axis=0) - 1)
        tl.store(used_ptr + tile * width + k, used.to(used_ptr.dtype.element_ty), mask=k < width)
        tl.store(list_ptr + tile * width + slot, (lo + k).to(list_ptr.dtype.element_ty), mask=k < width)
        tl.store(count_ptr + tile, count)
        at = tile * width * BLOCK_M + slot[None, :] * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        tl.store(slots_ptr + at, source, mask=(k < width)[None, :])

    # Triton's interpreter runs a kernel's source again against its module's globals, not the closure
    # that defines it here: the helpers the kernels call must be found there too.
    globals().update(_entry=_entry, _rarity=_rarity, _masks=_masks, _table_fields=_table_fields,
                     _plan_tile=_plan_tile)

    @triton.jit(do_not_specialize=["rows", "row_stride", "stride", "b0", "b1", "b2", "b3"])
    def row_masks(table_ptr, count_ptr, out_ptr, rows, row_stride, stride, b0, b1, b2, b3,
                  BLOCK: tl.constexpr, WIDTH: tl.constexpr, BITS: tl.constexpr):
        """The sort keys of up to three offset groups' row orders (group g = program_id(1) holds the
        offsets [b_g, b_g+1)): out[g * stride + i] = g << BITS | the bitmask of the group's
        offsets present in row i, the rarest offset (fewest pairs, ``count_ptr[k]``; ties by offset)
        most significant; only the ``BITS`` rarest get a bit. Entries from ``rows`` to ``stride``
        (the padding that keeps each group's part aligned) get the group's largest key."""
        g = tl.program_id(1)
        lo = tl.where(g == 0, b0, tl.where(g == 1, b1, b2))
        width = tl.where(g == 0, b1, tl.where(g == 1, b2, b3)) - lo
        bit = BITS - 1 - _rarity(count_ptr, lo, width, WIDTH)
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        masks = _masks(table_ptr, r, rows, row_stride, lo, width, bit, BLOCK, WIDTH)
        masks = tl.where(r < rows, masks, (1 << BITS) - 1) | (g.to(tl.int64) << BITS)
        tl.store(out_ptr + g.to(tl.int64) * stride + r, masks.to(out_ptr.dtype.element_ty), mask=r < stride)

    @triton.jit
    def _count_block(table_ptr, out_ptr, rows, width, block, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Add the pairs per offset of one block of rows of a (rows, width) neighbour table into ``out``
        (integer atomics: the sums do not depend on their order)."""
        r = block * BLOCK + tl.arange(0, BLOCK)
        k = tl.arange(0, WIDTH)
        ok = (r[:, None] < rows) & (k[None, :] < width)
        present = tl.load(table_ptr + r[:, None] * width + k[None, :], mask=ok, other=-1) >= 0
        tl.atomic_add(out_ptr + k, tl.sum(present.to(tl.int64), axis=0), mask=k < width)

    globals().update(_count_block=_count_block)  # found by the interpreter (see above)

    @triton.jit(do_not_specialize=["rows"])
    def pair_counts(table_ptr, out_ptr, rows, width, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Pairs per offset of one (rows, width) neighbour table, added into a zeroed int64 ``out``."""
        _count_block(table_ptr, out_ptr, rows, width, tl.program_id(0).to(tl.int64), BLOCK, WIDTH)

    @triton.jit(do_not_specialize=["entries"])
    def pair_counts_many(meta_ptr, out_ptr, entries, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """:func:`pair_counts` of several neighbour tables in one launch. Per table, 5 int64 (first
        block, table address, rows, width = row stride, where its counts start in out)."""
        meta, e, block = _entry(meta_ptr, entries, 5)
        table_ptr = tl.load(meta + 1).to(tl.pointer_type(tl.int32))
        _count_block(table_ptr, out_ptr + tl.load(meta + 4), tl.load(meta + 2), tl.load(meta + 3), block, BLOCK, WIDTH)

    @triton.jit(do_not_specialize=["entries"])
    def row_masks_many(meta_ptr, out_ptr, entries, BLOCK: tl.constexpr, WIDTH: tl.constexpr, SHIFT: tl.constexpr):
        """row_masks of one offset group for several tables in one launch (the map plan's orders):
        the program's block is the entry's whose first block (meta field 0) it is at or past. Per
        entry, 9 int64 (planned_views.build_planned_orders writes them): first block, table and count
        addresses, rows, row stride, lo, width (its mask bits), where its keys start in out, their
        count (rows padded, the padding given the largest key); the entry's index is its tag."""
        meta, e, block = _entry(meta_ptr, entries, 9)
        table_ptr, count_ptr, rows, row_stride, lo, width = _table_fields(meta)
        keys_ptr = out_ptr + tl.load(meta + 7)
        size = tl.load(meta + 8)
        bit = width - 1 - _rarity(count_ptr, lo, width, WIDTH)
        r = block * BLOCK + tl.arange(0, BLOCK)
        masks = _masks(table_ptr, r, rows, row_stride, lo, width, bit, BLOCK, WIDTH)
        masks = tl.where(r < rows, masks, (tl.full((BLOCK,), 1, tl.int64) << width) - 1) | (e.to(tl.int64) << SHIFT)
        tl.store(keys_ptr + r, masks, mask=r < size)

    @triton.jit(do_not_specialize=["entries"])
    def orders_from_positions(meta_ptr, order_ptr, entries, BLOCK: tl.constexpr):
        """After row_masks_many (same meta table and grid) and one sort of its keys: each entry's
        sorted positions, which lie in its own part of the keys (its tag orders it there), less the
        part's start (meta field 7), are the entry's rows in visiting order."""
        meta, e, block = _entry(meta_ptr, entries, 9)
        start = tl.load(meta + 7)
        r = block * BLOCK + tl.arange(0, BLOCK)
        at = order_ptr + start + r
        ok = r < tl.load(meta + 8)
        tl.store(at, tl.load(at, mask=ok, other=0) - start, mask=ok)

    @triton.jit(do_not_specialize=["rows", "lo", "width"])
    def tile_plan(table_ptr, order_ptr, used_ptr, list_ptr, count_ptr, slots_ptr, rows, row_stride, lo, width,
                  BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
        """One tile of one (table, row order) pair's plan (:func:`_plan_tile`) a program. ``used_ptr``: the
        int32 part of the plan's buffer that holds the used flags' bytes (:func:`mask_views.plan_views`)."""
        _plan_tile(table_ptr, order_ptr, used_ptr.to(tl.pointer_type(tl.int8)), list_ptr, count_ptr, slots_ptr,
                   tl.program_id(0), rows, row_stride, lo, width, BLOCK_M, WIDTH)

    @triton.jit(do_not_specialize=["plans"])
    def tile_plans(meta_ptr, plans, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
        """tile_plan for several (table, row order) pairs of one tile height in one launch: the
        program's tile is the plan's whose first tile (meta field 0) it is at or past. Per plan,
        12 int64 (planned_views.build_planned_tile_plans writes them): first tile, table and order
        addresses, rows, row stride, lo, width, and the addresses of its lists, counts, slots and
        used flags, and a pad (each entry 16-byte aligned)."""
        meta, _, tile = _entry(meta_ptr, plans, 12)
        table_ptr, order_ptr, rows, row_stride, lo, width = _table_fields(meta)
        _plan_tile(table_ptr, order_ptr, tl.load(meta + 10).to(tl.pointer_type(tl.int8)),
                   tl.load(meta + 7).to(tl.pointer_type(tl.int32)),
                   tl.load(meta + 8).to(tl.pointer_type(tl.int32)),
                   tl.load(meta + 9).to(tl.pointer_type(tl.int32)),
                   tile, rows, row_stride, lo, width, BLOCK_M, WIDTH)

    @triton.jit(do_not_specialize=["rows", "width", "blocks"])
    def pair_blocks(table_ptr, counts_ptr, rows, width, blocks, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """counts[k, b] ((WIDTH, blocks), offsets along the rows so that their sums over the blocks
        are an innermost-dimension scan): the pairs of offset k among rows [b * BLOCK, (b + 1) *
        BLOCK) of a (rows, width) neighbour table."""
        block = tl.program_id(0)
        i = block * BLOCK + tl.arange(0, BLOCK)
        k = tl.arange(0, WIDTH)
        ok = (i[:, None] < rows) & (k[None, :] < width)
        source = tl.load(table_ptr + i[:, None] * width + k[None, :], mask=ok, other=-1)
        tl.store(counts_ptr + k * blocks + block, tl.sum((source >= 0).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["rows", "width", "blocks"])
    def pair_lists(table_ptr, before_ptr, in_ptr, out_ptr, offset_ptr, rows, width, blocks,
                   BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """The pairs of a neighbour table by offset, each offset's by row: ``before`` (WIDTH, blocks)
        holds pair_blocks' counts summed over the blocks up to each (inclusive), so offset k's pairs start
        at the sum of the earlier offsets' totals (its last row), a block's at that plus the earlier
        blocks', a row's at that plus the block's earlier rows'."""
        block = tl.program_id(0)
        k = tl.arange(0, WIDTH)
        k_ok = k < width
        totals = tl.load(before_ptr + k * blocks + blocks - 1, mask=k_ok, other=0)
        starts = tl.cumsum(totals, axis=0) - totals
        if block == 0:
            tl.store(offset_ptr + k, starts, mask=k_ok)
            tl.store(offset_ptr + width, tl.sum(totals, axis=0))
        earlier = tl.load(before_ptr + k * blocks + tl.maximum(block - 1, 0), mask=k_ok, other=0)
        earlier = tl.where(block > 0, earlier, 0)
        i = block * BLOCK + tl.arange(0, BLOCK)
        ok = (i[:, None] < rows) & k_ok[None, :]
        source = tl.load(table_ptr + i[:, None] * width + k[None, :], mask=ok, other=-1)
        present = (source >= 0).to(tl.int64)
        at = starts[None, :].to(tl.int64) + earlier[None, :] + tl.cumsum(present, axis=0) - present
        tl.store(in_ptr + at, source.to(tl.int64), mask=present > 0)
        tl.store(out_ptr + at, (i[:, None] + k[None, :] * 0).to(tl.int64), mask=present > 0)

    return dict(row_masks=row_masks, row_masks_many=row_masks_many, orders_from_positions=orders_from_positions,
                tile_plan=tile_plan, tile_plans=tile_plans, pair_counts=pair_counts, pair_counts_many=pair_counts_many,
                pair_blocks=pair_blocks, pair_lists=pair_lists)
