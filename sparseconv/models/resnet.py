"""SparseResNetBackbone: the sparse residual backbone of voxel-based LiDAR 3D detectors
(SECOND / PV-RCNN's VoxelResBackBone8x shape), with multi-scale outputs and a dense BEV map."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..nn import BatchNorm, Sequential
from ..tensor import SparseTensor
from .blocks import NormFactory, conv_norm_relu, residual_stage


@dataclass(frozen=True)
class BackboneOutput:
    """What SparseResNetBackbone returns.

    stages: one SparseTensor per stage (strides 1, 2, 4, 8 with the default channels 16 / 32 / 64 / 128);
    out: the output of the height-reducing conv; bev: (B, C * D, A, B') float, ``out`` made dense
    with its D cells along the height axis folded into channels (channel-major, as in
    OpenPCDet's HeightCompression) and the two other axes kept in x, y, z order.
    """

    stages: tuple[SparseTensor, ...]
    out: SparseTensor
    bev: torch.Tensor


class SparseResNetBackbone(nn.Module):
    """Sparse ResNet for voxelised LiDAR: SparseTensor (N, in_channels) -> BackboneOutput.

    A submanifold stem conv, then a stage per entry of ``channels``: the first keeps the input's
    coordinates, every later one starts with a k3/s2 conv; each has ``blocks`` submanifold
    residual blocks. Last, a conv of kernel 3 and stride 2 along the height axis only (spconv
    and OpenPCDet write it ``(3, 1, 1)`` / ``(2, 1, 1)`` in their z, y, x order) and the BEV map.

    height_axis: which of x, y, z (0, 1, 2) is up. grid_shape, grid_origin: the voxel grid of the
    input (voxel counts along x, y, z and the voxel at its corner, as the point-cloud range / voxel
    size of a detector) fix the BEV map's size; without them it just covers each batch.
    generative_down: the strided convs (the stages' and the height conv) make every coarse voxel whose
    window holds an input, as spconv's and OpenPCDet's ``SparseConv3d`` with padding ``k // 2`` do (the
    output grows by the kernel's reach), instead of keeping the floors of the input's voxels.
    """

    def __init__(
        self,
        in_channels: int,
        channels: Sequence[int] = (16, 32, 64, 128),
        blocks: int | Sequence[int] = 2,
        out_channels: int = 128,
        height_axis: int = 2,
        grid_shape: Sequence[int] | None = None,
        grid_origin: Sequence[int] = (0, 0, 0),
        norm: NormFactory = BatchNorm,
        generative_down: bool = False,
    ) -> None:
        super().__init__()
        blocks = [blocks] * len(channels) if isinstance(blocks, int) else list(blocks)
        if len(blocks) != len(channels) or not channels:
            raise ValueError(f"blocks must be an int or have one entry per stage ({len(channels)}), got {blocks!r}")
        if height_axis not in (0, 1, 2):
            raise ValueError(f"height_axis must be 0 (x), 1 (y) or 2 (z), got {height_axis!r}")
        if grid_shape is not None and (len(grid_shape) != 3 or min(grid_shape) < 1):
            raise ValueError(f"grid_shape must be 3 positive voxel counts (x, y, z), got {grid_shape!r}")
        if len(grid_origin) != 3:
            raise ValueError(f"grid_origin must be 3 ints (x, y, z), got {grid_origin!r}")
        self.height_axis = height_axis
        self.grid_shape = None if grid_shape is None else tuple(int(v) for v in grid_shape)
        self.grid_origin = tuple(int(v) for v in grid_origin)
        self.stem = conv_norm_relu(in_channels, channels[0], 3, norm=norm)
        self.stages = nn.ModuleList()
        c = channels[0]
        for i, (out, depth) in enumerate(zip(channels, blocks)):
            down = [] if i == 0 else [conv_norm_relu(c, out, 3, 2, norm=norm, generative=generative_down)]
            self.stages.append(Sequential(*down, *residual_stage(out, out, depth, norm)))
            c = out
        kernel = tuple(3 if axis == height_axis else 1 for axis in range(3))
        stride = tuple(2 if axis == height_axis else 1 for axis in range(3))
        self.height_conv = conv_norm_relu(c, out_channels, kernel, stride, norm=norm, generative=generative_down)

    def forward(self, input: SparseTensor) -> BackboneOutput:
        x = self.stem(input)
        stages = []
        for stage in self.stages:
            x = stage(x)
            stages.append(x)
        out = self.height_conv(x)
        return BackboneOutput(tuple(stages), out, self.bev(out))

    def bev(self, tensor: SparseTensor) -> torch.Tensor:
        """(B, C * D, A, B') dense bird's-eye map of ``tensor``, height cells folded into channels."""
        origin, shape = self._dense_box(tensor)
        dense = tensor.dense(shape, origin)
        b, c = dense.shape[:2]
        dense = dense.movedim(2 + self.height_axis, 2)
        return dense.reshape(b, c * dense.shape[2], *dense.shape[3:])

    def _dense_box(self, tensor: SparseTensor) -> tuple[list[int], list[int]]:
        """Origin (voxels, a multiple of the stride) and shape (cells) of the dense grid."""
        stride = tensor.stride
        if self.grid_shape is not None:
            lo, hi = self.grid_origin, [o + n - 1 for o, n in zip(self.grid_origin, self.grid_shape)]
        elif len(tensor):
            lo, hi = torch.stack(torch.aminmax(tensor.coords[:, 1:], dim=0)).tolist()  # one read of the device
        else:
            lo = hi = [0, 0, 0]
        first = [v // s for v, s in zip(lo, stride)]
        last = [v // s for v, s in zip(hi, stride)]
        return [f * s for f, s in zip(first, stride)], [b - a + 1 for a, b in zip(first, last)]
