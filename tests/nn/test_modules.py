"""Modules: construction checks, torch-like initialisation, dense_weight layout, containers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICES
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.nn import BatchNorm, Features, ReLU, Sequential, SparseConv3d, SparseConvTranspose3d


@pytest.mark.parametrize("transposed", [False, True])
def test_reset_parameters_uses_torchs_conv_bounds(transposed):
    conv = SparseConv3d(16, 48, 3, transposed=transposed)
    dense = (torch.nn.ConvTranspose3d(16, 48, 3) if transposed else torch.nn.Conv3d(16, 48, 3))
    bound = 1 / math.sqrt((48 if transposed else 16) * 27)
    # The draws are float32: a sample may equal the bound rounded up to float32 (1/36 -> 0.0277777780).
    bound32 = float(torch.tensor(bound, dtype=torch.float32))
    for ours, theirs in ((conv.weight, dense.weight), (conv.bias, dense.bias)):
        assert float(ours.detach().abs().max()) <= bound32
        assert float(theirs.detach().abs().max()) <= bound32
    # 20,736 uniform draws all below 0.9 * bound would happen with probability 0.9**20736: never.
    assert float(conv.weight.detach().abs().max()) > 0.9 * bound
    assert conv.dense_weight().shape == dense.weight.shape


@pytest.mark.parametrize("device", DEVICES)
def test_dense_weight_layout_matches_torch_conv3d_on_a_full_grid(device):
    # On a fully occupied grid a submanifold conv is a dense conv with 'same' padding.
    conv = SparseConv3d(2, 3, (3, 1, 5), bias=False, device=device, dtype=torch.float64)
    grid = torch.randn(1, 2, 4, 5, 6, device=device, dtype=torch.float64)
    out = conv(SparseTensor.from_dense(grid)).dense(shape=(4, 5, 6))
    expected = torch.nn.functional.conv3d(grid, conv.dense_weight(), padding=(1, 0, 2))
    torch.testing.assert_close(out, expected)


def test_constructor_rejects_bad_arguments_and_algorithms():
    with pytest.raises(ValueError, match="in_channels must be a positive int"):
        SparseConv3d(0, 4)
    with pytest.raises(ValueError, match=r"kernel_size must be a positive int or a tuple of 3"):
        SparseConv3d(2, 4, (3, 3))
    with pytest.raises(ValueError, match="fwd_algo: unknown algorithm 'implicit'"):
        SparseConv3d(2, 4, fwd_algo="implicit")
    with pytest.raises(TypeError, match="wgrad_algo must be a mode string or a non-empty list"):
        SparseConv3d(2, 4, wgrad_algo=3)


@pytest.mark.parametrize("device", DEVICES)
def test_encoder_decoder_round_trip_trains(device):
    coords = random_coords(400, 12, device=device)
    x = SparseTensor(coords, torch.randn(len(coords), 4, device=device))
    net = Sequential(
        SparseConv3d(4, 8, 3), BatchNorm(8), ReLU(),
        SparseConv3d(8, 16, 2, stride=2), BatchNorm(16), ReLU(),
        SparseConvTranspose3d(16, 8, 2, stride=2), Features(torch.nn.Dropout(0.0)),
        SparseConv3d(8, 2, 1),
    ).to(device)
    # A target the network can represent (a linear map of the inputs), so the loss must fall.
    target = x.feats @ torch.randn(4, 2, device=device)
    optimiser = torch.optim.Adam(net.parameters(), lr=0.01)
    losses = []
    for _ in range(30):
        optimiser.zero_grad()
        y = net(x)
        loss = torch.nn.functional.mse_loss(y.feats, target)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert torch.equal(y.coords, x.coords) and y.stride == (1, 1, 1)
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_transposed_module_is_transposed_and_has_no_transposed_keyword():
    conv = SparseConvTranspose3d(2, 3, 2, 2)
    assert conv.transposed and conv.dense_weight().shape == (2, 3, 2, 2, 2)
    with pytest.raises(TypeError, match="transposed"):
        SparseConvTranspose3d(2, 3, 2, 2, transposed=False)
