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

    The spatial shape has one spare cell per axis so stride-2 outputs stay inside it.
    """
    shifted = shifted_coords(coords)
    shape = (shifted[:, 1:].amax(0) + 2).tolist()
    return spc.SparseConvTensor(feats, shifted.int(), shape, int(coords[:, 0].max()) + 1)
