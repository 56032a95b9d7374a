"""A new batch's planned kernel maps, built at once at its first map request (:mod:`.plan` says which).

Every canonical power-of-two coordinate set and its table by :func:`~.floors.floor_sets` (hash inserts of the
input's floored keys, one sync for all their sizes), every neighbour table in one launch on a GPU (up to
16 maps, of any kernel volumes, reading the input set's or the coarse sets' arrays), the sets generative
convs make from those and the maps on them (one host read each for a set's size, as a layer's build), and
the maps' pair counts in one more transfer; then the views and products the last batches' layers used,
through the builders the batch was given (:class:`~.batch.Builders`: the backends' and the tuner's).
The maps are those a lazy build makes, bit for bit (the same sets, in their cells' first-row order, and the
same queries).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import NamedTuple

import torch

from .batch import Builders
from .floors import floor_sets
from .hashing import MAX_LEVELS, MAX_MAPS, CoordHashTable, MapQuery, query_many
from .keys import floor_masks, floors_by_mask
from .host_copy import HostCopy
from .kernel_map import KernelMap, KernelMapKey, Triple, count_pairs, offset_deltas
from .sets import CoordinateSets

ALIGN = 16
"""Neighbour tables of one launch start at multiples of this many entries (64 bytes): Triton
specialises pointers on 16-byte alignment, and an unaligned table would be another compile."""


class MapSpec(NamedTuple):
    """A regular (not transposed) map from the set at ``source_stride``: the canonical one, or where
    ``origin`` is given the generated one it names (:meth:`~.cache.CoordinateCache.origin`); a
    ``generative`` map's output set is generated (its origin :attr:`output_origin`)."""

    source_stride: Triple
    kernel_size: Triple
    stride: Triple
    dilation: Triple
    origin: tuple = ()
    generative: bool = False

    @property
    def output_stride(self) -> Triple:
        return times(self.source_stride, self.stride)

    @property
    def generated(self) -> bool:
        """Whether the map reads or makes a generated set (built by :func:`_generated_maps`)."""
        return self.generative or bool(self.origin)

    @property
    def base_stride(self) -> Triple:
        """The stride of the canonical set the map's sets come from."""
        return self.origin[0] if self.origin else self.source_stride

    @property
    def output_origin(self) -> tuple:
        return (*(self.origin or (self.source_stride,)), (self.kernel_size, self.stride, self.dilation))


def build(cache: CoordinateSets, plan: list[MapSpec],
          views: dict[tuple[MapSpec, bool], dict[Hashable, None]] | None = None,
          calls: dict[tuple[MapSpec, bool], dict[Hashable, None]] | None = None
          ) -> dict[KernelMapKey, tuple[KernelMap, int]]:
    """Build the maps of ``plan`` that the input set reaches through power-of-two floors and generative
    convs (:func:`_generated_maps`), through the batch's view builders (``cache.batch.builders``) the
    ``views`` their counterparts (or their adjoints) used, and through its call builder the products of
    ``calls``; returns the maps by key with their output set ids (the coarse sets are
    registered in ``cache``; an adjoint with views under its transposed conv's key, which keeps it alive
    until asked for)."""
    base = cache.coord_set(0).stride
    strides = [base]
    for spec in plan:
        for stride in (spec.base_stride,) if spec.generated else (spec.source_stride, spec.output_stride):
            if stride not in strides and len(strides) <= MAX_LEVELS and floorable(stride, base):
                strides.append(stride)
    plan = [spec for spec in plan if spec.base_stride in strides and (spec.generated or spec.output_stride in strides)]
    if not plan:
        return {}
    levels = _add_levels(cache, strides[1:]) if len(strides) > 1 else None
    ids = {stride: cache.canonical(stride) for stride in strides}
    regular = [spec for spec in plan if not spec.generated]
    keys = {spec: _key_of(spec, ids) for spec in regular}
    built: dict[KernelMapKey, tuple[KernelMap, int]] = {}
    for start in range(0, len(regular), MAX_MAPS):
        built.update(_query(cache, regular[start: start + MAX_MAPS], ids, base, levels))
    built.update(_generated_maps(cache, [spec for spec in plan if spec.generated], ids, keys))
    copy_pair_counts([kernel_map for kernel_map, _ in built.values()])
    # Per planned map and its adjoint (made here where the last batches' layers used views of it): the views
    # to build and the products to prepare.
    batch = cache.batch
    builders: Builders = batch.builders
    views = views if builders.views else None
    calls = calls if builders.prepare is not None else None
    wanted, prepared = [], []
    for spec in plan if views or calls else ():
        hit = built.get(keys.get(spec))
        if hit is None:
            continue
        adjoint = None
        if views and views.get((spec, True)) and hit[0].identity_offset is None and not spec.generated:
            adjoint = hit[0].transposed()
            up = KernelMapKey(ids[spec.output_stride], spec.kernel_size, spec.stride, spec.dilation, True, False)
            built[up] = (adjoint, ids[spec.source_stride])
        for kernel_map, which in ((hit[0], (spec, False)), (adjoint, (spec, True))):
            if kernel_map is None:
                continue
            if views and views.get(which):
                wanted.append((kernel_map, list(views[which])))
            recipes = calls.get(which) if calls else None
            if recipes:
                use = batch.use(kernel_map)
                use.planned = recipes  # the new record keeps them (Record.note)
                prepared.append((kernel_map, use, list(recipes)))
    if views:
        for builder in builders.views:
            builder(wanted)
    if calls:
        builders.prepare(prepared)
    return built


