"""Normalisation: per-element statistics against torch's norms on each element's (1, C, N_b) slice,
LayerNorm per voxel, BatchNorm / SyncBatchNorm over the batch, gradcheck, half precision."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.nn import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, ReLU, Sequential, SparseConv3d, SyncBatchNorm
from sparseconv.nn import functional as F


def _batch(device, channels=8, dtype=torch.float64, batch_size=3):
    """Rows in random order, elements of different sizes and offsets (statistics must not mix)."""
    coords = random_coords(300, 7, batch_size=batch_size, device=device)
    coords = coords[torch.randperm(len(coords), device=device)]
    scale = 1 + 3 * coords[:, :1].to(dtype)
    feats = torch.randn(len(coords), channels, device=device, dtype=dtype) * scale + 5 * coords[:, :1]
    return SparseTensor(coords, feats)


def _per_element(x, out_channels, torch_norm):
    """torch_norm applied to every element's (1, C, N_b) slice, scattered back to (N, C)."""
    expected = x.feats.new_zeros((len(x), out_channels))
    for b in range(x.batch_size):
        rows = x.coords[:, 0] == b
        expected[rows] = torch_norm(x.feats[rows].t()[None])[0].t()
    return expected


def _randomise_affine(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_groups", [1, 2, 8])
def test_group_norm_equals_torch_per_element(num_groups, device):
    x = _batch(device)
    ours = _randomise_affine(GroupNorm(num_groups, 8, device=device, dtype=torch.float64))
    theirs = torch.nn.GroupNorm(num_groups, 8, device=device, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x).feats, _per_element(x, 8, theirs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_equals_torch_per_element(affine, device):
    x = _batch(device)
    ours = InstanceNorm(8, affine=affine, device=device, dtype=torch.float64)
    theirs = torch.nn.InstanceNorm1d(8, affine=affine, device=device, dtype=torch.float64)
    if affine:
        theirs.load_state_dict(_randomise_affine(ours).state_dict())
    torch.testing.assert_close(ours(x).feats, _per_element(x, 8, theirs))


def test_one_group_is_a_layer_norm_over_each_element():
    x = _batch("cpu")
    expected = _per_element(x, 8, lambda s: torch.nn.functional.layer_norm(s, s.shape[1:]))
    torch.testing.assert_close(F.group_norm(x, 1).feats, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_normalises_each_voxel_over_its_channels(device):
    x = _batch(device)
    ours = _randomise_affine(LayerNorm(8, device=device, dtype=torch.float64))
    torch.testing.assert_close(ours(x).feats, torch.nn.functional.layer_norm(x.feats, (8,), ours.weight, ours.bias))


def test_batch_norm_and_sync_batch_norm_equal_batchnorm1d_over_all_voxels():
    x = _batch("cpu")
    ours = _randomise_affine(BatchNorm(8, dtype=torch.float64))
    theirs = torch.nn.BatchNorm1d(8, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x).feats, theirs(x.feats))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    # Without a process group SyncBatchNorm computes what BatchNorm does.
    sync = SyncBatchNorm(8, dtype=torch.float64)
    sync.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(sync(x).feats, theirs(x.feats))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batch_norm_training_steps_equal_batchnorm1d(device, momentum):
    # Outputs, gradients, running statistics and the batch count after several training steps,
    # with a set momentum (ours calls torch.batch_norm itself) and a cumulative average (torch's forward).
    ours = _randomise_affine(BatchNorm(8, momentum=momentum, device=device, dtype=torch.float64))
    theirs = torch.nn.BatchNorm1d(8, momentum=momentum, device=device, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    for _ in range(3):
        x = _batch(device)
        feats = x.feats.clone().requires_grad_()
        expected = theirs(feats)
        got = ours(x.replace(x.feats.clone().requires_grad_()))
        torch.testing.assert_close(got.feats, expected)
        grad = torch.randn_like(expected)
        expected.backward(grad)
        got.feats.backward(grad)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, msg=name)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad)
    x = _batch(device)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ours(SparseTensor(x.coords[:1], x.feats[:1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_batch_norm_inference_equals_batchnorm1d_and_follows_changed_statistics(device, dtype):
    x = _batch(device)
    x = x.replace(x.feats.to(dtype))
    ours = _randomise_affine(BatchNorm(8, device=device, dtype=torch.float64))
    with torch.no_grad():
        ours.running_mean.uniform_(-1, 1)
        ours.running_var.uniform_(0.5, 2)
    ours = ours.to(dtype).eval()
    theirs = torch.nn.BatchNorm1d(8, device=device, dtype=dtype).eval()
    theirs.load_state_dict(ours.state_dict())
    tolerance = {} if dtype == torch.float64 else dict(atol=4e-3, rtol=4e-3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).feats, theirs(x.feats), **tolerance)
        # Statistics and parameters changed in place (an optimiser step, load_state_dict): followed.
        ours.running_var.mul_(3)
        ours.weight.add_(1)
        theirs.load_state_dict(ours.state_dict())
        torch.testing.assert_close(ours(x).feats, theirs(x.feats), **tolerance)
    # With autograd on (eval-mode fine-tuning) torch's path runs: gradients reach weight and bias.
    ours(x.replace(x.feats.requires_grad_())).feats.float().sum().backward()
    assert ours.weight.grad is not None and ours.bias.grad is not None


def test_convert_sync_batchnorm_replaces_sparse_batch_norms_and_keeps_their_state():
    norm = _randomise_affine(BatchNorm(4, dtype=torch.float64))
    net = Sequential(SparseConv3d(8, 4, 3, dtype=torch.float64), norm, ReLU())
    x = _batch("cpu")
    net(x)  # moves the running statistics away from their initial values
    before = net.eval()(x).feats
    converted = SyncBatchNorm.convert_sync_batchnorm(net)
    assert isinstance(converted[1], SyncBatchNorm) and not converted[1].training
    torch.testing.assert_close(converted(x).feats, before)


def test_gradcheck_group_and_instance_norm():
    x = _batch("cpu", channels=4, batch_size=2)
    x = SparseTensor(x.coords[:40], x.feats[:40])
    feats = x.feats.clone().requires_grad_()
    weight = torch.randn(4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, w, b: F.group_norm(x.replace(f), 2, w, b).feats, (feats, weight, bias))
    assert torch.autograd.gradcheck(lambda f: F.instance_norm(x.replace(f)).feats, (feats,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_normalised_in_float32_and_keeps_its_dtype(dtype):
    x = _batch("cpu", dtype=torch.float32)
    out = F.group_norm(x.replace(x.feats.to(dtype)), 4)
    assert out.dtype == dtype
    torch.testing.assert_close(out.feats.float(), F.group_norm(x, 4).feats, rtol=2e-2, atol=3e-2)


def test_norms_reject_bad_arguments():
    x = _batch("cpu")
    with pytest.raises(ValueError, match="num_groups must be a positive int dividing the 8 channels"):
        F.group_norm(x, 3)
    with pytest.raises(ValueError, match="track_running_stats"):
        InstanceNorm(8, track_running_stats=True)
    with pytest.raises(ValueError, match="InstanceNorm expects 4 channels, got a SparseTensor with 8"):
        InstanceNorm(4)(x)
    with pytest.raises(ValueError, match="GroupNorm expects 4 channels, got a SparseTensor with 8"):
        GroupNorm(2, 4)(x)
    with pytest.raises(TypeError, match="GroupNorm takes a SparseTensor, got Tensor"):
        GroupNorm(2, 8)(x.feats)


def _eval_norm(channels, device, dtype):
    norm = _randomise_affine(BatchNorm(channels)).to(device)
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2)
    return norm.eval().to(dtype)


def _count_fused(monkeypatch):
    """The norms' fused passes (residual, relu) as they ran: sparseconv.ops.features.norm_affine from the
    statistics, or channel_affine from the kept (scale, shift) pair where that declined."""
    from sparseconv.nn import norm as norm_module

    calls = []
    from_statistics, from_pair = norm_module.norm_affine, norm_module.channel_affine

    def statistics(feats, mean, var, weight, bias, eps, residual=None, relu=False, kept=None, inplace=False):
        out = from_statistics(feats, mean, var, weight, bias, eps, residual, relu, kept, inplace)
        if out is not None:
            calls.append((residual, relu, inplace))
        return out

    def pair(feats, scale, shift, residual=None, relu=False, inplace=False):
        calls.append((residual, relu, inplace))
        return from_pair(feats, scale, shift, residual, relu, inplace)

    monkeypatch.setattr(norm_module, "norm_affine", statistics)
    monkeypatch.setattr(norm_module, "channel_affine", pair)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_an_inference_norm_and_its_relu_run_fused_in_sequential_and_match_the_modules(device, monkeypatch):
    torch.manual_seed(0)
    x = _batch(device, channels=8, dtype=torch.float32)
    block = Sequential(SparseConv3d(8, 16, 3).to(device), _eval_norm(16, device, torch.float32), ReLU(inplace=True))
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        conv_out = block[0](x)
        expected = torch.relu(block[1](conv_out).feats)
        got = block(x)
    assert len(calls) == 1 and calls[0][1] is True, "one fused pass, with the ReLU"
    assert torch.allclose(got.feats, expected, atol=1e-5) and (got.feats == 0).any()
    assert torch.equal(got.coords, x.coords)
    # A hook on the ReLU sees its call: no fusion then. Training mode or autograd on: the modules too.
    seen = []
    handle = block[2].register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        hooked = block(x)
    handle.remove()
    assert len(seen) == 1 and len(calls) == 1 and torch.allclose(hooked.feats, expected, atol=1e-5)
    block(x)
    assert len(calls) == 1, "autograd on: the norm's own forward"


@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_norm_overwrites_only_its_own_convs_unwatched_output(device, monkeypatch):
    torch.manual_seed(3)
    x = _batch(device, channels=8, dtype=torch.float32)
    before = x.feats.clone()
    block = Sequential(SparseConv3d(8, 8, 3).to(device), _eval_norm(8, device, torch.float32), ReLU(inplace=True))
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        expected = torch.relu(block[1](block[0](x)).feats)
        got = block(x)
        seen = []
        handle = block[0].register_forward_hook(lambda module, args, out: seen.append(out.feats.clone()) or
                                                seen.append(out))
        hooked = block(x)
        handle.remove()
        alone = Sequential(block[1], block[2])(x)  # the norm first: its input is the caller's
    torch.testing.assert_close(got.feats, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hooked.feats, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(seen[1].feats, seen[0]), "a hook's view of the conv's output stays the conv's output"
    assert torch.equal(x.feats, before) and not torch.equal(alone.feats, before)
    assert [call[2] for call in calls] == [True, False, False], "in place: the unwatched conv's output alone"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_fused_inference_norm_follows_statistics_a_training_step_changed(device, dtype, monkeypatch):
    # Training between inferences (a validation loop) changes the statistics in place: the fused pass reads
    # them as they are, whichever way it runs (from the statistics, or a (scale, shift) pair made again).
    torch.manual_seed(2)
    x = _batch(device, channels=8, dtype=dtype)
    block = Sequential(_eval_norm(8, device, dtype), ReLU())
    theirs = torch.nn.BatchNorm1d(8, device=device, dtype=dtype).eval()
    calls = _count_fused(monkeypatch)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    for _ in range(2):
        theirs.load_state_dict(block[0].state_dict())
        with torch.no_grad():
            torch.testing.assert_close(block(x).feats, torch.relu(theirs(x.feats)), **tolerance)
        block.train()
        block(x.replace(x.feats * 2 + 1))  # a training forward: the running statistics move
        block.eval()
    assert len(calls) == 2 and all(call[1] for call in calls)


@pytest.mark.parametrize("device", DEVICES)
def test_a_basic_blocks_inference_fuses_its_norms_and_matches_the_modules(device, monkeypatch):
    from sparseconv.models.blocks import BasicBlock

    torch.manual_seed(1)
    for channels_in in (8, 12):  # the identity skip, then the projected one
        x = _batch(device, channels=channels_in, dtype=torch.float32)
        block = BasicBlock(channels_in, 8).to(device)
        for name in ("norm1", "norm2"):
            setattr(block, name, _eval_norm(8, device, torch.float32))
        if block.shortcut is not None:
            block.shortcut[1] = _eval_norm(8, device, torch.float32)
        block.eval()
        calls = _count_fused(monkeypatch)
        with torch.no_grad():
            got = block(x)
            hidden = block.relu(block.norm1(block.conv1(x)))
            out = block.norm2(block.conv2(hidden))
            skip = x if block.shortcut is None else block.shortcut(x)
            expected = torch.relu(out.feats + skip.feats)
        assert [call[0] is not None for call in calls] == [False, True], "norm1 with its ReLU, norm2 with the sum"
        assert torch.allclose(got.feats, expected, atol=1e-5)
        monkeypatch.undo()


@pytest.mark.parametrize("device", DEVICES)
def test_a_norm_that_ran_fused_can_be_copied_and_saved(device, tmp_path):
    """The fused pass keeps its prepared launches apart from the module: deepcopy and torch.save see none."""
    import copy

    torch.manual_seed(5)
    x = _batch(device, channels=8, dtype=torch.float32)
    block = Sequential(SparseConv3d(8, 16, 3).to(device), _eval_norm(16, device, torch.float32), ReLU(inplace=True))
    with torch.no_grad():
        expected = block(x).feats
        twin = copy.deepcopy(block)
        torch.save(block, tmp_path / "block.pt")
        loaded = torch.load(tmp_path / "block.pt", weights_only=False)
        assert torch.allclose(twin(x).feats, expected, atol=1e-5)
        assert torch.allclose(loaded(x).feats, expected, atol=1e-5)
        twin[1].running_mean.add_(1.0)
        assert not torch.allclose(twin(x).feats, expected, atol=1e-5), "the copy reads its own statistics"
        assert torch.allclose(block(x).feats, expected, atol=1e-5)
