"""Triton kernels of the fused backends, defined on first use (importing sparseconv never imports Triton).

Three kernels, each computing one tile of a gather-GEMM(-scatter) with fp32 accumulation (and
those that build views of a map: the mask kernels' ``row_masks`` and ``tile_plan(s)``, one launch
each where torch needed about ten ops, and the pair lists, ``pair_blocks`` and ``pair_lists``):

- ``rows_gemm``: output-stationary. Each program owns BLOCK_M output rows x BLOCK_N columns and
  runs one pipelined loop over (offset, channel block), gathering its rows' neighbours; no
  atomics, deterministic. It visits only the offsets some row of its tile uses (a per-tile list
  built on the host, with the tile's gather rows per listed offset laid out contiguously), which
  is why rows are sorted by neighbour mask. With ACCUMULATE it adds to
  the output instead (a later group of offsets, its rows sorted by that group's mask).
- ``pairs_gemm``: pair-stationary. Each program takes BLOCK_P (gather, scatter) pairs of one
  offset, multiplies and atomically adds into an fp32 output (or, where every output row has
  one pair in the whole map, stores straight into the output dtype: ATOMIC=False).
- ``pairs_wgrad``: dW_k = A[in_k]^T B[out_k] over the pairs of offset k, split SPLIT ways along
  the pairs (split-K); splits meet through fp32 atomics in a workspace the last split stores
  from (in dW's dtype) and leaves zeroed; one split stores dW directly.

The weight is addressed through strides, so dgrad reads W_k^T without a copy. Their launches:
:mod:`.triton_launch`.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from .. import config


_DEFINED: SimpleNamespace | None = None
_LOCK = threading.Lock()


def kernels() -> SimpleNamespace:
    """The @triton.jit kernels, defined once per process. Thread-safe: the tuner compiles them on
    several threads at once, and a second definition (functools.cache does not lock) would take
    the kernels one thread compiled away from the others."""
    global _DEFINED
    if _DEFINED is None:
        with _LOCK:
            if _DEFINED is None:
                _DEFINED = _define()
    return _DEFINED


def _define() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_dot(acc, a_ptr, w_ptr, idx, k, ck, ck_ok, cols, col_ok, reduce_dim, stride_wk, stride_wr, stride_wo,
                    PRECISION: tl.constexpr):
        """``acc`` plus the rows ``idx`` of A (-1: none) times W_k, over the reduce columns ``ck``."""
        src = idx.to(tl.int64) * reduce_dim
        a = tl.load(a_ptr + src[:, None] + ck[None, :], mask=(idx >= 0)[:, None] & ck_ok[None, :], other=0.0)
        w = tl.load(
            w_ptr + k * stride_wk + ck[:, None] * stride_wr + cols[None, :] * stride_wo,
            mask=ck_ok[:, None] & col_ok[None, :], other=0.0,
        )
        return acc + tl.dot(a, w, input_precision=PRECISION)

    globals().update(_gather_dot=_gather_dot)  # found by the interpreter (see _entry's)

    # Row counts, list lengths and view offsets change with every point cloud: not specialised on
    # (Triton would compile a second binary whenever one turns divisible by 16), channels and
    # strides are, since vector loads need them.
    @triton.jit(do_not_specialize=["n_rows", "list_len"])
    def rows_gemm(
        a_ptr, w_ptr, slots_ptr, rows_ptr, active_ptr, count_ptr, out_ptr,
        n_rows, reduce_dim, out_dim, list_len,
        stride_wk, stride_wr, stride_wo,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):
        # Column tiles of one row tile are neighbours in launch order, so they share its gathers in L2.
        tiles_n = tl.cdiv(out_dim, BLOCK_N)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        lanes = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < out_dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The tile's gather rows, offset after offset, are BLOCK_M consecutive int32 each (-1 = none),
        # list_len slots a tile: a coalesced load whose address needs only the loop counter, so the
        # pipeliner puts it one stage ahead of the gather it feeds instead of two (the offset's id,
        # then the row's entry).
        slots = slots_ptr + pid_m.to(tl.int64) * list_len * BLOCK_M + lanes
        # One pipelined loop over (active offset, channel block): no pipeline drain between offsets.
        k_tiles = tl.cdiv(reduce_dim, BLOCK_K)
        steps = tl.load(count_ptr + pid_m) * k_tiles
        for t in range(0, steps):
            j = t // k_tiles
            ck = (t - j * k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
            ck_ok = ck < reduce_dim
            idx = tl.load(slots + j * BLOCK_M)
            k = tl.load(active_ptr + pid_m * list_len + j)
            acc = _gather_dot(acc, a_ptr, w_ptr, idx, k, ck, ck_ok, cols, col_ok, reduce_dim, stride_wk, stride_wr,
                              stride_wo, PRECISION)
        slot = pid_m * BLOCK_M + lanes
        slot_ok = slot < n_rows
        rows = tl.load(rows_ptr + slot, mask=slot_ok, other=0).to(tl.int64)
        out = out_ptr + rows[:, None] * out_dim + cols[None, :]
        out_ok = slot_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:  # a later offset group: add to the rows the earlier groups wrote
            if steps > 0:
                acc += tl.load(out, mask=out_ok, other=0.0).to(tl.float32)
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_ok)

    # rows_gemm without a tile plan: a tile is BLOCK_M rows of the neighbour table, consecutive or in the
    # order ``order_ptr`` gives (ORDERED), and the offsets it visits are found from its table rows (a map
    # serving one product: no plan to build first). One offset group, every row stored.
    @triton.jit(do_not_specialize=["n_rows"])
    def table_gemm(
        a_ptr, w_ptr, table_ptr, order_ptr, out_ptr,
        n_rows, reduce_dim, out_dim, width,
        stride_wk, stride_wr, stride_wo,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH: tl.constexpr,
        PRECISION: tl.constexpr, ORDERED: tl.constexpr,
    ):
        tiles_n = tl.cdiv(out_dim, BLOCK_N)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = slots < n_rows
        if ORDERED:
            rows = tl.load(order_ptr + slots, mask=row_ok, other=0).to(tl.int64)
        else:
            rows = slots.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < out_dim
        entries = table_ptr + rows * width  # each row's table entries (row stride = width)
        # The offsets some row of the tile has, and each one's place in the tile's list of them.
        j = tl.arange(0, WIDTH)
        tile = tl.load(entries[:, None] + j[None, :], mask=row_ok[:, None] & (j < width)[None, :], other=-1)
        used = (tl.max(tile, axis=0) >= 0).to(tl.int32)
        place = tl.where(used > 0, tl.cumsum(used, axis=0) - 1, -1)
        k_tiles = tl.cdiv(reduce_dim, BLOCK_K)
        steps = tl.sum(used, axis=0) * k_tiles
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(0, steps):
            s = t // k_tiles
            k = tl.sum(tl.where(place == s, j, 0), axis=0)  # the tile's s-th used offset
            ck = (t - s * k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
            ck_ok = ck < reduce_dim
            idx = tl.load(entries + k, mask=row_ok, other=-1)  # in L1 since the tile's load
            acc = _gather_dot(acc, a_ptr, w_ptr, idx, k, ck, ck_ok, cols, col_ok, reduce_dim, stride_wk, stride_wr,
                              stride_wo, PRECISION)
        out = out_ptr + rows[:, None] * out_dim + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def pairs_gemm(
        a_ptr, w_ptr, gather_ptr, scatter_ptr, offset_ptr, out_ptr,
        reduce_dim, out_dim,
        stride_wk, stride_wr, stride_wo,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
    ):
        k = tl.program_id(0)
        pid_p = tl.program_id(1)
        pid_n = tl.program_id(2)
        start = tl.load(offset_ptr + k)
        end = tl.load(offset_ptr + k + 1)
        first = start + pid_p * BLOCK_P
        if first < end:
            p = first + tl.arange(0, BLOCK_P)
            p_ok = p < end
            src = tl.load(gather_ptr + p, mask=p_ok, other=0).to(tl.int64) * reduce_dim
            dst = tl.load(scatter_ptr + p, mask=p_ok, other=0).to(tl.int64) * out_dim
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < out_dim
            acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
            for c0 in range(0, reduce_dim, BLOCK_K):
                ck = c0 + tl.arange(0, BLOCK_K)
                ck_ok = ck < reduce_dim
                a = tl.load(a_ptr + src[:, None] + ck[None, :], mask=p_ok[:, None] & ck_ok[None, :], other=0.0)
                w = tl.load(
                    w_ptr + k * stride_wk + ck[:, None] * stride_wr + cols[None, :] * stride_wo,
                    mask=ck_ok[:, None] & col_ok[None, :], other=0.0,
                )
                acc += tl.dot(a, w, input_precision=PRECISION)
            target = out_ptr + dst[:, None] + cols[None, :]
            if ATOMIC:
                tl.atomic_add(target, acc, mask=p_ok[:, None] & col_ok[None, :])
            else:  # every output row has this one pair: a plain store in the output dtype
                tl.store(target, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & col_ok[None, :])

    @triton.jit
    def pairs_wgrad(
        a_ptr, b_ptr, in_ptr, out_idx_ptr, offset_ptr, dw_ptr, sum_ptr, ticket_ptr,
        c_in, c_out, split,
        BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
    ):
        k = tl.program_id(0)
        pid_mn = tl.program_id(1)
        s = tl.program_id(2)
        tiles_n = tl.cdiv(c_out, BLOCK_N)
        rm = (pid_mn // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pid_mn % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm_ok = rm < c_in
        rn_ok = rn < c_out
        start = tl.load(offset_ptr + k)
        end = tl.load(offset_ptr + k + 1)
        chunk = tl.cdiv(tl.cdiv(end - start, split), BLOCK_P) * BLOCK_P
        lo = start + s * chunk
        hi = tl.minimum(lo + chunk, end)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p0 in range(lo, hi, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_ok = p < hi
            src = tl.load(in_ptr + p, mask=p_ok, other=0).to(tl.int64) * c_in
            dst = tl.load(out_idx_ptr + p, mask=p_ok, other=0).to(tl.int64) * c_out
            a = tl.load(a_ptr + src[:, None] + rm[None, :], mask=p_ok[:, None] & rm_ok[None, :], other=0.0)
            b = tl.load(b_ptr + dst[:, None] + rn[None, :], mask=p_ok[:, None] & rn_ok[None, :], other=0.0)
            acc += tl.dot(tl.trans(a), b, input_precision=PRECISION)
        at = k * c_in * c_out + rm[:, None] * c_out + rn[None, :]
        ok = rm_ok[:, None] & rn_ok[None, :]
        if ATOMIC:
            # The splits add into a zeroed fp32 sum; the last of them to finish (a ticket per
            # (offset, tile)) reads the sum where the atomics left it (an atomic add of zero: from
            # L2, never a stale cache line), stores it in dW's dtype, and zeroes the sum and the
            # ticket for the next launch. No zero fill, no cast pass.
            tl.atomic_add(sum_ptr + at, acc, mask=ok)
            tl.debug_barrier()  # every thread's adds before the ticket (which one thread takes)
            ticket = tl.atomic_add(ticket_ptr + k * tl.num_programs(1) + pid_mn, 1, sem="acq_rel")
            tl.debug_barrier()
            if ticket == split - 1:
                none = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total = tl.atomic_add(sum_ptr + at, none, mask=ok)
                tl.store(dw_ptr + at, total.to(dw_ptr.dtype.element_ty), mask=ok)
                tl.store(sum_ptr + at, none, mask=ok)
                tl.atomic_xchg(ticket_ptr + k * tl.num_programs(1) + pid_mn, 0)
        else:  # every (offset, tile) program stores, pairs or none: dW in its own dtype, no zero fill
            tl.store(dw_ptr + at, acc.to(dw_ptr.dtype.element_ty), mask=ok)

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
        int32 part of the plan's buffer that holds the used flags' bytes (:func:`mask_views._plan_views`)."""
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

    return SimpleNamespace(triton=triton, rows_gemm=rows_gemm, table_gemm=table_gemm, pairs_gemm=pairs_gemm,
                           pairs_wgrad=pairs_wgrad, row_masks=row_masks, tile_plan=tile_plan, tile_plans=tile_plans,
                           orders_from_positions=orders_from_positions,
                           pair_blocks=pair_blocks, pair_lists=pair_lists, row_masks_many=row_masks_many,
                           pair_counts=pair_counts, pair_counts_many=pair_counts_many)



