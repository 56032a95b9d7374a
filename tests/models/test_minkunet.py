"""MinkUNet: shapes, coordinates, gradients, presets, and that a tiny one learns on CPU."""

from __future__ import annotations

import pytest
import torch
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.data import make_scene
from sparseconv.models import BasicBlock, MinkUNet, MinkUNet14, MinkUNet18, MinkUNet34
from sparseconv.nn import GroupNorm


def _input(channels=3, n=400, extent=20):
    coords = random_coords(n, extent)
    return SparseTensor(coords, torch.randn(len(coords), channels))


@pytest.mark.parametrize("norm", [None, lambda c: GroupNorm(1, c)], ids=["batch_norm", "group_norm"])
def test_output_is_on_the_input_coordinates_and_every_parameter_gets_a_gradient(norm):
    x = _input()
    kwargs = {} if norm is None else {"norm": norm}
    model = MinkUNet14(3, 5, width=0.125, stem_kernel_size=3, **kwargs)
    out = model(x)
    assert out.feats.shape == (len(x), 5) and out.stride == (1, 1, 1)
    assert out.cache is x.cache and out.coord_id == x.coord_id
    (out.feats * torch.randn_like(out.feats)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and bool(p.grad.abs().sum() > 0), name


def test_presets_stack_the_published_block_counts_and_width_scales_channels():
    counts = {
        MinkUNet14: 8,
        MinkUNet18: 16,
        MinkUNet34: 2 + 3 + 4 + 6 + 2 * 4,
    }
    for preset, blocks in counts.items():
        model = preset(4, 20)
        assert sum(isinstance(m, BasicBlock) for m in model.modules()) == blocks
        assert model.head.in_channels == 96 and model.stem[0].out_channels == 32
        assert model.stem[0].kernel_size == (5, 5, 5)
    half = MinkUNet18(4, 20, width=0.5)
    assert half.stem[0].out_channels == 16 and half.head.in_channels == 48
    # The decoder's first block sees the upsampled channels plus the skip's.
    assert half.decoder[0][0].conv1.in_channels == 128 + 64


def test_custom_blocks_and_planes_and_bad_arguments():
    model = MinkUNet(2, 3, blocks=(1, 0, 0, 0, 0, 0, 0, 1), planes=(4,) * 8, stem_channels=4)
    x = _input(channels=2)
    assert model(x).feats.shape == (len(x), 3)
    with pytest.raises(ValueError, match="8 entries"):
        MinkUNet(2, 3, blocks=(1, 1, 1))
    with pytest.raises(ValueError, match="width must be > 0"):
        MinkUNet(2, 3, width=0)


def test_a_tiny_minkunet_learns_to_segment_a_synthetic_room_on_cpu():
    torch.manual_seed(0)
    coords, feats, labels = make_scene("room", voxel_size=0.15, scale=0.05, batch_size=2, with_labels=True)
    x = SparseTensor(coords, feats)
    model = MinkUNet14(4, 4, width=0.25, stem_kernel_size=3)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(25):
        loss = torch.nn.functional.cross_entropy(model(x).feats, labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:3]) / 3, losses


def test_a_training_pass_queries_each_distinct_map_once_and_the_next_batch_all_at_its_first_conv(monkeypatch):
    from sparseconv.coords import prebuild, warp_launch

    queried = []  # (output rows, kernel volume) of every neighbour query, by launch
    launch = warp_launch.launch

    def counting(kernel, dim, inputs, device):
        if "query" in kernel.key:
            queried.append(dim)
        return launch(kernel, dim, inputs, device)

    monkeypatch.setattr(warp_launch, "launch", counting)
    from sparseconv.coords import cache as coordinate_cache

    cell_neighbors = coordinate_cache.cell_neighbors

    def from_floors(*args):  # a k2 s2 map on a CPU whose cells the floors gave: built, with no query launch
        if args[-1] is not None:
            queried.append("floors")
        return cell_neighbors(*args)

    monkeypatch.setattr(coordinate_cache, "cell_neighbors", from_floors)
    at_prebuild = []
    build = prebuild.build
    monkeypatch.setattr(prebuild, "build", lambda *args: (lambda built: at_prebuild.append(len(queried)) or built)(
        build(*args)))
    model = MinkUNet14(3, 5, width=0.125, stem_kernel_size=3, stem_convs=2)
    for step in range(2):
        x = _input(n=600)
        queried.clear()
        model(x).feats.square().sum().backward()
        maps = {(m.num_out, m.num_in, m.kernel_volume) for m in x.cache.kernel_maps() if m.transpose_of is None}
        # The stem's and each level's submanifold 3^3 map, and the four k2 s2 maps (their transposes
        # serve the decoder and every dgrad; the 1x1 convs need none): nine queries (or builds from the
        # floors' cells), each map once.
        assert len(maps) == 9 and len(queried) == 9
    # The second batch's nine queries all ran inside its first map request.
    assert at_prebuild == [9]