class Levels(NamedTuple):
    """The coarse sets of one :func:`_add_levels`: their coordinates and their tables, set after set,
    in one array each (each set's coordinates and table are slices of these)."""

    coords: torch.Tensor
    table: CoordHashTable


def _add_levels(cache: CoordinateSets, strides: list[Triple]) -> Levels:
    """Register the canonical sets at ``strides`` (floors of the input set), with their tables."""
    sets = floor_sets(cache.keys(0), floor_masks(tuple(strides), cache.device))
    # Each array split at once (one torch op each, where a slice a set and array took four a level)
    parts = zip(strides, sets.coords.split(sets.counts), sets.keys.split(sets.counts),
                sets.table.keys.split(sets.capacity), sets.table.values.split(sets.capacity))
    for level, (stride, coords, keys, table_keys, table_values) in enumerate(parts):
        cache.add(coords, stride, canonical=True, keys=keys, table=CoordHashTable(table_keys, table_values),
                  floor_of=(0, sets, level))
    return Levels(sets.coords, sets.table)


def _query(cache: CoordinateSets, specs: list[MapSpec], ids: dict[Triple, int], base: Triple, levels: Levels | None
           ) -> dict[KernelMapKey, tuple[KernelMap, int]]:
    """The neighbour tables of ``specs`` in one launch on a GPU: their output sets are row slices of
    the input set's coordinates or of the coarse sets' (``levels``), their source tables slices of the
    input set's table or of the coarse sets' (one launch for every map, where one per output array,
    source array and kernel volume cost the host ~130 us each: four a MinkUNet batch)."""
    queries, out_base, offset_base, transposed_base, geometry, sources_rows = [], 0, 0, 0, [], []
    outs = [cache.coord_set(ids[spec.output_stride]).coords for spec in specs]
    sources = [cache.table(ids[spec.source_stride]) for spec in specs]
    fine = cache.coord_set(0).coords
    coords = (fine, levels.coords if levels is not None else fine)
    coarse = [(spec.output_stride != base, spec.source_stride != base) for spec in specs]
    # (the input set's table is not built for a batch none of whose maps read it)
    fine_table = levels.table if all(source for _, source in coarse) else cache.table(0)
    tables = (fine_table, levels.table if levels is not None else fine_table)
    # A submanifold map alone takes the one-map kernel (its bounds as arguments, no table of them to
    # copy to the device; a strided map's transposed table comes only from the batched kernel)
    one_launch = _one_launch(fine.device) and (len(specs) > 1 or specs[0].stride != (1, 1, 1))
    for spec, out, source, (coarse_rows, coarse_table) in zip(specs, outs, sources, coarse):
        volume, rows_in = math.prod(spec.kernel_size), _rows_in(cache, ids, spec)
        sources_rows.append(rows_in)
        # A strided map's transposed table (a transposed conv's, its own dgrad's) in the same launch:
        # a submanifold map's is its own with the columns reversed (one op, KernelMap).
        at = transposed_base if one_launch and spec.stride != (1, 1, 1) else -1
        queries.append(MapQuery(_start_in(out, coords[coarse_rows]), out.shape[0], offset_base, volume,
                                _start_in(source.keys, tables[coarse_table].keys), source.keys.shape[0], out_base, at,
                                coarse_rows, coarse_table))
        geometry.append((spec.kernel_size, times(spec.dilation, spec.source_stride)))
        offset_base += volume
        out_base += _aligned(out.shape[0] * volume)
        transposed_base += _aligned(rows_in * volume) if at >= 0 else 0
    offsets = offset_table(tuple(geometry), fine.device)
    transposed = [None] * len(queries)
    if one_launch:
        flat = torch.empty((out_base,), dtype=torch.int32, device=fine.device)
        flat_t = (torch.full((transposed_base,), -1, dtype=torch.int32, device=fine.device)
                  if transposed_base else None)
        query_many(coords, offsets, tables, flat, queries, flat_t)
        # Each map's table a part of one split (one torch op, where a slice a map took one more)
        parts = _split_at(flat, [(q.out_base, q.rows * q.volume) for q in queries])
        neighbors = [part.view(q.rows, q.volume) for part, q in zip(parts, queries)]
        asked = [(index, rows_in) for index, (q, rows_in) in enumerate(zip(queries, sources_rows))
                 if q.transposed_base >= 0]
        if asked:
            parts = _split_at(flat_t, [(queries[index].transposed_base, rows_in * queries[index].volume)
                                       for index, rows_in in asked])
            for (index, rows_in), part in zip(asked, parts):
                transposed[index] = part.view(rows_in, queries[index].volume)
    else:
        neighbors = [cache.query(_key_of(spec, ids), ids[spec.output_stride],
                                 offsets[q.offset_base: q.offset_base + q.volume]) for spec, q in zip(specs, queries)]
    built = {}
    for spec, table, table_t in zip(specs, neighbors, transposed):
        key = _key_of(spec, ids)
        out_id = ids[spec.output_stride]
        kernel_map = cache.new_map(key, table, out_id)
        if table_t is not None:
            kernel_map.__dict__["transposed_neighbors"] = table_t
        built[key] = (kernel_map, out_id)
    return built


