"""Pooling: local max / avg against dense max_pool3d / avg_pool3d at the output coordinates, the
output coordinates of the matching conv, global pooling against per-element reductions."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from sparse_reference import dense_pool_reference, random_coords

from sparseconv import SparseTensor
from sparseconv.nn import GlobalAvgPool, GlobalMaxPool, SparseAvgPool3d, SparseConv3d, SparseMaxPool3d
from sparseconv.nn import functional as F

# (kernel_size, stride, input stride): standard, overlapping, submanifold, anisotropic (detection
# backbones), from a strided input, and kernels narrower than their stride (windows can be empty).
CASES = [
    pytest.param(2, 2, 1, id="k2_s2"),
    pytest.param(3, 2, 1, id="k3_s2"),
    pytest.param(3, 1, 1, id="k3_s1_submanifold"),
    pytest.param((3, 1, 1), (2, 1, 1), 1, id="k311_s211"),
    pytest.param((2, 3, 1), (2, 2, 1), 2, id="k231_s221_from_stride2"),
    pytest.param(1, 2, 1, id="k1_s2_empty_windows"),
    pytest.param(3, 3, 1, id="k3_s3_empty_windows"),
]


def _input(device, input_stride, channels=3, n=150, extent=8):
    s = (input_stride,) * 3
    coords = random_coords(n, extent, stride=s, low=-4 * input_stride, device=device)
    return SparseTensor(coords, torch.randn(len(coords), channels, device=device, dtype=torch.float64), s)


def _reference(x, out, feats, kernel_size, stride, op):
    k = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
    s = (stride,) * 3 if isinstance(stride, int) else stride
    return dense_pool_reference(x.coords, feats, x.stride, out.coords, out.stride, k, s, op)


def _pool(module, device, input_stride):
    """(input, its features as a grad leaf, the pooled output)."""
    x = _input(device, input_stride)
    feats = x.feats.clone().requires_grad_()
    return x, feats, module(x.replace(feats))


def _assert_same_gradients(out, ref, feats):
    probe = torch.randn_like(ref)
    ours, = torch.autograd.grad((out.feats * probe).sum(), feats)
    theirs, = torch.autograd.grad((ref * probe).sum(), feats)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kernel_size", "stride", "input_stride"), CASES)
def test_max_pool_equals_dense_max_pool_with_empty_cells_excluded(kernel_size, stride, input_stride, device):
    x, feats, out = _pool(SparseMaxPool3d(kernel_size, stride), device, input_stride)
    ref = _reference(x, out, feats, kernel_size, stride, "max")
    # A window without any input is -inf densely and 0 here (with zero gradient).
    empty = torch.isinf(ref)
    ref = torch.where(empty, torch.zeros_like(ref), ref)
    torch.testing.assert_close(out.feats, ref, rtol=0, atol=0)
    if (kernel_size, stride) in ((1, 2), (3, 3)):
        assert bool(empty.any()), "with 150 random voxels this case has empty windows"
    _assert_same_gradients(out, ref, feats)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kernel_size", "stride", "input_stride"), CASES)
def test_avg_pool_is_dense_sum_pool_over_the_count_of_inputs(kernel_size, stride, input_stride, device):
    x, feats, out = _pool(SparseAvgPool3d(kernel_size, stride), device, input_stride)
    sums = _reference(x, out, feats, kernel_size, stride, "sum")
    counts = _reference(x, out, feats, kernel_size, stride, "count")
    ref = sums / counts.clamp(min=1)
    torch.testing.assert_close(out.feats, ref, rtol=1e-12, atol=1e-12)
    _assert_same_gradients(out, ref, feats)


@pytest.mark.parametrize(("kernel_size", "stride", "input_stride"), CASES)
def test_pool_output_is_the_coordinate_set_of_the_conv_of_same_geometry(kernel_size, stride, input_stride):
    x = _input("cpu", input_stride)
    conv = SparseConv3d(3, 2, kernel_size, stride, dtype=torch.float64)(x)
    for pool in (SparseMaxPool3d(kernel_size, stride), SparseAvgPool3d(kernel_size, stride)):
        out = pool(x)
        assert out.cache is conv.cache and out.coord_id == conv.coord_id and out.stride == conv.stride


def test_stride_defaults_to_kernel_size_like_torch():
    pool = SparseMaxPool3d((2, 2, 1))
    assert pool.stride == (2, 2, 1) and "kernel_size=(2, 2, 1), stride=(2, 2, 1)" in repr(pool)
    x = _input("cpu", 1)
    assert F.avg_pool3d(x, 2).stride == (2, 2, 2)


@pytest.mark.parametrize("op", [F.avg_pool3d, F.max_pool3d])
def test_gradcheck_local_pooling(op):
    x = _input("cpu", 1, channels=2, n=30, extent=4)
    feats = x.feats.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda f: op(x.replace(f), 3, 2).feats, (feats,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pooling_keeps_the_feature_dtype(dtype):
    x = _input("cpu", 1)
    low = x.replace(x.feats.to(dtype))
    for op in (F.avg_pool3d, F.max_pool3d):
        out = op(low, 2)
        assert out.dtype == dtype
        torch.testing.assert_close(out.feats.double(), op(x, 2).feats, rtol=2e-2, atol=2e-2)


def _per_element(x, batch_size, reduce):
    rows = []
    for b in range(batch_size):
        mine = x.feats[x.coords[:, 0] == b]
        rows.append(reduce(mine) if len(mine) else torch.zeros_like(x.feats[0]))
    return torch.stack(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_global_pooling_equals_per_element_reductions(device):
    # Batch indices 0, 2 and 3 only: element 1 and the trailing element 4 (via batch_size) are empty.
    coords = random_coords(200, 6, batch_size=4, device=device)
    coords = coords[coords[:, 0] != 1]
    x = SparseTensor(coords[torch.randperm(len(coords), device=device)], torch.randn(len(coords), 5, device=device))
    for module, reduce in ((GlobalAvgPool(), lambda f: f.mean(0)), (GlobalMaxPool(), lambda f: f.amax(0))):
        torch.testing.assert_close(module(x), _per_element(x, 4, reduce))
        padded = module(x, batch_size=5)
        assert padded.shape == (5, 5) and torch.equal(padded[4], torch.zeros(5, device=device))


def test_gradcheck_global_pooling():
    coords = random_coords(30, 4, batch_size=3)
    x = SparseTensor(coords, torch.randn(len(coords), 2, dtype=torch.float64))
    feats = x.feats.clone().requires_grad_()
    for op in (F.global_avg_pool, F.global_max_pool):
        assert torch.autograd.gradcheck(lambda f, op=op: op(x.replace(f)), (feats,))


def test_pooling_rejects_bad_arguments():
    x = _input("cpu", 1)
    with pytest.raises(TypeError, match="input must be a SparseTensor"):
        F.max_pool3d(x.feats, 2)
    with pytest.raises(ValueError, match="kernel_size"):
        SparseMaxPool3d((2, 2))
    with pytest.raises(ValueError, match="stride must be >= 1"):
        SparseAvgPool3d(2, 0)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 2"):
        F.global_avg_pool(x, batch_size=1)
