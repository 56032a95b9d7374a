"""sparseconv.graphed: the fixed-size pass a CUDA graph captures equals the eager pass on new point clouds.

On the CPU the same pass runs without capture (``capture=False``): its tables, capacities, padded rows and
recording are what a graph replays; float64 runs the convs in torch's ops, float32 the Triton table kernel
(interpreted). The GPU test captures and replays.
"""

from __future__ import annotations

import pytest
import torch
from sparse_reference import random_coords

import sparseconv
from sparseconv import SparseTensor
from sparseconv.models import MinkUNet
from sparseconv.nn import BatchNorm, ReLU, Sequential, SparseConv3d, SparseMaxPool3d
from sparseconv.ops import capacity


def _model(dtype, device="cpu") -> MinkUNet:
    torch.manual_seed(0)
    model = MinkUNet(3, 5, blocks=(1,) * 8, width=0.25, stem_kernel_size=3)
    for module in model.modules():  # statistics that change the result (a fresh norm is the identity)
        if isinstance(module, BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
    return model.to(device, dtype).eval()


def _cloud(n: int, dtype, device="cpu") -> SparseTensor:
    coords = random_coords(n, 10, batch_size=2).to(device)
    return SparseTensor(coords, torch.randn(len(coords), 3, dtype=dtype, device=device))


def _check_equal(graphed_out: SparseTensor, eager_out: SparseTensor, tolerance: float) -> None:
    assert torch.equal(graphed_out.coords, eager_out.coords)
    error = (graphed_out.feats - eager_out.feats).abs().max() / eager_out.feats.abs().max()
    assert error <= tolerance, error


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_graphed_pass_equals_eager_on_new_clouds(dtype):
    model = _model(dtype)
    run = sparseconv.graphed(model, capture=False)
    sizes = [300, 280, 310] if dtype == torch.float64 else [120, 110]
    for at, n in enumerate(sizes):
        x = _cloud(n, dtype)
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(run(x), eager, 1e-10 if dtype == torch.float64 else 1e-4)
        assert (x.cache.built_keys() == []) == (at > 0)  # later clouds' maps built into the tables, no eager map
    assert run.captures == 1  # each later cloud's sets fit the first's capacities
    kinds = {type(product).__name__ for product in run._graphs[0].maps.products.values()}
    assert kinds == ({"function"} if dtype == torch.float64 else {"_RowsProduct"})  # torch's ops / Triton's kernel


def test_a_larger_cloud_gets_a_bucket_of_its_own_and_the_first_still_serves():
    model = _model(torch.float64)
    run = sparseconv.graphed(model, capture=False)
    small, large = _cloud(150, torch.float64), _cloud(600, torch.float64)
    for x in (small, large, _cloud(140, torch.float64)):
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(run(x), eager, 1e-10)
    assert run.captures == 2
    small_bucket, large_bucket = sorted(run.buckets, key=lambda bucket: bucket.capacities[0])
    assert all(a <= b for a, b in zip(small_bucket.capacities, large_bucket.capacities))
    assert small_bucket.seconds > 0 and small_bucket.memory_bytes == 0  # (no CUDA memory on the CPU)


def test_a_cloud_whose_coarse_sets_overflow_grows_the_bucket_of_its_size():
    """Equal input sizes, a sparser cloud with more coarse voxels: the bucket grows in place of a second one."""
    model = _model(torch.float64)
    run = sparseconv.graphed(model, margin=1.0, capture=False)

    def cloud(extent: int) -> SparseTensor:
        coords = torch.unique(torch.cat([torch.randint(0, 2, (1200, 1)), torch.randint(0, extent, (1200, 3))], 1), dim=0)
        coords = coords[torch.randperm(len(coords))[:1000]]
        return SparseTensor(coords, torch.randn(len(coords), 3, dtype=torch.float64))

    dense, sparse = cloud(12), cloud(40)  # (1000 voxels each; at most 432 and about 950 at stride 2)
    for x in (dense, sparse, cloud(12)):
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(run(x), eager, 1e-10)
    assert run.captures == 2 and len(run.buckets) == 1
    capacities = run.buckets[0].capacities
    assert capacities[0] == capacity.capacity_of(1000, 1.0) and capacities[1] >= 900


def test_at_most_max_buckets_graphs_stay_the_least_recently_used_going_first():
    model = _model(torch.float64)
    run = sparseconv.graphed(model, capture=False, max_buckets=2)
    small, middle, large = (_cloud(n, torch.float64) for n in (150, 600, 1500))
    for x in (small, middle, small, large):  # small used after middle: middle is the one replaced
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(run(x), eager, 1e-10)
    assert run.captures == 3 and len(run.buckets) == 2
    kept = sorted(bucket.capacities[0] for bucket in run.buckets)
    assert kept[0] >= len(small) and kept[0] < len(middle) and kept[1] >= len(large)
    for x in (_cloud(140, torch.float64), _cloud(1400, torch.float64)):  # each on its own, smallest, graph
        run(x)
    assert run.captures == 3
    with pytest.raises(ValueError, match="max_buckets"):
        sparseconv.graphed(model, max_buckets=0)


@pytest.mark.parametrize("fixed", [True, False], ids=["built-into-the-tables", "built-eagerly"])
def test_padded_rows_never_reach_a_result(monkeypatch, fixed):
    """Rows past each set's count are poisoned (NaN features, stale tables pointing at them): no valid row reads
    them, whether the batch's maps were built into the tables or built eagerly and copied in."""
    model = _model(torch.float64)
    run = sparseconv.graphed(model, capture=False)
    run(_cloud(300, torch.float64))
    graph = run._graphs[0]
    assert graph.maps.fixed is not None
    graph.feats.fill_(float("nan"))
    poisoned = []

    def poison(maps: capacity.CapacityMaps, rows_of) -> None:  # past the count: rows that name padded input rows
        for key, table in maps.tables.items():
            table[rows_of(key):] = torch.arange(table.shape[1], dtype=table.dtype) % maps.maps[key].num_in
        poisoned.append(True)

    original_load, original_build = capacity.CapacityMaps.load, capacity.CapacityMaps.build

    def load(self, maps):
        original_load(self, maps)
        poison(self, lambda key: maps[key].neighbors.shape[0])

    def build(self, cache, input_set):
        ends = original_build(self, cache, input_set)
        rows = self.fixed.counts(ends, cache.coord_set(input_set).coords.shape[0])  # (on the CPU: ready)
        poison(self, lambda key: rows[self.out_ids[key]])
        return ends

    monkeypatch.setattr(capacity.CapacityMaps, "load", load)
    if fixed:
        monkeypatch.setattr(capacity.CapacityMaps, "build", build)
    else:
        graph.maps.fixed = None
    x = _cloud(250, torch.float64)
    with torch.no_grad():
        eager = model(SparseTensor(x.coords, x.feats))
    out = run(x)
    assert poisoned and torch.isfinite(out.feats).all()
    assert (x.cache.built_keys() == []) == fixed  # (built into the tables: no eager map)
    _check_equal(out, eager, 1e-10)


def test_graphed_passes_run_no_eager_product(monkeypatch):
    """The first call records the maps without running the convs' products (nor tuning them): zeros of each
    conv's shape; every pass after runs the capacity pass."""
    from sparseconv.ops import conv

    calls = []
    monkeypatch.setattr(conv, "dispatch", lambda *args, **kwargs: calls.append(args[0]))
    model = _model(torch.float64)
    run = sparseconv.graphed(model, capture=False)
    for n in (200, 190):
        x = _cloud(n, torch.float64)
        out = run(x)
    assert calls == []
    monkeypatch.undo()
    with torch.no_grad():
        _check_equal(out, model(SparseTensor(x.coords, x.feats)), 1e-10)


class _Stages(torch.nn.Module):
    """Returns its stages in a dict and a tuple: the structure a graphed call returns too."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = Sequential(SparseConv3d(3, 8, 3, bias=False), BatchNorm(8), ReLU())
        self.down = SparseConv3d(8, 16, 2, stride=2)

    def forward(self, x: SparseTensor) -> dict:
        stem = self.stem(x)
        return {"stem": stem, "stages": (stem, self.down(stem))}


def test_outputs_in_tuples_and_dicts_come_back_in_their_structure_on_the_batch_coordinates():
    model = _Stages().double().eval()
    run = sparseconv.graphed(model, capture=False)
    for n in (200, 180):
        x = _cloud(n, torch.float64)
        out = run(x)
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(out["stem"], eager["stem"], 1e-10)
        for graphed_stage, eager_stage in zip(out["stages"], eager["stages"]):
            _check_equal(graphed_stage, eager_stage, 1e-10)
            assert graphed_stage.cache is x.cache and graphed_stage.stride == eager_stage.stride


def test_a_dense_output_is_refused_with_what_to_do():
    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = SparseConv3d(3, 4, 3)

        def forward(self, x: SparseTensor) -> tuple:
            out = self.conv(x)
            return out, out.feats.sum()

    with pytest.raises(TypeError, match="dense result"):
        sparseconv.graphed(Dense().double().eval(), capture=False)(_cloud(100, torch.float64))


def test_capacity_buckets_cover_the_rows_with_a_margin():
    for rows in [0, 1, 15, 16, 17, 1000, 91_234, 657_000]:
        cap = capacity.capacity_of(rows, 1.1)
        least = max(rows * 1.1, rows + capacity.SLACK)
        assert cap > least
        step = 1 << max(0, cap.bit_length() - 4)
        assert cap % step == 0 and cap <= least * 1.13 + 1


def test_graphed_refuses_training_mode_and_layers_that_need_coordinates():
    model = _model(torch.float64).train()
    with pytest.raises(ValueError, match="eval"):
        sparseconv.graphed(model, capture=False)(_cloud(100, torch.float64))
    pooled = Sequential(SparseConv3d(3, 4, 3), BatchNorm(4), ReLU(), SparseMaxPool3d(2, 2)).double().eval()
    with pytest.raises(AttributeError, match="graphed"):
        sparseconv.graphed(pooled, capture=False)(_cloud(100, torch.float64))
    with pytest.raises(ValueError, match="margin"):
        sparseconv.graphed(model, margin=0.5)
    with pytest.raises(TypeError, match="module"):
        sparseconv.graphed(lambda x: x)
    with pytest.raises(ValueError, match="CUDA"):
        sparseconv.graphed(model.eval(), capture=True)(_cloud(100, torch.float64))


def test_on_the_cpu_by_default_graphed_is_the_module_itself():
    model = _model(torch.float64)
    run = sparseconv.graphed(model)
    x = _cloud(200, torch.float64)
    with torch.no_grad():
        eager = model(SparseTensor(x.coords, x.feats))
    _check_equal(run(x), eager, 0.0)
    assert run.captures == 0


@pytest.mark.gpu
def test_graph_replays_equal_eager_in_fp16_without_recapture():
    device = torch.device("cuda")
    model = MinkUNet(4, 13).to(device, torch.float16).eval()
    run = sparseconv.graphed(model)
    for at in range(8):
        coords = random_coords(20_000, 64, batch_size=2, device=device)
        x = SparseTensor(coords, torch.randn(len(coords), 4, dtype=torch.float16, device=device))
        with torch.no_grad():
            eager = model(SparseTensor(x.coords, x.feats))
        _check_equal(run(x), eager, 2e-2)
        assert (x.cache.built_keys() == []) == (at > 0)  # maps built into the tables, no host sync before the replay
    assert run.captures == 1
    assert run._graphs[0].graph is not None and run.buckets[0].memory_bytes > 0
    # Checks a GPU tensor defers (read at the coordinates' first use) are read by a graphed call too
    repeated = torch.cat([coords, coords[:5]])
    bad = SparseTensor(repeated, torch.randn(len(repeated), 4, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="duplicate"):
        run(bad)
