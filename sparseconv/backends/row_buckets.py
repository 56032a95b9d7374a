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
"""

from __future__ import annotations

import torch

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
