"""Pooling: local max / average on the convolution's kernel maps, and global pooling to (B, C)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._args import triple
from ..tensor import SparseTensor
from . import functional as F


class _Pool3d(nn.Module):
    def __init__(self, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None) -> None:
        super().__init__()
        self.kernel_size = triple(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else triple(stride, "stride")

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


class SparseMaxPool3d(_Pool3d):
    """Max over the occupied cells of each window (:func:`sparseconv.nn.functional.max_pool3d`);
    stride defaults to kernel_size; output coordinates are those of the conv of that geometry."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.max_pool3d(input, self.kernel_size, self.stride)


class SparseAvgPool3d(_Pool3d):
    """Mean over the occupied cells of each window (:func:`sparseconv.nn.functional.avg_pool3d`):
    empty cells do not count, unlike dense avg_pool3d."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.avg_pool3d(input, self.kernel_size, self.stride)


class GlobalAvgPool(nn.Module):
    """Mean over each batch element's voxels: SparseTensor (N, C) -> (B, C) tensor."""

    def forward(self, input: SparseTensor, batch_size: int | None = None) -> torch.Tensor:
        return F.global_avg_pool(input, batch_size)


class GlobalMaxPool(nn.Module):
    """Max over each batch element's voxels: SparseTensor (N, C) -> (B, C) tensor."""

    def forward(self, input: SparseTensor, batch_size: int | None = None) -> torch.Tensor:
        return F.global_max_pool(input, batch_size)
