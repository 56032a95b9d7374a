"""Feature-wise layers, cat for skip connections, ToDense."""

from __future__ import annotations

import pytest
import torch
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv import nn as snn


def _tensor(channels=3, n=100):
    coords = random_coords(n, 6)
    return SparseTensor(coords, torch.randn(len(coords), channels))


def test_feature_modules_equal_their_torch_module_on_the_features():
    x = _tensor()
    for ours, theirs in (
        (snn.ReLU(), torch.relu),
        (snn.LeakyReLU(0.3), lambda f: torch.nn.functional.leaky_relu(f, 0.3)),
        (snn.GELU(), torch.nn.functional.gelu),
        (snn.Dropout(0.5).eval(), lambda f: f),
        (snn.Features(torch.nn.Softplus()), torch.nn.functional.softplus),
    ):
        out = ours(x)
        assert out.cache is x.cache and out.coord_id == x.coord_id
        torch.testing.assert_close(out.feats, theirs(x.feats))


def test_linear_is_torch_linear_per_voxel_with_torch_state_dict_keys():
    x = _tensor()
    linear = snn.Linear(3, 5)
    assert set(linear.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(linear(x).feats, x.feats @ linear.weight.t() + linear.bias)


def test_dropout_drops_features_in_training():
    x = _tensor(channels=64)
    out = snn.Dropout(0.5)(x).feats
    zeros = float((out == 0).float().mean())
    assert 0.4 < zeros < 0.6
    torch.testing.assert_close(out[out != 0], 2 * x.feats[out != 0])


def test_feature_modules_reject_dense_tensors_and_non_modules():
    with pytest.raises(TypeError, match="ReLU takes a SparseTensor, got Tensor"):
        snn.ReLU()(torch.randn(3, 3))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        snn.Features(torch.relu)


def test_cat_of_one_coordinate_set_concatenates_channels_and_gradients():
    x = _tensor()
    conv = snn.SparseConv3d(3, 4, 3)
    a, b = snn.ReLU()(x), conv(x)
    out = snn.cat(a, b)
    assert out.num_channels == 7 and out.cache is x.cache and out.coord_id == x.coord_id
    torch.testing.assert_close(out.feats, torch.cat([a.feats, b.feats], 1))
    probe = torch.randn_like(out.feats)
    (out.feats * probe).sum().backward()
    torch.testing.assert_close(conv.bias.grad, probe[:, 3:].sum(0))
    assert snn.cat([a, b]).num_channels == 7


def test_cat_of_a_decoder_output_and_its_skip():
    x = _tensor(channels=2, n=300)
    down = snn.SparseConv3d(2, 4, 2, 2)(x)
    up = snn.SparseConvTranspose3d(4, 2, 2, 2)(down)
    assert snn.cat(up, x).coord_id == x.coord_id


def test_cat_of_separately_built_tensors_compares_coordinates():
    coords = random_coords(80, 5)
    a = SparseTensor(coords, torch.randn(len(coords), 2))
    b = SparseTensor(coords.clone(), torch.randn(len(coords), 3))
    out = snn.cat(a, b)
    assert out.cache is a.cache and torch.equal(out.feats[:, 2:], b.feats)

    other = coords.clone()
    other[7, 1] += 100
    with pytest.raises(ValueError, match=r"tensors\[1\] has other coordinates than tensors\[0\]: row 7"):
        snn.cat(a, SparseTensor(other, torch.randn(len(coords), 1)))
    flipped = coords.flip(0)
    with pytest.raises(ValueError, match="the same voxels in another row order"):
        snn.cat(a, SparseTensor(flipped, torch.randn(len(coords), 1)))
    n = len(coords)
    with pytest.raises(ValueError, match=rf"tensors\[1\] has {n - 1} voxels, tensors\[0\] has {n}"):
        snn.cat(a, SparseTensor(coords[1:], torch.randn(n - 1, 1)))
    with pytest.raises(ValueError, match=r"tensors\[1\] has stride \(2, 2, 2\)"):
        snn.cat(a, SparseTensor(coords * 2, torch.randn(len(coords), 1), stride=2))
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a SparseTensor"):
        snn.cat(a, b.feats)
    with pytest.raises(ValueError, match="at least one"):
        snn.cat()


def test_to_dense_equals_sparse_tensor_dense_and_round_trips():
    coords = random_coords(60, 5)
    x = SparseTensor(coords, torch.rand(len(coords), 2) + 0.5)  # no all-zero rows
    grid = snn.ToDense()(x)
    assert torch.equal(grid, x.dense())
    back = SparseTensor.from_dense(grid)
    order = torch.argsort(x.coords[:, 0] * 10**6 + x.coords[:, 1] * 10**4 + x.coords[:, 2] * 100 + x.coords[:, 3])
    assert torch.equal(back.coords, x.coords[order]) and torch.equal(back.feats, x.feats[order])
    assert snn.ToDense(shape=(7, 7, 7))(x).shape == (2, 2, 7, 7, 7)
