"""Kernel maps built into fixed-size tables (graph mode's batches, :mod:`sparseconv.coords.fixed`) equal the map
plan's, entry for entry; a set past its capacity is cut off there, never written past it."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.coords.floors import FixedFloors, floor_sets, floor_sets_into
from sparseconv.coords.keys import floor_masks, pack_coords
from sparseconv.ops import batch
from sparseconv.ops.capacity import CapacityMaps


def _rows(n: int, device) -> torch.Tensor:
    rows = torch.randint(-30, 30, (n, 4), dtype=torch.int32)
    rows[:, 0] = rows[:, 0].abs() % 2
    rows = rows.unique(dim=0)
    return rows[torch.randperm(len(rows))].to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_floors_into_fixed_rows_are_the_floor_sets_each_from_its_own_row(device):
    rows = _rows(2000, device)
    keys = pack_coords(rows)
    strides = ((2, 2, 2), (4, 4, 4), (1, 2, 8))
    masks = floor_masks(strides, keys.device)
    sets = floor_sets(keys, masks)
    capacities = [count + extra for count, extra in zip(sets.counts, (7, 0, 300))]
    floors = FixedFloors.allocate(len(rows) + 50, capacities, keys.device)
    floors.coords.fill_(5)  # poison: rows past a set's count must come back -1
    ends = floor_sets_into(keys, masks, floors).tolist()
    assert [end - start for start, end in zip([0, *ends], ends)] == sets.counts
    table = floors.table()
    start = 0
    for level, count in enumerate(sets.counts):
        base = floors.bases[level]
        assert torch.equal(floors.coords[base: base + count], sets.coords[start: start + count])
        assert (floors.coords[base + count: base + capacities[level]] == -1).all()
        slots = slice(level * floors.capacity, (level + 1) * floors.capacity)
        found = type(table)(table.keys[slots], table.values[slots]).neighbors(
            sets.coords[start: start + count], torch.zeros((1, 3), dtype=torch.int32, device=device))
        assert torch.equal(found[:, 0].cpu(), torch.arange(count, dtype=torch.int32))
        start += count


@pytest.mark.parametrize("device", DEVICES)
def test_a_set_past_its_capacity_is_cut_there_and_its_other_cells_are_found_absent(device):
    rows = _rows(1500, device)
    keys = pack_coords(rows)
    masks = floor_masks(((2, 2, 2), (4, 4, 4)), keys.device)
    sets = floor_sets(keys, masks)
    capacities = [sets.counts[0] // 2, sets.counts[1]]
    floors = FixedFloors.allocate(len(rows), capacities, keys.device)
    guard = floors.coords.new_full((floors.coords.shape[0] + 8, 4), 9)
    ends = floor_sets_into(keys, masks, floors).tolist()
    assert ends[0] == sets.counts[0]  # (the count is the set's, however many rows were written)
    cut = capacities[0]
    assert torch.equal(floors.coords[:cut], sets.coords[:cut])
    assert torch.equal(floors.coords[cut: cut + sets.counts[1]], sets.coords[sets.counts[0]: sum(sets.counts)])
    table = floors.table()
    found = type(table)(table.keys[: floors.capacity], table.values[: floors.capacity]).neighbors(
        sets.coords[: sets.counts[0]], torch.zeros((1, 3), dtype=torch.int32, device=device))[:, 0].cpu()
    assert torch.equal(found[:cut], torch.arange(cut, dtype=torch.int32)) and (found[cut:] == -1).all()
    assert (guard == 9).all()


def _network_requests(x: SparseTensor):
    """A MinkUNet-like batch's maps (a stem, two strided levels with their submanifold maps, the transposes back)
    built by the map plan as a graphed recording builds them: (key, out id) in order, the canonical strides."""
    from sparseconv.coords import KernelMapKey

    cache, requests, source = x.cache, [], x.coord_id
    keys = [KernelMapKey(source, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)]
    for _ in range(2):
        keys.append(KernelMapKey(source, (2, 2, 2), (2, 2, 2), (1, 1, 1), False, False))
        _, _, source = batch.kernel_map(cache, keys[-1], batch.MAPS_ONLY)
        keys.append(KernelMapKey(source, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))
    for down in (keys[3], keys[1]):
        keys.append(down._replace(source=cache.built_map(down)[1], transposed=True))
    for key in keys:
        _, _, out_id = batch.kernel_map(cache, key, batch.MAPS_ONLY)
        requests.append((key, out_id))
    strides = {i: cache.coord_set(i).stride for i in range(cache.set_count()) if cache.coord_set(i).canonical}
    return requests, strides


@pytest.mark.parametrize("device", DEVICES)
def test_maps_built_into_the_tables_equal_the_map_plans_copied_in(device):
    coords = random_coords(400, 12, batch_size=2).to(device)
    first = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    requests, strides = _network_requests(first)
    capacities = {set_id: first.cache.coord_set(set_id).coords.shape[0] * 2 + 16 for set_id in strides}
    maps = CapacityMaps(requests, capacities, first.cache.device, strides, first.coord_id)
    assert maps.fixed is not None
    for n in (380, 410):  # a new cloud each: its tables by the fixed build, then the plan's copied in
        coords = random_coords(n, 12, batch_size=2).to(device)
        x = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
        maps.flat.fill_(7)
        ends = maps.build(x.cache, x.coord_id)
        rows = maps.fixed.counts(ends, len(x))
        built = {key: table.clone() for key, table in maps.tables.items()}
        y = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
        eager = {}
        for key, out_id in requests:  # (the same requests in the same order: the same set ids)
            kernel_map, _, eager_out = batch.kernel_map(y.cache, key, batch.MAPS_ONLY)
            eager[key] = kernel_map
            assert eager_out == out_id and rows[out_id] == y.cache.coord_set(out_id).coords.shape[0]
        maps.flat.fill_(7)
        maps.load(eager)
        for key, table in maps.tables.items():
            assert torch.equal(built[key], table), key
        for set_id in strides:
            if set_id != x.coord_id:
                assert torch.equal(maps.fixed.coords(set_id, rows[set_id]), y.cache.coord_set(set_id).coords)


def test_networks_whose_maps_the_fixed_build_does_not_make_are_left_to_the_plan():
    from sparseconv.coords import KernelMapKey

    coords = random_coords(200, 10)
    x = SparseTensor(coords, torch.zeros(len(coords), 1))
    generative = KernelMapKey(x.coord_id, (3, 3, 3), (2, 2, 2), (1, 1, 1), False, True)
    _, _, out_id = batch.kernel_map(x.cache, generative, batch.MAPS_ONLY)
    strides = {i: x.cache.coord_set(i).stride for i in range(x.cache.set_count()) if x.cache.coord_set(i).canonical}
    maps = CapacityMaps([(generative, out_id)], {x.coord_id: 300, out_id: 300}, x.cache.device, strides, x.coord_id)
    assert maps.fixed is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 300), st.integers(2, 12), st.lists(st.sampled_from([(2, 2, 2), (4, 4, 4), (2, 4, 1), (8, 8, 8)]),
                                                          min_size=1, max_size=3, unique=True),
       st.lists(st.floats(0.3, 1.5), min_size=3, max_size=3), st.integers(0, 2**31 - 1))
def test_floors_into_fixed_rows_on_random_sets_and_capacities(n, extent, strides, shares, seed):
    """Any set, any strides, capacities above and below the counts: each set's first rows are floor_sets', the
    rest -1, its table finds exactly those written, and nothing past a set's capacity is touched."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, extent, (n, 4), dtype=torch.int32, generator=generator)
    rows[:, 0] %= 2
    rows = rows.unique(dim=0)
    rows = rows[torch.randperm(len(rows), generator=generator)]
    keys = pack_coords(rows)
    masks = floor_masks(tuple(strides), keys.device)
    sets = floor_sets(keys, masks)
    capacities = [max(1, int(count * share)) for count, share in zip(sets.counts, shares)]
    floors = FixedFloors.allocate(len(rows) + 3, capacities, keys.device)
    floors.coords.fill_(7)
    ends = floor_sets_into(keys, masks, floors).tolist()
    assert ends == list(itertools.accumulate(sets.counts))
    table, start = floors.table(), 0
    for level, (count, capacity) in enumerate(zip(sets.counts, capacities)):
        base, kept = floors.bases[level], min(count, capacity)
        assert torch.equal(floors.coords[base: base + kept], sets.coords[start: start + kept])
        assert (floors.coords[base + kept: base + capacity] == -1).all()
        slots = slice(level * floors.capacity, (level + 1) * floors.capacity)
        found = type(table)(table.keys[slots], table.values[slots]).neighbors(
            sets.coords[start: start + count], torch.zeros((1, 3), dtype=torch.int32))[:, 0]
        assert torch.equal(found[:kept], torch.arange(kept, dtype=torch.int32)) and (found[kept:] == -1).all()
        start += count
