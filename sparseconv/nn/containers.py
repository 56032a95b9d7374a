"""Containers and conversions: Sequential, ToDense."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..tensor import SparseTensor
from .features import features_of
from .norm import fused_norm_relu


class Sequential(nn.Sequential):
    """nn.Sequential of modules that take and return SparseTensors.

    In inference, a :class:`BatchNorm` followed by a :class:`ReLU` runs as one pass
    (:meth:`BatchNorm.forward_fused`), unless a hook watches the ReLU; after a conv of this container no
    hook watches, in place on the conv's output."""

    def forward(self, input):
        modules = tuple(self._modules.values())
        last, at = len(modules) - 1, 0
        while at <= last:
            module = modules[at]
            made_by = modules[at - 1] if at else None  # this pass's own intermediate, or the caller's input
            fused = fused_norm_relu(module, modules[at + 1], input, made_by=made_by) if at < last else None
            if fused is not None:
                input, at = fused, at + 2
                continue
            input = module(input)
            at += 1
        return input


class ToDense(nn.Module):
    """SparseTensor -> (B, C, X, Y, Z) dense grid at the tensor's stride (see SparseTensor.dense).

    shape, origin: fixed grid size in cells and the voxel at cell 0 (a multiple of the stride);
    by default the grid starts at voxel 0 and just covers the batch.
    """

    def __init__(self, shape: Sequence[int] | None = None, origin: Sequence[int] | None = None) -> None:
        super().__init__()
        self.shape = None if shape is None else tuple(shape)
        self.origin = None if origin is None else tuple(origin)

    def forward(self, input: SparseTensor) -> torch.Tensor:
        features_of(input, self)
        return input.dense(self.shape, self.origin)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, origin={self.origin}"
