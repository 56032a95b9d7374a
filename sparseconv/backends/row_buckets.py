"""Matrix products on row counts rounded to size buckets: what keeps cuBLAS's per-shape host cost out of
products whose row counts change with every point cloud.

cuBLAS picks its algorithm per problem shape on the host, and a shape it has not met costs that
pick again: a (N, 64) x (64, 128) fp16 product took 2.3 ms of host time at a new N against 0.016 ms
at a known one (H200, torch 2.11, CUDA 13, median of 20 random N in 60k-110k). Every point cloud
brings new row counts, so a MinkUNet's seven 1x1 layers paid it in every pass, forward and backward
(7.7 ms of host time in a 91k-voxel inference), and explicit_gemm (the tuner's reference, and what a
layer runs while its kernels compile) once per kernel offset. Split into the first N rounded down to a
multiple of 1/16 to 1/32 of N and the rest padded with zero rows to one such step, the products meet
~16-32 shapes an octave (padding the whole input instead: 0.12 ms a call, the copy included, but a
copy of every input and gradient, which raised a training step's peak memory by ~0.1 GB at 91k voxels).
A gathered operand is a copy anyway: its index is padded instead (:func:`bucketed_index`).

Where Triton runs, :func:`padded_mm` is instead one launch of :func:`rows_mm`'s kernel, whose row count (and
channel counts) are runtime values: no shape is new to it, and a call costs the host one launch, where the
bucketed cuBLAS pair cost ~0.12 ms of host time a call once its shapes were known (two products, the pad, the copy
of the rest), and a first meeting of a bucket 0.2-8 ms: at 40 new row counts in 60k-110k, (N, 64) x (64, 128) fp16
met new buckets' costs over the first ~20 (H200, torch 2.11, CUDA 13, 2026-12-02).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .mask_views import fused as _triton_runs
from .triton_kernels import cdiv, defined_once, precision
from .triton_launch import launch_ready

MIN_STEP = 64
"""The smallest row bucket step (small layers: the padding is a few rows at most)."""


def row_step(n: int) -> int:
    """The row bucket step of ``n`` rows: 2**(bit_length(n) - 5), at least :data:`MIN_STEP` (1/16 to 1/32 of n)."""
    return max(MIN_STEP, 1 << max(0, n.bit_length() - 5))


def padded_mm(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ matrix (+ bias)``: (N, C_out), in two products of bucketed shapes and no copy of ``rows``: the
    first N rounded down to a multiple of :func:`row_step`, then the rest padded with zero rows to one step."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, matrix, bias)):
        # (products into ``out`` do not record autograd: a caller differentiating through this gets torch's own)
        return _product(rows, matrix, bias)
    out = rows_mm(rows, matrix, bias)
    if out is not None:
        return out
    n, step = rows.shape[0], row_step(rows.shape[0])
    head = n - n % step
    out = rows.new_empty(n, matrix.shape[1])
    if head:
        _product(rows[:head], matrix, bias, out[:head])
    if head < n:
        tail = torch.nn.functional.pad(rows[head:], (0, 0, 0, step - (n - head)))
        out[head:] = _product(tail, matrix, bias)[: n - head]
    return out


def padded_reduction(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left.T @ right`` for left (N, A), right (N, B): (A, B), N (the reduced dimension) split as
    :func:`padded_mm` splits its rows (the rest padded with zero rows on both sides)."""
    out = rows_reduction(left, right)
    if out is not None:
        return out
    n, step = left.shape[0], row_step(left.shape[0])
    head = n - n % step
    out = torch.mm(left[:head].t(), right[:head])
    if head < n:
        pad = (0, 0, 0, step - (n - head))
        out += torch.mm(torch.nn.functional.pad(left[head:], pad).t(), torch.nn.functional.pad(right[head:], pad))
    return out


