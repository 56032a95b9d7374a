"""A batch's kernel maps built into fixed-size tables with no host synchronisation: how a graphed pass's batch is
built (:mod:`sparseconv.ops.capacity`, :mod:`sparseconv.nn.graphed`).

The map plan (:mod:`.prebuild`) reads the coarse sets' sizes on the host before it queries the maps on them, so
a graphed call waited for the GPU twice (for the floors' counts, then for its replay) with the queries, the
tables' copies and the replay launched in between: ~1.5 ms of a 5 ms street1 inference (H200). Here the
layout is fixed ahead by a captured graph's capacities: each coarse set (a power-of-two floor of the input) is
written from a fixed row, at most its capacity (:func:`.floors.floor_sets_into`); each map's neighbour table
is queried straight into the graph's table over its output set's capacity (rows past the set's count hold -1
coordinates, found nowhere, so their entries are -1), a strided map's transposed table beside it; the sets'
counts go to the host in one copy that nothing waits for until the replay is queued. A batch whose set
outgrew its capacity is found then; its caller builds it again through the map plan. The tables are the plan's,
entry for entry (the same sets in the same order, the same queries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .floors import FixedFloors, floor_sets_into
from .hashing import MAX_LEVELS, MAX_MAPS, MapQuery, query_many
from .host_copy import HostCopy
from .kernel_map import KernelMapKey, Triple
from .keys import floor_masks
from .prebuild import offset_table, floorable, times
from .sets import CoordinateSets


class FixedMaps:
    """What builds one capture's maps into its tables (:meth:`build`), planned from its recorded requests
    (:meth:`plan`)."""

    def __init__(self, input_id: int, levels: list[int], strides: Mapping[int, Triple], queries: list[MapQuery],
                 floors: FixedFloors | None, masks: torch.Tensor | None, offsets: torch.Tensor) -> None:
        self.input_id, self.levels, self.strides = input_id, levels, strides
        self.queries = queries
        """Per map, its query of :func:`query_many` into the flat tables (the coarse sets' rows and tables at their
        fixed places); those on the input set's rows or table take the batch's row count and table size per
        batch (:meth:`build`)."""
        self.floors, self.masks, self.offsets = floors, masks, offsets

    @classmethod
    def plan(cls, requests: Sequence[tuple[KernelMapKey, int]], strides: Mapping[int, Triple], input_id: int,
             capacities: Mapping[int, int], bases: Mapping[KernelMapKey, int], device: torch.device
             ) -> FixedMaps | None:
        """``requests``: the recorded pass's maps as (key, its output set id); ``strides``: the stride of each
        recorded set that is canonical (the others absent); ``input_id``: the input's set; ``capacities``: rows
        per set; ``bases``: where each request's table starts in the flat tables (its rows: its output set's
        capacity). None where a map is not one this build makes: a set that is no power-of-two floor of the
        input, a generative map, a transposed one whose strided map was not recorded, a transposed submanifold
        one, or more sets or maps than one launch takes."""
        base = strides.get(input_id)
        sets = {out_id for _, out_id in requests} | {key.source for key, _ in requests}
        levels = sorted(sets - {input_id})
        if base is None or any(s not in strides or not floorable(strides[s], base) for s in levels):
            return None
        if len(levels) > MAX_LEVELS or len({strides[s] for s in levels}) != len(levels):
            return None
        outputs = dict(requests)
        transposed_at: dict[KernelMapKey, int] = {}
        for key, out_id in requests:
            if key.generative:
                return None
            if key.transposed:
                forward = key._replace(source=out_id, transposed=False)
                if key.stride == (1, 1, 1) or outputs.get(forward) != key.source:
                    return None
                transposed_at[forward] = bases[key]
            elif strides[out_id] != times(strides[key.source], key.stride) or (
                    key.stride == (1, 1, 1) and out_id != key.source):
                return None
        regular = [(key, out_id, bases[key], transposed_at.get(key, -1)) for key, out_id in requests
                   if not key.transposed]
        if len(regular) > MAX_MAPS:
            return None
        floors = masks = None
        if levels:
            floors = FixedFloors.allocate(capacities[input_id], [capacities[s] for s in levels], device)
            masks = floor_masks(tuple(strides[s] for s in levels), device)
        queries, offset_base = [], 0
        for key, out_id, out_base, transposed_base in regular:  # (the input's rows and table: 0 until a batch's)
            volume = math.prod(key.kernel_size)
            rows = (0, 0) if out_id == input_id else (floors.bases[levels.index(out_id)], capacities[out_id])
            table = (0, 0) if key.source == input_id else (levels.index(key.source) * floors.capacity, floors.capacity)
            queries.append(MapQuery(*rows, offset_base, volume, *table, out_base, transposed_base,
                                    out_id != input_id, key.source != input_id))
            offset_base += volume
        geometry = tuple((key.kernel_size, times(key.dilation, strides[key.source])) for key, *_ in regular)
        return cls(input_id, levels, strides, queries, floors, masks, offset_table(geometry, device))

    def build(self, cache: CoordinateSets, input_set: int, tables: torch.Tensor) -> HostCopy | None:
        """Query the batch's maps (``cache``'s input set ``input_set``, its rows at most the input's capacity)
        into ``tables`` (the flat int32 tables, filled with -1 first); no host read. Returns the coarse sets'
        ends on their way to the host (:meth:`counts` reads them), None without coarse sets."""
        fine = cache.coord_set(input_set).coords
        fine_table = cache.table(input_set)
        ends = None
        coarse, coarse_table = fine, fine_table
        if self.floors is not None:
            ends = floor_sets_into(cache.keys(input_set), self.masks, self.floors)
            coarse, coarse_table = self.floors.coords, self.floors.table()
        tables.fill_(-1)
        queries = [q if q.coarse_rows else q._replace(rows=fine.shape[0]) for q in self.queries]
        queries = [q if q.coarse_table else q._replace(capacity=fine_table.keys.shape[0]) for q in queries]
        query_many((fine, coarse), self.offsets, (fine_table, coarse_table), tables, queries, tables)
        return None if ends is None else HostCopy(ends)

    def counts(self, ends: HostCopy | None, input_rows: int) -> dict[int, int]:
        """Rows per recorded set of the batch :meth:`build` built (waiting for its copy)."""
        counts = {self.input_id: input_rows}
        if ends is not None:
            values = ends.values()
            for set_id, start, end in zip(self.levels, [0, *values], values):
                counts[set_id] = end - start
        return counts

    def coords(self, set_id: int, rows: int) -> torch.Tensor:
        """(rows, 4) int32: a coarse set's coordinates as :meth:`build` made them (a copy: the buffers are the
        next batch's)."""
        start = self.floors.bases[self.levels.index(set_id)]
        return self.floors.coords[start: start + rows].clone()
