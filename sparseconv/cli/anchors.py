"""The speed anchors the benchmarks compare with: spconv 2.x and spconv-triton (one API), how our
coordinates become their input, and the benchmark networks written in their API.

Importing this module imports neither spconv nor spconv-triton: :func:`import_anchor` does, when asked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["ALIGN", "IN_CHANNELS", "NUM_CLASSES", "AnchorBackbone", "AnchorBlock", "AnchorMinkUNet", "anchor_cbr",
           "anchor_tensor", "import_anchor", "shifted_coords", "spatial_shape", "subm_maps"]

NUM_CLASSES = 20
IN_CHANNELS = 4

def import_anchor(name: str) -> Any:
    """``spconv.pytorch`` (``name`` "spconv") or ``spconv_triton.pytorch``, or an 'n/a (...)' string when it
    does not import."""
    try:
        if name == "spconv":
            import spconv.pytorch as module
        else:
            import spconv_triton.pytorch as module
        return module
    except Exception as error:  # noqa: BLE001 - an anchor that does not import is reported as n/a
        return f"n/a ({type(error).__name__})"


ALIGN = 64
"""The anchors' coordinates are shifted by a multiple of this (every stride the benchmarks' networks
reach divides it), so their strided convs floor onto the same coarse voxels as ours."""


def shifted_coords(coords: torch.Tensor) -> torch.Tensor:
    """``coords`` [batch, x, y, z] moved to non-negative x, y, z by a multiple of :data:`ALIGN` per axis.

    Shifting by the minimum instead moved the 2x2x2 grid whenever a minimum was odd: on street4
    (z from -1) spconv's stride-2 set had 187,992 voxels where ours, the floors of the same
    coordinates, had 225,412 (17% fewer, and fewer still at the coarser levels): a different,
    smaller network to time and to measure memory on.
    """
    shifted = coords.clone()
    low = shifted[:, 1:].amin(0)
    shifted[:, 1:] -= torch.div(low, ALIGN, rounding_mode="floor") * ALIGN
    return shifted


def spatial_shape(shifted: torch.Tensor) -> list[int]:
    """The anchor's spatial shape for non-negative ``shifted`` coordinates: per axis, the smallest
    multiple of :data:`ALIGN` above the largest coordinate.

    A k2 s2 conv's output shape is ``(S - 2) // 2 + 1``, and the anchor drops the outputs beyond
    it. With one spare cell (``max + 2``, until 2026-11-26) an odd level shape cut the floors of the
    largest coordinates at the next level: room2's stride-4 / 8 / 16 sets had 59,557 / 13,303 / 2,502
    voxels where ours (every floor) had 63,740 / 16,119 / 3,897, a smaller network to time and to
    measure memory on. A multiple of ALIGN halves exactly down to stride ALIGN.
    """
    top = shifted[:, 1:].amax(0) + 1
    return (torch.div(top + ALIGN - 1, ALIGN, rounding_mode="floor") * ALIGN).tolist()


def anchor_tensor(spc: Any, coords: torch.Tensor, feats: torch.Tensor) -> Any:
    """Our [batch, x, y, z] coordinates (:func:`shifted_coords`) as the anchor's SparseConvTensor.

    The spatial shape is :func:`spatial_shape`'s: every coarse voxel of every level stays inside it.
    """
    shifted = shifted_coords(coords)
    shape = spatial_shape(shifted)
    return spc.SparseConvTensor(feats, shifted.int(), shape, int(coords[:, 0].max()) + 1)


def subm_maps(out: Any) -> dict:
    """The submanifold maps of a spconv pass, kept for the next one (spconv reuses only those)."""
    return {key: data for key, data in out.indice_dict.items() if getattr(data, "is_subm", False)}


def anchor_cbr(spc: Any, conv: nn.Module, channels: int) -> nn.Module:
    """spconv's conv, BatchNorm1d and ReLU in one SparseSequential (both anchor networks build theirs so)."""
    return spc.SparseSequential(conv, nn.BatchNorm1d(channels), nn.ReLU(inplace=True))


