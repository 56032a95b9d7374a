"""explicit_gemm_grouped: every conv mode's forward and gradients equal the dense reference (float64), with its
groups' rows in one chunk and in many (a bounded workspace), each group's length a multiple of its row step."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, assert_conv_matches_reference, make_conv, make_input

from sparseconv.backends import grouped
from sparseconv.backends.row_buckets import row_step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workspace", ["one chunk", "many chunks"])
@pytest.mark.parametrize("mode", [m for m in MODES if m.kernel_size != 1], ids=str)
def test_every_mode_equals_the_dense_reference(mode, workspace, device, monkeypatch):
    if workspace == "many chunks":
        monkeypatch.setattr(grouped, "WORKSPACE_BYTES", 1)  # each chunk one row step (64 rows here)
    x = make_input(mode, 3, device, n=1500, extent=14)
    conv = make_conv(mode, 3, 4, device)
    conv.pins = type(conv.pins).checked(*(["explicit_gemm_grouped"] * 3))
    chunks = []
    original = grouped._chunks
    monkeypatch.setattr(grouped, "_chunks", lambda g, row_bytes: chunks.append(original(g, row_bytes)) or chunks[-1])
    assert_conv_matches_reference(conv, x)
    assert chunks
    for ranges in chunks:
        length = ranges[-1][1]
        assert length % row_step(length) == 0 and ranges[0][0] == 0
        assert all(end == start2 for (_, end), (start2, _) in zip(ranges, ranges[1:]))
        assert len(ranges) == (length // row_step(length) if workspace == "many chunks" else 1)
    if mode.name == "submanifold_k3":  # (~1300 voxels: ~290 pairs an offset, about five steps of 64)
        assert (max(len(ranges) for ranges in chunks) > 1) == (workspace == "many chunks")


def test_chunked_weight_gradients_sum_in_float32(monkeypatch):
    """bfloat16 operands over many chunks: the weight gradient is about as close to float64's as in one chunk
    (chunks summed in bfloat16 would lose ~8 bits more)."""
    from sparseconv.coords import KernelMapKey

    mode = next(m for m in MODES if m.kernel_size == 3 and m.stride == 1 and not m.transposed and not m.generative)
    x = make_input(mode, 8, "cpu", n=3000, extent=18)
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    a, b = torch.randn(len(x), 8, dtype=torch.float64), torch.randn(kernel_map.num_out, 8, dtype=torch.float64)
    exact = grouped.wgrad(a, b, kernel_map, {"max_waste": 0.25})
    errors = []
    for workspace in (grouped.WORKSPACE_BYTES, 1):
        monkeypatch.setattr(grouped, "WORKSPACE_BYTES", workspace)
        low = grouped.wgrad(a.bfloat16(), b.bfloat16(), kernel_map, {"max_waste": 0.25})
        assert low.dtype == torch.bfloat16
        errors.append(((low.double() - exact).abs().max() / exact.abs().max()).item())
    assert errors[1] <= 2 * errors[0] + 2e-3, errors
