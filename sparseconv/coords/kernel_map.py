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
import itertools
import math
import weakref
from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar

import torch

from .host_copy import HostCopy

Triple = tuple[int, int, int]
V = TypeVar("V")


class KernelMapKey(NamedTuple):
    """What a kernel map depends on: the source coordinate set and the conv geometry.

    A named tuple, not a frozen dataclass: every conv call makes one and looks it up, and the
    tuple's C-level construction, hash and equality cost a fraction of the dataclass's."""

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
    (the centre of an odd submanifold kernel): backends may run it as a plain matmul, and such a
    map's offsets are symmetric about it (what :attr:`transposed_neighbors` relies on).
    Every view is built on the device without a host sync except :attr:`pair_counts` (one
    transfer of K integers), which the views needing pair counts on the host share.
    """

    def __init__(
        self,
        neighbors: torch.Tensor,
        num_in: int,
        kernel_size: Triple,
        identity_offset: int | None = None,
    ) -> None:
        self.neighbors = neighbors
        self._describe(num_in, neighbors.shape[0], kernel_size, identity_offset)
        _own_table(self)

    def _describe(self, num_in: int, num_out: int, kernel_size: Triple, identity_offset: int | None) -> None:
        """Everything but the table (which :class:`_AdjointMap` makes lazily)."""
        self.num_in = num_in
        self.num_out = num_out
        self.kernel_size = kernel_size
        self.kernel_volume = math.prod(kernel_size)
        self.identity_offset = identity_offset
        self._derived: dict[Hashable, object] = {}
        self.transpose_of: KernelMap | None = None
        """The map this one is the adjoint of (see :meth:`transposed`), or None if it was queried."""
        self.each_input_once = False
        """Every input row is in exactly one pair (a strided conv whose kernel equals its stride:
        each voxel lies in one coarse cell). Set by whoever builds the map; False means unknown."""
        self.each_output_once = False
        """Every output row is in exactly one pair (the transpose of such a map); False means unknown."""

    def transposed(self) -> KernelMap:
        """The adjoint map (inputs and outputs swapped, same offset index): a transposed conv's map
        is the transpose of the strided conv that made its coordinates. It shares this map's
        pairs and counts and has this map's table as its transposed table, so nothing is built twice.
        One object per map (the adjoint of an adjoint is its source): backends keep the views of a
        product on the map whose table it walks, so a dgrad finds those of its adjoint's forward."""
        if self.transpose_of is not None:
            return self.transpose_of
        ref = self.__dict__.get("_adjoint")
        adjoint = None if ref is None else ref()
        if adjoint is None:
            adjoint = _AdjointMap(self)
            # A weak reference: the adjoint refers to its source, and a cycle between two maps
            # would hold their GPU tables until a full garbage collection, batch after batch.
            self.__dict__["_adjoint"] = weakref.ref(adjoint)
        return adjoint

    @functools.cached_property
    def transposed_neighbors(self) -> torch.Tensor:
        """(N_in, K) int32: the output row that input row ``j`` feeds through offset ``k``, or -1 (the
        table dgrad walks). One scatter, no host sync: within an offset an input feeds at most one
        output, so only the spare row that absent neighbours are sent to sees colliding writes."""
        if self.identity_offset is not None:
            # Same coordinates on both sides and offsets symmetric about the centre (offset
            # K-1-k is -delta_k): row j feeds row i through k exactly when i feeds j through
            # K-1-k, so the transposed table is this one with its columns reversed (one op).
            return self.neighbors.flip(1)
        num_out, volume = self.neighbors.shape
        table = torch.full((self.num_in + 1, volume), -1, dtype=torch.int32, device=self.neighbors.device)
        target = torch.where(self.neighbors >= 0, self.neighbors, self.num_in).long()
        rows = torch.arange(num_out, dtype=torch.int32, device=table.device).unsqueeze(1).expand(num_out, volume)
        return table.scatter_(0, target, rows)[: self.num_in]

    @functools.cached_property
    def offset_counts(self) -> torch.Tensor:
        """(K,) int64 pairs per offset, on the map's device (no host sync)."""
        if self.transpose_of is not None:
            return self.transpose_of.offset_counts
        return count_pairs([self], None if self.kernels is None else self.kernels.pair_counts)[0]

    @functools.cached_property
    def pair_counts(self) -> list[int]:
        """Number of (input, output) pairs per offset, length K, on the host (one sync per map and
        its adjoint together; for a planned map, a wait for the plan's copy of every map's counts,
        which the plan started without waiting: :class:`HostCopy`)."""
        if self.transpose_of is not None:
            return self.transpose_of.pair_counts
        copied = self.__dict__.pop("_counts_copy", None)
        if copied is not None:
            counts, start = copied
            return counts.values()[start: start + self.kernel_volume]
        return self.offset_counts.tolist()

    def counts_copied(self, counts: HostCopy, start: int) -> None:
        """Where :attr:`pair_counts` will be read from: ``counts``, from ``start`` (the map plan copies
        every map's counts at once)."""
        self.__dict__["_counts_copy"] = (counts, start)

    @functools.cached_property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CSR by offset: ``in_idx (P,) int64``, ``out_idx (P,) int64``, ``offset_ptr (K+1,) int64``.

        Pairs of offset ``k`` are ``[offset_ptr[k], offset_ptr[k+1])``, sorted by output row (by
        input row for a :meth:`transposed` map, whose pairs are its source's swapped).
        """
        if self.transpose_of is not None:
            in_idx, out_idx, offset_ptr = self.transpose_of.pairs
            return out_idx, in_idx, offset_ptr
        built = None if self.kernels is None else self.kernels.pair_lists(self)
        if built is not None:
            return built
        if self.neighbors.device.type == "cpu":
            in_idx, out_idx, counts = self._cpu_pair_lists
        else:  # the host already knows the pair count (pair_counts), so the compaction needs no sync
            in_idx, out_idx = _pair_lists(self.neighbors, _nonzero(self.neighbors.t() >= 0, self.num_pairs))
            counts = self.offset_counts
        offset_ptr = torch.zeros(self.kernel_volume + 1, dtype=torch.int64, device=in_idx.device)
        torch.cumsum(counts, 0, out=offset_ptr[1:])
        return in_idx, out_idx, offset_ptr

    @functools.cached_property
    def _cpu_pair_lists(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """On a CPU: (in_idx, out_idx) of :attr:`pairs` and the (K,) int64 counts per offset, the counts from the
        pairs found (a bincount: the column sums of the (N, K) mask cost 6-9 ms at 92k rows on two cores, more
        than the lists; every CPU backend reads the lists). nonzero, not nonzero_static: no sync to save, and
        nonzero runs on every core."""
        found = (self.neighbors.t() >= 0).nonzero()
        return *_pair_lists(self.neighbors, found), torch.bincount(found[:, 0], minlength=self.kernel_volume)

    @functools.cached_property
    def num_pairs(self) -> int:
        """Total pairs: read from the map's own description where it says (every input, or every
        output, in exactly one pair: a strided conv whose kernel equals its stride, its transpose),
        which needs no host sync; else the sum of :attr:`pair_counts` (one sync per map)."""
        if self.each_input_once:
            return self.num_in
        if self.each_output_once:
            return self.num_out
        return sum(self.pair_counts)

    @functools.cached_property
    def per_offset(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(in_idx_k, out_idx_k)]`` for every offset k (views into :attr:`pairs`)."""
        in_idx, out_idx, _ = self.pairs
        return list(zip(in_idx.split(self.pair_counts), out_idx.split(self.pair_counts)))

    kernels: MapKernels | None = None
    """The device kernels that build this map's :attr:`pairs` and :attr:`offset_counts` where they can
    (torch's ops otherwise): the floor above passes them with each map request
    (:func:`sparseconv.ops.batch.kernel_map`), and the coordinate cache gives them to the maps it builds."""
    on_view: Callable[[Hashable], None] | None = None
    """Told the key of each view this map's layers use (the first time): the map plan's record of the batch
    keeps them for the next batch's maps (set by :meth:`.plan.Record.note`)."""

    def derived(self, key: Hashable, build: Callable[[KernelMap], V], product: bool = False) -> V:
        """A backend's own view of this map (e.g. padded groups), built on first use and kept with the
        map; a view :meth:`offer` holds is taken instead of building it. ``product``: a prepared
        product, which may hold releasable views (:meth:`release_views` drops it with them)."""
        view = self._derived.get(key, _NONE)  # one lookup on the hot path (a step makes ~300)
        if view is _NONE:
            offered = self.__dict__.get("_offered")
            view = offered.pop(key, _NONE) if offered else _NONE
            view = self._derived[key] = build(self) if view is _NONE else view
            if product:
                self.__dict__.setdefault("_products", []).append(key)
            if self.on_view is not None:
                self.on_view(key)
        return view  # type: ignore[return-value]

    def view_keys(self) -> list[Hashable]:
        """The keys of the views built or taken so far, in that order."""
        return list(self._derived)

    def offer(self, key: Hashable, view: object, releasable: bool = False) -> None:
        """Hold ``view``, built ahead (several maps' views in one pass), for :meth:`derived` to take
        when a layer asks for ``key``; one never asked for is not reported to :attr:`on_view`.
        ``releasable``: ``view.release()`` frees its memory after the map's last forward product of a
        training pass (:meth:`release_views`); whoever reads it then calls ``view.restore()`` first."""
        self.__dict__.setdefault("_offered", {})[key] = view
        if releasable:
            self.__dict__.setdefault("_releasable", []).append(key)

    def fill(self) -> tuple[int, int]:
        """(pairs, table slots) of this map: the map plan's estimate where it offered one (:data:`FILL_VIEW`: the last
        batch's map under this map's key, for a map built when a layer asked for it), read without a wait, else this
        map's own (its pair count: a host sync where the map does not say it)."""
        return self.derived(FILL_VIEW, lambda m: (m.num_pairs, m.num_out * m.kernel_volume))

    def ranking_counts(self) -> torch.Tensor:
        """(K,) counts that rank the offsets of a row order (rarest first): this map's where counted already, else
        the map plan's estimate where it offered one (:data:`RANKS_VIEW`: an earlier batch's map under this map's key,
        for a lone map whose own are not counted), else this map's, counted now. Any ranking makes a correct order;
        a good one makes tiles dense, and an earlier batch's map of the same layer ranks the same offsets rarest."""
        counts = self.__dict__.get("offset_counts")
        if counts is None:
            counts = self.derived(RANKS_VIEW, lambda m: m.offset_counts)
        return counts

    def unviewed(self) -> KernelMap:
        """This map as a new batch's build leaves it: its table, sizes, flags and pair counts, none of the
        views or products built on it since (the tuner times a lone map's candidates on these)."""
        if self.transpose_of is not None:
            return self.transpose_of.unviewed().transposed()
        copy = KernelMap.__new__(KernelMap)
        copy.neighbors = self.neighbors
        copy._describe(self.num_in, self.num_out, self.kernel_size, self.identity_offset)
        copy.each_input_once, copy.each_output_once = self.each_input_once, self.each_output_once
        copy.kernels = self.kernels
        offered = self.__dict__.get("_offered") or {}
        for key in (FILL_VIEW, RANKS_VIEW):  # the plan's estimates: what this batch knew before the map was counted
            view = self._derived.get(key, offered.get(key, _NONE))
            if view is not _NONE:
                copy.offer(key, view)
        for name in ("offset_counts", "pair_counts", "num_pairs"):
            if name in self.__dict__:
                copy.__dict__[name] = self.__dict__[name]
        return copy

    def release_views(self) -> list[KernelMap]:
        """Release the releasable views' memory (:meth:`offer`), and drop the products prepared on this map
        and on its adjoint (a dgrad's product on one walks the other's views), which may hold them: the next
        product is prepared again, through the views' readers, which restore them. Returns the maps whose
        products went (none if nothing was releasable): their batch drops its prepared calls on them too
        (:meth:`sparseconv.coords.batch.MapUse.release`)."""
        keys = self.__dict__.pop("_releasable", ())
        if not keys:
            return []
        offered = self.__dict__.get("_offered") or {}
        for key in keys:
            view = self._derived.get(key, offered.get(key))
            release = getattr(view, "release", None)
            if release is not None:
                release()
        ref = self.__dict__.get("_adjoint")
        maps = [m for m in (self, self.transpose_of if ref is None else ref()) if m is not None]
        for kernel_map in maps:
            for key in kernel_map.__dict__.pop("_products", ()):
                kernel_map._derived.pop(key, None)
        return maps

    def __repr__(self) -> str:
        return (
            f"KernelMap(num_in={self.num_in}, num_out={self.num_out}, "
            f"kernel_size={self.kernel_size}, identity_offset={self.identity_offset})"
        )


