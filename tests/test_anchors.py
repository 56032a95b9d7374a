"""The benchmarks' anchor input: shifted to non-negative coordinates without moving the coarse grids."""

from __future__ import annotations

import pytest
import torch
from sparseconv.cli.bench import ALIGN, shifted_coords, spatial_shape


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


def _kept(coords: torch.Tensor, shape: list[int], levels: int) -> list[int]:
    """Voxels per level of a chain of k2 s2 convs as the anchor makes them: floors, less those at or
    beyond the level's spatial shape ``(S - 2) // 2 + 1``."""
    sizes, level, shape = [], coords, torch.tensor(shape)
    for _ in range(levels):
        shape = torch.div(shape - 2, 2, rounding_mode="floor") + 1
        level = _coarse(level, 2)
        level = level[(level[:, 1:] < shape).all(1)]
        sizes.append(level.shape[0])
    return sizes


@pytest.mark.parametrize("top", [(300, 250, 150), (1, 1, 1), (64, 127, 129)])
def test_spatial_shape_keeps_every_coarse_voxel(top):
    # room2's extent: with one spare cell the stride-4 and coarser sets lost their last floors
    generator = torch.Generator().manual_seed(1)
    xyz = torch.cat([torch.randint(0, t + 1, (3000, 1), generator=generator) for t in top], 1)
    xyz[0] = torch.tensor(top)
    shifted = shifted_coords(torch.cat([torch.randint(0, 2, (3000, 1), generator=generator), xyz - 1], 1))
    shape = spatial_shape(shifted)
    assert all(s % ALIGN == 0 and s > m for s, m in zip(shape, shifted[:, 1:].amax(0).tolist()))
    assert _kept(shifted, shape, 5) == [_coarse(shifted, 2 ** level).shape[0] for level in range(1, 6)]
