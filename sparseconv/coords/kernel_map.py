"""Kernel maps: which input row feeds which output row through which kernel offset.

Offset order (the weight's first axis): for kernel size ``(kx, ky, kz)`` the offset index is
``(jx * ky + jy) * kz + jz`` with ``j`` in ``[0, k)`` per axis (x slowest, z fastest), and the
offset itself is ``delta = j - (k - 1) // 2``: centred for odd sizes, ``0 .. k-1`` for even
ones (so a ``k=2, s=2`` conv pools a cell onto its lower corner). In voxel units of the input
tensor, a regular conv reads ``in[p + delta * dilation * s_in]`` for output ``p``; a transposed
conv reads ``in[p - delta * dilation * s_out]``, i.e. it is the adjoint of the regular conv from
its output coordinates to its input coordinates. This is ``torch.nn.functional.conv3d`` /
``conv_transpose3d`` with ``padding = dilation * ((k - 1) // 2)`` evaluated at the sparse
coordinates, which is what the tests check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch

Triple = tuple[int, int, int]
V = TypeVar("V")


@dataclass(frozen=True)
class KernelMapKey:
    """What a kernel map depends on: the source coordinate set and the conv geometry."""

    source: int
    kernel_size: Triple
    stride: Triple
    dilation: Triple
    transposed: bool
    generative: bool


def offset_deltas(kernel_size: Triple) -> torch.Tensor:
    """(K, 3) int32 offsets ``delta`` in the documented order, in units of one kernel step."""
    axes = [torch.arange(k, dtype=torch.int32) - (k - 1) // 2 for k in kernel_size]
    grid = torch.meshgrid(*axes, indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def center_offset(kernel_size: Triple) -> int | None:
    """Index of the zero offset, or None for kernels with an even size along some axis."""
    if any(k % 2 == 0 for k in kernel_size):
        return None
    kx, ky, kz = kernel_size
    return ((kx // 2) * ky + ky // 2) * kz + kz // 2


class KernelMap:
    """Output-stationary neighbour table and the views the backends derive from it.

    ``neighbors``: (N_out, K) int32, the input row feeding output row ``i`` through offset ``k``,
    or -1. ``identity_offset`` names an offset whose pairs are exactly ``(i, i)`` for every row
    (the centre of an odd submanifold kernel): backends may run it as a plain matmul.
    """

    def __init__(
        self,
        neighbors: torch.Tensor,
        num_in: int,
        kernel_size: Triple,
        identity_offset: int | None = None,
    ) -> None:
        self.neighbors = neighbors
        self.num_in = num_in
        self.num_out = neighbors.shape[0]
        self.kernel_size = kernel_size
        self.kernel_volume = math.prod(kernel_size)
        self.identity_offset = identity_offset
        self._derived: dict[Hashable, object] = {}

    @functools.cached_property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CSR by offset: ``in_idx (P,) int64``, ``out_idx (P,) int64``, ``offset_ptr (K+1,) int64``.

        Pairs of offset ``k`` are ``[offset_ptr[k], offset_ptr[k+1])``, sorted by output row.
        """
        by_offset = self.neighbors.t()
        offset_idx, out_idx = (by_offset >= 0).nonzero(as_tuple=True)
        in_idx = by_offset[offset_idx, out_idx].to(torch.int64)
        counts = torch.bincount(offset_idx, minlength=self.kernel_volume)
        offset_ptr = torch.zeros(self.kernel_volume + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offset_ptr[1:])
        return in_idx, out_idx, offset_ptr

    @functools.cached_property
    def pair_counts(self) -> list[int]:
        """Number of (input, output) pairs per offset, length K, on the host."""
        return torch.diff(self.pairs[2]).tolist()

    @property
    def num_pairs(self) -> int:
        return sum(self.pair_counts)

    @functools.cached_property
    def per_offset(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(in_idx_k, out_idx_k)]`` for every offset k (views into :attr:`pairs`)."""
        in_idx, out_idx, _ = self.pairs
        return list(zip(in_idx.split(self.pair_counts), out_idx.split(self.pair_counts)))

    def derived(self, key: Hashable, build: Callable[[KernelMap], V]) -> V:
        """A backend's own view of this map (e.g. padded groups), built on first use and kept with the map."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"KernelMap(num_in={self.num_in}, num_out={self.num_out}, "
            f"kernel_size={self.kernel_size}, identity_offset={self.identity_offset})"
        )
