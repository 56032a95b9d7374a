"""The speed anchors (spconv 2.x and spconv-triton share one API), for the benchmark scripts."""

from __future__ import annotations

import torch


def import_anchor(name: str):
    """``spconv.pytorch`` or ``spconv_triton.pytorch``, or an 'n/a (...)' string when it does not import."""
    try:
        if name == "spconv":
            import spconv.pytorch as module
        else:
            import spconv_triton.pytorch as module
        return module
    except Exception as error:  # noqa: BLE001 - an anchor that does not import is reported as n/a
        return f"n/a ({type(error).__name__})"


ALIGN = 64
"""The anchors' coordinates are shifted by a multiple of this (every stride the benchmarks' networks
reach divides it), so their strided convs floor onto the same coarse voxels as ours."""


def shifted_coords(coords: torch.Tensor) -> torch.Tensor:
    """``coords`` [batch, x, y, z] moved to non-negative x, y, z by a multiple of :data:`ALIGN` per axis.

    Shifting by the minimum instead moved the 2x2x2 grid whenever a minimum was odd: on street4
    (z from -1) spconv's stride-2 set had 187,992 voxels where ours, the floors of the same
    coordinates, had 225,412 (17% fewer, and fewer still at the coarser levels): a different,
    smaller network to time and to measure memory on.
    """
    shifted = coords.clone()
    low = shifted[:, 1:].amin(0)
    shifted[:, 1:] -= torch.div(low, ALIGN, rounding_mode="floor") * ALIGN
    return shifted


def anchor_tensor(spc, coords: torch.Tensor, feats: torch.Tensor):
    """Our [batch, x, y, z] coordinates (:func:`shifted_coords`) as the anchor's SparseConvTensor.

    The spatial shape is :func:`spatial_shape`'s: every coarse voxel of every level stays inside it.
    """
    shifted = shifted_coords(coords)
    shape = spatial_shape(shifted)
    return spc.SparseConvTensor(feats, shifted.int(), shape, int(coords[:, 0].max()) + 1)


def spatial_shape(shifted: torch.Tensor) -> list[int]:
    """The anchor's spatial shape for non-negative ``shifted`` coordinates: per axis, the smallest
    multiple of :data:`ALIGN` above the largest coordinate.

    A k2 s2 conv's output shape is ``(S - 2) // 2 + 1``, and the anchor drops the outputs beyond
    it. With one spare cell (``max + 2``, until 2026-11-26) an odd level shape cut the floors of the
    largest coordinates at the next level: room2's stride-4 / 8 / 16 sets had 59,557 / 13,303 / 2,502
    voxels where ours (every floor) had 63,740 / 16,119 / 3,897, a smaller network to time and to
    measure memory on. A multiple of ALIGN halves exactly down to stride ALIGN.
    """
    top = shifted[:, 1:].amax(0) + 1
    return (torch.div(top + ALIGN - 1, ALIGN, rounding_mode="floor") * ALIGN).tolist()