def _generated_maps(cache: CoordinateSets, specs: list[MapSpec], ids: dict[Triple, int],
                    keys: dict[MapSpec, KernelMapKey]) -> dict[KernelMapKey, tuple[KernelMap, int]]:
    """The maps of ``specs`` that read or make generated sets (a detection backbone's: its strided convs
    generative, its blocks on their sets), as the layers' own builds make them, the sets before the maps
    that read them: a set's size is one host read (its layer's would be the same one), a map one query.
    Planned, their pair counts go to the host in the plan's one copy and their views and products are
    built with the other maps' (a backbone's 8 maps each built by its layer: ~4 ms of host time a pass).
    Records each built spec's key in ``keys``."""
    made: dict[tuple, int] = {}  # the generated sets by origin
    built = {}
    # The generations first (a set's origin is longer than its maker's), then the maps on their sets: a generation's
    # read of its size then waits for the GPU's work on the generations before it, not for those maps' queries too.
    for spec in sorted(specs, key=lambda spec: (not spec.generative, len(spec.origin))):
        source = made.get(spec.origin) if spec.origin else ids.get(spec.source_stride)
        if source is None:  # (its maker was not planned)
            continue
        key = KernelMapKey(source, spec.kernel_size, spec.stride, spec.dilation, False, spec.generative)
        try:
            built[key] = cache.build(key)
        except ValueError:
            # Bad coordinates (the input's, read by the generation, or a generated set out of range): the layer's
            # own build raises it to the caller; this batch's plan stops here and the next batches keep theirs.
            break
        keys[spec] = key
        if spec.generative:
            made[spec.output_origin] = built[key][1]
    return built


