"""Packed voxel keys: ``[batch, x, y, z]`` in one non-negative int64, the hash tables' keys (:mod:`.hashing`)
and the Warp kernels' (:mod:`.warp_kernels`); range checks, packing, unpacking and the floors of keys.
"""

from __future__ import annotations

import functools

import torch

# Bit budget of a packed key: 12 batch bits + 3 x 17 coordinate bits = 63 bits, so every valid
# key is a non-negative int64 and -1 can mark an empty slot.
BATCH_BITS = 12
COORD_BITS = 17
BATCH_MAX = (1 << BATCH_BITS) - 1
COORD_MIN = -(1 << (COORD_BITS - 1))
COORD_MAX = (1 << (COORD_BITS - 1)) - 1
EMPTY_KEY = -1
def range_violation(coords: torch.Tensor) -> str | None:
    """coords: (N, 4) integer -> None if every row can be packed, else what is out of range."""
    if coords.shape[0] == 0:
        return None
    return range_violation_of(coords.amin(dim=0).tolist(), coords.amax(dim=0).tolist())


def range_violation_of(lo: list[int], hi: list[int]) -> str | None:
    """:func:`range_violation` from the per-column minima and maxima [batch, x, y, z], read already."""
    if lo[0] < 0 or hi[0] > BATCH_MAX:
        return f"batch indices span [{lo[0]}, {hi[0]}], supported [0, {BATCH_MAX}]"
    if min(lo[1:]) < COORD_MIN or max(hi[1:]) > COORD_MAX:
        return (
            f"x, y, z span [{min(lo[1:])}, {max(hi[1:])}], supported [{COORD_MIN}, {COORD_MAX}] "
            "(in voxel units of stride 1)"
        )
    return None


def pack_coords(coords: torch.Tensor) -> torch.Tensor:
    """coords: (N, 4) integer [batch, x, y, z], already range-checked -> (N,) int64 keys.

    The fields do not overlap, so shifting each into place is multiplying by its power of two and
    or-ing them is summing: three torch ops (a new coordinate set's host time) instead of eleven."""
    shifts, bias = _packing(coords.device)
    return torch.mul(coords, shifts).sum(1).add_(bias)


@functools.cache
def _packing(device: torch.device) -> tuple[torch.Tensor, int]:
    """(the (4,) int64 multipliers of [batch, x, y, z], the packed key of the bias -COORD_MIN on x, y, z)."""
    shifts = [1 << (3 * COORD_BITS), 1 << (2 * COORD_BITS), 1 << COORD_BITS, 1]
    return torch.tensor(shifts, dtype=torch.int64, device=device), -COORD_MIN * sum(shifts[1:])


def floors_by_mask(stride: tuple[int, int, int]) -> bool:
    """Whether flooring coordinates to multiples of ``stride`` is an AND of their packed keys
    (:func:`floor_mask`): powers of two that divide the bias -COORD_MIN, so the result stays in range."""
    return all(s > 0 and s & (s - 1) == 0 and -COORD_MIN % s == 0 for s in stride)


@functools.cache
def floor_mask(stride: tuple[int, int, int]) -> int:
    """The int64 mask whose AND floors every coordinate field of a packed key to a multiple of
    ``stride`` (powers of two that divide the bias -COORD_MIN; the result stays in range)."""
    low = sum((s - 1) << (COORD_BITS * (2 - axis)) for axis, s in enumerate(stride))
    return ~low


@functools.lru_cache(maxsize=64)
def floor_masks(strides: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """(L,) int64 :func:`floor_mask` of each stride, on ``device`` (made once: :func:`~.floors.floor_sets` reads them)."""
    return torch.tensor([floor_mask(stride) for stride in strides], dtype=torch.int64).to(device)


def unpack_keys(keys: torch.Tensor) -> torch.Tensor:
    """keys: (N,) int64 from :func:`pack_coords` -> (N, 4) int32 [batch, x, y, z].

    Each field is a shift, a mask and a bias: one broadcast op each over the four columns (four
    ops on a new coordinate set instead of thirteen)."""
    shifts, fields, biases = _unpacking(keys.device)
    return keys[:, None].bitwise_right_shift(shifts).bitwise_and_(fields).add_(biases).to(torch.int32)


@functools.cache
def _unpacking(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shifts, field masks, biases), (4,) int64 each, of [batch, x, y, z] in a packed key."""
    field = (1 << COORD_BITS) - 1
    values = ([3 * COORD_BITS, 2 * COORD_BITS, COORD_BITS, 0], [BATCH_MAX, field, field, field], [0, *[COORD_MIN] * 3])
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in values)
