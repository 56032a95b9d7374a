"""MinkUNet: the residual sparse U-Net used for LiDAR (SemanticKITTI) and indoor (ScanNet)
semantic segmentation, with MinkowskiEngine's MinkUNet14 / 18 / 34 presets."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..nn import BatchNorm, Sequential, SparseConv3d, cat
from ..tensor import SparseTensor
from .blocks import NormFactory, conv_norm_relu, residual_stage, scaled

PLANES = (32, 64, 128, 256, 256, 128, 96, 96)


class MinkUNet(nn.Module):
    """Per-voxel classifier: SparseTensor (N, in_channels) -> (N, num_classes) on the input's coordinates.

    A stem conv, four encoder stages (a k2/s2 conv then residual blocks, strides 2, 4, 8, 16) and
    four decoder stages (a k2/s2 transposed conv back onto the encoder's coordinates, channel
    concatenation with the encoder output of that stride, residual blocks), then a 1x1x1 conv.
    blocks: residual blocks per stage (4 encoder + 4 decoder); planes: their channels; width
    multiplies every channel count (0.5 halves the model's width); stem_convs: conv-norm-ReLUs in
    the stem (TorchSparse's MinkUNet has two of kernel 3). The input must be the tensor
    built from the coordinates (or a conv of it at stride 1) so that the decoder lands on it.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        blocks: Sequence[int] = (2,) * 8,
        planes: Sequence[int] = PLANES,
        stem_channels: int = 32,
        width: float = 1.0,
        stem_kernel_size: int = 5,
        norm: NormFactory = BatchNorm,
        stem_convs: int = 1,
    ) -> None:
        super().__init__()
        if len(blocks) != 8 or len(planes) != 8:
            raise ValueError(
                "blocks and planes must have 8 entries (4 encoder + 4 decoder stages), got "
                f"{len(blocks)} and {len(planes)}"
            )
        if not width > 0:
            raise ValueError(f"width must be > 0, got {width!r}")
        if isinstance(stem_convs, bool) or not isinstance(stem_convs, int) or stem_convs < 1:
            raise ValueError(f"stem_convs must be an int >= 1, got {stem_convs!r}")
        stem = scaled(stem_channels, width)
        planes = [scaled(c, width) for c in planes]
        self.stem = Sequential(*(layer for i in range(stem_convs)
                                 for layer in conv_norm_relu(in_channels if i == 0 else stem, stem, stem_kernel_size, norm=norm)))
        self.encoder = nn.ModuleList()
        channels = [stem]
        for depth, out in zip(blocks[:4], planes[:4]):
            c = channels[-1]
            self.encoder.append(Sequential(conv_norm_relu(c, c, 2, 2, norm=norm), *residual_stage(c, out, depth, norm)))
            channels.append(out if depth else c)
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        c = channels[-1]
        for depth, out, skip in zip(blocks[4:], planes[4:], reversed(channels[:-1])):
            self.up.append(conv_norm_relu(c, out, 2, 2, transposed=True, norm=norm))
            self.decoder.append(Sequential(*residual_stage(out + skip, out, depth, norm)))
            c = out if depth else out + skip
        self.head = SparseConv3d(c, num_classes, 1)

    def forward(self, input: SparseTensor) -> SparseTensor:
        skips = [self.stem(input)]
        for stage in self.encoder:
            skips.append(stage(skips[-1]))
        out = skips.pop()
        for up, stage in zip(self.up, self.decoder):
            out = stage(cat(up(out), skips.pop()))
        return self.head(out)


class MinkUNet14(MinkUNet):
    """MinkUNet with one residual block per stage."""

    def __init__(self, in_channels: int, num_classes: int, **kwargs) -> None:
        super().__init__(in_channels, num_classes, blocks=(1,) * 8, **kwargs)


class MinkUNet18(MinkUNet):
    """MinkUNet with two residual blocks per stage."""

    def __init__(self, in_channels: int, num_classes: int, **kwargs) -> None:
        super().__init__(in_channels, num_classes, blocks=(2,) * 8, **kwargs)


class MinkUNet34(MinkUNet):
    """MinkUNet with (2, 3, 4, 6) encoder and (2, 2, 2, 2) decoder residual blocks."""

    def __init__(self, in_channels: int, num_classes: int, **kwargs) -> None:
        super().__init__(in_channels, num_classes, blocks=(2, 3, 4, 6, 2, 2, 2, 2), **kwargs)
