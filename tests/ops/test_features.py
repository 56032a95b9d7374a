"""The inference norm's fused affine map (sparseconv.ops.features.channel_affine) against float64, on the
GPU and under Triton's interpreter on the CPU (conftest), and torch's ops where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

from sparseconv.ops import features

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""Relative to the largest magnitude of the result: about two roundings of each dtype."""


def _operands(n, c, dtype, device):
    feats = torch.randn(n, c, dtype=dtype, device=device) * 3
    scale, shift = torch.randn(c, dtype=dtype, device=device), torch.randn(c, dtype=dtype, device=device)
    return feats, scale, shift, torch.randn(n, c, dtype=dtype, device=device)


def _reference(feats, scale, shift, residual, relu):
    out = feats.double() * scale.double() + shift.double()
    if residual is not None:
        out = out + residual.double()
    return out.clamp_min(0) if relu else out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residual, relu", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("n, c", [(700, 32), (37, 96), (5, 3)])
def test_the_fused_affine_map_matches_float64(device, dtype, residual, relu, n, c):
    feats, scale, shift, other = _operands(n, c, dtype, device)
    other = other if residual else None
    assert features._fusable(feats, scale, shift, other), "the kernel takes these (GPU, or the interpreter)"
    got = features.channel_affine(feats, scale, shift, other, relu)
    expected = _reference(feats, scale, shift, other, relu)
    assert got.dtype == dtype and got.shape == feats.shape and got.data_ptr() != feats.data_ptr()
    error = (got.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.abs().max().item(), error
    if relu:
        negative = _reference(feats, scale, shift, other, False) < 0
        assert (got >= 0).all() and (got[negative] == 0).all(), "the ReLU clamps"
        assert n * c < 100 or negative.any(), "the larger cases have values to clamp (about a third)"


@pytest.mark.parametrize("device", DEVICES)
def test_operands_the_kernel_does_not_take_go_through_torch(device):
    # A strided (non-contiguous) feature view, a residual of another dtype: torch's ops, the same values.
    feats, scale, shift, other = _operands(64, 48, torch.float32, device)
    view = feats[:, :32]
    assert not features._fusable(view, scale[:32], shift[:32], None)
    got = features.channel_affine(view, scale[:32], shift[:32], None, relu=True)
    assert torch.allclose(got.double(), _reference(view, scale[:32], shift[:32], None, True), atol=1e-5)
    assert not features._fusable(feats, scale, shift, other.double())
    got = features.channel_affine(feats, scale, shift, other.double(), relu=False)
    assert got.dtype == torch.float64, "promoted as torch's sum of the two would be"
    assert torch.allclose(got, _reference(feats, scale, shift, other, False), atol=1e-5)


def test_the_norm_alone_stays_torchs_op(monkeypatch):
    # Only what the kernel fuses pays for its launch: a lone affine map is torch's addcmul.
    feats, scale, shift, _ = _operands(16, 8, torch.float32, "cpu")
    monkeypatch.setattr(features, "launch_ready", lambda *a, **k: pytest.fail("launched for a lone affine map"))
    assert torch.allclose(features.channel_affine(feats, scale, shift), torch.addcmul(shift, feats, scale))


def _statistics(c, dtype, device, affine):
    mean = torch.randn(c, dtype=dtype, device=device)
    var = torch.rand(c, dtype=dtype, device=device) * 4 + 0.05
    weight = torch.randn(c, dtype=dtype, device=device) if affine else None
    bias = torch.randn(c, dtype=dtype, device=device) if affine else None
    return mean, var, weight, bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, stats_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("residual, relu", [(False, True), (True, True), (True, False)])
def test_the_norm_from_its_statistics_matches_float64(device, dtype, stats_dtype, affine, residual, relu):
    feats, _, _, other = _operands(300, 48, dtype, device)
    other = other if residual else None
    mean, var, weight, bias = _statistics(48, stats_dtype, device, affine)
    got = features.norm_affine(feats, mean, var, weight, bias, 1e-3, other, relu)
    assert got is not None, "the kernel takes these (GPU, or the interpreter)"
    expected = (feats.double() - mean.double()) / (var.double() + 1e-3).sqrt()
    if affine:
        expected = expected * weight.double() + bias.double()
    if other is not None:
        expected = expected + other.double()
    expected = expected.clamp_min(0) if relu else expected
    assert got.dtype == dtype and got.shape == feats.shape
    error = (got.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.abs().max().item(), error


@pytest.mark.parametrize("device", DEVICES)
def test_the_norm_from_its_statistics_declines_what_it_does_not_take(device):
    feats, _, _, other = _operands(64, 48, torch.float32, device)
    mean, var, weight, bias = _statistics(48, torch.float32, device, True)
    assert features.norm_affine(feats[:, :32], mean[:32], var[:32], weight[:32], bias[:32], 1e-5) is None
    assert features.norm_affine(feats, mean, var.double(), weight, bias, 1e-5) is None, "float64 statistics"
    assert features.norm_affine(feats, mean[:32], var[:32], weight[:32], bias[:32], 1e-5) is None, "C mismatch"
    assert features.norm_affine(feats, mean, var, weight, bias, 1e-5, other.double()) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_norm_launch_follows_its_statistics_and_what_replaces_them(device):
    """norm_affine with ``kept`` (a norm module's launches): the same results as without, statistics changed in
    place read at each call, a statistic replaced by another tensor (or another features dtype, a residual) a
    launch of its own."""
    feats, _, _, other = _operands(300, 48, torch.float16, device)
    mean, var, weight, bias = _statistics(48, torch.float32, device, True)
    kept = {}

    def both(mean, var, residual=None, feats=feats):
        got = features.norm_affine(feats, mean, var, weight, bias, 1e-3, residual, True, kept)
        assert got is not None
        assert torch.equal(got, features.norm_affine(feats, mean, var, weight, bias, 1e-3, residual, True))
        return got

    first = both(mean, var)
    assert len(kept) == 1
    assert torch.equal(both(mean, var), first)
    mean.add_(1.0)  # a statistic updated in place (training): read at the next call
    moved = both(mean, var)
    assert not torch.equal(moved, first)
    (slot, held), = kept.items()
    replaced = var.clone().mul_(4)
    both(mean, replaced)
    assert kept[slot] is not held and kept[slot].vectors[1] is replaced, "another tensor: another launch"
    both(mean, replaced, other)
    both(mean, replaced, feats=feats.float())
    assert len(kept) == 3, "a residual and another features dtype: their own slots"
    assert features.norm_affine(feats[:, :32], mean[:32], var[:32], weight[:32], bias[:32], 1e-3, kept=kept) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kept", [False, True])
def test_in_place_the_fused_kernels_overwrite_the_features_with_what_they_return_otherwise(device, kept):
    # A norm after a conv of the caller's pass (nn.norm.fused_norm_relu's promise): the kernels write into the
    # conv's output instead of a new tensor, with the same values.
    feats, scale, shift, other = _operands(300, 48, torch.float16, device)
    original = feats.clone()
    mean, var, weight, bias = _statistics(48, torch.float32, device, True)
    launches = {} if kept else None
    for residual in (None, other):
        expected = features.norm_affine(feats, mean, var, weight, bias, 1e-3, residual, True, launches)
        overwritten = feats.clone()
        got = features.norm_affine(overwritten, mean, var, weight, bias, 1e-3, residual, True, launches, inplace=True)
        assert got is not None and got.data_ptr() == overwritten.data_ptr() and torch.equal(got, expected)
        expected = features.channel_affine(feats, scale, shift, residual, True)
        overwritten = feats.clone()
        got = features.channel_affine(overwritten, scale, shift, residual, True, inplace=True)
        assert got.data_ptr() == overwritten.data_ptr() and torch.equal(got, expected)
    assert torch.equal(feats, original), "the calls not in place leave their features as they were"
