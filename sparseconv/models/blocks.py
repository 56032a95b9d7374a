"""Building blocks of the sparse CNNs: conv-norm-ReLU and the residual BasicBlock."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..nn import BatchNorm, ReLU, Sequential, SparseConv3d
from ..nn.norm import fused_norm_relu
from ..tensor import SparseTensor

NormFactory = Callable[[int], nn.Module]
"""channels -> a sparse norm module, e.g. ``BatchNorm`` or ``lambda c: GroupNorm(8, c)``."""


def conv_norm_relu(
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int] = 3,
    stride: int | Sequence[int] = 1,
    transposed: bool = False,
    norm: NormFactory = BatchNorm,
    generative: bool = False,
) -> Sequential:
    """Sequential(conv without bias, norm, ReLU); the norm's shift makes a conv bias redundant."""
    conv = SparseConv3d(in_channels, out_channels, kernel_size, stride, bias=False, transposed=transposed,
                        generative=generative)
    return Sequential(conv, norm(out_channels), ReLU(inplace=True))


class BasicBlock(nn.Module):
    """ResNet basic block on the input's coordinates: two submanifold convs with norms, plus the
    input (or its 1x1x1 projection when the channel count changes), then ReLU; (N, C_in) -> (N, C_out)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int | Sequence[int] = 3, norm: NormFactory = BatchNorm
    ) -> None:
        super().__init__()
        self.conv1 = SparseConv3d(in_channels, out_channels, kernel_size, bias=False)
        self.norm1 = norm(out_channels)
        self.relu = ReLU(inplace=True)
        self.conv2 = SparseConv3d(out_channels, out_channels, kernel_size, bias=False)
        self.norm2 = norm(out_channels)
        self.shortcut = (
            None
            if in_channels == out_channels
            else Sequential(SparseConv3d(in_channels, out_channels, 1, bias=False), norm(out_channels))
        )

    def forward(self, input: SparseTensor) -> SparseTensor:
        # In inference each norm runs fused with what follows it (BatchNorm.forward_fused): the first with
        # its ReLU, the second with the sum and the ReLU; the modules run one by one otherwise.
        hidden = self.conv1(input)
        fused = fused_norm_relu(self.norm1, self.relu, hidden, made_by=self.conv1)
        hidden = self.relu(self.norm1(hidden)) if fused is None else fused
        out = self.conv2(hidden)
        skip = input if self.shortcut is None else self.shortcut(input)
        fused = fused_norm_relu(self.norm2, None, out, skip, made_by=self.conv2)
        if fused is not None:
            return fused
        out = self.norm2(out)
        return out.replace(torch.relu(out.feats + skip.feats))


def residual_stage(
    in_channels: int, out_channels: int, num_blocks: int, norm: NormFactory = BatchNorm
) -> list[nn.Module]:
    """``num_blocks`` BasicBlocks, the first one changing in_channels to out_channels."""
    return [BasicBlock(in_channels if i == 0 else out_channels, out_channels, norm=norm) for i in range(num_blocks)]


def scaled(channels: int, width: float) -> int:
    """channels * width, rounded, at least 1 (the width multiplier of the models)."""
    return max(1, round(channels * width))