_NONE = object()

FILL_VIEW, RANKS_VIEW = ("map_fill",), ("ranking_counts",)
"""The keys of a map's estimates of its counts, which the map plan offers a new batch's map (:meth:`KernelMap.offer`)
from an earlier batch's map under the same key before this one is counted (:meth:`.plan.Record.note`): its (pairs,
table slots), which the tuner's key reads (:meth:`KernelMap.fill`), and its (K,) pairs per offset on the device,
which a lone map's row orders rank its offsets by (:meth:`KernelMap.ranking_counts`)."""


_owners: dict[int, weakref.ref[KernelMap]] = {}
"""Table address -> the map that owns it (see :func:`owner_of`); dead entries pruned as it grows."""
_prune_at = 1024


def _own_table(kernel_map: KernelMap) -> None:
    # ~0.4 µs once per map built (not per conv call): a plain dict of weak references, because a
    # WeakValueDictionary costs ~4 µs an insert.
    global _prune_at
    if len(_owners) >= _prune_at:
        for address in [a for a, ref in _owners.items() if ref() is None]:
            del _owners[address]
        _prune_at = max(1024, 2 * len(_owners))
    _owners[kernel_map.neighbors.data_ptr()] = weakref.ref(kernel_map)


def owner_of(neighbors: torch.Tensor) -> KernelMap | None:
    """The live map whose ``neighbors`` is this (N_out, K) int32 table, or None.

    For torch.compile's custom ops (:mod:`sparseconv.ops.compiled`), which receive the table but
    not the map, and so find the map's cached views again. A live map keeps its table alive, so
    no other tensor can sit at that address: a match of device, address, shape and strides is it.
    """
    ref = _owners.get(neighbors.data_ptr())
    found = None if ref is None else ref()
    if found is None:
        return None
    table = found.neighbors
    if table.device != neighbors.device or table.shape != neighbors.shape or table.stride() != neighbors.stride():
        return None
    return found


