"""A batch's coordinate sets as the map plan reads and extends them.

:class:`~.cache.CoordinateCache` is the one implementation; the plan (:mod:`.plan`, :mod:`.prebuild`) is written
against :class:`CoordinateSets`, so that it sits below the cache that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .batch import Batch
from .hashing import CoordHashTable
from .kernel_map import KernelMap, KernelMapKey, Triple


@dataclass(frozen=True)
class CoordSet:
    """coords: (N, 4) int32 [batch, x, y, z], unique rows, multiples of ``stride`` per axis."""

    coords: torch.Tensor
    stride: Triple
    canonical: bool


class CoordinateSets(Protocol):
    """The coordinate sets, tables and maps of one batch on one device, and its :class:`~.batch.Batch`."""

    device: torch.device
    batch: Batch

    def coord_set(self, set_id: int) -> CoordSet: ...

    def set_count(self) -> int: ...

    def canonical(self, stride: Triple) -> int | None:
        """Id of the canonical set at ``stride`` (the floor of the input), if the batch has one."""

    def origin(self, set_id: int) -> tuple | None:
        """How a generated set comes from the canonical sets (see :meth:`~.cache.CoordinateCache.origin`)."""

    def keys(self, set_id: int) -> torch.Tensor: ...

    def table(self, set_id: int) -> CoordHashTable: ...

    def add(self, coords: torch.Tensor, stride: Triple, canonical: bool, keys: torch.Tensor | None = None,
            table: CoordHashTable | None = None) -> int:
        """Register a set (with its keys and table, if made already); its id."""

    def build(self, key: KernelMapKey) -> tuple[KernelMap, int]:
        """The map of ``key`` and its output set id, built now."""

    def query(self, key: KernelMapKey, out_id: int, offsets: torch.Tensor) -> torch.Tensor:
        """The neighbour table of ``key`` onto ``out_id`` by a query of its own."""

    def new_map(self, key: KernelMapKey, neighbors: torch.Tensor, out_id: int) -> KernelMap:
        """The map of ``key`` from its queried neighbour table."""
