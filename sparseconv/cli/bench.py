"""Benchmark support: what the scripts in ``scripts/`` share.

The benchmark scenes (:data:`SCENES`, :func:`scene_coords`, and :func:`unseen_clouds`: point clouds
no network has seen, as a data set brings them), the timers (:func:`median_ms` with the tuner's timer,
:func:`timed` for host and wall time, :func:`one_call_ms`, :func:`gpu_ms`), and the whole network every
library runs (:class:`Runner`: ours, naive torch, or an anchor's network from :mod:`.anchors`: spconv 2.x
and spconv-triton share one API).

Importing this module has no side effects and imports neither spconv nor Triton: an anchor is
imported when :func:`.anchors.import_anchor` asks for it.
"""

from __future__ import annotations

import dataclasses
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
from ..nn import SparseConv3d, graphed
from ..tensor import SparseTensor
from ..tune import wait_for_compiles
from ..tune.timing import Timer, TimingPlan
from .anchors import (ALIGN, IN_CHANNELS, NUM_CLASSES, AnchorBackbone, AnchorBlock, AnchorMinkUNet, anchor_tensor,
                      import_anchor, shifted_coords, spatial_shape, subm_maps)

__all__ = [
    "ALIGN", "IN_CHANNELS", "MODELS", "NAIVE_PINS", "NUM_CLASSES", "SCENES", "AnchorBackbone", "AnchorBlock",
    "AnchorMinkUNet", "Cloud", "Runner", "anchor_tensor", "gpu_ms", "import_anchor", "median_ms", "one_call_ms",
    "ours_model", "scene_coords", "shifted_coords", "spatial_shape", "subm_maps", "sync", "timed", "unseen_clouds",
]

# --- scenes -----------------------------------------------------------------------------------
# (kind, voxel size m, batch, scale): streets sampled twice as densely as the default sweep, so
# that one street at 5 cm holds ~92k voxels and four ~370k (the grid spans 90k-700k voxels).
SCENES = {"street1": ("street", 0.05, 1, 2.0), "street4": ("street", 0.05, 4, 2.0), "room2": ("room", 0.02, 2, 1.0)}


def scene_coords(name: str, scale: float = 1.0) -> torch.Tensor:
    """(N, 4) int32 coords of the benchmark scene ``name`` (SCENES), its size times ``scale``."""
    kind, voxel, batch, base = SCENES[name]
    return make_scene(kind, voxel_size=voxel, batch_size=batch, scale=base * scale)[0]


@dataclasses.dataclass(frozen=True)
class Cloud:
    """One voxelised point cloud as a network gets it: coords (N, 4) int32, feats (N, IN_CHANNELS) in the
    benchmark dtype, labels (N,) int64, on the benchmark device."""

    coords: torch.Tensor
    feats: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def random(cls, coords: torch.Tensor, dtype: torch.dtype) -> Cloud:
        """``coords`` with random features and labels."""
        return cls(coords, torch.randn(len(coords), IN_CHANNELS, device=coords.device, dtype=dtype),
                   torch.randint(0, NUM_CLASSES, (len(coords),), device=coords.device))


def unseen_clouds(name: str, count: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0,
                  first_seed: int = 1000) -> list[Cloud]:
    """``count`` clouds of the scene kind ``name`` (SCENES) that no pass has seen: each a new layout (a
    street's buildings, cars and poles, a room's furniture; seeds from ``first_seed``, far from
    :func:`scene_coords`' 0), so contents and voxel counts change from cloud to cloud as in training on a
    data set. Made before any timing (a street4 cloud takes about a second of host time)."""
    kind, voxel, batch, base = SCENES[name]
    return [Cloud.random(make_scene(kind, voxel_size=voxel, batch_size=batch, scale=base * scale,
                                    seed=first_seed + i * batch)[0].to(device), dtype) for i in range(count)]


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


# --- the networks -------------------------------------------------------------------------------
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


class Runner:
    """One library's network on one scene: how to make its input and read its logits.

    ``name``: "ours", "ours_lazy_maps" (ours with SPARSECONV_PLAN_MAPS=0), "ours_graphed" (ours' inference
    through :func:`sparseconv.graphed`: CUDA-graph replays; no training step), "naive" (:data:`NAIVE_PINS`),
    or an anchor ("spconv", "spconv_triton"; RuntimeError when it does not import); ``native`` trains an
    anchor with its ConvAlgo.Native; ``model`` one of :data:`MODELS`.
    """

    def __init__(self, name: str, coords: torch.Tensor, dtype: torch.dtype, device: torch.device, native: bool = False,
                 model: str = "minkunet") -> None:
        self.lazy_maps = name == "ours_lazy_maps"
        graph_mode = name == "ours_graphed"
        name = "ours" if self.lazy_maps or graph_mode else name
        self.name, self.device, self.model = name, device, model
        if name in ("ours", "naive"):
            self.net = ours_model(NAIVE_PINS if name == "naive" else None, model, coords).to(device, dtype)
        else:
            self.spc = import_anchor(name)
            if isinstance(self.spc, str):
                raise RuntimeError(self.spc)
            anchor = AnchorBackbone if model == "backbone" else AnchorMinkUNet
            # On the CPU spconv runs Native alone: its default algorithm asks for a CUDA stream.
            native = native or device.type == "cpu"
            self.net = anchor(self.spc, algo=self.spc.ConvAlgo.Native if native else None).to(device, dtype)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3)
        self._same = None
        self.use(Cloud.random(coords, dtype))
        if self.lazy_maps:
            self.infer, self.step = functools.partial(_lazily, self.infer), functools.partial(_lazily, self.step)
        self.graphed = graphed(self.net) if graph_mode else None

    def use(self, cloud: Cloud) -> None:
        """The cloud the next new-input passes read (a data loader's batch): an anchor's input is prepared
        here, untimed, as a spconv user's loader shifts coordinates to its fixed spatial shape."""
        self.coords, self.feats, self.labels = cloud.coords, cloud.feats, cloud.labels
        if self.name not in ("ours", "naive"):
            self._anchor_input = anchor_tensor(self.spc, cloud.coords, cloud.feats)

    def make_input(self, same: bool) -> Any:
        """A new input tensor (new maps), or with ``same`` the one kept from the last such call."""
        if same and self._same is not None:
            self.input_labels = self._same_labels
            return self._same
        self.input_labels = self.labels
        if self.name in ("ours", "naive"):
            x = SparseTensor(self.coords, self.feats)
        else:
            made = self._anchor_input
            x = self.spc.SparseConvTensor(self.feats, made.indices, made.spatial_shape, made.batch_size)
        if same:
            self._same, self._same_labels = x, self.labels
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
        return nn.functional.cross_entropy(self.logits(out).float(), self.input_labels)

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
            out = (self.net if self.graphed is None else self.graphed)(self.make_input(same))
            if self.model == "backbone" and self.name not in ("ours", "naive"):
                self.logits(out)  # spconv's dense map: ours makes its BEV map in the forward
        if same and self.name not in ("ours", "naive"):
            self._same.indice_dict = subm_maps(out)

    def step(self, same: bool = False) -> None:
        """One training step (forward, loss, backward, SGD), on new coordinates or the kept input."""
        if self.graphed is not None:
            raise RuntimeError("graph mode (sparseconv.graphed) runs inference only")
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
