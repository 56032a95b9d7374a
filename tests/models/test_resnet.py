"""SparseResNetBackbone: stage strides and channels, the height conv, the BEV map, gradients."""

from __future__ import annotations

import pytest
import torch
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.models import BackboneOutput, SparseResNetBackbone


def _input(channels=4, low=-20):
    coords = random_coords(500, 40, low=low)
    return SparseTensor(coords, torch.randn(len(coords), channels))


def test_stages_strides_channels_and_height_conv():
    x = _input()
    backbone = SparseResNetBackbone(4, blocks=1)
    out = backbone(x)
    assert isinstance(out, BackboneOutput)
    assert [s.stride for s in out.stages] == [(1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8)]
    assert [s.num_channels for s in out.stages] == [16, 32, 64, 128]
    assert out.stages[0].coord_id == x.coord_id
    conv = backbone.height_conv[0]
    assert conv.kernel_size == (1, 1, 3) and conv.stride == (1, 1, 2)
    assert out.out.stride == (8, 8, 16) and out.out.num_channels == 128


def test_bev_folds_height_cells_into_channels_on_the_fixed_grid():
    x = _input()
    # Input voxels x, y in [-20, 20), z in [-20, 20): cells of stride (8, 8, 16) from -24 / -32.
    backbone = SparseResNetBackbone(4, blocks=1, grid_shape=(40, 40, 40), grid_origin=(-20, -20, -20))
    out = backbone(x)
    depth = 20 // 16 - (-20 // 16) + 1
    assert out.bev.shape == (x.batch_size, 128 * depth, 6, 6)
    dense = out.out.dense((6, 6, depth), (-24, -24, -32))
    torch.testing.assert_close(out.bev, dense.permute(0, 1, 4, 2, 3).reshape(x.batch_size, 128 * depth, 6, 6))
    out.bev.sum().backward()
    assert all(p.grad is not None for p in backbone.parameters())


def test_height_axis_x_is_spconvs_3_1_1_kernel_and_bev_keeps_y_z():
    x = _input(low=0)
    backbone = SparseResNetBackbone(4, channels=(8, 8, 8, 8), blocks=(1, 0, 0, 1), out_channels=8, height_axis=0)
    conv = backbone.height_conv[0]
    assert conv.kernel_size == (3, 1, 1) and conv.stride == (2, 1, 1)
    out = backbone(x)
    dense = out.out.dense(origin=(0, 0, 0))
    assert out.bev.shape == (x.batch_size, 8 * dense.shape[2], *dense.shape[3:])


def test_bev_reads_the_device_once_on_a_fixed_grid_and_twice_without(monkeypatch):
    # Without a grid the box is the coordinates' bounds (one read), then the dense map's own range checks (one).
    x = _input()
    for grid, expected in (({"grid_shape": (40, 40, 40), "grid_origin": (-20, -20, -20)}, 1), ({}, 2)):
        backbone = SparseResNetBackbone(4, channels=(4, 4), blocks=1, out_channels=4, **grid).eval()
        with torch.no_grad():
            out = backbone(x).out
            reads = []
            for name in ("tolist", "item", "__bool__"):
                method = getattr(torch.Tensor, name)
                monkeypatch.setattr(torch.Tensor, name,
                                    lambda self, *a, method=method: reads.append(self.shape) or method(self, *a))
            backbone.bev(out)
            monkeypatch.undo()
        assert len(reads) == expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="height_axis"):
        SparseResNetBackbone(4, height_axis=3)
    with pytest.raises(ValueError, match="blocks"):
        SparseResNetBackbone(4, blocks=(1, 2))
    with pytest.raises(ValueError, match="grid_shape"):
        SparseResNetBackbone(4, grid_shape=(10, 10))


def test_generative_down_makes_every_coarse_voxel_whose_window_holds_an_input():
    # spconv's / OpenPCDet's SparseConv3d(k=3, s=2, padding=1): output o (a multiple of the new stride)
    # exists where some input voxel lies within one input step of it along every axis.
    x = _input(low=-9)
    backbone = SparseResNetBackbone(4, channels=(4, 4, 4), blocks=(1, 0, 1), out_channels=4, generative_down=True)
    out = backbone(x)
    previous = x
    for stage in (*out.stages[1:], out.out):
        step, stride = torch.tensor(previous.stride), torch.tensor(stage.stride)
        reach = step * (stride > step)  # one input step along the strided axes, none along the others
        wanted = set()
        for b, *p in previous.coords.tolist():
            point = torch.tensor(p)
            for dx in (-1, 0, 1):
                for dy in (-1, 0, 1):
                    for dz in (-1, 0, 1):
                        o = point + torch.tensor((dx, dy, dz)) * reach
                        if bool((o % stride == 0).all()):
                            wanted.add((b, *o.tolist()))
        assert set(map(tuple, stage.coords.tolist())) == wanted
        previous = stage
    floored = SparseResNetBackbone(4, channels=(4, 4, 4), blocks=(1, 0, 1), out_channels=4)(x)
    assert len(out.stages[1]) > len(floored.stages[1])
