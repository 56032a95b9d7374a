"""A 1x1x1 conv on the same coordinates: one matrix product, its rows padded to a size bucket on a GPU
(:mod:`sparseconv.backends.row_buckets`: cuBLAS's per-shape host cost, 7.7 ms of host time in a
91k-voxel MinkUNet inference's seven 1x1 layers before)."""

from __future__ import annotations

import torch

from ..backends.row_buckets import padded_mm, padded_reduction
from ..precision import product_dtype


def pointwise(feats: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None,
              padded: bool | None = None) -> torch.Tensor:
    """``feats @ matrix (+ bias)``: feats (N, C_in), matrix (C_in, C_out), bias (C_out,) or None, one dtype and
    device; (N, C_out). With ``padded`` (default: on CUDA) the products run on rows padded to bucketed shapes
    (:func:`~sparseconv.backends.row_buckets.padded_mm`), forward and backward; else torch's mm / addmm as they
    are (a CPU's BLAS has no per-shape host cost to save), float16 on a CPU multiplied in float32
    (:func:`~sparseconv.precision.product_dtype`)."""
    if not (feats.is_cuda if padded is None else padded):
        wide = product_dtype(feats.dtype, feats.device)
        if wide != feats.dtype:  # (autograd through the casts: backward multiplies in it too)
            return pointwise(feats.to(wide), matrix.to(wide), None if bias is None else bias.to(wide), False).to(
                feats.dtype)
        return torch.mm(feats, matrix) if bias is None else torch.addmm(bias, feats, matrix)
    return _Pointwise.apply(feats, matrix, bias)


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
            grad_matrix = padded_reduction(feats, grad)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_feats, grad_matrix, grad_bias
