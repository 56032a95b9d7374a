"""Coordinates: the warp-lang hash table, kernel maps and the per-batch coordinate cache."""

from .cache import CoordinateCache
from .kernel_map import KernelMap, KernelMapKey, center_offset, offset_deltas

__all__ = ["CoordinateCache", "KernelMap", "KernelMapKey", "center_offset", "offset_deltas"]
