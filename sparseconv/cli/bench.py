"""Benchmark support: what the scripts in ``scripts/`` share.

The benchmark scenes (:data:`SCENES`, :func:`scene_coords`), the timers (:func:`median_ms` with the
tuner's timer, :func:`timed` for host and wall time, :func:`one_call_ms`, :func:`gpu_ms`), the speed
anchors (spconv 2.x and spconv-triton share one API: :func:`import_anchor`, :func:`anchor_tensor`),
and the whole network every library runs (:class:`Runner`: ours, naive torch, or an anchor's
:class:`AnchorMinkUNet` / :class:`AnchorBackbone`).

Importing this module has no side effects and imports neither spconv nor Triton: an anchor is
imported when :func:`import_anchor` asks for it.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..data import make_scene
from ..models import MinkUNet, SparseResNetBackbone
from ..nn import SparseConv3d
from ..tensor import SparseTensor
from ..tune import wait_for_compiles
from ..tune.timing import Timer, TimingPlan

__all__ = [
    "ALIGN", "IN_CHANNELS", "MODELS", "NAIVE_PINS", "NUM_CLASSES", "SCENES", "AnchorBackbone", "AnchorBlock",
    "AnchorMinkUNet", "Runner", "anchor_tensor", "gpu_ms", "import_anchor", "median_ms", "one_call_ms", "ours_model",
    "scene_coords", "shifted_coords", "spatial_shape", "subm_maps", "sync", "timed",
]

# --- scenes -----------------------------------------------------------------------------------
# (kind, voxel size m, batch, scale): streets sampled twice as densely as the default sweep, so
# that one street at 5 cm holds ~92k voxels and four ~370k (the grid spans 90k-700k voxels).
SCENES = {"street1": ("street", 0.05, 1, 2.0), "street4": ("street", 0.05, 4, 2.0), "room2": ("room", 0.02, 2, 1.0)}


def scene_coords(name: str, scale: float = 1.0) -> torch.Tensor:
    """(N, 4) int32 coords of the benchmark scene ``name`` (SCENES), its size times ``scale``."""
    kind, voxel, batch, base = SCENES[name]
    return make_scene(kind, voxel_size=voxel, batch_size=batch, scale=base * scale)[0]


# --- timers -----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for ``device`` to be idle (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3, calls: int = 1) -> float:
    """Median milliseconds of ``fn`` with the tuner's timer (CUDA events; perf_counter on the CPU), a sample
    being the mean of ``calls`` back-to-back calls; no L2 flush."""
    plan = TimingPlan(warmup=warmup, repeats=repeats, flush_l2=False, calls=calls)
    return Timer(device, plan).median(fn)[0]


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median wall ms, median host ms until ``fn`` returned) over ``repeats`` passes after the
    warm-up: passes, each followed by our background compiles finished, until every layer runs its
    settled choice (a lone layer's map is known lone from its third new tensor, as the map plan reads
    the last two batches: its product is tuned again then, with the views it builds), then one more."""
    for _ in range(4):
        fn()
        wait_for_compiles()
    fn()
    walls, hosts = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        sync(device)
        walls.append(time.perf_counter() - start)
        hosts.append(issued - start)
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(hosts)


def one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``, the device idle before and drained after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - start)


def gpu_ms(fn: Callable[[], object], device: torch.device) -> float | str:
    """The kernels' summed device time (ms, torch.profiler) of one call of ``fn``; "-" off CUDA."""
    if device.type != "cuda":
        return "-"
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


# --- anchors: spconv 2.x and spconv-triton ------------------------------------------------------
def import_anchor(name: str) -> Any:
    """``spconv.pytorch`` (``name`` "spconv") or ``spconv_triton.pytorch``, or an 'n/a (...)' string when it
    does not import."""
    try:
        if name == "spconv":
            import spconv.pytorch as module
        else:
            import spconv_triton.pytorch as module
        return module
    except Exception as error:  # noqa: BLE001 - an anchor that does not import is reported as n/a
        return f"n/a ({type(error).__name__})"


ALIGN = 64
"""The anchors' coordinates are shifted by a multiple of this (every stride the benchmarks' networks
reach divides it), so their strided convs floor onto the same coarse voxels as ours."""


def shifted_coords(coords: torch.Tensor) -> torch.Tensor:
    """``coords`` [batch, x, y, z] moved to non-negative x, y, z by a multiple of :data:`ALIGN` per axis.

    Shifting by the minimum instead moved the 2x2x2 grid whenever a minimum was odd: on street4
    (z from -1) spconv's stride-2 set had 187,992 voxels where ours, the floors of the same
    coordinates, had 225,412 (17% fewer, and fewer still at the coarser levels): a different,
    smaller network to time and to measure memory on.
    """
    shifted = coords.clone()
    low = shifted[:, 1:].amin(0)
    shifted[:, 1:] -= torch.div(low, ALIGN, rounding_mode="floor") * ALIGN
    return shifted


