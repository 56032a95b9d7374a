"""Modules that act on features alone and keep the coordinates: activations, norms, any torch module."""

from __future__ import annotations

from torch import nn

from ..tensor import SparseTensor


class Features(nn.Module):
    """Apply any torch module to the (N, C) features of a SparseTensor, keeping its coordinates."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(self.module(input.feats))


class ReLU(Features):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__(nn.ReLU(inplace=inplace))


class BatchNorm(nn.BatchNorm1d):
    """BatchNorm over the features of all voxels of the batch: feats (N, C)."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(super().forward(input.feats))


class Sequential(nn.Sequential):
    """nn.Sequential of modules that take and return SparseTensors."""
