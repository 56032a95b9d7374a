"""A 1x1x1 conv on the same coordinates: one matrix product, its rows padded to a size bucket on a GPU.

cuBLAS picks its algorithm per problem shape on the host, and a shape it has not met costs that
pick again: a (N, 64) x (64, 128) fp16 product took 2.3 ms of host time at a new N against 0.016 ms
at a known one (H200, torch 2.11, CUDA 13, median of 20 random N in 60k-110k). Every point cloud
brings new row counts, so a MinkUNet's seven 1x1 layers paid it in every pass, forward and backward
(7.7 ms of host time in a 91k-voxel inference). Padded with zero rows to a multiple of 1/16 to 1/32
of N, the products meet at most ~20 shapes an octave: 0.12 ms a call, the pad's copy included.
Only the forward's and backward's transient copies are padded: the saved input is the layer's own.
"""

from __future__ import annotations

import torch

MIN_STEP = 64
"""The smallest row bucket step (small layers: the padding is a few rows at most)."""


def bucket_rows(n: int) -> int:
    """``n`` rounded up to a multiple of 2**(bit_length(n) - 5) (at least :data:`MIN_STEP`): at most
    ~6% of padding, ~16-32 buckets an octave."""
    step = max(MIN_STEP, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


def pointwise(feats: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None,
              padded: bool | None = None) -> torch.Tensor:
    """``feats @ matrix (+ bias)``: feats (N, C_in), matrix (C_in, C_out), bias (C_out,) or None, one dtype and
    device; (N, C_out). With ``padded`` (default: on CUDA) the products run on rows padded to
    :func:`bucket_rows`, forward and backward; else torch's mm / addmm as they are (a CPU's BLAS has no
    per-shape host cost to save)."""
    if not (feats.is_cuda if padded is None else padded):
        return torch.mm(feats, matrix) if bias is None else torch.addmm(bias, feats, matrix)
    return _Pointwise.apply(feats, matrix, bias)


def padded_mm(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ matrix (+ bias)`` computed on ``rows`` padded with zero rows to :func:`bucket_rows`; (N, C_out)."""
    n = rows.shape[0]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, bucket_rows(n) - n))
    out = torch.mm(padded, matrix) if bias is None else torch.addmm(bias, padded, matrix)
    return out[:n]


class _Pointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feats: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(feats, matrix)
        ctx.has_bias = bias is not None
        return padded_mm(feats, matrix, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        feats, matrix = ctx.saved_tensors
        grad_feats = grad_matrix = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_feats = padded_mm(grad, matrix.t())
        if ctx.needs_input_grad[1]:
            # (C_in, N) x (N, C_out): N is the reduced dimension, padded on both sides with zero rows
            n = feats.shape[0]
            pad = (0, 0, 0, bucket_rows(n) - n)
            grad_matrix = torch.mm(torch.nn.functional.pad(feats, pad).t(), torch.nn.functional.pad(grad, pad))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_feats, grad_matrix, grad_bias
