"""SparseTensor construction, checks, dense round trips and the shared cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICES
from sparse_reference import random_coords

from sparseconv import SparseTensor
from sparseconv.coords.keys import BATCH_MAX, COORD_MAX, COORD_MIN
from sparseconv.nn import SparseConv3d


def _tensor(n=50, c=3, device="cpu", **kwargs):
    coords = random_coords(n, 6, device=device)
    return SparseTensor(coords, torch.randn(len(coords), c, device=device), **kwargs)


def test_coords_are_stored_as_int32_and_rows_keep_their_order():
    coords = torch.tensor([[1, 5, -2, 3], [0, 0, 0, 0], [0, -7, 1, 65535]], dtype=torch.int64)
    x = SparseTensor(coords, torch.randn(3, 2))
    assert x.coords.dtype == torch.int32 and torch.equal(x.coords, coords.int())
    assert x.batch_size == 2 and x.stride == (1, 1, 1) and len(x) == 3


def test_numpy_inputs_are_accepted():
    x = SparseTensor(np.array([[0, 1, 2, 3]], dtype=np.int16), np.ones((1, 4), dtype=np.float32))
    assert x.coords.dtype == torch.int32 and x.feats.dtype == torch.float32


@pytest.mark.parametrize(
    "coords, feats, match, error",
    [
        (torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 1), r"coords must have shape \(N, 4\)", ValueError),
        (torch.zeros(4, dtype=torch.int32), torch.zeros(4, 1), r"coords must have shape \(N, 4\)", ValueError),
        (torch.zeros(4, 4), torch.zeros(4, 1), "coords must be an integer tensor", TypeError),
        (torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.float32), r"feats must have shape \(N, C\)", ValueError),
        (torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64), "feats must be floating point", TypeError),
        (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 1), "coords N=3 and feats N=2", ValueError),
        (torch.tensor([[-1, 0, 0, 0]]), torch.zeros(1, 1), r"batch indices \(column 0\) must be >= 0", ValueError),
        (torch.tensor([[BATCH_MAX + 1, 0, 0, 0]]), torch.zeros(1, 1), rf"supported \[0, {BATCH_MAX}\]", ValueError),
        (torch.tensor([[0, COORD_MAX + 1, 0, 0]]), torch.zeros(1, 1), rf"supported \[{COORD_MIN}, {COORD_MAX}\]", ValueError),
        (torch.tensor([[0, 0, COORD_MIN - 1, 0]]), torch.zeros(1, 1), "out of the supported range", ValueError),
        ("not a tensor", torch.zeros(1, 1), "coords must be a torch.Tensor or numpy array", TypeError),
    ],
)
def test_bad_input_names_the_argument(coords, feats, match, error):
    with pytest.raises(error, match=match):
        SparseTensor(coords, feats)


def test_bad_stride_and_off_grid_coordinates():
    with pytest.raises(ValueError, match="stride must be >= 1"):
        SparseTensor(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1), stride=0)
    with pytest.raises(ValueError, match=r"multiples of it.*row 1 is \[0, 2, 3, 4\]"):
        SparseTensor(torch.tensor([[0, 2, 4, 6], [0, 2, 3, 4]]), torch.zeros(2, 1), stride=2)
    with pytest.raises(ValueError, match="on_duplicate must be one of"):
        SparseTensor(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1), on_duplicate="drop")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_coords_and_feats_on_different_devices_are_rejected(device):
    with pytest.raises(ValueError, match="must be on one device"):
        SparseTensor(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_duplicates_are_detected_or_merged(device):
    coords = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], device=device)
    feats = torch.randn(5, 2, device=device)
    with pytest.raises(ValueError, match=r"2 duplicate rows \(e.g. \[0, 1, 1, 1\]\).*on_duplicate"):
        SparseTensor(coords, feats).check()  # (on a GPU the checks are read at check() or a first use)
    summed = SparseTensor(coords, feats, on_duplicate="sum")
    mean = SparseTensor(coords, feats, on_duplicate="mean")
    assert summed.coords.tolist() == [[0, 1, 1, 1], [0, 2, 2, 2], [1, 1, 1, 1]]
    torch.testing.assert_close(summed.feats[0], feats[[0, 2, 4]].sum(0))
    torch.testing.assert_close(mean.feats[0], feats[[0, 2, 4]].mean(0))
    torch.testing.assert_close(mean.feats[1:], feats[[1, 3]])


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["duplicate", "out of range", "off the grid"])
def test_gpu_checks_are_read_at_the_first_use_and_fail_every_use(bad):
    # A new GPU tensor launches its checks without waiting for them (no host sync: torch's sync debug
    # mode raises on one); bad coordinates raise at the first use of the coordinates, and again at the
    # next, never returning a map or a result built from them.
    coords = random_coords(200, 12, batch_size=2, device="cuda")
    coords[:, 1:] *= 2
    clean = coords.clone()
    expected = {"duplicate": "duplicate rows", "out of range": "supported range", "off the grid": "multiples of it"}
    if bad == "duplicate":
        coords[7] = coords[3]
    elif bad == "out of range":
        coords[5, 2] = 1 << 20
    else:
        coords[9, 3] += 1
    feats = torch.randn(len(coords), 3, device="cuda")
    conv = SparseConv3d(3, 4, 3).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = SparseTensor(coords, feats, stride=2)
        good = SparseTensor(clean, feats, stride=2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for use in (lambda: conv(x), lambda: conv(x), lambda: x.batch_size, x.dense, lambda: x.cpu(), x.check):
        with pytest.raises(ValueError, match=expected[bad]):
            use()
    assert good.check() is good and good.batch_size == int(clean[:, 0].max()) + 1
    assert conv(good).feats.shape == (len(clean), 4)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_round_trip_with_stride_and_origin(device):
    coords = random_coords(80, 5, stride=(2, 2, 2), low=-6, device=device)
    x = SparseTensor(coords, torch.randn(len(coords), 3, device=device), stride=2)
    with pytest.raises(ValueError, match="below origin"):
        x.dense()
    grid = x.dense(origin=(-6, -6, -6))
    assert grid.shape[:2] == (x.batch_size, 3)
    cells = (coords[:, 1:].long() + 6) // 2
    torch.testing.assert_close(grid[coords[:, 0].long(), :, cells[:, 0], cells[:, 1], cells[:, 2]], x.feats)
    assert int((grid != 0).any(1).sum()) == len(x)
    back = SparseTensor.from_dense(grid, stride=2, origin=(-6, -6, -6))
    order = lambda t: {tuple(r): f for r, f in zip(t.coords.tolist(), t.feats.tolist())}  # noqa: E731
    assert order(back) == order(x)
    with pytest.raises(ValueError, match="shape .* is too small"):
        x.dense(shape=(1, 1, 1), origin=(-6, -6, -6))


@pytest.mark.parametrize("device", DEVICES)
def test_dense_reads_the_device_once(device, monkeypatch):
    # Its range checks and default shape come from one read of the cells' bounds (a backbone's BEV map made
    # six host syncs of its checks and constants); the batch size is the checks' (read once a batch).
    coords = random_coords(80, 5, stride=(2, 2, 2), low=-6, device=device)
    x = SparseTensor(coords, torch.randn(len(coords), 3, device=device), stride=2).check()
    x.batch_size
    for shape in (None, (7, 7, 7)):
        reads = []
        for name in ("tolist", "item", "__bool__"):
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, method=method: reads.append(self.shape) or method(self, *a))
        grid = x.dense(shape, origin=(-6, -6, -6))
        monkeypatch.undo()
        assert len(reads) == 1
        assert shape is None or grid.shape == (x.batch_size, 3, *shape)


def test_dense_is_differentiable():
    x = _tensor()
    feats = x.feats.clone().requires_grad_()
    x.replace(feats).dense().sum().backward()
    assert torch.equal(feats.grad, torch.ones_like(feats))


def test_replace_keeps_coordinates_and_cache_and_checks_rows():
    x = _tensor()
    y = x.replace(torch.zeros(len(x), 7))
    assert y.cache is x.cache and y.coord_id == x.coord_id and y.num_channels == 7
    with pytest.raises(ValueError, match=r"feats must have shape \(\d+, C\)"):
        x.replace(torch.zeros(len(x) + 1, 7))


def test_to_changes_dtype_and_keeps_the_cache():
    x = _tensor()
    y = x.to(torch.float64)
    assert y.dtype == torch.float64 and y.cache is x.cache
    with pytest.raises(TypeError, match="floating point"):
        x.to(torch.int32)


@pytest.mark.gpu
def test_to_device_moves_the_whole_coordinate_cache():
    x = _tensor(device="cuda")
    coarse = SparseConv3d(3, 3, 2, 2).cuda()(x)
    # Through the CPU and back: the finer coordinates travel with the cache, no map is built on the CPU.
    on_cpu = coarse.cpu()
    assert on_cpu.cache is x.cpu().cache and torch.equal(on_cpu.coords, coarse.coords.cpu())
    back = on_cpu.cuda()
    up = SparseConv3d(3, 3, 2, 2, transposed=True).cuda()(back)
    assert up.device.type == "cuda" and torch.equal(up.coords, x.coords)


def test_empty_tensor_gives_empty_outputs_in_every_mode():
    x = SparseTensor(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 3, requires_grad=True))
    assert x.batch_size == 0 and x.dense().shape == (0, 3, 0, 0, 0)
    for conv in (SparseConv3d(3, 4, 3), SparseConv3d(3, 4, 2, 2), SparseConv3d(3, 4, 3, generative=True)):
        y = conv(x)
        assert y.feats.shape == (0, 4)
        y.feats.sum().backward()
    up = SparseConv3d(4, 2, 2, 2, transposed=True)(SparseConv3d(3, 4, 2, 2)(x))
    assert up.feats.shape == (0, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_the_batch_size_comes_with_the_checks_transfer(device, monkeypatch):
    coords = random_coords(300, 9, batch_size=5, device=device)
    coords = coords[coords[:, 0] != coords[:, 0].max()] if bool(torch.rand(()) < 0.5) else coords  # sometimes fewer
    x = SparseTensor(coords, torch.randn(len(coords), 2, device=device))
    expected = int(coords[:, 0].max()) + 1
    reads = []
    for name in ("tolist", "item", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)
        # (reads of the test's device: a GPU tensor's checks are read from pinned host memory)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name:
                            self.device.type == device and reads.append(_n) or _o(self, *a))
    assert x.batch_size == expected
    assert reads == [], "the tensor knew its batch size: no read of the device"
