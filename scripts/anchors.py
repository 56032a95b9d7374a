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


def anchor_tensor(spc, coords: torch.Tensor, feats: torch.Tensor):
    """Our [batch, x, y, z] coordinates (shifted to be non-negative) as the anchor's SparseConvTensor.

    The spatial shape has one spare cell per axis so stride-2 outputs stay inside it.
    """
    shifted = coords.clone()
    shifted[:, 1:] -= shifted[:, 1:].amin(0)
    shape = (shifted[:, 1:].amax(0) + 2).tolist()
    return spc.SparseConvTensor(feats, shifted.int(), shape, int(coords[:, 0].max()) + 1)
