"""Every conv mode equals dense conv3d / conv_transpose3d at the sparse output coordinates (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from conv_cases import MODES, assert_conv_matches_reference, make_conv, make_input, triple
from sparse_reference import dense_reference, random_coords


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_conv_forward_and_gradients_equal_dense_reference(mode, device):
    c_in, c_out = 3, 4
    assert_conv_matches_reference(make_conv(mode, c_in, c_out, device), make_input(mode, c_in, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [m for m in MODES if not m.generative and not m.transposed], ids=str)
def test_output_coordinates_are_the_floor_to_stride_of_the_input(mode, device):
    x = make_input(mode, 1, device)
    out = make_conv(mode, 1, 1, device)(x)
    step = torch.tensor((1, *out.stride), device=device)
    expected = torch.unique(torch.div(x.coords.long(), step, rounding_mode="floor") * step, dim=0)
    assert torch.equal(torch.unique(out.coords.long(), dim=0), expected)
    assert out.stride == tuple(a * b for a, b in zip(x.stride, triple(mode.stride)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [m for m in MODES if m.generative], ids=str)
def test_generative_output_is_every_cell_the_dense_kernel_reaches(mode, device):
    x = make_input(mode, 1, device)
    conv = make_conv(mode, 1, 1, device)
    out = conv(x)
    # Candidate cells: the generated ones plus random cells around them; a ones-kernel over the
    # occupancy grid is non-zero exactly where some input is within the kernel's reach.
    extra = random_coords(400, 14, batch_size=x.batch_size, stride=out.stride, low=-9 * max(out.stride), device=device)
    cells = torch.unique(torch.cat([out.coords, extra.to(torch.int32)]), dim=0)
    occupancy = torch.ones(len(x), 1, device=device, dtype=torch.float64)
    ones = torch.ones_like(conv.dense_weight())
    reach = dense_reference(x.coords, occupancy, x.stride, cells, out.stride, ones,
                            conv.kernel_size, conv.stride, conv.dilation, conv.transposed)[:, 0]
    generated = {tuple(r) for r in out.coords.tolist()}
    assert generated == {tuple(r) for r, hit in zip(cells.tolist(), (reach > 0).tolist()) if hit}