def spatial_shape(shifted: torch.Tensor) -> list[int]:
    """The anchor's spatial shape for non-negative ``shifted`` coordinates: per axis, the smallest
    multiple of :data:`ALIGN` above the largest coordinate.

    A k2 s2 conv's output shape is ``(S - 2) // 2 + 1``, and the anchor drops the outputs beyond
    it. With one spare cell (``max + 2``, until 2026-11-26) an odd level shape cut the floors of the
    largest coordinates at the next level: room2's stride-4 / 8 / 16 sets had 59,557 / 13,303 / 2,502
    voxels where ours (every floor) had 63,740 / 16,119 / 3,897, a smaller network to time and to
    measure memory on. A multiple of ALIGN halves exactly down to stride ALIGN.
    """
    top = shifted[:, 1:].amax(0) + 1
    return (torch.div(top + ALIGN - 1, ALIGN, rounding_mode="floor") * ALIGN).tolist()


def anchor_tensor(spc: Any, coords: torch.Tensor, feats: torch.Tensor) -> Any:
    """Our [batch, x, y, z] coordinates (:func:`shifted_coords`) as the anchor's SparseConvTensor.

    The spatial shape is :func:`spatial_shape`'s: every coarse voxel of every level stays inside it.
    """
    shifted = shifted_coords(coords)
    shape = spatial_shape(shifted)
    return spc.SparseConvTensor(feats, shifted.int(), shape, int(coords[:, 0].max()) + 1)


def subm_maps(out: Any) -> dict:
    """The submanifold maps of a spconv pass, kept for the next one (spconv reuses only those)."""
    return {key: data for key, data in out.indice_dict.items() if getattr(data, "is_subm", False)}


# --- the networks -------------------------------------------------------------------------------
NUM_CLASSES = 20
IN_CHANNELS = 4
NAIVE_PINS = {"fwd_algo": "explicit_gemm", "dgrad_algo": "explicit_gemm", "wgrad_algo": "explicit_gemm"}
"""naive torch: our network with every product pinned to explicit_gemm (gather, mm, scatter-add in torch)."""
MODELS = ("minkunet", "backbone")


def ours_model(pins: dict | None = None, model: str = "minkunet", coords: torch.Tensor | None = None) -> nn.Module:
    """Our network: TorchSparse++'s MinkUNet (two stem convs), or with ``model`` "backbone" the
    SparseResNetBackbone with spconv's downsampling on ``coords``' grid; every conv pinned to ``pins``."""
    if model == "backbone":
        # spconv's downsampling (every coarse voxel a window reaches), on the scene's voxel grid (a detector's
        # fixed point-cloud range: the BEV map's size needs no read of the batch's coordinates)
        # The grid reaches past the input's voxels by what the convs generate there: 1 + 2 + 4 voxels along
        # every axis, 8 more along the height (spconv drops what leaves its spatial shape instead).
        lo = [v - 16 for v in coords[:, 1:].amin(0).tolist()]
        hi = [v + 16 for v in coords[:, 1:].amax(0).tolist()]
        net = SparseResNetBackbone(IN_CHANNELS, generative_down=True, grid_origin=lo,
                                   grid_shape=[b - a + 1 for a, b in zip(lo, hi)])
    else:
        net = MinkUNet(IN_CHANNELS, NUM_CLASSES, stem_kernel_size=3, stem_convs=2)
    for module in net.modules():
        if pins and isinstance(module, SparseConv3d):
            module.pins = type(module.pins).checked(pins["fwd_algo"], pins["dgrad_algo"], pins["wgrad_algo"])
    return net


def anchor_cbr(spc: Any, conv: nn.Module, channels: int) -> nn.Module:
    """spconv's conv, BatchNorm1d and ReLU in one SparseSequential (both anchor networks build theirs so)."""
    return spc.SparseSequential(conv, nn.BatchNorm1d(channels), nn.ReLU(inplace=True))