def _split_at(flat: torch.Tensor, parts: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The (start, length) parts of ``flat``, in increasing order and apart, by one split."""
    sizes, at = [], 0
    for start, length in parts:
        sizes += [start - at, length]
        at = start + length
    sizes.append(flat.shape[0] - at)
    return list(flat.split_with_sizes(sizes)[1::2])


def _aligned(entries: int) -> int:
    return -(-entries // ALIGN) * ALIGN


def _rows_in(cache: CoordinateSets, ids: dict[Triple, int], spec: MapSpec) -> int:
    return cache.coord_set(ids[spec.source_stride]).coords.shape[0]


def _key_of(spec: MapSpec, ids: dict[Triple, int]) -> KernelMapKey:
    return KernelMapKey(ids[spec.source_stride], spec.kernel_size, spec.stride, spec.dilation, False, False)


def _one_launch(device: torch.device) -> bool:
    """Whether a group's maps are queried in one launch: on a GPU, where a launch costs the host more
    than its kernel takes. On the CPU a launch costs little beside its kernel, and the one-map kernel
    is ~20% faster a row (measured on the CI machine's 2 cores): one launch per map there."""
    return device.type == "cuda"


def copy_pair_counts(maps: list[KernelMap]) -> HostCopy | None:
    """Every map's pairs per offset, copied to the host in one transfer that nothing waits for until
    a map's :attr:`~KernelMap.pair_counts` is read: the tuner's key needs a submanifold map's, and
    the wgrad backends every map's (and its adjoint's, the same list), which would otherwise be a
    host sync each in a training step's backward, with the GPU busy. Returns the copy (maps after maps)."""
    if not maps:
        return None
    kernels = maps[0].kernels  # (one cache's maps: the same kernels)
    together, starts = count_pairs(maps, None if kernels is None else kernels.pair_counts)
    copy = HostCopy(together)  # read where a tuner key or a wgrad first needs them, not here
    for kernel_map, start in zip(maps, starts):
        kernel_map.__dict__["offset_counts"] = together[start: start + kernel_map.kernel_volume]
        kernel_map.counts_copied(copy, start)
    return copy


def _start_in(part: torch.Tensor, whole: torch.Tensor) -> int:
    """Where ``part`` (a slice of ``whole``'s first dimension) starts in ``whole``, in rows."""
    return (part.data_ptr() - whole.data_ptr()) // (whole.stride(0) * whole.element_size())


@functools.lru_cache(maxsize=256)
def times(a: Triple, b: Triple) -> Triple:
    """The product per axis (a plan reads ~60 of a few distinct ones a batch: each a generator otherwise)."""
    return tuple(x * y for x, y in zip(a, b))


def floorable(stride: Triple, base: Triple) -> bool:
    """Whether the canonical set at ``stride`` is the floor of a set at ``base`` that the lazy build
    makes by one AND of packed keys (:func:`~sparseconv.coords.keys.floors_by_mask`)."""
    return stride != base and floors_by_mask(stride) and all(s % b == 0 for s, b in zip(stride, base))


@functools.lru_cache(maxsize=64)
def offset_table(geometry: tuple[tuple[Triple, Triple], ...], device: torch.device) -> torch.Tensor:
    """(sum of volumes, 3) int32: each map's ``delta * step`` offsets, map after map (made once per plan)."""
    parts = [offset_deltas(kernel_size) * torch.tensor(step, dtype=torch.int32) for kernel_size, step in geometry]
    return torch.cat(parts).contiguous().to(device)
