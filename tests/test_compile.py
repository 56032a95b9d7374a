"""torch.compile: the conv products as custom ops, a MinkUNet trained compiled, the tuner's refusal.

CPU inductor compiles C++ (slow on two cores), so the training test uses backend="aot_eager":
Dynamo's graphs and AOTAutograd's joint forward/backward with the custom ops, executed by
torch. What inductor adds (code generation) never sees inside our ops, which stay opaque calls.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from sparse_reference import random_coords

import sparseconv.tune
from sparseconv import SparseTensor
from sparseconv.models import MinkUNet
from sparseconv.nn import SparseConv3d
from sparseconv.ops import compiled

PIN = "explicit_gemm"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _input(n=200, extent=10, channels=3):
    coords = random_coords(n, extent)
    return SparseTensor(coords, torch.randn(len(coords), channels))


def test_a_conv_layer_compiles_with_fullgraph_once_its_map_is_built_and_matches_eager_with_gradients():
    x = _input(channels=4)
    conv = SparseConv3d(4, 8, 3, fwd_algo=PIN, dgrad_algo=PIN, wgrad_algo=PIN)
    conv(x)  # builds the map: a build inside the graph would be a (forbidden) graph break
    feats = x.feats.clone().requires_grad_()
    eager = conv(x.replace(feats))
    compiled_conv = torch.compile(conv, backend="aot_eager", fullgraph=True)
    out = compiled_conv(x.replace(feats))
    assert out.coord_id == eager.coord_id and out.cache is x.cache
    torch.testing.assert_close(out.feats, eager.feats)
    grad = torch.randn_like(eager.feats)
    expected = torch.autograd.grad(eager.feats, (feats, conv.weight, conv.bias), grad)
    got = torch.autograd.grad(out.feats, (feats, conv.weight, conv.bias), grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_an_inference_block_with_fused_norms_compiles_with_fullgraph_and_matches_eager():
    # Eager inference fuses each norm with its ReLU and sum in one Triton launch (BatchNorm.forward_fused);
    # traced, torch's ops run instead (Dynamo cannot trace the launch; Inductor fuses them itself).
    from sparseconv.models.blocks import BasicBlock, conv_norm_relu

    x = _input(channels=4)
    model = torch.nn.Sequential(conv_norm_relu(4, 8), BasicBlock(8, 8)).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2)
    with torch.no_grad():
        eager = model(x)  # builds the maps
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out.feats, eager.feats, rtol=1e-5, atol=1e-5)


def test_without_a_built_map_fullgraph_names_the_map_build():
    x = _input(channels=4)
    conv = SparseConv3d(4, 8, 3, fwd_algo=PIN)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_build_map"):
        torch.compile(conv, backend="aot_eager", fullgraph=True)(x)


def test_the_ops_find_the_live_map_and_its_cached_views():
    x = _input(channels=2)
    conv = SparseConv3d(2, 3, 3, fwd_algo=PIN)
    conv(x)
    kernel_map = x.cache.kernel_maps()[0]
    assert compiled.lookup(kernel_map.neighbors, kernel_map.num_in, kernel_map.kernel_size) is kernel_map
    copy = kernel_map.neighbors.clone()  # a table no live map owns: a map rebuilt from it
    rebuilt = compiled.lookup(copy, kernel_map.num_in, kernel_map.kernel_size)
    assert rebuilt is not kernel_map and rebuilt.neighbors is copy


@pytest.mark.parametrize("transposed", [False, True], ids=["strided", "transposed"])
def test_the_custom_ops_pass_opcheck(transposed):
    x = _input(channels=3)
    down = SparseConv3d(3, 3, 2, 2)
    coarse = down(x)
    source, kernel_size, stride = (coarse, (2, 2, 2), (2, 2, 2)) if transposed else (x, (3, 3, 3), (1, 1, 1))
    conv = SparseConv3d(3, 4, kernel_size, stride, transposed=transposed)
    out = conv(source)
    kernel_map = next(m for m in x.cache.kernel_maps() if m.num_out == len(out) and m.num_in == len(source))
    layer = (list(kernel_size), list(stride), [1, 1, 1], transposed, False)
    feats = source.feats.detach().clone().requires_grad_()
    weight = conv.weight.detach().clone().requires_grad_()
    grad_out = torch.randn(len(out), 4)
    torch.library.opcheck(compiled.conv_forward, (feats, weight, kernel_map.neighbors, *layer, PIN, PIN, PIN))
    dgrad_args = (grad_out, weight.detach(), kernel_map.neighbors, len(source), *layer, PIN)
    torch.library.opcheck(compiled.conv_dgrad, dgrad_args)
    torch.library.opcheck(compiled.conv_wgrad, (feats.detach(), grad_out, kernel_map.neighbors, *layer, PIN))


def test_tuning_inside_a_trace_refuses_and_names_the_warmup_helper():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = _input(channels=3)
    conv = SparseConv3d(3, 4, 3)
    conv.requires_grad_(False)
    # The map and its pair counts exist (the tuner's key needs them); timing is what the trace cannot do.
    assert x.cache.kernel_map(_key(x, conv))[0].num_pairs > 0
    message = r"cannot be tuned on fake tensors.*sparseconv\.warmup\(model, example_input\)"
    with pytest.raises(RuntimeError, match=message):
        make_fx(lambda f: conv(x.replace(f)).feats, tracing_mode="fake")(x.feats)


def test_after_warmup_the_trace_finds_every_choice():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = _input(channels=3)
    conv = SparseConv3d(3, 4, 3)
    conv.requires_grad_(False)
    sparseconv.warmup(conv, x)
    # The map's index tensors and the weight are real inside the trace, hence _allow_non_fake_inputs.
    traced = make_fx(lambda f: conv(x.replace(f)).feats, tracing_mode="fake", _allow_non_fake_inputs=True)(x.feats)
    assert traced is not None


def _key(x, conv):
    from sparseconv.coords.kernel_map import KernelMapKey

    return KernelMapKey(x.coord_id, conv.kernel_size, conv.stride, conv.dilation, conv.transposed, conv.generative)


def test_warmup_restores_gradients_and_batch_norm_statistics(monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")  # what it restores does not depend on timing
    torch.manual_seed(0)
    model = MinkUNet(3, 4, blocks=(1, 0, 0, 0, 0, 0, 0, 1), planes=(4,) * 8, stem_channels=4, stem_kernel_size=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sparseconv.warmup(model, _input())
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        sparseconv.warmup(lambda x: x, _input())


def test_a_small_minkunet_trains_two_steps_compiled_with_the_eager_losses(monkeypatch):
    # The heuristic choice (no timing) keeps the test short; tuning is covered above.
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    torch.manual_seed(0)
    coords = random_coords(300, 12)
    feats = torch.randn(len(coords), 3)
    labels = torch.randint(0, 4, (len(coords),))

    def make():
        torch.manual_seed(1)
        # Every kind of layer (submanifold, strided, transposed, 1x1 head, norms, skip concatenation)
        # without residual blocks, which only add more of the same to compile.
        return MinkUNet(3, 4, blocks=(0,) * 8, planes=(8,) * 8, stem_channels=8, stem_kernel_size=3)

    def train(model):
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            x = SparseTensor(coords, feats)  # a new batch: new coordinate cache, maps built again
            loss = torch.nn.functional.cross_entropy(model(x).feats, labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        return losses

    eager = train(make())
    model = make()
    example = SparseTensor(coords, feats)
    sparseconv.warmup(model, example)
    got = train(torch.compile(model, backend="aot_eager"))
    assert got == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert got[1] != got[0]  # it did train
    # Each batch's maps are built at its first miss, not one graph break per map.
    maps = len(example.cache.built_keys())
    graphs = counters["stats"]["unique_graphs"]
    assert graphs < maps, (graphs, maps)


@pytest.mark.gpu
def test_tuning_during_cuda_graph_capture_refuses_and_names_the_warmup_helper():
    x = _input(channels=16).to("cuda")
    conv = SparseConv3d(16, 16, 3, device="cuda")
    conv.requires_grad_(False)
    # The map and its pair counts exist (reading them syncs, which a capture forbids too).
    assert x.cache.kernel_map(_key(x, conv))[0].num_pairs > 0
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"during CUDA-graph capture.*sparseconv\.warmup"):
        with torch.cuda.graph(graph):
            conv(x)


@pytest.mark.gpu
def test_a_small_minkunet_trains_compiled_by_inductor_on_cuda_with_the_eager_losses():
    torch.manual_seed(0)
    coords = random_coords(2000, 24, device="cuda")
    feats = torch.randn(len(coords), 3, device="cuda")
    labels = torch.randint(0, 4, (len(coords),), device="cuda")

    def make():
        torch.manual_seed(1)
        return MinkUNet(3, 4, blocks=(1,) * 8, planes=(16,) * 8, stem_channels=16, stem_kernel_size=3).cuda()

    def train(model):
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(SparseTensor(coords, feats)).feats, labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        return losses

    model = make()
    sparseconv.warmup(model, SparseTensor(coords, feats))  # tunes every product: the runs below only look up
    eager = train(model)
    model = make()
    got = train(torch.compile(model))
    # Split-K and scatter-add backends sum in a run-dependent order on the GPU.
    assert got == pytest.approx(eager, rel=1e-3, abs=1e-4)


def test_pooling_compiles_with_its_map_built_outside_the_graph():
    from sparseconv.nn import functional as F

    x = _input(channels=3)

    def pools(t):
        return F.max_pool3d(t, 2).feats, F.avg_pool3d(t, 2).feats

    expected = pools(x)
    got = torch.compile(pools, backend="aot_eager")(SparseTensor(x.coords, x.feats))  # a new cache: maps missing
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    # The graph breaks where the map is found, not inside the map build's own code (and at
    # avg_pool3d's bincount, whose output size Dynamo takes as data-dependent).
    reasons = list(counters["graph_break"])
    assert reasons and all("pool_map" in r or "bincount" in r for r in reasons), [r[:300] for r in reasons]
