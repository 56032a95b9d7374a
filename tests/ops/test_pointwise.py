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
def test_padded_products_meet_the_same_shapes_at_nearby_row_counts(with_bias, monkeypatch):
    from sparseconv.backends import row_buckets

    monkeypatch.setattr(row_buckets, "rows_mm", lambda *args: None)  # cuBLAS's bucketed products (no Triton)
    monkeypatch.setattr(row_buckets, "rows_reduction", lambda *args: None)
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
    gpu = conv.cuda().to(dtype)
    for _ in range(2):  # the first while the kernels may compile in the background (cuBLAS's bucketed products)
        x = sparseconv.SparseTensor(coords.cuda(), feats.cuda().to(dtype).requires_grad_())
        with MatmulShapes() as shapes:
            out = gpu(x).feats
            out.float().square().sum().backward()
        rows = {d for s in shapes.shapes for d in (s[0][0], s[0][1]) if d not in (48, 24)}
        assert all(d % row_step(len(coords)) == 0 for d in rows), rows
        sparseconv.tune.wait_for_compiles()
    assert not shapes.shapes  # compiled: the Triton kernels, no cuBLAS product
    assert torch.allclose(out.double().cpu(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
    grad = 2 * out.float().double().cpu()
    want = grad @ conv.weight.detach()[0].double().cpu().t()
    assert torch.allclose(x.feats.grad.double().cpu(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@pytest.fixture
def poisoned_rows_mm(monkeypatch):
    from sparseconv.backends import row_buckets

    monkeypatch.setattr(row_buckets, "new_output", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype,
                                                                                   device=like.device))


DEVICES_MM = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES_MM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 16, 16), (300, 64, 128), (77, 96, 19), (129, 40, 70), (5000, 256, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["plain", "bias", "transposed", "offset rows"])
def test_the_rows_kernel_equals_a_float64_product_at_any_size_and_layout(shape, dtype, layout, device, poisoned_rows_mm):
    from sparseconv.backends.row_buckets import rows_mm

    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter computes in numpy, which has no bfloat16 (GPU only)")
    n, c_in, c_out = shape
    if device == "cpu" and n > 1000:
        n = 400  # the interpreter: a few tiles
    rows = torch.randn(n + 3, c_in, dtype=dtype, device=device)
    rows = rows[3:] if layout == "offset rows" else rows[:n]  # a slice: the first row past a 16-byte boundary
    matrix = (torch.randn(c_out, c_in, dtype=dtype, device=device).t() if layout == "transposed"
              else torch.randn(c_in, c_out, dtype=dtype, device=device)) / c_in ** 0.5
    bias = torch.randn(c_out, dtype=dtype, device=device) if layout == "bias" else None
    got = rows_mm(rows, matrix, bias)
    assert got is not None and got.shape == (n, c_out) and got.dtype == dtype
    want = rows.double() @ matrix.double() + (bias.double() if bias is not None else 0)
    tolerance = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance


@pytest.mark.parametrize("device", DEVICES_MM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 16, 16), (300, 64, 128), (5000, 19, 96), (9000, 256, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_reduction_kernel_equals_a_float64_product_over_any_row_count(shape, dtype, device):
    from sparseconv.backends.row_buckets import CHUNK, rows_reduction

    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter computes in numpy, which has no bfloat16 (GPU only)")
    n, a_width, b_width = shape
    if device == "cpu":
        n = min(n, CHUNK + 300)  # the interpreter: two splits at most
    left = torch.randn(n + 1, a_width, dtype=dtype, device=device)[1:]  # a slice: rows past a 16-byte boundary
    right = torch.randn(n, b_width, dtype=dtype, device=device)
    got = rows_reduction(left, right)
    assert got is not None and got.shape == (a_width, b_width) and got.dtype == dtype
    want = left.double().t() @ right.double()
    tolerance = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance
    assert torch.equal(rows_reduction(left, right), got)  # no atomics: the same sum every run


def test_the_rows_kernel_declines_what_it_does_not_take():
    from sparseconv.backends.row_buckets import rows_mm, rows_reduction

    assert rows_reduction(torch.randn(40, 16).double(), torch.randn(40, 8).double()) is None
    assert rows_reduction(torch.randn(40, 16), torch.randn(41, 8)) is None  # row counts differ

    rows, matrix = torch.randn(40, 16), torch.randn(16, 8)
    assert rows_mm(rows.double(), matrix.double()) is None  # float64: torch's product
    assert rows_mm(rows.t().contiguous().t(), matrix) is None  # column-strided rows
    assert rows_mm(rows, matrix.half()) is None  # mixed dtypes
    assert rows_mm(rows, matrix, torch.randn(8, 2)[:, 0]) is None  # a strided bias
    assert rows_mm(rows.bfloat16(), matrix.bfloat16()) is None  # bfloat16 under the interpreter


def test_padded_products_run_one_kernel_and_no_matmul_where_triton_runs(poisoned_rows_mm):
    for n in (1000, 1013):
        feats = torch.randn(n, 32)
        matrix = torch.randn(32, 16)
        with MatmulShapes() as shapes:
            out = pointwise(feats, matrix, padded=True)
        assert shapes.shapes == set()  # no cuBLAS product: no shape of its to meet
        assert torch.allclose(out, feats @ matrix, atol=1e-4, rtol=1e-4)
    feats, matrix = torch.randn(300, 24, requires_grad=True), torch.randn(24, 40, requires_grad=True)
    grad = torch.randn(300, 40)
    got = torch.autograd.grad(pointwise(feats, matrix, padded=True), (feats, matrix), grad)
    want = torch.autograd.grad(feats @ matrix, (feats, matrix), grad)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and torch.allclose(g, w, atol=1e-4, rtol=1e-4)
