"""Half precisions, autocast, argument errors and algorithm pins of sparse_conv3d."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, make_conv, make_input, reference
from sparse_reference import relative_error

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit, register, unregister

# Relative error bounds per dtype: loose enough for rounding of the operands, tight enough that a
# dropped offset or a K-fold rounding of the sum fails.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", [m for m in MODES if m.name in ("submanifold_k3", "strided_k2_s2", "transposed_k2_s2")], ids=str)
def test_low_precision_matches_float64_reference(mode, dtype, device):
    x64 = make_input(mode, 16, device, n=300)
    conv = make_conv(mode, 16, 24, device)
    feats64 = x64.feats.clone().requires_grad_()
    out64 = conv(x64.replace(feats64))
    ref = reference(conv, x64, out64, x64.feats).detach()
    probe = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((out64.feats * probe).sum(), [feats64, conv.weight])

    low = copy.deepcopy(conv).to(dtype)
    feats = x64.feats.to(dtype).requires_grad_()
    out = low(x64.replace(feats))
    out.feats.backward(probe.to(dtype))
    assert out.dtype == feats.grad.dtype == low.weight.grad.dtype == dtype
    assert relative_error(out.feats, ref) < TOLERANCE[dtype]
    assert relative_error(feats.grad, ref_grads[0]) < TOLERANCE[dtype]
    assert relative_error(low.weight.grad, ref_grads[1]) < TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_explicit_wgrad_sums_long_reductions_in_float32(dtype, device):
    """The tuner's reference must not round a 10^5-pair reduction in half precision."""
    mode = next(m for m in MODES if m.name == "submanifold_k3")
    x = make_input(mode, 16, device, dtype=dtype, n=60_000 if device == "cuda" else 20_000, extent=40)
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    grad_out = torch.randn(kernel_map.num_out, 24, device=device, dtype=dtype)
    out = explicit.wgrad(x.feats, grad_out, kernel_map)
    ref = explicit.wgrad(x.feats.double(), grad_out.double(), kernel_map)
    assert out.dtype == dtype
    assert relative_error(out, ref) < {torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_calls_without_gradients_skip_autograd_and_match_the_reference(mode, device):
    """Inference calls (no_grad, or no input needing a gradient) run the forward product without an
    autograd node and give the dense reference; a call where only the weight needs a gradient
    still builds one and gets the reference's weight gradient."""
    x = make_input(mode, 5, device)
    conv = make_conv(mode, 5, 4, device)
    args = (conv.kernel_size, conv.stride, conv.dilation, conv.transposed, conv.generative)
    record: dict[str, str] = {}
    with torch.no_grad():
        out = sparse_conv3d(x, conv.weight, conv.bias, *args, record=record)
    plain = sparse_conv3d(x, conv.weight.detach(), conv.bias.detach(), *args)
    for result in (out, plain):
        assert result.feats.grad_fn is None and not result.feats.requires_grad
    assert set(record) == {"AB_gather_scatter"}
    ref = reference(conv, x, out, x.feats)
    assert relative_error(out.feats, ref.detach()) < 1e-12
    assert relative_error(plain.feats, out.feats) < 1e-12  # not bit-equal: CUDA scatters add in any order

    graph = sparse_conv3d(x, conv.weight, conv.bias, *args)
    assert graph.feats.requires_grad and relative_error(graph.feats.detach(), out.feats) < 1e-12
    probe = torch.randn_like(ref)
    (grad_weight,) = torch.autograd.grad((graph.feats * probe).sum(), [conv.weight])
    (ref_weight,) = torch.autograd.grad((ref * probe).sum(), [conv.weight])
    assert relative_error(grad_weight, ref_weight) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_the_conv_in_the_autocast_dtype(device):
    mode = MODES[1]
    x = make_input(mode, 8, device, dtype=torch.float32, n=200)
    conv = make_conv(mode, 8, 8, device, dtype=torch.float32)
    low = torch.bfloat16 if device == "cpu" else torch.float16
    with torch.autocast(device_type=device, dtype=low):
        out = conv(x)
    assert out.dtype == low
    with torch.no_grad():
        ref = conv(x).feats
    assert relative_error(out.feats, ref) < TOLERANCE[low]
    out.feats.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32


def test_mismatched_weight_is_rejected_with_its_shape():
    x = make_input(MODES[1], 4, "cpu")
    with pytest.raises(ValueError, match=r"weight must have shape \(K=27, C_in=4, C_out\).*got \(27, 5, 2\)"):
        sparse_conv3d(x, torch.zeros(27, 5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"K=8"):
        sparse_conv3d(x, torch.zeros(27, 4, 2, dtype=torch.float64), kernel_size=2)
    with pytest.raises(TypeError, match="must have the input features' dtype"):
        sparse_conv3d(x, torch.zeros(27, 4, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\)"):
        sparse_conv3d(x, torch.zeros(27, 4, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="input must be a SparseTensor"):
        sparse_conv3d(x.feats, torch.zeros(27, 4, 2))
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        sparse_conv3d(x, torch.zeros(27, 4, 2, dtype=torch.float64), dilation=0)


def test_transposed_conv_without_finer_coordinates_says_what_is_missing():
    x = make_input(MODES[1], 2, "cpu")
    coarse = SparseTensor(x.coords * torch.tensor([1, 2, 2, 2], dtype=torch.int32), x.feats, stride=2)
    with pytest.raises(ValueError, match=r"no tensor of this batch has coordinates at stride \(1, 1, 1\).*generative=True"):
        sparse_conv3d(coarse, torch.zeros(8, 2, 2, dtype=torch.float64), kernel_size=2, stride=2, transposed=True)
    with pytest.raises(ValueError, match="cannot go below stride 1"):
        sparse_conv3d(x, torch.zeros(8, 2, 2, dtype=torch.float64), kernel_size=2, stride=2, transposed=True, generative=True)


@pytest.mark.parametrize("pin", ["fwd_algo", "dgrad_algo", "wgrad_algo"])
def test_unknown_algorithm_lists_valid_names_and_closest_match(pin):
    x = make_input(MODES[1], 2, "cpu")
    with pytest.raises(ValueError, match=rf"{pin}: unknown algorithm 'explicit_gem'.*valid: \['auto', 'trimmed', 'all', .*'explicit_gemm'.*\]; did you mean 'explicit_gemm'"):
        sparse_conv3d(x, torch.zeros(27, 2, 2, dtype=torch.float64), **{pin: "explicit_gem"})


def test_pins_route_each_product_to_the_named_backend():
    calls = []

    def run(namespace, problem, params, a, b, kernel_map):
        calls.append(namespace)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    register(Backend("recording_fake", frozenset({"ABt_gather_scatter", "AtB_gather_gather"}), run))
    try:
        x = make_input(MODES[1], 2, "cpu")
        feats = x.feats.clone().requires_grad_()
        weight = torch.randn(27, 2, 3, dtype=torch.float64, requires_grad=True)
        with pytest.raises(ValueError, match="fwd_algo: unknown algorithm 'recording_fake'"):
            sparse_conv3d(x, weight, fwd_algo="recording_fake")
        out = sparse_conv3d(x.replace(feats), weight, dgrad_algo="recording_fake", wgrad_algo="recording_fake")
        assert calls == []
        out.feats.sum().backward()
        assert sorted(calls) == ["ABt_gather_scatter", "AtB_gather_gather"]
    finally:
        unregister("recording_fake")


@pytest.mark.parametrize(("backend", "dtype"), [
    *((name, dtype) for name in ("explicit_gemm", "explicit_gemm_grouped", "explicit_gemm_table", "matmul")
      for dtype in (torch.float16, torch.bfloat16)),
    ("explicit_gemm_csr", torch.float16),  # (torch's CPU sparse product takes no bfloat16)
], ids=str)
def test_a_cpus_float16_products_multiply_in_float32_and_bfloat16_in_its_own(backend, dtype, monkeypatch):
    # torch's CPU float16 GEMM has no fast kernel on x86 without AVX512-FP16 (precision.product_dtype: a MinkUNet
    # training step took 10-17 s in float16 against ~1 s in float32); its bfloat16 GEMM is fast. (explicit_gemm's
    # wgrad multiplies half operands in float32 anyway: its long reductions.)
    multiplied = set()
    for name in ("mm", "bmm", "addmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, real=real, **kwargs: multiplied.add(args[-1].dtype)
                            or real(*args, **kwargs))
    pointwise = backend == "matmul"  # a 1x1x1 conv's one product (ops.pointwise)
    x64 = make_input(MODES[0 if pointwise else 1], 8, "cpu", n=300)
    weight64 = torch.randn(1 if pointwise else 27, 8, 16, dtype=torch.float64)
    pins = {} if pointwise else dict(fwd_algo=backend, dgrad_algo=backend,
                                     wgrad_algo="explicit_gemm" if backend == "explicit_gemm_csr" else backend)
    feats = x64.feats.to(dtype).requires_grad_()
    weight = weight64.to(dtype).requires_grad_()
    kernel_size = 1 if pointwise else 3
    out = sparse_conv3d(x64.replace(feats), weight, kernel_size=kernel_size, **pins)
    probe = torch.randn_like(out.feats)
    out.feats.backward(probe)
    assert torch.float16 not in multiplied and (dtype == torch.float16 or dtype in multiplied), multiplied
    assert out.feats.dtype == feats.grad.dtype == weight.grad.dtype == dtype
    # The same conv in float64 from the rounded operands: only the final rounding to the dtype differs.
    feats_ref, weight_ref = feats.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = sparse_conv3d(x64.replace(feats_ref), weight_ref, kernel_size=kernel_size)
    ref.feats.backward(probe.double())
    for got, want in ((out.feats, ref.feats), (feats.grad, feats_ref.grad), (weight.grad, weight_ref.grad)):
        assert relative_error(got, want.detach()) < TOLERANCE[dtype]
