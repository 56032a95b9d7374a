"""ConvProblem: what a backend and the tuner need to know about one sparse-conv product."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..coords.kernel_map import KernelMap, Triple

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
    lone: bool = False
    """The map serves this product alone in a batch (:attr:`sparseconv.coords.batch.MapUse.lone`): views built for it
    are its cost."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.num_in, self.num_out, self.in_channels, self.out_channels,
                                                self.kernel_size, self.stride, self.dilation, self.transposed,
                                                self.generative, self.dtype, self.device, self.lone)))

    def __hash__(self) -> int:
        # Hashed once: the tuner's lookups of every conv call key on the problem (~2 µs a hash of the fields).
        return self._hash

    def __getstate__(self) -> dict:
        # Not the hash: another process (a compile worker) hashes dtypes and devices differently.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def layer(self) -> tuple:
        """Everything but the row counts: (in_channels, out_channels, kernel_size, stride, dilation, transposed,
        generative, dtype, device), what a layer's problem is on any map (:func:`layer_problem`)."""
        return (self.in_channels, self.out_channels, self.kernel_size, self.stride, self.dilation, self.transposed,
                self.generative, self.dtype, self.device)

    @property
    def kernel_volume(self) -> int:
        kx, ky, kz = self.kernel_size
        return kx * ky * kz


def layer_problem(kernel_map: KernelMap, layer: tuple, lone: bool = False) -> ConvProblem:
    """The problem of a layer (:attr:`ConvProblem.layer`: in_channels, out_channels, kernel_size, stride,
    dilation, transposed, generative, dtype, device) on ``kernel_map``, kept with the map: one object per
    (map, layer), so the eager and compiled calls of the layer, the tuner's memo keyed on it and the
    products the tuner prepares ahead for a new batch's map share it. ``lone``: the map serves this product
    alone in its batch (:attr:`sparseconv.coords.batch.MapUse.lone`), as the first call on the map says."""
    return kernel_map.derived(("conv_problem", *layer), lambda m: ConvProblem(m.num_in, m.num_out, *layer, lone))
