"""Kernel maps equal a brute-force reference on random sparse sets (property-based)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparse_reference import brute_force_map, offsets

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey, center_offset, offset_deltas
from sparseconv.coords import hashing
from sparseconv.coords.floors import floor_sets
from sparseconv.coords.hashing import CoordHashTable
from sparseconv.coords.kernel_map import FILL_VIEW
from sparseconv.coords.keys import COORD_MAX, COORD_MIN, floor_masks, pack_coords


@st.composite
def geometries(draw):
    kernel = draw(st.integers(1, 5))
    anisotropic = draw(st.booleans())
    kernel_size = tuple(draw(st.integers(1, 5)) for _ in range(3)) if anisotropic else (kernel,) * 3
    return {
        "kernel_size": kernel_size,
        "stride": (draw(st.integers(1, 3)),) * 3,
        "dilation": (draw(st.integers(1, 3)),) * 3,
        "input_stride": draw(st.sampled_from([1, 2])),
        "transposed": draw(st.booleans()),
        "generative": draw(st.booleans()),
    }


@st.composite
def coordinate_sets(draw):
    n = draw(st.integers(0, 60))
    batch = draw(st.integers(1, 3))
    extent = draw(st.integers(1, 8))
    low = draw(st.integers(-20, 20))
    rows = draw(st.lists(st.tuples(st.integers(0, batch - 1), *[st.integers(low, low + extent)] * 3), min_size=n, max_size=n))
    return sorted(set(rows))


def _expected_output(source_rows, geometry, in_stride, out_stride, fine_rows):
    """Output coordinates by the definitions in the kernel_map docstring."""
    kernel_size, dilation = geometry["kernel_size"], geometry["dilation"]
    if geometry["generative"]:
        unit = out_stride if geometry["transposed"] else in_stride
        sign = 1 if geometry["transposed"] else -1
        out = set()
        for b, *xyz in source_rows:
            for delta in offsets(kernel_size):
                p = [c + sign * d * dl * u for c, d, dl, u in zip(xyz, delta, dilation, unit)]
                if all(v % s == 0 for v, s in zip(p, out_stride)):
                    out.add((b, *p))
        return sorted(out)
    if geometry["transposed"]:
        return sorted(fine_rows)
    return sorted({(b, *[(c // s) * s for c, s in zip(xyz, out_stride)]) for b, *xyz in source_rows})


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=coordinate_sets(), geometry=geometries())
def test_kernel_map_equals_brute_force(rows, geometry, device, cpu_query_parts):
    s = geometry["input_stride"]
    stride = geometry["stride"]
    coords = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4) * torch.tensor([1, s, s, s], dtype=torch.int32)
    base = SparseTensor(coords.to(device), torch.zeros(len(coords), 1, device=device), s)
    source, fine_rows = base, None
    if geometry["transposed"]:
        # The coarse side of a real downsampling, so the finer coordinates exist in the cache.
        key = KernelMapKey(base.coord_id, geometry["kernel_size"], stride, geometry["dilation"], False, False)
        _, coarse_id = base.cache.kernel_map(key)
        source = SparseTensor._derived(None, base.cache, coarse_id)
        fine_rows = [tuple(r) for r in base.coords.tolist()]
    in_stride = source.stride
    if geometry["transposed"]:
        out_stride = tuple(a // b for a, b in zip(in_stride, stride))
    else:
        out_stride = tuple(a * b for a, b in zip(in_stride, stride))

    key = KernelMapKey(source.coord_id, geometry["kernel_size"], stride, geometry["dilation"],
                       geometry["transposed"], geometry["generative"])
    kernel_map, out_id = source.cache.kernel_map(key)
    out_set = source.cache.coord_set(out_id)
    assert out_set.stride == out_stride
    source_rows = [tuple(r) for r in source.coords.tolist()]
    out_rows = [tuple(r) for r in out_set.coords.tolist()]
    assert sorted(out_rows) == _expected_output(source_rows, geometry, in_stride, out_stride, fine_rows)
    assert len(set(out_rows)) == len(out_rows)

    step = [d * u for d, u in zip(geometry["dilation"], out_stride if geometry["transposed"] else in_stride)]
    expected = brute_force_map(source.coords.cpu(), out_set.coords.cpu(), geometry["kernel_size"], step,
                               -1 if geometry["transposed"] else 1)
    assert kernel_map.neighbors.cpu().tolist() == expected

    in_idx, out_idx, offset_ptr = kernel_map.pairs
    pairs = {(k, int(i), int(o)) for k in range(kernel_map.kernel_volume)
             for i, o in zip(in_idx[offset_ptr[k]:offset_ptr[k + 1]].tolist(), out_idx[offset_ptr[k]:offset_ptr[k + 1]].tolist())}
    assert pairs == {(k, i, o) for o, row in enumerate(expected) for k, i in enumerate(row) if i >= 0}
    assert kernel_map.pair_counts == [sum(row[k] >= 0 for row in expected) for k in range(kernel_map.kernel_volume)]
    if kernel_map.identity_offset is not None:
        assert kernel_map.neighbors[:, kernel_map.identity_offset].tolist() == list(range(kernel_map.num_out))
    assert source.cache.kernel_map(key)[0] is kernel_map  # cached and reused


def test_offsets_are_in_the_documented_order():
    assert offset_deltas((3, 3, 3))[:4].tolist() == [[-1, -1, -1], [-1, -1, 0], [-1, -1, 1], [-1, 0, -1]]
    assert offset_deltas((2, 1, 3)).tolist() == [list(o) for o in offsets((2, 1, 3))]
    assert center_offset((3, 3, 3)) == 13 and center_offset((5, 1, 3)) == 7 and center_offset((2, 3, 3)) is None


@pytest.mark.parametrize("step", [1, 4, 27])
def test_a_cpu_query_finds_the_same_neighbours_with_any_offsets_a_thread(step, monkeypatch):
    # A GPU runs a thread per (row, offset) (step K = 27), a CPU a thread per row (step 1); any step covers every offset.
    monkeypatch.setattr(hashing, "QUERY_STEP_CPU", step)
    coords = torch.randint(0, 9, (600, 4), dtype=torch.int32)
    coords[:, 0] %= 2
    coords = coords.unique(dim=0)
    found = CoordHashTable.build(coords).neighbors(coords, offset_deltas((3, 3, 3)).int())
    assert found.tolist() == brute_force_map(coords, coords, (3, 3, 3), (1, 1, 1), 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel_size, dilation", [((3, 3, 3), 1), ((3, 1, 5), 2), ((5, 5, 5), 1), ((1, 1, 1), 1)])
@pytest.mark.parametrize("step", [1, 2, 27])
def test_a_set_queried_against_itself_by_half_its_offsets_finds_every_neighbour(kernel_size, dilation, step, device,
                                                                                 cpu_query_parts, monkeypatch):
    # The mirrored half comes from writes by other rows' threads: with steps and row ranges (cpu_query_parts),
    # no entry may be lost or written twice.
    monkeypatch.setattr(hashing, "QUERY_STEP_CPU", step)
    coords = torch.randint(0, 11, (900, 4), dtype=torch.int32)
    coords[:, 0] %= 2
    coords = coords.unique(dim=0)
    offsets = offset_deltas(kernel_size).int() * dilation
    table = CoordHashTable.build(coords.to(device))
    found = table.self_neighbors(coords.to(device), offsets.to(device))
    assert found.cpu().tolist() == brute_force_map(coords, coords, kernel_size, (dilation,) * 3, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel_size, fine_stride", [((2, 2, 2), (1, 1, 1)), ((2, 1, 2), (3, 1, 2)),
                                                       ((1, 2, 2), (2, 2, 2))])
def test_a_window_that_tiles_its_cells_finds_each_input_by_one_lookup(kernel_size, fine_stride, device):
    fine = torch.randint(-12, 12, (700, 4), dtype=torch.int32)
    fine[:, 0] %= 3
    fine[:, 1:] *= torch.tensor(fine_stride, dtype=torch.int32)
    fine = fine.unique(dim=0)
    steps = torch.tensor([f * k for f, k in zip(fine_stride, kernel_size)], dtype=torch.int32)
    coarse = torch.cat([fine[:, :1], torch.div(fine[:, 1:], steps, rounding_mode="floor") * steps], 1).unique(dim=0)
    found = hashing.cell_neighbors(CoordHashTable.build(coarse.to(device)), len(coarse), fine.to(device), fine_stride,
                                   kernel_size)
    assert found.cpu().tolist() == brute_force_map(fine, coarse, kernel_size, fine_stride, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_hash_table_finds_every_key_and_nothing_else_at_the_range_limits(device):
    corners = torch.tensor([[0, COORD_MIN, COORD_MIN, COORD_MIN], [4095, COORD_MAX, COORD_MAX, COORD_MAX],
                            [3, COORD_MAX, 0, COORD_MIN]], dtype=torch.int32)
    rows = torch.cat([corners, torch.randint(-1000, 1000, (5000, 4), dtype=torch.int32).abs()]).unique(dim=0).to(device)
    table = CoordHashTable.build(rows)
    probe = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 0, -1]], dtype=torch.int32, device=device)
    found = table.neighbors(rows, probe)
    assert torch.equal(found[:, 0].cpu(), torch.arange(len(rows), dtype=torch.int32))
    index = {tuple(r): i for i, r in enumerate(rows.tolist())}
    for r, (_, plus_x, minus_z) in zip(rows.tolist(), found.tolist()):
        assert plus_x == index.get((r[0], r[1] + 1, r[2], r[3]), -1)
        assert minus_z == index.get((r[0], r[1], r[2], r[3] - 1), -1)


@pytest.mark.parametrize("device", DEVICES)
def test_floor_sets_list_each_cell_once_in_first_row_order_with_tables_that_find_them(device):
    # Rows shuffled (first-row order is not key order), cells of many rows and of one, negative
    # coordinates and the range limits (the floors stay in range), an anisotropic stride.
    corners = torch.tensor([[0, COORD_MIN, COORD_MIN, COORD_MIN], [4095, COORD_MAX, COORD_MAX, COORD_MAX]],
                           dtype=torch.int32)
    rows = torch.cat([corners, torch.randint(-40, 40, (3000, 4), dtype=torch.int32)])
    rows[:, 0] = rows[:, 0].abs() % 3
    rows = rows.unique(dim=0)
    rows = rows[torch.randperm(len(rows))].to(device)
    keys = pack_coords(rows)
    strides = ((2, 2, 2), (8, 8, 8), (1, 4, 2))
    sets = floor_sets(keys, floor_masks(strides, keys.device))
    assert sets.keys.shape == (sum(sets.counts),) and sets.coords.shape == (sum(sets.counts), 4)
    firsts = 0
    for level, stride in enumerate(strides):
        expected = {}
        for row in rows.tolist():
            cell = (row[0], *[(c // s) * s for c, s in zip(row[1:], stride)])
            expected.setdefault(cell, len(expected))
        part = slice(firsts, firsts + sets.counts[level])
        assert [tuple(r) for r in sets.coords[part].tolist()] == list(expected), f"stride {stride}"
        assert torch.equal(sets.keys[part], pack_coords(sets.coords[part]))
        slots = slice(level * sets.capacity, (level + 1) * sets.capacity)
        table = CoordHashTable(sets.table.keys[slots], sets.table.values[slots])
        probe = torch.tensor([[0, 0, 0], [stride[0], 0, 0]], dtype=torch.int32, device=device)
        found = table.neighbors(sets.coords[part], probe).tolist()
        assert [f[0] for f in found] == list(range(len(expected)))
        assert [f[1] for f in found] == [expected.get((c[0], c[1] + stride[0], *c[2:]), -1) for c in expected]
        # each input row's row in the set (its cell's), from the slots the inserts kept
        cells = [expected[(row[0], *[(c // s) * s for c, s in zip(row[1:], stride)])] for row in rows.tolist()]
        assert sets.cells(level).tolist() == cells, f"stride {stride}"
        firsts += sets.counts[level]


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_warp_launches_find_what_warps_own_setters_find(device, monkeypatch):
    # After a kernel's first launch, later ones write their bounds and arguments into the recorded
    # command's own structures (warp_launch._Replay). With this Warp the writes must take (bytes equal to
    # Warp's packing) and give, launch after launch of other sizes, what a replay through Warp's
    # setters gives.
    from sparseconv.coords import warp_launch

    def lookups(rows_count: int, probes: int):
        rows = torch.randint(0, 40, (rows_count, 4), dtype=torch.int32).unique(dim=0).to(device)
        probe = torch.tensor([[0, 0, 0], [1, 0, 0], [0, -1, 1]], dtype=torch.int32, device=device)[:probes]
        return CoordHashTable.build(rows).neighbors(rows, probe)

    torch.manual_seed(0)
    sizes = [(500, 3), (3000, 2), (50, 3), (1200, 1)]
    monkeypatch.setattr(warp_launch._RECORDED, "commands", {}, raising=False)  # this thread's, recorded anew
    lookups(10, 3)
    replays = list(warp_launch._RECORDED.commands.values())
    assert len(replays) == 2 and all(r.packers is not None and r.kernel_dim for r in replays), "in place with this Warp"
    torch.manual_seed(1)
    fast = [lookups(n, probes).cpu() for n, probes in sizes]
    # Recorded again, replayed through Warp's set_dim / set_param_at_index_from_ctype
    monkeypatch.setattr(warp_launch._RECORDED, "commands", {})
    monkeypatch.setattr(warp_launch._Replay, "of", classmethod(lambda cls, command, inputs, dim: cls(command, None, None)))
    torch.manual_seed(1)
    slow = [lookups(n, probes).cpu() for n, probes in sizes]
    for got, want in zip(fast, slow):
        assert torch.equal(got, want)
        assert torch.equal(got[:, 0], torch.arange(len(got), dtype=torch.int32))


def test_a_replays_packer_writes_the_descriptor_warps_packing_writes():
    # A replay rewrites only a descriptor's pointer, shape and strides over the recording's bytes: for
    # tensors of the recording's rank and dtype (contiguous, sliced, transposed), the bytes must be the
    # whole packing's (a descriptor of the same length, recorded from another tensor).
    from sparseconv.coords import warp_launch

    base = torch.arange(4 * 6 * 5, dtype=torch.int64)
    for recorded, later in [(base[:7], base[3:50:2]), (base.view(24, 5)[:, 1:], base.view(24, 5).t()),
                            (base.view(4, 6, 5), base.view(4, 6, 5)[1:, ::2, 1:]),
                            (base.view(torch.int32).view(40, 6), base.view(torch.int32).view(40, 6)[5:9])]:
        length = warp_launch._ARRAY.size + 4  # a parameter structure may be longer than the descriptor
        buffer = warp_launch._packed(recorded, length)
        warp_launch._packer(memoryview(buffer), later.dim(), later.element_size())(later)
        assert bytes(buffer) == bytes(warp_launch._packed(later, length)), (later.shape, later.stride())


@pytest.mark.parametrize("device", DEVICES)
def test_tables_built_on_several_threads_at_once_find_their_own_keys(device):
    # Warp launches replay a recorded command whose arguments are set in place (one per thread):
    # threads building tables of different sizes at once must each get their own results.
    import sys
    import threading

    clouds = [torch.randint(0, 60, (n, 4), dtype=torch.int32).unique(dim=0).to(device) for n in (300, 900, 2000)]
    probe = torch.tensor([[0, 0, 0], [1, 0, 0]], dtype=torch.int32, device=device)
    expected = [CoordHashTable.build(rows).neighbors(rows, probe).cpu() for rows in clouds]
    failures = []

    def build(which: int) -> None:
        for _ in range(40):
            rows = clouds[which]
            found = CoordHashTable.build(rows).neighbors(rows, probe).cpu()
            if not torch.equal(found, expected[which]):
                failures.append(which)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(clouds))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost any two bytecodes: races show up
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures
    assert all(torch.equal(e[:, 0], torch.arange(len(rows), dtype=torch.int32)) for e, rows in zip(expected, clouds))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer", ["subm3", "down2", "up2"])
def test_derived_views_equal_those_recomputed_on_the_cpu_from_the_neighbour_table(layer, device):
    # The views take device-specific paths (pairs by nonzero_static, the transposed table by a
    # scatter, a transposed conv's map as the adjoint of the strided one); a street scene at
    # stride 8 has the dense neighbourhoods of a deep layer.
    from sparseconv.coords import KernelMap
    from sparseconv.data.synthetic import make_scene

    coords = make_scene("street", voxel_size=0.05, scale=0.5)[0].to(device)
    x = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    cache, source = x.cache, x.coord_id
    for _ in range(3):
        source = cache.kernel_map(KernelMapKey(source, (2, 2, 2), (2, 2, 2), (1, 1, 1), False, False))[1]
    kernel_size, stride = ((3, 3, 3), (1, 1, 1)) if layer == "subm3" else ((2, 2, 2), (2, 2, 2))
    built = cache.kernel_map(KernelMapKey(source, kernel_size, stride, (1, 1, 1), layer == "up2", False))[0]
    plain = KernelMap(built.neighbors.cpu(), built.num_in, built.kernel_size, built.identity_offset)

    def by_offset(pairs):
        in_idx, out_idx, ptr = (t.cpu() for t in pairs)
        rows = []
        for k in range(len(ptr) - 1):
            order = torch.argsort(out_idx[ptr[k]:ptr[k + 1]])
            rows.append((in_idx[ptr[k]:ptr[k + 1]][order], out_idx[ptr[k]:ptr[k + 1]][order]))
        return rows

    assert built.pair_counts == plain.pair_counts and sum(plain.pair_counts) > 0
    assert built.num_pairs == sum(plain.pair_counts)
    for (got_in, got_out), (want_in, want_out) in zip(by_offset(built.pairs), by_offset(plain.pairs)):
        assert torch.equal(got_in, want_in) and torch.equal(got_out, want_out)
    in_idx, out_idx, ptr = plain.pairs
    offset = torch.repeat_interleave(torch.arange(plain.kernel_volume), torch.diff(ptr))
    adjoint = torch.full((plain.num_in, plain.kernel_volume), -1, dtype=torch.int32)
    adjoint[in_idx, offset] = out_idx.to(torch.int32)
    assert torch.equal(built.transposed_neighbors.cpu(), adjoint)


@pytest.mark.parametrize("device", DEVICES)
def test_a_strided_map_and_its_transpose_know_their_pair_total_without_counting(device):
    # The tuner's key reads num_pairs on every new map; for these two it is the row count of the
    # side whose every row is in one pair, so the key needs no host sync. It must be the count.
    coords = torch.cat([torch.randint(0, 2, (600, 1)), torch.randint(-9, 9, (600, 3))], 1).unique(dim=0).to(device)
    x = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    down, coarse = x.cache.kernel_map(KernelMapKey(x.coord_id, (2, 2, 2), (2, 2, 2), (1, 1, 1), False, False))
    up, _ = x.cache.kernel_map(KernelMapKey(coarse, (2, 2, 2), (2, 2, 2), (1, 1, 1), True, False))
    for kernel_map in (down, up):
        total = kernel_map.num_pairs
        assert "pair_counts" not in vars(kernel_map)  # not counted on the host
        assert total == int((kernel_map.neighbors >= 0).sum()) == len(coords)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=coordinate_sets(), repeats=st.lists(st.integers(0, 59), max_size=3), stride=st.sampled_from([1, 2]),
       off_grid=st.booleans(), out_of_range=st.sampled_from([None, "batch", "low", "high"]))
def test_checked_build_flags_exactly_what_the_input_breaks_and_builds_the_table(
        rows, repeats, stride, off_grid, out_of_range, device):
    rows = [(b, x * stride, y * stride, z * stride) for b, x, y, z in rows]
    if not rows:
        return
    planted = [rows[i % len(rows)] for i in repeats]
    if off_grid and stride > 1:
        planted.append((0, rows[0][1] + 1, rows[0][2], rows[0][3]))
    edge = {"batch": (-1, 0, 0, 0), "low": (0, COORD_MIN - stride, 0, 0), "high": (0, 0, 0, COORD_MAX + 1)}
    if out_of_range is not None:
        planted.append(edge[out_of_range])
    order = torch.randperm(len(rows) + len(planted))
    coords = torch.tensor(rows + planted, dtype=torch.int32)[order].to(device)
    table, keys, flags = CoordHashTable.build_checked(coords, (stride,) * 3)
    expected = [out_of_range is not None, bool(off_grid and stride > 1),
                len(set(map(tuple, coords.tolist()))) < len(coords)]
    assert [f > 0 for f in flags[:3].tolist()] == expected
    in_range = [r for r in coords.tolist() if r[0] >= 0 and all(COORD_MIN <= v <= COORD_MAX for v in r[1:])]
    assert flags[3] == max(r[0] for r in in_range)  # the largest batch index, for the batch size
    if any(expected):
        return
    assert torch.equal(keys, pack_coords(coords))
    # The table answers like one built from the keys: every row finds itself, a shifted row finds its own or nothing.
    reference = CoordHashTable.build(coords)
    shift = torch.tensor([[0, 0, 0], [stride, 0, 0]], dtype=torch.int32, device=device)
    assert torch.equal(table.neighbors(coords, shift), reference.neighbors(coords, shift))
    assert table.neighbors(coords, shift)[:, 0].tolist() == list(range(len(coords)))


@pytest.mark.parametrize("device", DEVICES)
def test_an_unviewed_map_shares_the_table_and_counts_but_no_view(device):
    # What a lone map's candidates are timed on (tune/sweep.as_run): a new batch's map, as its build leaves it.
    torch.manual_seed(0)
    coords = torch.unique(torch.randint(0, 8, (200, 4), device=device, dtype=torch.int32) * torch.tensor(
        [0, 2, 2, 2], device=device, dtype=torch.int32), dim=0)
    x = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    for geometry in (((3, 3, 3), (1, 1, 1)), ((2, 2, 2), (2, 2, 2))):
        kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, *geometry, (1, 1, 1), False, False))[0]
        kernel_map.offer(FILL_VIEW, (5, 50))  # the map plan's estimate (a new batch's map holds it)
        counts, pairs = kernel_map.pair_counts, kernel_map.pairs
        kernel_map.derived(("a view",), lambda m: 1)
        for source in (kernel_map, kernel_map.transposed()):
            copy = source.unviewed()
            assert copy is not source and copy._derived == {} and "pairs" not in copy.__dict__
            assert torch.equal(copy.neighbors, source.neighbors) and copy.pair_counts == counts
            assert (copy.num_in, copy.num_out, copy.identity_offset, copy.each_input_once, copy.each_output_once) == (
                source.num_in, source.num_out, source.identity_offset, source.each_input_once, source.each_output_once)
            assert (copy.transpose_of is None) == (source.transpose_of is None)
        unviewed = kernel_map.unviewed()
        assert unviewed.fill() == (5, 50) and unviewed.neighbors is kernel_map.neighbors
        assert [torch.equal(a, b) for a, b in zip(unviewed.pairs, pairs)] == [True] * 3  # built again, the same


def test_cpu_queries_split_into_one_range_per_thread_each_worth_a_launch(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert hashing._cpu_chunks(100, 27) == [0, 100], "2700 lookups: one launch"
    bounds = hashing._cpu_chunks(92401, 27)
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == 92401
    assert all(b - a >= hashing.CPU_CHUNK_LOOKUPS // 27 for a, b in zip(bounds, bounds[1:]))
    assert len(hashing._cpu_chunks(20000, 27)) == 3, "540k lookups: two ranges of at least 2^18"
    monkeypatch.setattr(hashing, "CPU_CHUNK_LOOKUPS", 1)
    assert hashing._cpu_chunks(2, 27) == [0, 1, 2], "never an empty range"