def unsupported(problem) -> str | None:
    """Why the Triton backends cannot run ``problem``, or None."""
    if problem.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"Triton kernels take float16, bfloat16 or float32, not {problem.dtype}"
    if problem.device.type != "cuda" and not config.triton_interpret():
        return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them on the CPU)"
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed ({error})"
    return None


def pool_on(problem, level: str, space: tuple, auto: list) -> list:
    """On the CPU (the interpreter) Triton candidates are never timed; pins still run them."""
    if problem.device.type != "cuda":
        return []
    if level == "trimmed":  # the auto sets, then the first half of the space
        return list({_params_id(p): p for p in [*auto, *space[: len(space) // 2 + 1]]}.values())
    return auto if level == "auto" else list(space)


def _params_id(params) -> tuple:
    return tuple(sorted(params.items()))


def launch_options(params) -> dict:
    return {"num_warps": int(params.get("num_warps", 4)), "num_stages": int(params.get("num_stages", 3))}


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: tf32 for fp32 only where torch allows it, else exact."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee" if dtype == torch.float64 else "tf32"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids on the host: ``triton.cdiv`` is a constexpr function in recent Triton
    (3.9), whose call from Python goes through Triton's function wrapper (the launches of a new map's
    products compute ~100 grids a step)."""
    return -(-a // b)
