"""The benchmarks' anchor input: shifted to non-negative coordinates without moving the coarse grids."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from anchors import ALIGN, shifted_coords  # noqa: E402


def _coarse(coords: torch.Tensor, stride: int) -> torch.Tensor:
    """The stride's voxels of ``coords``, as spconv's k2 s2 convs make them from non-negative ones
    and ours from any: floors, deduplicated per batch element."""
    floored = torch.cat([coords[:, :1], torch.div(coords[:, 1:], stride, rounding_mode="floor")], 1)
    return torch.unique(floored, dim=0)


@pytest.mark.parametrize("low", [(-1191, -1028, -1), (3, 5, 7), (0, 0, 0)])
def test_shifted_coords_are_non_negative_and_keep_every_coarse_grid(low):
    generator = torch.Generator().manual_seed(0)
    xyz = torch.randint(0, 40, (2000, 3), generator=generator) + torch.tensor(low)
    coords = torch.cat([torch.randint(0, 3, (2000, 1), generator=generator), xyz], 1)
    shifted = shifted_coords(coords)
    assert shifted[:, 1:].min() >= 0 and torch.equal(shifted[:, 0], coords[:, 0])
    moved = shifted[0, 1:] - coords[0, 1:]
    assert bool((moved % ALIGN == 0).all()) and torch.equal(shifted[:, 1:] - coords[:, 1:], moved.expand(2000, 3))
    for stride in (2, 4, 8, 16, 32):
        assert _coarse(shifted, stride).shape == _coarse(coords, stride).shape