class _AdjointMap(KernelMap):
    """:meth:`KernelMap.transposed`: its neighbour table (the source's transposed table, a scatter
    of ~8 torch ops) is built only if a backend reads it; pair-list backends never do."""

    def __init__(self, source: KernelMap) -> None:
        self._describe(source.num_out, source.num_in, source.kernel_size, source.identity_offset)
        self.__dict__["transposed_neighbors"] = source.neighbors
        self.transpose_of = source
        self.kernels = source.kernels
        self.each_input_once, self.each_output_once = source.each_output_once, source.each_input_once

    @functools.cached_property
    def neighbors(self) -> torch.Tensor:  # type: ignore[override] - an attribute of a queried map
        table = self.__dict__["neighbors"] = self.transpose_of.transposed_neighbors  # _own_table reads it
        _own_table(self)  # found by its table from now on (torch.compile's ops), as a queried map is
        return table


PairLists = Callable[[KernelMap], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
"""pair_lists(map): :attr:`KernelMap.pairs` (the same lists, in the same order), or None where it cannot."""

PairCounter = Callable[[list[KernelMap]], tuple[torch.Tensor, list[int]] | None]
"""counter(maps): every map's pairs per offset in one int64 tensor on their device and where each
map's start in it; None where it cannot (the torch ops then do: two a map and a concatenation)."""


class MapKernels(NamedTuple):
    """Device kernels that build maps' pair lists and pair counts faster than torch's ops (each returns
    None where it cannot, and torch's ops build them). They belong to the floor above (Triton kernels of
    :mod:`sparseconv.backends`): :mod:`sparseconv.ops.batch` names the library's, and passes them with
    each map request; nothing is registered here."""

    pair_lists: PairLists
    pair_counts: PairCounter


def count_pairs(maps: list[KernelMap], counter: PairCounter | None = None) -> tuple[torch.Tensor, list[int]]:
    """(K_1 + ... ,) int64 pairs per offset of every map of ``maps`` (maps with their own tables), on
    their device and without a host sync, and where each map's counts start in it; by ``counter`` where
    it can (:attr:`MapKernels.pair_counts`)."""
    counted = None if counter is None else counter(maps)
    if counted is None:  # (a CPU map's with its pair lists)
        counts = [kernel_map._cpu_pair_lists[2] if kernel_map.neighbors.device.type == "cpu" else
                  (kernel_map.neighbors >= 0).sum(0) for kernel_map in maps]
        counted = (counts[0] if len(counts) == 1 else torch.cat(counts),
                   list(itertools.accumulate((m.kernel_volume for m in maps[:-1]), initial=0)))
    return counted


def _pair_lists(neighbors: torch.Tensor, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_idx, out_idx) int64 of the (offset, output row) pairs ``found`` (P, 2) in ``neighbors`` (N, K)."""
    # out_idx in an allocation of its own (clone, not contiguous: CUDA's nonzero returns the
    # transpose of a (2, P) buffer, whose second row starts at 8·P bytes, unaligned for odd P).
    # Triton compiles a kernel per pointer alignment, so kernels compiled ahead of a sweep for
    # aligned arrays were compiled again for such maps (H100, 2026-11-25).
    offset_idx, out_idx = found[:, 0], found[:, 1].clone()
    return neighbors[out_idx, offset_idx].to(torch.int64), out_idx


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """(count, mask.dim()) int64 indices of the True entries of ``mask`` (``count`` of them), in row-major order."""
    try:
        return torch.nonzero_static(mask, size=count)
    except (NotImplementedError, RuntimeError):  # a device without nonzero_static: one more sync
        return mask.nonzero()