class AnchorMinkUNet(nn.Module):
    """The same network in spconv's API (spconv-triton shares it): indice keys name each map so the
    decoder's inverse convs reuse the encoder's maps, as spconv users write it."""

    def __init__(self, spc: Any, planes: tuple[int, ...] = (32, 64, 128, 256, 256, 128, 96, 96), stem: int = 32,
                 algo: Any = None) -> None:
        super().__init__()
        self.spc = spc
        extra = {} if algo is None else {"algo": algo}

        cbr = functools.partial(anchor_cbr, spc)
        self.stem = spc.SparseSequential(cbr(spc.SubMConv3d(IN_CHANNELS, stem, 3, bias=False, indice_key="s0", **extra), stem),
                                         cbr(spc.SubMConv3d(stem, stem, 3, bias=False, indice_key="s0", **extra), stem))
        self.down, self.enc = nn.ModuleList(), nn.ModuleList()
        channels, c = [stem], stem
        for i, out in enumerate(planes[:4]):
            self.down.append(cbr(spc.SparseConv3d(c, c, 2, 2, bias=False, indice_key=f"d{i}", **extra), c))
            self.enc.append(nn.ModuleList([AnchorBlock(spc, c, out, f"s{i + 1}", extra),
                                           AnchorBlock(spc, out, out, f"s{i + 1}", extra)]))
            c = out
            channels.append(c)
        self.up, self.dec = nn.ModuleList(), nn.ModuleList()
        for i, out in enumerate(planes[4:]):
            level = 3 - i
            skip = channels[level]
            self.up.append(cbr(spc.SparseInverseConv3d(c, out, 2, indice_key=f"d{level}", bias=False, **extra), out))
            self.dec.append(nn.ModuleList([AnchorBlock(spc, out + skip, out, f"s{level}", extra),
                                           AnchorBlock(spc, out, out, f"s{level}", extra)]))
            c = out
        self.head = spc.SubMConv3d(c, NUM_CLASSES, 1, indice_key="head", **extra)

    def forward(self, x):
        skips = [self.stem(x)]
        for down, blocks in zip(self.down, self.enc):
            y = down(skips[-1])
            for block in blocks:
                y = block(y)
            skips.append(y)
        y = skips.pop()
        for up, blocks in zip(self.up, self.dec):
            u = up(y)
            y = u.replace_feature(torch.cat([u.features, skips.pop().features], 1))
            for block in blocks:
                y = block(y)
        return self.head(y)


class AnchorBackbone(nn.Module):
    """SparseResNetBackbone in spconv's API (OpenPCDet's VoxelResBackBone8x shape with our channels): a
    submanifold stem, four stages of two residual blocks, stages 2-4 opened by a k3 s2 conv with padding 1,
    and the height conv (k3 s2 along z, padding 1 there); the output made dense (the BEV map's tensor).
    ``sizes``: the voxels of each stage's output and of the height conv's, from the last pass."""

    def __init__(self, spc: Any, channels: tuple[int, ...] = (16, 32, 64, 128), out_channels: int = 128,
                 algo: Any = None) -> None:
        super().__init__()
        extra = {} if algo is None else {"algo": algo}

        cbr = functools.partial(anchor_cbr, spc)
        self.stem = cbr(spc.SubMConv3d(IN_CHANNELS, channels[0], 3, bias=False, indice_key="s0", **extra), channels[0])
        self.down, self.blocks = nn.ModuleList(), nn.ModuleList()
        c = channels[0]
        for i, out in enumerate(channels):
            self.down.append(nn.Identity() if i == 0 else cbr(
                spc.SparseConv3d(c, out, 3, 2, padding=1, bias=False, indice_key=f"d{i}", **extra), out))
            self.blocks.append(nn.ModuleList([AnchorBlock(spc, out, out, f"s{i}", extra) for _ in range(2)]))
            c = out
        self.height = cbr(spc.SparseConv3d(c, out_channels, (1, 1, 3), (1, 1, 2), padding=(0, 0, 1), bias=False,
                                           indice_key="h", **extra), out_channels)
        self.sizes: list[int] = []

    def forward(self, x):
        x, sizes = self.stem(x), []
        for down, blocks in zip(self.down, self.blocks):
            x = down(x)
            for block in blocks:
                x = block(x)
            sizes.append(x.indices.shape[0])
        out = self.height(x)
        self.sizes = [*sizes, out.indices.shape[0]]
        return out


class AnchorBlock(nn.Module):
    """A residual block of two submanifold 3^3 convs in spconv's API (a 1x1x1 shortcut when channels change)."""

    def __init__(self, spc: Any, c_in: int, c_out: int, key: str, extra: dict) -> None:
        super().__init__()
        self.conv1 = spc.SubMConv3d(c_in, c_out, 3, bias=False, indice_key=key, **extra)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = spc.SubMConv3d(c_out, c_out, 3, bias=False, indice_key=key, **extra)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.shortcut = None if c_in == c_out else spc.SubMConv3d(c_in, c_out, 1, bias=False, indice_key=key + "p", **extra)
        self.bn_s = None if c_in == c_out else nn.BatchNorm1d(c_out)

    def forward(self, x):
        y = self.conv1(x)
        y = y.replace_feature(torch.relu(self.bn1(y.features)))
        y = self.conv2(y)
        skip = x.features if self.shortcut is None else self.bn_s(self.shortcut(x).features)
        return y.replace_feature(torch.relu(self.bn2(y.features) + skip))
