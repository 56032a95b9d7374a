"""A 1x1x1 conv's matrix product with its rows padded to a size bucket: the same values and gradients as
torch's, and products whose shapes repeat across row counts (cuBLAS's per-shape host cost)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseconv.backends.row_buckets import MIN_STEP, row_step
from sparseconv.ops.pointwise import pointwise


class MatmulShapes(TorchDispatchMode):
    """The matrix operands' shapes of every mm / addmm run under it (not addmm's bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm"):
            self.shapes.add(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return func(*args, **(kwargs or {}))


def test_row_steps_are_a_sixteenth_to_a_thirty_second_of_the_rows_and_few_an_octave():
    for n in [1, 63, 64, 65, 1000, 4097, 91234, 370001]:
        assert MIN_STEP <= row_step(n) <= max(MIN_STEP, n // 16), n
    assert len({(n - n % row_step(n), row_step(n)) for n in range(65536, 131072)}) <= 32


@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_products_equal_torch_s_values_and_gradients(with_bias):
    feats = torch.randn(1013, 6, dtype=torch.float64, requires_grad=True)
    matrix = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True) if with_bias else None
    inputs = (feats, matrix) + ((bias,) if with_bias else ())
    expected = feats @ matrix + (bias if with_bias else 0)
    assert torch.allclose(pointwise(feats, matrix, bias, padded=True), expected)
    small = [t.detach()[:37].clone().requires_grad_() if t.shape[0] == 1013 else t for t in inputs]
    assert torch.autograd.gradcheck(lambda *a: pointwise(a[0], a[1], a[2] if with_bias else None, padded=True),
                                    small)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(pointwise(feats, matrix, bias, padded=True), inputs, grad)
    want = torch.autograd.grad(expected, inputs, grad)
    for g, w in zip(got, want):
        assert torch.allclose(g, w)


@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_products_meet_the_same_shapes_at_nearby_row_counts(with_bias):
    seen = []
    for n in (1000, 1013, 1020):
        feats = torch.randn(n, 32, requires_grad=True)
        matrix = torch.randn(32, 16, requires_grad=True)
        bias = torch.randn(16, requires_grad=True) if with_bias else None
        with MatmulShapes() as shapes:
            pointwise(feats, matrix, bias, padded=True).square().sum().backward()
        seen.append(shapes.shapes)
        rows = {d for s in shapes.shapes for d in (s[0][0], s[0][1]) if d not in (32, 16)}
        assert rows and all(d % row_step(n) == 0 for d in rows), rows  # every product's rows bucketed
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 6  # forward, grad of feats, grad of the matrix: 2 each
    with MatmulShapes() as plain:
        pointwise(torch.randn(1013, 32), torch.randn(32, 16), padded=False)
    assert plain.shapes == {((1013, 32), (32, 16))}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_1x1_conv_on_the_gpu_runs_padded_products_with_the_reference_s_values(dtype):
    import sparseconv
    from sparseconv.nn import SparseConv3d

    coords = torch.unique(torch.randint(0, 40, (3001, 4)), dim=0)
    coords[:, 0] = 0
    coords = torch.unique(coords, dim=0)
    feats = torch.randn(len(coords), 48)
    conv = SparseConv3d(48, 24, 1, bias=True)
    reference = feats.double() @ conv.weight.detach()[0].double() + conv.bias.detach().double()
    x = sparseconv.SparseTensor(coords.cuda(), feats.cuda().to(dtype).requires_grad_())
    gpu = conv.cuda().to(dtype)
    with MatmulShapes() as shapes:
        out = gpu(x).feats
        out.float().square().sum().backward()
    rows = {d for s in shapes.shapes for d in (s[0][0], s[0][1]) if d not in (48, 24)}
    assert rows and all(d % row_step(len(coords)) == 0 for d in rows), rows
    assert torch.allclose(out.double().cpu(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
    grad = 2 * out.float().double().cpu()
    want = grad @ conv.weight.detach()[0].double().cpu().t()
    assert torch.allclose(x.feats.grad.double().cpu(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
