"""ConvProblem: what a backend and the tuner need to know about one sparse-conv product."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..coords.kernel_map import Triple

NAMESPACES = ("AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather")
"""Forward (out = Σ_k scatter(gather(A) · B_k)), dgrad (… · B_kᵀ), wgrad (gather(A)ᵀ · gather(B))."""

PIN_ARGUMENT = dict(zip(NAMESPACES, ("fwd_algo", "dgrad_algo", "wgrad_algo")))
"""The keyword argument that pins each namespace's algorithm; error messages name it."""


@dataclass(frozen=True)
class ConvProblem:
    """Shapes and flags of one conv layer call; the same for its forward, dgrad and wgrad."""

    num_in: int
    num_out: int
    in_channels: int
    out_channels: int
    kernel_size: Triple
    stride: Triple
    dilation: Triple
    transposed: bool
    generative: bool
    dtype: torch.dtype
    device: torch.device

    @property
    def kernel_volume(self) -> int:
        kx, ky, kz = self.kernel_size
        return kx * ky * kz