class AnchorMinkUNet(nn.Module):
    """The same network in spconv's API (spconv-triton shares it): indice keys name each map so the
    decoder's inverse convs reuse the encoder's maps, as spconv users write it."""

    def __init__(self, spc: Any, planes: tuple[int, ...] = (32, 64, 128, 256, 256, 128, 96, 96), stem: int = 32,
                 algo: Any = None) -> None:
        super().__init__()
        self.spc = spc
        extra = {} if algo is None else {"algo": algo}

        cbr = functools.partial(anchor_cbr, spc)
        self.stem = spc.SparseSequential(cbr(spc.SubMConv3d(IN_CHANNELS, stem, 3, bias=False, indice_key="s0", **extra), stem),
                                         cbr(spc.SubMConv3d(stem, stem, 3, bias=False, indice_key="s0", **extra), stem))
        self.down, self.enc = nn.ModuleList(), nn.ModuleList()
        channels, c = [stem], stem
        for i, out in enumerate(planes[:4]):
            self.down.append(cbr(spc.SparseConv3d(c, c, 2, 2, bias=False, indice_key=f"d{i}", **extra), c))
            self.enc.append(nn.ModuleList([AnchorBlock(spc, c, out, f"s{i + 1}", extra),
                                           AnchorBlock(spc, out, out, f"s{i + 1}", extra)]))
            c = out
            channels.append(c)
        self.up, self.dec = nn.ModuleList(), nn.ModuleList()
        for i, out in enumerate(planes[4:]):
            level = 3 - i
            skip = channels[level]
            self.up.append(cbr(spc.SparseInverseConv3d(c, out, 2, indice_key=f"d{level}", bias=False, **extra), out))
            self.dec.append(nn.ModuleList([AnchorBlock(spc, out + skip, out, f"s{level}", extra),
                                           AnchorBlock(spc, out, out, f"s{level}", extra)]))
            c = out
        self.head = spc.SubMConv3d(c, NUM_CLASSES, 1, indice_key="head", **extra)

    def forward(self, x):
        skips = [self.stem(x)]
        for down, blocks in zip(self.down, self.enc):
            y = down(skips[-1])
            for block in blocks:
                y = block(y)
            skips.append(y)
        y = skips.pop()
        for up, blocks in zip(self.up, self.dec):
            u = up(y)
            y = u.replace_feature(torch.cat([u.features, skips.pop().features], 1))
            for block in blocks:
                y = block(y)
        return self.head(y)


class AnchorBackbone(nn.Module):
    """SparseResNetBackbone in spconv's API (OpenPCDet's VoxelResBackBone8x shape with our channels): a
    submanifold stem, four stages of two residual blocks, stages 2-4 opened by a k3 s2 conv with padding 1,
    and the height conv (k3 s2 along z, padding 1 there); the output made dense (the BEV map's tensor).
    ``sizes``: the voxels of each stage's output and of the height conv's, from the last pass."""

    def __init__(self, spc: Any, channels: tuple[int, ...] = (16, 32, 64, 128), out_channels: int = 128,
                 algo: Any = None) -> None:
        super().__init__()
        extra = {} if algo is None else {"algo": algo}

        cbr = functools.partial(anchor_cbr, spc)
        self.stem = cbr(spc.SubMConv3d(IN_CHANNELS, channels[0], 3, bias=False, indice_key="s0", **extra), channels[0])
        self.down, self.blocks = nn.ModuleList(), nn.ModuleList()
        c = channels[0]
        for i, out in enumerate(channels):
            self.down.append(nn.Identity() if i == 0 else cbr(
                spc.SparseConv3d(c, out, 3, 2, padding=1, bias=False, indice_key=f"d{i}", **extra), out))
            self.blocks.append(nn.ModuleList([AnchorBlock(spc, out, out, f"s{i}", extra) for _ in range(2)]))
            c = out
        self.height = cbr(spc.SparseConv3d(c, out_channels, (1, 1, 3), (1, 1, 2), padding=(0, 0, 1), bias=False,
                                           indice_key="h", **extra), out_channels)
        self.sizes: list[int] = []

    def forward(self, x):
        x, sizes = self.stem(x), []
        for down, blocks in zip(self.down, self.blocks):
            x = down(x)
            for block in blocks:
                x = block(x)
            sizes.append(x.indices.shape[0])
        out = self.height(x)
        self.sizes = [*sizes, out.indices.shape[0]]
        return out


class AnchorBlock(nn.Module):
    """A residual block of two submanifold 3^3 convs in spconv's API (a 1x1x1 shortcut when channels change)."""

    def __init__(self, spc: Any, c_in: int, c_out: int, key: str, extra: dict) -> None:
        super().__init__()
        self.conv1 = spc.SubMConv3d(c_in, c_out, 3, bias=False, indice_key=key, **extra)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = spc.SubMConv3d(c_out, c_out, 3, bias=False, indice_key=key, **extra)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.shortcut = None if c_in == c_out else spc.SubMConv3d(c_in, c_out, 1, bias=False, indice_key=key + "p", **extra)
        self.bn_s = None if c_in == c_out else nn.BatchNorm1d(c_out)

    def forward(self, x):
        y = self.conv1(x)
        y = y.replace_feature(torch.relu(self.bn1(y.features)))
        y = self.conv2(y)
        skip = x.features if self.shortcut is None else self.bn_s(self.shortcut(x).features)
        return y.replace_feature(torch.relu(self.bn2(y.features) + skip))


