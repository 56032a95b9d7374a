"""explicit_gemm with its products on bucketed row counts (what it runs on CUDA, forced here on the CPU): every
conv mode's forward and gradients equal the dense reference (float64), every matrix product's rows are a
multiple of the bucket step, and the padding never reaches a result."""

from __future__ import annotations

import functools

import pytest
import torch
from conv_cases import MODES, assert_conv_matches_reference, make_conv, make_input
from test_pointwise import MatmulShapes

from sparseconv.backends import explicit
from sparseconv.backends.row_buckets import bucketed_index, row_step


@pytest.fixture
def padded(monkeypatch):
    """explicit_gemm's products padded, as on CUDA."""
    products = {name: functools.partial(fn, padded=True) for name, fn in explicit._PRODUCTS.items()}
    monkeypatch.setattr(explicit, "_PRODUCTS", products)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_every_mode_equals_the_dense_reference_with_padded_products(mode, padded):
    x = make_input(mode, 3, "cpu")
    conv = make_conv(mode, 3, 4, "cpu")
    conv.pins = type(conv.pins).checked("explicit_gemm", "explicit_gemm", "explicit_gemm")
    with MatmulShapes() as shapes:
        assert_conv_matches_reference(conv, x)
    if conv.kernel_size == (1, 1, 1) and conv.stride == (1, 1, 1):
        return  # a 1x1x1 conv is one product (ops.pointwise, padded on CUDA only), not explicit_gemm's
    rows = [d for s in shapes.shapes for d in (s[0][0], s[0][1]) if d not in (3, 4)]
    assert rows and all(d % 64 == 0 for d in rows), rows  # row_step of these sizes: 64, the smallest


def test_a_bucketed_index_repeats_row_zero_to_the_step():
    for n in (1, 64, 65, 1000, 70001):
        index = torch.arange(1, n + 1)
        padded = bucketed_index(index)
        assert len(padded) % row_step(n) == 0 and len(padded) - n < row_step(n)
        assert torch.equal(padded[:n], index) and (padded[n:] == 0).all()


def test_the_weight_gradient_s_padding_reaches_no_result_even_past_a_nan():
    # Row 0 (what the padding gathers) holds a NaN in both operands but takes part in no pair of offset 1.
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMapKey

    coords = torch.tensor([[0, 0, 0, 0], [0, 5, 5, 5], [0, 5, 5, 6], [0, 5, 6, 6]], dtype=torch.int32)
    x = SparseTensor(coords, torch.randn(4, 2, dtype=torch.float64))
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    a, grad = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    a[0], grad[0] = float("nan"), float("nan")
    got, want = explicit.wgrad(a, grad, kernel_map, padded=True), explicit.wgrad(a, grad, kernel_map, padded=False)
    finite = want.isfinite().flatten(1).all(1)
    assert finite.any() and (~finite).any(), "some offsets pair row 0, others not"
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_padded_products_differentiate_where_a_caller_records_autograd():
    # Called outside the conv op's autograd Function (operands that require grad): torch's own product,
    # differentiable (products into a preallocated output would raise there).
    from sparseconv.backends.row_buckets import padded_mm

    rows = torch.randn(1013, 6, dtype=torch.float64, requires_grad=True)
    matrix = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    out = padded_mm(rows, matrix)
    torch.testing.assert_close(out, rows @ matrix)
    out.sum().backward()
    torch.testing.assert_close(matrix.grad, rows.detach().sum(0, keepdim=True).t().expand(6, 5))
