"""torch.autograd.gradcheck for every conv mode, float64: as tuned, and through explicit_gemm_table."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, make_conv, make_input

from sparseconv.ops import sparse_conv3d


@pytest.mark.parametrize("algo", [None, "explicit_gemm_table"], ids=["auto", "table"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_gradcheck(mode, device, algo):
    x = make_input(mode, 2, device, n=25, extent=5)
    conv = make_conv(mode, 2, 3, device)
    feats = x.feats.clone().requires_grad_()
    weight = conv.weight.detach().clone().requires_grad_()
    bias = conv.bias.detach().clone().requires_grad_()

    def fn(f, w, b):
        return sparse_conv3d(x.replace(f), w, b, conv.kernel_size, conv.stride, conv.dilation,
                             conv.transposed, conv.generative, fwd_algo=algo, dgrad_algo=algo, wgrad_algo=algo).feats

    # index_add_ on CUDA accumulates with atomics, so repeated backwards differ in the last bits.
    nondet_tol = 1e-10 if device == "cuda" else 0.0
    assert torch.autograd.gradcheck(fn, (feats, weight, bias), fast_mode=conv.weight.shape[0] > 27, nondet_tol=nondet_tol)
