"""SparseTensor: integer voxel coordinates, features, a stride and the shared coordinate cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._args import Triple, triple
from .coords.cache import CoordinateCache, on_device
from .coords.hashing import CoordHashTable
from .coords.keys import range_violation_of, unpack_keys
from .coords.host_copy import HostCopy

DUPLICATE_MODES = ("error", "sum", "mean")
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


class SparseTensor:
    """Features on occupied voxels of a batch of 3D grids.

    coords: (N, 4) integer ``[batch, x, y, z]``, stored as int32; x, y, z are in voxel units of
    the input grid, so a tensor at stride ``s`` has coordinates that are multiples of ``s``.
    feats: (N, C) float16/bfloat16/float32/float64 on the same device.
    on_duplicate: ``"error"`` (default) rejects repeated coordinates; ``"sum"`` / ``"mean"`` merge
    their features (the merged tensor's rows are then sorted by ``[batch, x, y, z]``).
    validate: skip the checks (shape, dtype, range, duplicates) only for coordinates known to be
    valid. On a GPU with ``on_duplicate="error"`` the range, grid and duplicate checks run on the
    device with the hash table's build and the host reads them where it next waits for the GPU,
    at the latest at the coordinates' first use (a kernel map, ``batch_size``, ``dense``, ``to``):
    bad coordinates raise there, not here (:meth:`check` reads them at once).
    """

    def __init__(
        self,
        coords: torch.Tensor | np.ndarray,
        feats: torch.Tensor | np.ndarray,
        stride: int | Sequence[int] = 1,
        *,
        on_duplicate: str = "error",
        validate: bool = True,
    ) -> None:
        coords = _as_tensor(coords, "coords")
        feats = _as_tensor(feats, "feats")
        stride = triple(stride, "stride")
        keys = table = None
        cache = CoordinateCache(coords.device)
        if validate:
            coords, feats, keys, table = _validated(coords, feats, stride, on_duplicate, cache)
        self.feats = feats
        self.cache = cache
        self.coord_id = cache.add(coords.to(torch.int32).contiguous(), stride, canonical=True, keys=keys, table=table)

    @classmethod
    def _derived(cls, feats: torch.Tensor, cache: CoordinateCache, coord_id: int) -> SparseTensor:
        """A tensor on an existing coordinate set of ``cache`` (no checks, no copies)."""
        tensor = cls.__new__(cls)
        tensor.feats = feats
        tensor.cache = cache
        tensor.coord_id = coord_id
        return tensor

    @property
    def coords(self) -> torch.Tensor:
        """(N, 4) int32 ``[batch, x, y, z]``."""
        return self.cache.coord_set(self.coord_id).coords

    @property
    def stride(self) -> Triple:
        return self.cache.coord_set(self.coord_id).stride

    @property
    def device(self) -> torch.device:
        return self.feats.device

    @property
    def dtype(self) -> torch.dtype:
        return self.feats.dtype

    @property
    def num_channels(self) -> int:
        return self.feats.shape[1]

    def __len__(self) -> int:
        return self.feats.shape[0]

    def check(self) -> SparseTensor:
        """Read the checks of the coordinates now (raising ``ValueError`` for bad ones) and return self;
        on a GPU they are otherwise read at the coordinates' first use (see the class)."""
        self.cache.settle()
        return self

    @property
    def batch_size(self) -> int:
        """1 + the largest batch index of the batch (0 for an empty tensor); shared by every
        tensor derived from the same input, so it costs one host sync per batch."""
        return self.cache.batch_size

    def replace(self, feats: torch.Tensor) -> SparseTensor:
        """Same coordinates and cache, new features: feats (N, C') floating on the same device."""
        if not isinstance(feats, torch.Tensor):
            raise TypeError(f"feats must be a torch.Tensor, got {type(feats).__name__}")
        if feats.dim() != 2 or feats.shape[0] != len(self):
            raise ValueError(f"feats must have shape ({len(self)}, C), got {tuple(feats.shape)}")
        if feats.device != self.device:
            raise ValueError(f"feats must be on {self.device} like the coordinates, got {feats.device}")
        return SparseTensor._derived(feats, self.cache, self.coord_id)

    def to(self, *args, **kwargs) -> SparseTensor:
        """Like ``torch.Tensor.to`` on the features; a new device moves the whole coordinate cache."""
        feats = self.feats.to(*args, **kwargs)
        if not feats.is_floating_point():
            raise TypeError(f"SparseTensor.to: features must stay floating point, got {feats.dtype}")
        return SparseTensor._derived(feats, self.cache.to(feats.device), self.coord_id)

    def cpu(self) -> SparseTensor:
        return self.to("cpu")

    def cuda(self, device: int | str | torch.device | None = None) -> SparseTensor:
        return self.to("cuda" if device is None else device)

    def dense(
        self, shape: Sequence[int] | None = None, origin: Sequence[int] | None = None
    ) -> torch.Tensor:
        """(B, C, X, Y, Z) dense grid of this tensor's resolution (one cell per ``stride`` voxels).

        origin: the (x, y, z) voxel that maps to cell 0 (default 0; a multiple of the stride).
        shape: the spatial size (X, Y, Z); default just covers every coordinate.
        """
        self.cache.settle()
        stride = self.stride
        origin = (0, 0, 0) if origin is None else _int3(origin, "origin")
        if any(o % s for o, s in zip(origin, stride)):
            raise ValueError(f"origin must be a multiple of the stride {stride}, got {origin}")
        if shape is not None:
            shape = _int3(shape, "shape")
            if min(shape) < 0:
                raise ValueError(f"shape must be 3 non-negative ints (X, Y, Z), got {shape}")
        coords = self.coords
        cells = torch.div(coords[:, 1:].long() - on_device(origin, self.device, torch.int64),
                          on_device(stride, self.device, torch.int64), rounding_mode="floor")
        # The cells' bounds in one read of the device: the range checks and the default shape.
        lo, hi = torch.stack(torch.aminmax(cells, dim=0)).tolist() if len(self) else ([0] * 3, [-1] * 3)
        if min(lo) < 0:
            low = [c * s + o for c, s, o in zip(lo, stride, origin)]
            raise ValueError(f"dense: coordinates lie below origin {origin} (min {tuple(low)}); pass origin= "
                             "(e.g. the minimum coordinate)")
        size = [h + 1 for h in hi] if shape is None else list(shape)
        if shape is not None and any(h >= n for h, n in zip(hi, shape)):
            raise ValueError(f"shape {shape} is too small: cells reach {tuple(h + 1 for h in hi)}")
        out = self.feats.new_zeros((self.batch_size, *size, self.num_channels))
        index = (coords[:, 0], cells[:, 0], cells[:, 1], cells[:, 2])
        out = out.index_put(index, self.feats)
        return out.permute(0, 4, 1, 2, 3).contiguous()

    @classmethod
    def from_dense(
        cls, x: torch.Tensor, stride: int | Sequence[int] = 1, origin: Sequence[int] | None = None
    ) -> SparseTensor:
        """x: (B, C, X, Y, Z) floating -> the cells where any channel is non-zero, at ``stride``."""
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            raise ValueError(f"x must be a (B, C, X, Y, Z) tensor, got {getattr(x, 'shape', type(x).__name__)}")
        stride = triple(stride, "stride")
        origin_t = torch.tensor((0, 0, 0) if origin is None else _int3(origin, "origin"), device=x.device)
        cells = (x != 0).any(dim=1).nonzero()
        xyz = cells[:, 1:] * torch.tensor(stride, device=x.device) + origin_t
        coords = torch.cat([cells[:, :1], xyz], dim=1)
        feats = x.permute(0, 2, 3, 4, 1)[cells[:, 0], cells[:, 1], cells[:, 2], cells[:, 3]]
        return cls(coords, feats, stride)

    def __repr__(self) -> str:
        return (
            f"SparseTensor(N={len(self)}, C={self.num_channels}, stride={self.stride}, "
            f"dtype={self.dtype}, device={self.device})"
        )


def _as_tensor(value: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    return value


def _read_checks(flags: list[int], coords: torch.Tensor, keys: torch.Tensor, stride: Triple,
                 reject_duplicates: bool) -> int | None:
    """What :meth:`CoordHashTable.build_checked`'s flags say: raise for coordinates out of range or off
    the stride's grid (and repeated ones if ``reject_duplicates``); the batch size, or None where rows
    repeat (to be merged)."""
    *checks, batch_max = flags
    out_of_range, off_grid, has_duplicates = (flag > 0 for flag in checks)
    if out_of_range:
        wide = coords.long()
        lo, hi = wide.amin(0).tolist(), wide.amax(0).tolist()
        if lo[0] < 0:
            raise ValueError(f"coords: batch indices (column 0) must be >= 0, got {lo[0]}")
        raise ValueError(f"coords out of the supported range: {range_violation_of(lo, hi)}")
    if off_grid:
        off = (coords[:, 1:] % torch.tensor(stride, device=coords.device) != 0).any(dim=1)
        row = int(off.nonzero()[0, 0])
        raise ValueError(
            f"coords of a tensor at stride {stride} must be multiples of it along x, y, z; "
            f"row {row} is {coords[row].tolist()}"
        )
    if not has_duplicates:
        return batch_max + 1
    if reject_duplicates:
        unique, counts = torch.unique(keys, return_counts=True)
        repeated_row = unpack_keys(unique[counts > 1][:1])[0].tolist()
        raise ValueError(
            f"coords has {keys.shape[0] - unique.shape[0]} duplicate rows (e.g. {repeated_row}); merge them "
            "with on_duplicate='sum' or 'mean'"
        )
    return None


def _int3(value: Sequence[int], name: str) -> tuple[int, int, int]:
    value = tuple(int(v) for v in value)
    if len(value) != 3:
        raise ValueError(f"{name} must have 3 entries (x, y, z), got {value!r}")
    return value


def _validated(
    coords: torch.Tensor, feats: torch.Tensor, stride: Triple, on_duplicate: str, cache: CoordinateCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, CoordHashTable | None]:
    """(coords int32, feats, their packed keys, their hash table), duplicates merged as ``on_duplicate``
    says (keys and table None where not made here); the batch size the checks read goes to ``cache``, or,
    on a GPU rejecting duplicates, the checks themselves, read later (:meth:`CoordinateCache.settle`)."""
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must have shape (N, 4) as [batch, x, y, z], got {tuple(coords.shape)}")
    if coords.is_floating_point() or coords.is_complex() or coords.dtype == torch.bool:
        raise TypeError(
            f"coords must be an integer tensor, got {coords.dtype}; quantise points first, e.g. "
            "torch.floor(xyz / voxel_size).int()"
        )
    if feats.dim() != 2:
        raise ValueError(f"feats must have shape (N, C), got {tuple(feats.shape)}")
    if not feats.is_floating_point():
        raise TypeError(f"feats must be floating point (float16, bfloat16, float32, float64), got {feats.dtype}")
    if feats.shape[0] != coords.shape[0]:
        raise ValueError(
            f"coords and feats must have the same number of rows, got coords N={coords.shape[0]} "
            f"and feats N={feats.shape[0]}"
        )
    if coords.device != feats.device:
        raise ValueError(f"coords and feats must be on one device, got coords on {coords.device}, feats on {feats.device}")
    if coords.device.type == "meta":
        raise ValueError("coords and feats must hold data (e.g. on cpu or cuda), got tensors on the meta device")
    if coords.dtype in _WIDE_UNSIGNED:
        # torch has no min/max for these on the CPU; every valid coordinate fits in int64.
        coords = coords.to(torch.int64)
    if on_duplicate not in DUPLICATE_MODES:
        raise ValueError(f"on_duplicate must be one of {DUPLICATE_MODES}, got {on_duplicate!r}")
    if coords.shape[0] == 0:
        return coords.to(torch.int32), feats, None, None
    if coords.dtype != torch.int32:
        # Saturating, so that a value beyond int32 stays out of the packable range (the kernel flags it).
        info = torch.iinfo(torch.int32)
        narrow = (coords.clamp(info.min, info.max) if coords.dtype == torch.int64 else coords).to(torch.int32)
    else:
        narrow = coords
    # The range, grid and duplicate checks and the set's hash table in one kernel, read in one
    # transfer, and no sort.
    table, keys, flags = CoordHashTable.build_checked(narrow, stride)
    if narrow.is_cuda and on_duplicate == "error":
        # Nothing here depends on what they find: the host reads them where it next waits for the GPU
        # anyway, at the latest when the tensor's coordinates are first used (CoordinateCache.settle),
        # instead of waiting here for all the work queued before them.
        flags_copy = HostCopy(flags)
        cache.defer_checks(lambda: _read_checks(flags_copy.values(), coords, keys, stride, True))
        return narrow, feats, keys, table
    values = flags.tolist()
    cache.set_batch_size(values[3] + 1)
    if _read_checks(values, coords, keys, stride, on_duplicate == "error") is not None:
        return narrow, feats, keys, table
    unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    merged = feats.new_zeros((unique.shape[0], feats.shape[1])).index_add(0, inverse, feats)
    if on_duplicate == "mean":
        merged = merged / counts.to(merged.dtype)[:, None]
    return unpack_keys(unique), merged, unique, None