class Runner:
    """One library's network on one scene: how to make its input and read its logits.

    ``name``: "ours", "ours_lazy_maps" (ours with SPARSECONV_PLAN_MAPS=0), "naive" (:data:`NAIVE_PINS`),
    or an anchor ("spconv", "spconv_triton"; RuntimeError when it does not import); ``native`` trains an
    anchor with its ConvAlgo.Native; ``model`` one of :data:`MODELS`.
    """

    def __init__(self, name: str, coords: torch.Tensor, dtype: torch.dtype, device: torch.device, native: bool = False,
                 model: str = "minkunet") -> None:
        self.lazy_maps = name == "ours_lazy_maps"
        name = "ours" if self.lazy_maps else name
        self.name, self.coords, self.device, self.model = name, coords, device, model
        self.feats = torch.randn(len(coords), IN_CHANNELS, device=device, dtype=dtype)
        self.labels = torch.randint(0, NUM_CLASSES, (len(coords),), device=device)
        if name in ("ours", "naive"):
            self.net = ours_model(NAIVE_PINS if name == "naive" else None, model, coords).to(device, dtype)
        else:
            self.spc = import_anchor(name)
            if isinstance(self.spc, str):
                raise RuntimeError(self.spc)
            anchor = AnchorBackbone if model == "backbone" else AnchorMinkUNet
            self.net = anchor(self.spc, algo=self.spc.ConvAlgo.Native if native else None).to(device, dtype)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3)
        self._same = None
        if self.lazy_maps:
            self.infer, self.step = functools.partial(_lazily, self.infer), functools.partial(_lazily, self.step)

    def make_input(self, same: bool) -> Any:
        """A new input tensor (new maps), or with ``same`` the one kept from the last such call."""
        if same and self._same is not None:
            return self._same
        if self.name in ("ours", "naive"):
            x = SparseTensor(self.coords, self.feats)
        else:
            x = anchor_tensor(self.spc, self.coords, self.feats)
        if same:
            self._same = x
        return x

    def logits(self, out: Any) -> torch.Tensor:
        """What the loss reads: the MinkUNet's per-voxel logits, the backbone's dense BEV tensor (ours makes it
        in its forward, spconv's ``dense()`` here)."""
        ours = self.name in ("ours", "naive")
        if self.model == "backbone":
            return out.bev if ours else out.dense()
        return out.feats if ours else out.features

    def loss(self, out: Any) -> torch.Tensor:
        """Cross-entropy of the MinkUNet's logits; the mean square of the backbone's BEV map."""
        if self.model == "backbone":
            return self.logits(out).float().square().mean()
        return nn.functional.cross_entropy(self.logits(out).float(), self.labels)

    def voxels(self) -> list[int]:
        """The voxels of each stage's output and of the height conv's (the backbone), from a new pass."""
        with torch.no_grad():
            out = self.net.eval()(self.make_input(False))
        if self.name in ("ours", "naive"):
            return [len(stage) for stage in out.stages] + [len(out.out)]
        return list(self.net.sizes)

    def infer(self, same: bool = False) -> None:
        """One inference pass (no_grad, eval), on new coordinates or, with ``same``, the kept input."""
        if self.net.training:  # an inference loop sets the mode once, not every pass (~1 ms of host time)
            self.net.eval()
        with torch.no_grad():
            out = self.net(self.make_input(same))
            if self.model == "backbone" and self.name not in ("ours", "naive"):
                self.logits(out)  # spconv's dense map: ours makes its BEV map in the forward
        if same and self.name not in ("ours", "naive"):
            self._same.indice_dict = subm_maps(out)

    def step(self, same: bool = False) -> None:
        """One training step (forward, loss, backward, SGD), on new coordinates or the kept input."""
        if not self.net.training:
            self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net(self.make_input(same))
        if same and self.name not in ("ours", "naive"):
            self._same.indice_dict = subm_maps(out)
        self.loss(out).backward()
        self.optimizer.step()


def _lazily(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` with SPARSECONV_PLAN_MAPS=0 (read when a batch asks for its first map)."""
    previous = os.environ.get("SPARSECONV_PLAN_MAPS")
    os.environ["SPARSECONV_PLAN_MAPS"] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        if previous is None:
            del os.environ["SPARSECONV_PLAN_MAPS"]
        else:
            os.environ["SPARSECONV_PLAN_MAPS"] = previous