def _product(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    if bias is None:
        return torch.mm(rows, matrix, out=out)
    return torch.addmm(bias, rows, matrix, out=out)


def bucketed_index(index: torch.Tensor) -> torch.Tensor:
    """``index`` (n,) padded with zeros (row 0, any valid row) to a multiple of :func:`row_step` ``(n)``: the rows it
    gathers then make a product of a bucketed shape, whose first n rows are the product of ``index``'s."""
    n = index.shape[0]
    return torch.nn.functional.pad(index, (0, -n % row_step(n)))


BLOCK_M, BLOCK_N, BLOCK_K = 128, 64, 32
"""rows_mm's tile: 128 rows x 64 output channels, the reduction 32 channels a step (fp32 accumulator: 64 registers
a lane at 4 warps)."""


def rows_mm(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``rows @ matrix (+ bias)`` by one Triton kernel whose sizes are runtime values (no per-shape host cost), fp32
    accumulation, rounded once: (N, C_out) of rows' dtype. None where it does not run (no GPU and no interpreter,
    operands it does not take, torch.compile tracing, compiling in the background): the caller multiplies.

    rows: (N, C_in) float16/bfloat16/float32 with unit column stride (a slice of rows is fine); matrix: (C_in, C_out)
    of its dtype and device, any strides (a transposed weight: dgrad); bias: (C_out,) contiguous or None."""
    if not (_takes(rows) and matrix.dim() == 2 and matrix.dtype == rows.dtype and matrix.device == rows.device
            and rows.shape[1] == matrix.shape[0]):
        return None
    if bias is not None and not (bias.dtype == rows.dtype and bias.device == rows.device and bias.is_contiguous()
                                 and bias.shape == matrix.shape[1:]):
        return None
    n, reduce, width = rows.shape[0], rows.shape[1], matrix.shape[1]
    if not reduce and n and width:
        return None  # (an empty reduction: torch's zeros, or the bias)
    out = new_output((n, width), rows)
    if not n or not width:
        return out
    grid = (cdiv(n, BLOCK_M), cdiv(width, BLOCK_N))
    if launch_ready((_kernels, "rows_mm"), grid, rows, matrix, rows if bias is None else bias, out, n, reduce, width,
                    rows.stride(0), matrix.stride(0), matrix.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                    BLOCK_K=BLOCK_K, BIAS=bias is not None, PRECISION=precision(rows.dtype)):
        return out
    return None


CHUNK = 4096
"""Rows one program of :func:`rows_reduction` sums over (a fixed split: the sum's order depends on N alone)."""


def rows_reduction(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor | None:
    """``left.T @ right`` by one Triton kernel with runtime sizes: each program sums :data:`CHUNK` rows of one
    (64, 64) tile in fp32 into its own slice of a workspace, which one torch sum adds up (no atomics: the same
    result every run) and rounds once; (A, B) of left's dtype. None where it does not run (as :func:`rows_mm`).

    left: (N, A), right: (N, B), one float dtype and device, each with unit column stride."""
    if not (_takes(left) and _takes(right) and right.dtype == left.dtype and right.device == left.device
            and right.shape[0] == left.shape[0]):
        return None
    n, a_width, b_width = left.shape[0], left.shape[1], right.shape[1]
    if not (n and a_width and b_width):
        return None  # (torch's zeros)
    splits = cdiv(n, CHUNK)
    partial = left.new_empty((splits, a_width, b_width), dtype=torch.float32)
    grid = (cdiv(a_width, BLOCK_N), cdiv(b_width, BLOCK_N), splits)
    if not launch_ready((_kernels, "rows_reduction"), grid, left, right, partial, n, a_width, b_width, left.stride(0),
                        right.stride(0), CHUNK, BLOCK=BLOCK_N, BLOCK_R=BLOCK_K, PRECISION=precision(left.dtype)):
        return None
    return (partial[0] if splits == 1 else partial.sum(0)).to(left.dtype)


def _takes(rows: torch.Tensor) -> bool:
    """Whether the kernels take ``rows`` as a (N, C) operand: a float dtype, unit column stride, on a device
    they run on (bfloat16 on a GPU only: the interpreter's numpy has none), outside torch.compile's tracing."""
    return (not torch.compiler.is_compiling() and rows.dim() == 2 and rows.dtype in _DTYPES
            and (rows.shape[0] <= 1 or rows.stride(1) == 1) and _triton_runs(rows)
            and (rows.dtype != torch.bfloat16 or rows.is_cuda))


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def new_output(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """rows_mm's output, uninitialised (every element is stored by the kernel; the tests poison it here)."""
    return like.new_empty(shape)


@defined_once
def _kernels() -> SimpleNamespace:
    """The kernels, defined on first use (importing sparseconv never imports Triton)."""
    import triton
    import triton.language as tl

    # The row count is not specialised on (a point cloud's every size would be another compile); the channel
    # counts and strides are (multiples of 16 in a network, the loads vectorise).
    @triton.jit(do_not_specialize=["rows"])
    def rows_mm(a_ptr, w_ptr, bias_ptr, out_ptr, rows, reduce, width, stride_a, stride_wk, stride_wn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIAS: tl.constexpr,
                PRECISION: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = row < rows, col < width
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, reduce, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < reduce
            a = tl.load(a_ptr + row[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + k[:, None] * stride_wk + col[None, :] * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if BIAS:
            acc += tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + row[:, None] * width + col[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["rows"])
    def rows_reduction(l_ptr, r_ptr, partial_ptr, rows, l_width, r_width, stride_l, stride_r, chunk,
                       BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        i_ok, j_ok = i < l_width, j < r_width
        first = tl.program_id(2).to(tl.int64) * chunk
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for start in range(0, tl.minimum(chunk, rows - first), BLOCK_R):  # the last split: its rows only
            row = first + start + tl.arange(0, BLOCK_R)
            row_ok = row < rows
            lt = tl.load(l_ptr + row[:, None] * stride_l + i[None, :], mask=row_ok[:, None] & i_ok[None, :], other=0.0)
            rt = tl.load(r_ptr + row[:, None] * stride_r + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(lt), rt, acc, input_precision=PRECISION)
        at = tl.program_id(2).to(tl.int64) * l_width * r_width + i[:, None] * r_width + j[None, :]
        tl.store(partial_ptr + at, acc, mask=i_ok[:, None] & j_ok[None, :])

    return SimpleNamespace(rows_mm=rows_mm, rows_reduction=rows_reduction)
