"""One batch's shared state (sparseconv.coords.batch) as the operators use it (sparseconv.ops.batch)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import DEVICES
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.backends import triton_kernels
from sparseconv.coords import KernelMapKey, prebuild
from sparseconv.nn import SparseConv3d, SparseConvTranspose3d
from sparseconv.ops import batch as ops_batch

SUBM = ((3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)


def network(device) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([SparseConv3d(2, 4, 3), SparseConv3d(4, 4, 2, 2), SparseConv3d(4, 4, 3),
                                SparseConvTranspose3d(4, 3, 2, 2)]).to(device)


def step(layers, device, seed: int) -> list[weakref.ref]:
    """One training pass on a new point cloud; returns weak references to its batch's cache, state and maps."""
    torch.manual_seed(seed)
    coords = random_coords(300, 12, batch_size=2, low=-6, device=device)
    x = SparseTensor(coords, torch.randn(len(coords), 2, device=device, requires_grad=True))
    out = x
    for layer in layers:
        out = layer(out)
    out.feats.square().sum().backward()
    return [weakref.ref(x.cache), weakref.ref(x.cache.batch), *map(weakref.ref, x.cache.kernel_maps())]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batchs_maps_and_state_go_with_its_tensors_without_the_garbage_collector(device):
    # A batch holds its maps' views and prepared products (GPU memory): a reference cycle among its state
    # (a map's use back to its batch, say) would keep every batch's until a full collection, and the memory
    # of a training loop would grow between collections.
    layers = network(device)
    gc.collect()
    gc.disable()
    try:
        held = [step(layers, device, seed) for seed in range(4)]  # the later ones planned from the first
        assert [[ref() for ref in refs] for refs in held] == [[None] * len(refs) for refs in held]
    finally:
        gc.enable()


@pytest.mark.parametrize("device", DEVICES)
def test_the_operators_map_request_hands_the_batch_its_builders_and_a_use_per_map(device):
    # What a map is built with is passed at the request, not registered at import: a request without
    # builders (coords alone) builds by torch's ops; the operators' request (ops.batch.kernel_map) gives the
    # batch the library's, and the maps it builds their pair kernels.
    coords = random_coords(200, 10, low=-5, device=device)
    alone = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    kernel_map, _ = alone.cache.kernel_map(KernelMapKey(alone.coord_id, *SUBM))
    assert kernel_map.kernels is None and alone.cache.batch.builders.views == ()
    x = SparseTensor(coords, torch.zeros(len(coords), 1, device=device))
    kernel_map, use, out_id = ops_batch.kernel_map(x.cache, KernelMapKey(x.coord_id, *SUBM))
    assert x.cache.batch.builders is ops_batch.BUILDERS and kernel_map.kernels is ops_batch.BUILDERS.kernels
    assert use.map is kernel_map and x.cache.batch.use(kernel_map) is use and out_id == x.coord_id
    assert torch.equal(kernel_map.neighbors, alone.cache.kernel_map(KernelMapKey(alone.coord_id, *SUBM))[0].neighbors)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layers_later_calls_on_a_map_run_the_product_prepared_in_the_maps_use(device):
    # The tuner keeps a settled choice's prepared call in the map's use in its batch: the layer's second call
    # finds it there (and a new batch's map starts without, until the plan prepares it ahead).
    conv = SparseConv3d(2, 3, 3, fwd_algo="mask_implicit_gemm").to(device)  # a backend that prepares
    coords = random_coords(200, 10, low=-5, device=device)
    x = SparseTensor(coords, torch.randn(len(coords), 2, device=device))
    with torch.no_grad():
        first = conv(x)
        (kernel_map, _), = [x.cache.kernel_map(key) for key in x.cache.built_keys()]
        use = x.cache.batch.use(kernel_map)
        assert len(use.calls) == 1 and use.uses == [1]
        second = conv(x)
    assert len(use.calls) == 1 and use.uses == [2] and torch.equal(first.feats, second.feats)


def test_a_cpu_batch_is_planned_without_triton(monkeypatch, caplog):
    # A CPU-only install has no Triton (it comes with the GPU and test extras): the plan's view builders, which
    # build nothing on a CPU outside Triton's interpreter, must not import it. They did, and every CPU user's
    # second batch warned that planning failed and built its maps one layer at a time from then on.
    def no_triton():
        raise ModuleNotFoundError("No module named 'triton'")

    built = []  # how many maps each planned batch built ahead (the layers take them from the dict after)

    def build(*args):
        maps = planned_build(*args)
        built.append(len(maps))
        return maps

    planned_build = prebuild.build
    monkeypatch.setattr(prebuild, "build", build)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "kernels", no_triton)
    layers = network("cpu")
    with caplog.at_level("WARNING", logger="sparseconv"):
        for seed in range(4):
            step(layers, "cpu", seed)  # every batch after the first planned from the ones before
    assert not caplog.records, [r.message for r in caplog.records]
    assert len(built) == 3 and all(built), "every planned batch built its maps ahead"
