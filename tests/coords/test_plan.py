"""Maps planned ahead (coords/plan.py, coords/prebuild.py): a new batch builds what the last batches asked for, at once,
and gets exactly the maps a lazy build makes."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICES
from conv_cases import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparse_reference import random_coords, relative_error

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey, floors, hashing, host_copy, offset_deltas, plan, prebuild, warp_launch
from sparseconv.coords.hashing import CoordHashTable, MapQuery
from sparseconv.coords.kernel_map import RANKS_VIEW
from sparseconv.coords.keys import floor_masks, pack_coords

# A small U-Net's requests: submanifold 3^3 on four levels, k2 s2 down between them, the k2 s2
# transposed convs back up, a dilated and an anisotropic map; a detection backbone's generative k3 s2
# convs, one from the other's set, and a submanifold map on each generated set (all planned); a stride 3
# map (not planned: built lazily beside the plan).
SUBM = ((3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)
DOWN = ((2, 2, 2), (2, 2, 2), (1, 1, 1), False, False)
UP = ((2, 2, 2), (2, 2, 2), (1, 1, 1), True, False)
GENERATE = ((3, 3, 3), (2, 2, 2), (1, 1, 1), False, True)


def requests(x: SparseTensor) -> list:
    """Ask ``x``'s cache for a network's maps in layer order; returns (key, map, output set id)."""
    cache, asked, source = x.cache, [], x.coord_id
    sources = [source]

    def ask(source_id, geometry):
        key = KernelMapKey(source_id, *geometry)
        kernel_map, out_id = cache.kernel_map(key)
        asked.append((key, kernel_map, out_id))
        return out_id

    for _ in range(3):
        ask(source, SUBM)
        source = ask(source, DOWN)
        sources.append(source)
    ask(source, SUBM)
    ask(source, ((3, 3, 3), (1, 1, 1), (2, 2, 2), False, False))  # dilated
    ask(source, ((1, 3, 3), (1, 1, 1), (1, 1, 1), False, False))  # anisotropic
    for coarse in reversed(sources[:-1]):
        source = ask(source, UP)
        assert source == coarse
    generated = sources[0]
    for _ in range(2):
        generated = ask(generated, GENERATE)
        ask(generated, SUBM)
    ask(sources[0], ((3, 3, 3), (3, 3, 3), (1, 1, 1), False, False))  # stride 3: not a power of two
    return asked


def batch(device, seed: int) -> SparseTensor:
    torch.manual_seed(seed)
    coords = random_coords(900, 24, batch_size=2, low=-11, device=device)
    return SparseTensor(coords, torch.randn(len(coords), 2, device=device))


def assert_same_maps(planned: list, lazy: list, planned_cache, lazy_cache) -> None:
    assert [key for key, _, _ in planned] == [key for key, _, _ in lazy]
    for (key, p, p_out), (_, q, q_out) in zip(planned, lazy):
        assert p_out == q_out, key
        assert torch.equal(planned_cache.coord_set(p_out).coords, lazy_cache.coord_set(q_out).coords), key
        assert torch.equal(p.neighbors, q.neighbors), key
        assert torch.equal(p.transposed_neighbors, q.transposed_neighbors), key  # a strided one's: from the query
        assert p.pair_counts == q.pair_counts, key
        assert (p.num_in, p.num_out, p.identity_offset, p.each_input_once, p.each_output_once) == (
            q.num_in, q.num_out, q.identity_offset, q.each_input_once, q.each_output_once), key


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_a_planned_batch_gets_the_maps_a_lazy_build_makes(device, one_launch, monkeypatch):
    monkeypatch.setattr(prebuild, "_one_launch", lambda _: one_launch)  # the GPU's way on the CPU, and back
    requests(batch(device, 0))  # the first batch builds lazily and makes the plan
    prebuilt = []
    build = prebuild.build
    monkeypatch.setattr(prebuild, "build", lambda *args: prebuilt.append(dict(build(*args))) or dict(prebuilt[-1]))
    # Two planned batches of other sizes: the second reuses the recorded launches with new arguments.
    for seed in (1, 2):
        x = batch(device, seed)  # new coordinates: every planned map is built at the first request
        planned = requests(x)
        assert len(prebuilt[-1]) == 13  # 4 + 1 dilated + 1 anisotropic subm, 3 down, 2 generative, 2 subm on theirs
        assert x.cache.batch.planned == {}, "a planned map was never asked for"
        strided = [m for key, m in prebuilt[-1].items() if key.stride != (1, 1, 1) and not key.generative]
        assert len(strided) == 3 and all(("transposed_neighbors" in m.__dict__) == one_launch for m, _ in strided)
        monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
        y = batch(device, seed)
        assert_same_maps(planned, requests(y), x.cache, y.cache)
        monkeypatch.delenv("SPARSECONV_PLAN_MAPS")
    assert len(prebuilt) == 2 and len(x) != len(batch(device, 1))


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_of_one_coarse_set_gets_the_maps_a_lazy_build_makes(device, one_launch, monkeypatch):
    # One strided conv: its coarse set is the plan's one level, made as a lazy build makes it.
    monkeypatch.setattr(prebuild, "_one_launch", lambda _: one_launch)

    def one_level(x: SparseTensor) -> list:
        asked = []
        for geometry in (SUBM, DOWN):
            key = KernelMapKey(x.coord_id, *geometry)
            asked.append((key, *x.cache.kernel_map(key)))
        key = KernelMapKey(asked[-1][2], *SUBM)
        asked.append((key, *x.cache.kernel_map(key)))
        return asked

    one_level(batch(device, 0))
    x = batch(device, 1)
    planned = one_level(x)
    assert x.cache.set_count() == 2 and x.cache.batch.planned == {}, "the coarse set and its maps came from the plan"
    monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
    y = batch(device, 1)
    assert_same_maps(planned, one_level(y), x.cache, y.cache)


@pytest.mark.parametrize("device", DEVICES)
def test_a_planned_batch_builds_its_sets_and_tables_at_once_reading_the_host_once(device, monkeypatch):
    requests(batch(device, 0))
    x = batch(device, 2)
    launches, reads = [], []
    launch = warp_launch.launch
    monkeypatch.setattr(warp_launch, "launch", lambda kernel, *args: launches.append(kernel.key) or launch(kernel, *args))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: self.device.type == device and reads.append(self.shape) or tolist(self))
    x.cache.kernel_map(KernelMapKey(x.coord_id, *SUBM))
    # Three coarse sets and their tables in one insert launch; one read of the device for their sizes and
    # one for each generated set's (as its layer's build reads it); the generated sets' tables (for the maps
    # on them) one insert each. The pair counts (and a GPU input's checks) are copied without waiting, and
    # read where first needed (from pinned host memory).
    names = [key.rsplit("__", 1)[-1] for key in launches]
    assert names.count("floor_insert") == 1 and names.count("insert") == 2 and names.count("generate_compact") == 2
    assert len(reads) == 3
    assert x.cache.set_count() == 6  # the input, strides 2, 4, 8, two generated sets (stride 3: lazily)
    # Every planned map's pair counts come from that one copy, its adjoint's too (the wgrad
    # backends read them in a training step's backward): one copy for all of them, read on the host.
    planned = [kernel_map for kernel_map, _ in x.cache.batch.planned.values()]
    assert len(planned) == 12  # the first request's map is handed out already
    for kernel_map in planned:
        assert kernel_map.pair_counts == kernel_map.transposed().pair_counts == (kernel_map.neighbors >= 0).sum(0).tolist()
    # the counts' one read (on a GPU from pinned host memory: no read of the device) and the comparisons'
    assert len(reads) == (4 if device == "cpu" else 3) + len(planned)


@pytest.mark.parametrize("device", DEVICES)
def test_the_plan_keeps_what_the_last_two_batches_asked_for(device):
    requests(batch(device, 0))
    x = batch(device, 3)
    x.cache.kernel_map(KernelMapKey(x.coord_id, *SUBM))  # this batch asks for one map only
    y = batch(device, 4)
    y.cache.kernel_map(KernelMapKey(y.coord_id, *SUBM))
    assert len(y.cache.batch.planned) > 1, "the batch before the last one still counts"
    z = batch(device, 5)
    z.cache.kernel_map(KernelMapKey(z.coord_id, *SUBM))
    assert z.cache.batch.planned == {}, "two batches asked for one map: nothing else is built"


@pytest.mark.parametrize("device", DEVICES)
def test_only_a_batchs_first_set_is_planned_from(device):
    requests(batch(device, 0))
    x = batch(device, 6)
    coarse = x.cache.kernel_map(KernelMapKey(x.coord_id, *DOWN))[1]
    assert x.cache.set_count() == 6  # planned at the first request
    moved = x.cache.to("meta") if device == "cpu" else x.cache.to("cpu")
    assert moved.set_count() == 6 and moved.batch.record is None  # a moved cache keeps its sets; builds lazily
    assert coarse == x.cache.canonical((2, 2, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_query_many_equals_one_query_per_map(device, monkeypatch):
    torch.manual_seed(7)
    fine = random_coords(400, 12, batch_size=2, device=device).int()  # the hash kernels read int32 coordinates
    # The input set's coordinates and table in arrays of their own, the coarse sets' together (as a
    # planned batch holds them): a query's flags pick the arrays.
    fine_table = CoordHashTable.build(fine)
    coarse = floors.floor_sets(pack_coords(fine), floor_masks(((2, 2, 2), (4, 4, 4)), fine.device))
    sets = [fine, *coarse.coords.split(coarse.counts)]
    capacities = [coarse.capacity] * 2
    bases = [0, coarse.capacity]
    coarse_tables, coarse_coords = coarse.table, coarse.coords
    row_base = [0, 0, len(sets[1])]
    table_base = [0, *bases]
    capacity = [fine_table.keys.shape[0], *capacities]
    # (output set, source set, kernel size, step): kernel volumes 27 and 8 in one launch, output rows
    # and tables from either array, at regions with gaps between them (each map's part must land
    # where its query says).
    plan_ = [(2, 1, 3, 1), (0, 2, 2, 2), (1, 1, 3, 2), (2, 0, 2, 1), (0, 0, 3, 1)]
    offsets = torch.cat([offset_deltas((k, k, k)) * step for _, _, k, step in plan_]).contiguous().to(device)
    queries, out_base, offset_base = [], 5, 0
    for out, source, k, _ in plan_:
        queries.append(MapQuery(row_base[out], len(sets[out]), offset_base, k ** 3, table_base[source],
                                capacity[source], out_base, coarse_rows=out > 0, coarse_table=source > 0))
        out_base += len(sets[out]) * k ** 3 + 3
        offset_base += k ** 3
    flat = torch.full((out_base,), -7, dtype=torch.int32, device=device)
    launches, in_parallel = [], hashing.parallel.in_parallel
    with monkeypatch.context() as patch:
        patch.setattr(hashing, "CPU_CHUNK_LOOKUPS", 1)  # on the CPU: in row ranges on threads at once
        patch.setattr(hashing.parallel, "in_parallel", lambda fn, ranges: launches.append(ranges) or
                      in_parallel(fn, ranges))
        hashing.query_many((sets[0], coarse_coords), offsets, (fine_table, coarse_tables), flat, queries)
    assert len(launches[0]) == (torch.get_num_threads() if device == "cpu" else 1)
    for (out, source, k, _), query in zip(plan_, queries):
        volume = k ** 3
        part = offsets[query.offset_base: query.offset_base + volume]
        expected = CoordHashTable.build(sets[source]).neighbors(sets[out], part)
        got = flat[query.out_base: query.out_base + query.rows * volume].view(-1, volume)
        assert torch.equal(got, expected), (out, source, k)
        assert (expected >= 0).any() and (expected < 0).any()
        gap = flat[query.out_base + query.rows * volume: query.out_base + query.rows * volume + 3]
        assert (gap == -7).all(), "nothing written between the maps' parts"
    assert (flat[:5] == -7).all(), "nothing written outside the maps' parts"


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_plan_is_one_warning_and_the_layers_build_their_maps(device, monkeypatch, caplog):
    monkeypatch.setattr(prebuild, "_one_launch", lambda _: True)
    requests(batch(device, 0))

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(prebuild, "query_many", broken)
    x = batch(device, 8)
    with caplog.at_level("WARNING", logger="sparseconv"):
        planned = requests(x)
    assert [r.message for r in caplog.records if "planned kernel maps failed" in r.message] != []
    monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
    y = batch(device, 8)
    assert_same_maps(planned, requests(y), x.cache, y.cache)
    monkeypatch.delenv("SPARSECONV_PLAN_MAPS")
    caplog.clear()
    z = batch(device, 9)
    z.cache.kernel_map(KernelMapKey(z.coord_id, *SUBM))
    assert z.cache.set_count() == 1 and not caplog.records, "planning stays off on that device, quietly"


@pytest.mark.parametrize("device", DEVICES)
def test_a_record_keeps_only_the_views_a_builder_makes(device):
    # A layer's problem, tuner key and prepared products are views of its map too; the next batch's
    # builders make none of them, and merging two batches' keys compared them field by field.
    from sparseconv.nn import SparseConv3d  # the layers that ask for views beside the maps

    torch.manual_seed(0)
    layers = torch.nn.Sequential(SparseConv3d(2, 4, 3), SparseConv3d(4, 4, 2, 2)).to(device)
    x = batch(device, 0)
    layers(x)
    record = x.cache.batch.record
    kept = [key for keys in (*record.views.values(), *record.adjoint_views.values()) for key in keys]
    asked = [key for m in x.cache.kernel_maps() for key in m._derived]
    assert any(isinstance(key, tuple) and key[0] == "conv_problem" for key in asked), "the layers made views"
    kinds = x.cache.batch.builders.view_kinds  # the library's builders' (what the layers' map requests pass)
    assert kinds and all(isinstance(key, tuple) and key[0] in kinds for key in kept)
    assert set(kept) == {key for key in asked if isinstance(key, tuple) and key[0] in kinds}


@pytest.mark.parametrize("device", DEVICES)
def test_a_planned_batch_drops_its_hash_tables_but_those_queried_after_the_plan(device, monkeypatch):
    # Once the plan has queried its maps the sets' hash tables only take memory (through the forward
    # pass's peak): they go, and a map the plan does not make (stride 3: from the input set) builds its
    # source's table again, which the next batches then keep.
    requests(batch(device, 0))
    x = batch(device, 6)
    x.cache.kernel_map(KernelMapKey(x.coord_id, *SUBM))
    assert x.cache._tables == {} and len(x.cache._dropped) == 6  # the input's, 3 coarse and 2 generated sets
    # nothing holds the input's table through its keys (one allocation in the checks' kernel)
    keys = x.cache.keys(x.coord_id)
    assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    planned = requests(x)
    assert set(x.cache._tables) == {x.coord_id} and x.cache.batch.record.keep_tables == {(1, 1, 1)}
    monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
    y = batch(device, 6)
    assert_same_maps(planned, requests(y), x.cache, y.cache)
    monkeypatch.delenv("SPARSECONV_PLAN_MAPS")
    z = batch(device, 7)
    z.cache.kernel_map(KernelMapKey(z.coord_id, *SUBM))
    assert set(z.cache._tables) == {z.coord_id} and len(z.cache._dropped) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_planned_pair_counts_wait_for_their_copy_when_the_gpu_is_behind(monkeypatch):
    # The plan copies the counts without waiting; a reader waits for that copy. With the copy queued
    # behind ~50 ms of GPU work, reading the pinned buffer without that wait would see garbage.
    requests(batch("cuda", 0))
    x = batch("cuda", 5)
    start = host_copy.HostCopy.__init__

    def behind(self, tensor):
        torch.cuda._sleep(100_000_000)
        start(self, tensor)

    monkeypatch.setattr(host_copy.HostCopy, "__init__", behind)
    x.cache.kernel_map(KernelMapKey(x.coord_id, *SUBM))
    planned = [kernel_map for kernel_map, _ in x.cache.batch.planned.values()]
    read = [kernel_map.pair_counts for kernel_map in planned]
    assert read == [(kernel_map.neighbors >= 0).sum(0).tolist() for kernel_map in planned]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_take_a_kept_pinned_slot_again_only_once_its_copy_is_done():
    values = torch.randint(0, 1000, (40,), device="cuda")
    first = host_copy.HostCopy(values)
    address = first._host.data_ptr()
    assert first.values() == values.tolist()
    again = host_copy.HostCopy(values + 1)  # the slot the first gave back once read
    assert again._host.data_ptr() == address and again.values() == (values + 1).tolist()
    # A copy queued behind ~50 ms of GPU work and dropped unread: its slot is still being written to,
    # so the next copy takes another (reading that one would see the late copy land on it).
    torch.cuda._sleep(100_000_000)
    pending = host_copy.HostCopy(values + 2)
    busy = pending._host.data_ptr()
    del pending
    other = host_copy.HostCopy(values + 3)
    assert other._host.data_ptr() != busy and other.values() == (values + 3).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_a_lone_layers_map_is_lone_once_the_last_batches_made_one_product_on_it_alone(device):
    # Lone: the last two batches asked for this map and no other, and made one product on it each
    # (the tuner then times its candidates with the views they build); two products, or a network's
    # maps, are not.
    from sparseconv.nn import SparseConv3d

    conv = SparseConv3d(2, 3, 3).to(device)

    def seen(seed: int, products: int = 1):
        x = batch(device, seed)
        with torch.no_grad():
            for _ in range(products):
                conv(x)
        kernel_map = x.cache.kernel_maps()[0]
        maps.append(kernel_map)
        assert x.cache.batch.use(kernel_map).uses == [products]
        problems = [view for key, view in kernel_map._derived.items() if key[0] == "conv_problem"]
        lone = x.cache.batch.use(kernel_map).lone
        assert [problem.lone for problem in problems] == [lone]  # what the tuner reads
        return lone

    maps = []
    requests(batch(device, 0))  # a network's batch
    assert [seen(seed) for seed in (1, 2, 3, 4)] == [False, False, True, True]
    # The tuner's key takes a map's fill from the last batch's map under its key, where that one was built by its
    # layer too (counted and copied then: no wait); the first lone map's counterpart was built ahead by the plan.
    previous = maps[-2]
    assert maps[-2].fill() == (sum(maps[-2].pair_counts), maps[-2].num_out * 27)  # its own
    assert maps[-1].fill() == (sum(previous.pair_counts), previous.num_out * 27)
    assert [seen(seed, 2) for seed in (5, 6, 7)] == [True, False, False]
    assert [seen(seed) for seed in (8, 9, 10)] == [False, False, True]
    requests(batch(device, 11))  # a network again (its first map was taken for the lone layer's: no harm)
    x = batch(device, 12)
    requests(x)
    assert not any(x.cache.batch.use(kernel_map).lone for kernel_map in x.cache.kernel_maps())


def offered(kernel_map, key):
    """The view the map plan offered ``kernel_map`` under ``key``, taken by a reader or not (None: none)."""
    return kernel_map._derived.get(key, (kernel_map.__dict__.get("_offered") or {}).get(key))


@pytest.mark.parametrize("device", DEVICES)
def test_a_lone_map_is_counted_once_every_recount_batches_and_carries_that_count_between(device, monkeypatch):
    # A lone layer's map carries the count of the last batch that counted (its fill for the tuner's key, the ranks
    # of its row orders), counting anew every RECOUNT batches; its outputs stay exact.
    from sparseconv.nn import SparseConv3d

    counted = []

    def counting(maps):
        counted.append(maps[0])
        return prebuild.copy_pair_counts(maps)

    monkeypatch.setattr(plan, "copy_pair_counts", counting)
    conv = SparseConv3d(2, 3, 3).to(device)
    lone, last = [], None
    for seed in range(3 + 2 * plan.RECOUNT):
        x = batch(device, 20 + seed)
        with torch.no_grad():
            out = conv(x)
        kernel_map = x.cache.kernel_maps()[0]
        with torch.no_grad():
            expected = reference(copy.deepcopy(conv).double(), x, out, x.feats.double())  # dense conv3d, float64
        assert relative_error(out.feats, expected) < 1e-5
        if x.cache.batch.use(kernel_map).lone:
            lone.append(kernel_map)
            if last is not None:  # the count this map carries: the last counted map's
                assert kernel_map.fill() == (sum(last.pair_counts), last.num_out * 27)
                if kernel_map is not counted[-1]:
                    assert torch.equal(offered(kernel_map, RANKS_VIEW), last.offset_counts)
        if counted and counted[-1] is kernel_map:
            last = kernel_map
    # The batch before the first lone one counted (a map not lone yet): then every RECOUNT-th batch.
    at = [i for i, m in enumerate(lone) if any(m is c for c in counted)]
    assert len(lone) == 2 * plan.RECOUNT + 1 and at == [plan.RECOUNT - 1, 2 * plan.RECOUNT - 1]


@pytest.mark.parametrize("device", DEVICES)
def test_maps_built_by_their_layers_take_their_fill_from_the_last_batchs_maps_under_their_keys(device, monkeypatch):
    # Maps not planned (here: planning off) are built when their layers ask, and their tuner keys would wait
    # for their pair counts. It takes the last batch's counts under its key
    # instead (copied during that batch), and starts its own for the next.
    from sparseconv.nn import Sequential, SparseConv3d

    monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")  # (planned, their counts are copied with the plan's)
    net = Sequential(SparseConv3d(2, 3, 3, 2, generative=True), SparseConv3d(3, 3, 3)).to(device)
    first, second = batch(device, 1), batch(device, 2)
    with torch.no_grad():
        net(first)
        net(second)
    before = {key: kernel_map for key, (kernel_map, _) in first.cache._maps.items()}
    hinted = [(key, kernel_map) for key, (kernel_map, _) in second.cache._maps.items()]
    assert len(hinted) == 2 and all(key.source > 0 or key.generative for key, _ in hinted)
    for key, kernel_map in hinted:
        old = before[key]
        assert kernel_map.fill() == (sum(old.pair_counts), old.num_out * old.kernel_volume) != (
            sum(kernel_map.pair_counts), kernel_map.num_out * kernel_map.kernel_volume)


@pytest.mark.parametrize("device", DEVICES)
def test_a_detection_backbones_maps_on_generated_sets_are_planned_as_its_layers_build_them(device, monkeypatch):
    # spconv's downsampling (generative k3 s2 convs, then the height conv's): every map but the stem's reads or
    # makes a generated set. From the second batch the plan builds them all at the first request, each set
    # and map as the layer's own build makes it; the pass gives what it gives with every map built by its layer.
    from sparseconv.models import SparseResNetBackbone

    torch.manual_seed(3)
    net = SparseResNetBackbone(2, channels=(4, 4, 4), blocks=1, out_channels=4, generative_down=True).to(device).eval()
    prebuilt = []
    build = prebuild.build
    monkeypatch.setattr(prebuild, "build", lambda *args: prebuilt.append(dict(build(*args))) or dict(prebuilt[-1]))
    with torch.no_grad():
        net(batch(device, 1))
        assert prebuilt == []  # the first batch makes the plan
        x = batch(device, 2)
        planned = net(x)
        monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
        y = batch(device, 2)
        lazy = net(y)
    assert len(prebuilt) == 1 and set(prebuilt[0]) == set(x.cache._maps) and x.cache.batch.planned == {}
    assert len(x.cache._maps) == 6 and sum(key.generative for key in x.cache._maps) == 3  # 3 submanifold maps
    assert list(x.cache._maps) == list(y.cache._maps)
    for key, (kernel_map, out_id) in x.cache._maps.items():
        other, other_out = y.cache._maps[key]
        assert out_id == other_out and torch.equal(x.cache.coord_set(out_id).coords, y.cache.coord_set(other_out).coords)
        assert torch.equal(kernel_map.neighbors, other.neighbors) and kernel_map.pair_counts == other.pair_counts
    torch.testing.assert_close(planned.bev, lazy.bev)


@pytest.mark.parametrize("device", DEVICES)
def test_only_maps_whose_sets_the_input_alone_makes_are_planned(device):
    # A generated set's origin is the canonical set and the generative convs that made it; a floor of a
    # generated set, a transposed conv's set and a set from a generative transposed conv have none.
    x = batch(device, 4)
    cache = x.cache
    generated = cache.kernel_map(KernelMapKey(x.coord_id, *GENERATE))[1]
    assert cache.origin(generated) == ((1, 1, 1), GENERATE[:3])
    assert plan.spec_of(cache, KernelMapKey(generated, *SUBM)).origin == cache.origin(generated)
    again = cache.kernel_map(KernelMapKey(generated, *GENERATE))[1]
    assert cache.origin(again) == ((1, 1, 1), GENERATE[:3], GENERATE[:3])
    assert plan.spec_of(cache, KernelMapKey(generated, *DOWN)) is None
    assert plan.spec_of(cache, KernelMapKey(generated, *UP)) is None
    up = cache.kernel_map(KernelMapKey(generated, (3, 3, 3), (2, 2, 2), (1, 1, 1), True, True))[1]
    assert cache.origin(up) is None and plan.spec_of(cache, KernelMapKey(up, *SUBM)) is None


def test_a_batch_whose_generation_fails_raises_from_its_layer_and_the_next_batches_keep_their_plan(caplog, monkeypatch):
    # A voxel at the top of the range generates one past it: the plan's generation finds it first, and the layer
    # raises it as without a plan; planning is not switched off for the device (a bad batch, not a failing plan).
    from sparseconv.coords.keys import COORD_MAX
    from sparseconv.nn import Sequential, SparseConv3d

    net = Sequential(SparseConv3d(2, 3, 3, 2, generative=True), SparseConv3d(3, 3, 3)).eval()
    prebuilt = []
    build = prebuild.build
    monkeypatch.setattr(prebuild, "build", lambda *args: prebuilt.append(dict(build(*args))) or dict(prebuilt[-1]))
    with torch.no_grad():
        for seed in (1, 2):
            net(batch("cpu", seed))
        edge = torch.tensor([[0, 0, 0, 0], [0, COORD_MAX, 0, 0]], dtype=torch.int32)
        with pytest.raises(ValueError, match="generative conv: the generated output coordinates leave"):
            net(SparseTensor(edge, torch.randn(2, 2)))
        x = batch("cpu", 3)
        net(x)
    assert not caplog.records and [len(maps) for maps in prebuilt] == [2, 0, 2]
    assert set(prebuilt[-1]) == set(x.cache._maps) and x.cache.batch.planned == {}


# A network's requests drawn at random: submanifold maps (dilated, anisotropic) on the current set, k2 s2 floors,
# generative convs (isotropic, a height conv's, k2 s2), and floors of generated sets (which stay with their layers).
STEPS = {
    "subm": SUBM, "subm_dilated": ((3, 3, 3), (1, 1, 1), (2, 2, 2), False, False),
    "subm_aniso": ((1, 3, 3), (1, 1, 1), (1, 1, 1), False, False), "down": DOWN, "generate": GENERATE,
    "generate_height": ((1, 1, 3), (1, 1, 2), (1, 1, 1), False, True),
    "generate_k2": ((2, 2, 2), (2, 2, 2), (1, 1, 1), False, True),
}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=7), seed=st.integers(0, 2**16))
def test_any_network_of_generated_and_canonical_sets_is_planned_as_its_layers_build_it(steps, seed, monkeypatch):
    def requests_of(x: SparseTensor) -> list:
        asked, source = [], x.coord_id
        for step in steps:
            key = KernelMapKey(source, *STEPS[step])
            kernel_map, out_id = x.cache.kernel_map(key)
            asked.append((key, kernel_map, out_id))
            source = out_id
        return asked

    plan._history.clear()  # (the examples of one test share the fixture's history)
    built = []
    build = prebuild.build
    monkeypatch.setattr(prebuild, "build", lambda *args: built.append(dict(build(*args))) or dict(built[-1]))
    requests_of(batch("cpu", seed))
    x = batch("cpu", seed + 1)
    planned = requests_of(x)
    assert x.cache.batch.planned == {}, "a planned map was never asked for"
    # Every map the plan can describe was built at the batch's first request (but a plan of one map: a lone layer's).
    plannable = {key for key, _, _ in planned if plan.spec_of(x.cache, key) is not None}
    if len({plan.spec_of(x.cache, key) for key in plannable}) > 1:
        assert plannable <= set(built[-1])
    monkeypatch.setenv("SPARSECONV_PLAN_MAPS", "0")
    y = batch("cpu", seed + 1)
    assert_same_maps(planned, requests_of(y), x.cache, y.cache)
    monkeypatch.delenv("SPARSECONV_PLAN_MAPS")
