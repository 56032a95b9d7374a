"""explicit_gemm_table: every conv mode's forward and gradients equal the dense reference (float64), in one chunk
of rows and in many; half precision as close to float64 as the reference is (gradcheck: test_gradcheck.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, assert_conv_matches_reference, make_conv, make_input

from sparseconv.backends import explicit, table_gemm
from sparseconv.coords import KernelMapKey

PINNED = ["explicit_gemm_table"] * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workspace", ["one chunk", "many chunks"])
@pytest.mark.parametrize("mode", [m for m in MODES if m.kernel_size != 1], ids=str)  # 1x1x1: a pointwise product
def test_every_mode_equals_the_dense_reference(mode, workspace, device, monkeypatch):
    if workspace == "many chunks":
        monkeypatch.setattr(table_gemm, "WORKSPACE_BYTES", 1)  # chunks of 64 rows
    chunks = []
    original = table_gemm._chunks
    monkeypatch.setattr(table_gemm, "_chunks", lambda rows, row_bytes: chunks.append(original(rows, row_bytes)) or chunks[-1])
    x = make_input(mode, 3, device, n=1500, extent=14)
    conv = make_conv(mode, 3, 4, device)
    conv.pins = type(conv.pins).checked(*PINNED)
    assert_conv_matches_reference(conv, x)
    assert len(chunks) == 3  # forward, dgrad, wgrad
    assert any(len(c) > 1 for c in chunks) == (workspace == "many chunks")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_as_close_as_the_reference(dtype, device, monkeypatch):
    """Each product in half precision (one chunk and many) against float64: within 2x the reference's error."""
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("torch's CPU half matmuls are slow and not what runs this")
    mode = next(m for m in MODES if m.name == "submanifold_k3")
    x = make_input(mode, 16, device, n=3000, extent=18)
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    a = torch.randn(len(x), 16, dtype=torch.float64, device=device)
    g = torch.randn(kernel_map.num_out, 32, dtype=torch.float64, device=device)
    w = torch.randn(27, 16, 32, dtype=torch.float64, device=device) / 10
    for workspace in (table_gemm.WORKSPACE_BYTES, 1):
        monkeypatch.setattr(table_gemm, "WORKSPACE_BYTES", workspace)
        for ours, ref, args in ((table_gemm.forward, explicit.forward, (a, w)), (table_gemm.dgrad, explicit.dgrad, (g, w)),
                                (table_gemm.wgrad, explicit.wgrad, (a, g))):
            exact = ref(*args, kernel_map)
            low = [t.to(dtype) for t in args]
            got, reference = ours(*low, kernel_map), ref(*low, kernel_map)
            assert got.dtype == dtype and got.shape == exact.shape
            error = ((got.double() - exact).abs().max() / exact.abs().max()).item()
            bound = ((reference.double() - exact).abs().max() / exact.abs().max()).item()
            assert error <= 2 * bound + 1e-3, (ours.__name__, workspace, error, bound)


def test_a_table_of_no_rows_gives_no_rows():
    a, w = torch.randn(5, 3), torch.randn(27, 3, 4)
    out = table_gemm.table_product(a, torch.zeros((0, 27), dtype=torch.int32), w)
    assert out.shape == (0, 4) and out.dtype == a.dtype
