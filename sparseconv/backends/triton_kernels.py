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

import functools
import threading
from collections.abc import Callable
from types import SimpleNamespace

import torch

from .. import config
from . import triton_view_kernels


def defined_once(define: Callable[[], SimpleNamespace]) -> Callable[[], SimpleNamespace]:
    """``define`` (a module's @triton.jit kernels) called once per process, its namespace returned ever after.
    Thread-safe: the tuner and the background compiles' loaders compile kernels on several threads at once, and a
    second definition (functools.cache does not lock) would take the kernels one thread compiled away from the
    others. The wrapper keeps ``define``'s name: a compile worker looks the kernels up through it."""
    lock, held = threading.Lock(), []

    @functools.wraps(define)
    def kernels() -> SimpleNamespace:
        if not held:
            with lock:
                if not held:
                    held.append(define())
        return held[0]

    return kernels


@defined_once
def kernels() -> SimpleNamespace:
    """The @triton.jit kernels of the fused backends and of the map views."""
    return _define()


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

    views = triton_view_kernels.define(triton, tl)  # the kernels that build views of a map

    return SimpleNamespace(triton=triton, rows_gemm=rows_gemm, table_gemm=table_gemm, pairs_gemm=pairs_gemm,
                           pairs_wgrad=pairs_wgrad, **views)



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
