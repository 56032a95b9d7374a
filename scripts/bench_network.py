"""Whole-network benchmark: MinkUNet (or, with --model backbone, the detection backbone) as users run it,
ours beside spconv, spconv-triton and naive torch, in one run.

Every pass builds a new SparseTensor from the scene's coordinates ("new": the kernel maps are
built again, as when every batch brings new point clouds), or reuses one ("same": maps cached).
The model is the TorchSparse++ MinkUNet: a stem of two submanifold 3^3 convs to 32 channels,
four encoder stages [32, 64, 128, 256] of a k2 s2 conv and two residual blocks, four decoder
stages [256, 128, 96, 96] of a k2 s2 transposed conv, a skip concatenation and two residual
blocks, then a 1x1x1 head; weights in the benchmark dtype. The backbone (--model backbone) is
SparseResNetBackbone (OpenPCDet's VoxelResBackBone8x shape: a submanifold stem, stages [16, 32, 64,
128] of two residual blocks, the later three opened by a k3 s2 conv, a k3 s2 height conv, the dense
BEV map; its loss the map's mean square) with spconv's downsampling (``generative_down``: every coarse
voxel a window reaches, as spconv's SparseConv3d with padding 1 makes), against the same network
written with spconv's modules; the voxels of each stage are printed for both, to show equal networks. "naive torch" is our network with
every product pinned to explicit_gemm (gather, mm, scatter-add in torch). With --deterministic,
"ours_deterministic" is ours in deterministic mode (sparseconv.set_deterministic(True): only
atomics-free algorithms), the row after ours: what bitwise-repeatable runs cost. With --lazy-maps,
"ours_lazy_maps" is ours with SPARSECONV_PLAN_MAPS=0 (each kernel map built when a layer first asks
for it, instead of a new batch building the maps the last batches asked for at once), in the
alternating rounds too: what planning the maps saves.

Columns, per scene, dtype and library (milliseconds unless named; medians of --repeats):
  infer / step      inference (no_grad, eval) and one training step (forward, cross-entropy,
                    backward, SGD), new coordinates every pass
  infer= / step=    the same with the coordinates (and, for ours and spconv, the maps) reused
  host / gpu        inference, new coordinates: host time until the call returns, and the
                    kernels' summed device time (torch.profiler)
  peak GB           peak allocated memory of a training step, new coordinates
  first / 1st step  the first inference, and the first training step after the timed
                    inferences, in this process (ours: the tuner's sweeps and kernel compiles,
                    or the reference while decided layers compile in the background; empty
                    tuning cache unless SPARSECONV_CACHE_DIR points at a filled one; see
                    scripts/bench_cold_start.py for the steps after the first)
A peer whose training fails with its default algorithm trains with ConvAlgo.Native, marked.
  maps / syncs      kernel maps a pass queries (a transposed conv's map is the transpose of
  / warp            its strided conv's, not queried); host syncs torch reports in one new-coordinate
                    inference (torch.cuda.set_sync_debug_mode); Warp launches (hash-table inserts
                    and queries) in one; ours only
A second table times ours and each peer in alternating rounds (new coordinates, inference rounds
then training rounds, the order rotating): the ratio lines come from it, since timing one library
after the other let host drift between them move the ratios by tens of percent.
A last table times map building: for subm3, a 16-channel conv on a fresh tensor minus the
same conv with its map cached (both printed too); for down2 (k2 s2), the whole fresh conv, since
spconv cannot reuse a strided conv's map. ``--maps-only`` prints that table alone.

    python scripts/bench_network.py                                   # 3 scenes x fp16, bf16 (minutes)
    python scripts/bench_network.py --scenes street1 --dtypes float16 --peers spconv
    python scripts/bench_network.py --scenes street1 street4 room2 --dtypes float16 --peers --deterministic
    python scripts/bench_network.py --scenes street1 room2 --dtypes float16 --peers spconv --lazy-maps
    python scripts/bench_network.py --scenes street1 street4 --dtypes float16 --peers spconv --model backbone
    python scripts/bench_network.py --device cpu --scale 0.05 --repeats 2 --peers naive   # dry run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from anchors import anchor_tensor, import_anchor  # noqa: E402
from bench_layers import SCENES, scene_coords  # noqa: E402

import sparseconv  # noqa: E402
from sparseconv.models import MinkUNet, SparseResNetBackbone  # noqa: E402
from sparseconv.nn import SparseConv3d  # noqa: E402

PEERS = ("spconv", "spconv_triton", "naive")
NUM_CLASSES = 20
IN_CHANNELS = 4
NAIVE_PINS = {"fwd_algo": "explicit_gemm", "dgrad_algo": "explicit_gemm", "wgrad_algo": "explicit_gemm"}


MODELS = ("minkunet", "backbone")


def ours_model(pins: dict | None = None, model: str = "minkunet", coords: torch.Tensor | None = None) -> nn.Module:
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


def anchor_cbr(spc, conv: nn.Module, channels: int) -> nn.Module:
    """spconv's conv, BatchNorm1d and ReLU in one SparseSequential (both anchor networks build theirs so)."""
    return spc.SparseSequential(conv, nn.BatchNorm1d(channels), nn.ReLU(inplace=True))


class AnchorMinkUNet(nn.Module):
    """The same network in spconv's API (spconv-triton shares it): indice keys name each map so the
    decoder's inverse convs reuse the encoder's maps, as spconv users write it."""

    def __init__(self, spc, planes=(32, 64, 128, 256, 256, 128, 96, 96), stem=32, algo=None):
        super().__init__()
        self.spc = spc
        extra = {} if algo is None else {"algo": algo}

        def cbr(conv, c):
            return anchor_cbr(spc, conv, c)

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

    def __init__(self, spc, channels=(16, 32, 64, 128), out_channels=128, algo=None):
        super().__init__()
        extra = {} if algo is None else {"algo": algo}

        def cbr(conv, c):
            return anchor_cbr(spc, conv, c)

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
    def __init__(self, spc, c_in, c_out, key, extra):
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


OURS = ("ours", "ours_lazy_maps", "naive")


class Runner:
    """One library's network on one scene: how to make its input and read its logits."""

    def __init__(self, name: str, coords: torch.Tensor, dtype: torch.dtype, device: torch.device, native: bool = False,
                 model: str = "minkunet"):
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

    def make_input(self, same: bool):
        if same and self._same is not None:
            return self._same
        if self.name in ("ours", "naive"):
            x = sparseconv.SparseTensor(self.coords, self.feats)
        else:
            x = anchor_tensor(self.spc, self.coords, self.feats)
        if same:
            self._same = x
        return x

    def logits(self, out) -> torch.Tensor:
        """What the loss reads: the MinkUNet's per-voxel logits, the backbone's dense BEV tensor (ours makes it
        in its forward, spconv's ``dense()`` here)."""
        ours = self.name in ("ours", "naive")
        if self.model == "backbone":
            return out.bev if ours else out.dense()
        return out.feats if ours else out.features

    def loss(self, out) -> torch.Tensor:
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
        if self.net.training:  # an inference loop sets the mode once, not every pass (~1 ms of host time)
            self.net.eval()
        with torch.no_grad():
            out = self.net(self.make_input(same))
            if self.model == "backbone" and self.name not in ("ours", "naive"):
                self.logits(out)  # spconv's dense map: ours makes its BEV map in the forward
        if same and self.name not in ("ours", "naive"):
            self._same.indice_dict = subm_maps(out)

    def step(self, same: bool = False) -> None:
        if not self.net.training:
            self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net(self.make_input(same))
        if same and self.name not in ("ours", "naive"):
            self._same.indice_dict = subm_maps(out)
        self.loss(out).backward()
        self.optimizer.step()


def _lazily(fn, *args, **kwargs):
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


def subm_maps(out) -> dict:
    """The submanifold maps of a spconv pass, kept for the next one (spconv reuses only those)."""
    return {key: data for key, data in out.indice_dict.items() if getattr(data, "is_subm", False)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(median wall ms, median host ms until ``fn`` returned) over ``repeats`` passes after the
    warm-up: passes, each followed by our background compiles finished, until every layer runs its
    settled choice (a lone layer's map is known lone from its third new tensor, as the map plan reads
    the last two batches: its product is tuned again then, with the views it builds), then one more."""
    for _ in range(4):
        fn()
        sparseconv.tune.wait_for_compiles()
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


def one_call_ms(fn, device: torch.device) -> float:
    """Milliseconds of one call of ``fn``, the device idle before and drained after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - start)


def gpu_ms(fn, device: torch.device) -> float | str:
    if device.type != "cuda":
        return "-"
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def peak_gb(fn, device: torch.device, runner: Runner | None = None) -> float | str:
    """Peak memory of one call of ``fn``; a runner's same-coordinate input (kept by the ``infer=``
    column, with its maps and their views, or spconv's indice pairs) is dropped first: a training
    loop on new coordinates holds no other batch's maps. (Kept, it added ~0.5 GB to ours at street4
    and less to spconv's, H200, 2026-11-26.)"""
    if device.type != "cuda":
        return "-"
    if runner is not None:
        runner._same = None
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def warp_launches(fn) -> int:
    """Warp kernel launches (hash-table inserts and queries) of one call of ``fn``."""
    from sparseconv.coords import hashing

    launch, count = hashing._launch, [0]

    def counting(*args):
        count[0] += 1
        return launch(*args)

    hashing._launch = counting
    try:
        fn()
    finally:
        hashing._launch = launch
    return count[0]


def count_syncs(fn, device: torch.device) -> int | str:
    if device.type != "cuda":
        return "-"
    return sum(sync_sites(fn).values())


def train_columns(runner: Runner, device, repeats: int, row: dict) -> None:
    """The training columns, into ``row`` one by one (those measured before a failure stay)."""
    for column, measure in (("1st step", lambda: one_call_ms(runner.step, device)),
                            ("step", lambda: timed(runner.step, device, repeats)[0]),
                            ("peak GB", lambda: peak_gb(runner.step, device, runner)),
                            ("step=", lambda: timed(lambda: runner.step(same=True), device, repeats)[0])):
        if column not in row:
            row[column] = measure()


def run_network(name: str, coords, dtype, device, repeats: int, model: str = "minkunet") -> dict:
    if name == "ours_deterministic":
        previous = sparseconv.set_deterministic(True)
        try:
            return run_network("ours", coords, dtype, device, repeats, model)
        finally:
            sparseconv.set_deterministic(previous)
    try:
        runner = Runner(name, coords, dtype, device, model=model)
        row = {"first": one_call_ms(runner.infer, device)}
        row["infer"], row["host"] = timed(runner.infer, device, repeats)
        row["infer="], _ = timed(lambda: runner.infer(same=True), device, repeats)
        row["gpu"] = gpu_ms(runner.infer, device)
        try:
            train_columns(runner, device, repeats, row)
        except Exception as error:  # noqa: BLE001
            if name not in ("spconv", "spconv_triton"):
                raise
            # spconv's default (mask implicit GEMM) fails in backward on some passes (seen on an
            # H100 with spconv-cu126 2.3.8, in the maps-kept passes, whose maps this script hands
            # back to it); a user would then train with its Native algorithm. The columns measured
            # before the failure keep the default algorithm's numbers.
            print(f"{name}: training failed ({type(error).__name__}: {str(error)[:300]}); "
                  "the remaining training columns with ConvAlgo.Native", flush=True)
            row["native"] = [k for k in ("step", "peak GB", "step=") if k not in row]
            train_columns(Runner(name, coords, dtype, device, native=True, model=model), device, repeats, row)
            row["note"] = "Native: " + ", ".join(row["native"])
        if model == "backbone" and name in ("ours", "spconv", "spconv_triton"):
            row["voxels"] = runner.voxels()
        if name in ("ours", "ours_lazy_maps"):
            x = runner.make_input(False)
            with torch.no_grad():
                runner.net.eval()(x)
            row["maps"] = sum(m.transpose_of is None for m in x.cache.kernel_maps())
            row["syncs"] = count_syncs(runner.infer, device)
            row["warp"] = warp_launches(runner.infer)
        return row
    except Exception as error:  # noqa: BLE001 - a peer that cannot run a case is reported as n/a
        return {"error": f"n/a ({type(error).__name__}: {str(error)[:80]})"}


def interleaved(coords, dtype, device, libraries: list[str], rows: dict, repeats: int, model: str = "minkunet"
                ) -> dict[str, dict]:
    """{library: {"infer": ms, "step": ms}}: new-coordinate inference and training step timed in
    rounds that alternate the libraries (the order rotating every round), inference rounds first.

    The per-library rows above time each library's columns one after the other; on a shared
    host the same pass drifted by up to 2x between such runs (H100, 2026-11-25), which moved the
    ratios more than most changes do. Alternating puts that drift on every library alike.
    """
    runners = {}
    for library in libraries:
        if library == "ours_deterministic" or "error" in rows.get(library, {"error": True}):
            continue
        # As its row trained on new coordinates: Native only if its default algorithm failed there.
        runners[library] = Runner(library, coords, dtype, device, native="step" in rows[library].get("native", ()),
                                  model=model)
    for runner in runners.values():
        for _ in range(2):
            runner.infer()
            runner.step()
    sparseconv.tune.wait_for_compiles()
    times = {library: {"infer": [], "step": []} for library in runners}
    names = list(runners)
    for kind in ("infer", "step") if names else ():
        for round_ in range(repeats):
            for library in names[round_ % len(names):] + names[: round_ % len(names)]:
                times[library][kind].append(one_call_ms(getattr(runners[library], kind), device))
    return {library: {kind: statistics.median(v) for kind, v in kinds.items()} for library, kinds in times.items()}


def map_build_ms(name: str, coords, device, repeats: int, layer: str) -> dict[str, float] | str:
    """subm3: {"build": one conv (16 -> 16 channels) on a fresh tensor minus the same conv with its map cached,
    "fresh" and "kept": the two}; down2: {"build": the whole fresh conv} (spconv cannot reuse a strided map)."""
    feats = torch.randn(len(coords), 16, device=device)
    try:
        if name == "ours":
            conv = SparseConv3d(16, 16, 3 if layer == "subm3" else 2, 1 if layer == "subm3" else 2).to(device)

            def fresh():
                conv(sparseconv.SparseTensor(coords, feats))

            cached_x = sparseconv.SparseTensor(coords, feats)
            conv(cached_x)

            def cached():
                conv(cached_x)
        else:
            spc = import_anchor(name)
            if isinstance(spc, str):
                return spc
            if layer == "subm3":
                conv = spc.SubMConv3d(16, 16, 3, bias=False, indice_key="k").to(device)
            else:
                conv = spc.SparseConv3d(16, 16, 2, 2, bias=False, indice_key="k").to(device)
            template = anchor_tensor(spc, coords, feats)

            def fresh():
                conv(spc.SparseConvTensor(feats, template.indices, template.spatial_shape, template.batch_size))

            keep = conv(template)
            cached_x = spc.SparseConvTensor(feats, template.indices, template.spatial_shape, template.batch_size)
            cached_x.indice_dict = subm_maps(keep)

            def cached():
                conv(cached_x)
        with torch.no_grad():
            if layer != "subm3":  # spconv cannot reuse a strided conv's map: time the whole fresh conv
                return {"build": timed(fresh, device, repeats)[0]}
            made, kept = timed(fresh, device, repeats)[0], timed(cached, device, repeats)[0]
            return {"build": max(0.0, made - kept), "fresh": made, "kept": kept}
    except Exception as error:  # noqa: BLE001
        return f"n/a ({type(error).__name__})"


def profile_ours(coords, dtype, device, model: str = "minkunet") -> None:
    """Where ours spends host time: per pass kind (inference and training step, new and kept
    coordinates), the torch ops each line of sparseconv issues (count, host ms), then the host
    syncs by line and a cProfile of one training step."""
    runner = Runner("ours", coords, dtype, device, model=model)
    passes = {"infer new": runner.infer, "infer same": lambda: runner.infer(same=True),
              "step same": lambda: runner.step(same=True), "step new": runner.step}
    for fn in passes.values():
        for _ in range(3):
            fn()
    sparseconv.tune.wait_for_compiles()  # else layers whose kernels compile in the background profile the reference
    for fn in passes.values():
        fn()
    sync(device)
    for label, fn in passes.items():
        with OpSites() as sites:
            fn()
            sync(device)
        print(f"\n{label}: {sum(c for c, _ in sites.counts.values())} torch ops; top sites by host ms (ops, ms)")
        for site, (count, ms) in sorted(sites.counts.items(), key=lambda kv: -kv[1][1])[:40]:
            print(f"  {count:5d} {ms:8.2f}  {site}")
    if device.type == "cuda":
        print("host syncs of one new-coordinate inference, by the line that caused them:")
        for site, count in sync_sites(runner.infer).most_common():
            print(f"  {count:4d}  {site}")
    profiler = cProfile.Profile()
    profiler.enable()
    runner.step()
    sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    print("cProfile of one training step, new coordinates\n" + text.getvalue())


class OpSites(TorchDispatchMode):
    """Counts the torch ops each line of sparseconv issues, with their host time (launch and any
    wait included): the profiler's Python stacks are not available on every torch build."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not ("/sparseconv/" in frame.f_code.co_filename
                                         and "site-packages" not in frame.f_code.co_filename):
            frame = frame.f_back
        where = "(outside sparseconv)" if frame is None else (
            f"{frame.f_code.co_filename.rsplit('/sparseconv/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        entry = self.counts[f"{where}  {func.__name__}"]
        entry[0] += 1
        entry[1] += 1e3 * (time.perf_counter() - start)
        return out


def sync_sites(fn) -> collections.Counter:
    """Where ``fn``'s host syncs happen: file:line of the Python frame that caused each one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=list(SCENES), choices=list(SCENES))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="minkunet", choices=MODELS,
                        help="the MinkUNet, or the detection backbone (SparseResNetBackbone with spconv's downsampling)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=1.0, help="scene size multiplier")
    parser.add_argument("--profile", action="store_true", help="profile one new-coordinate inference of ours first")
    parser.add_argument("--no-maps", dest="maps", action="store_false", help="skip the map-build table")
    parser.add_argument("--maps-only", action="store_true", help="the map-build table alone (no network)")
    parser.add_argument("--no-interleave", dest="interleave", action="store_false",
                        help="skip the alternating-rounds table (and the ratios it gives)")
    parser.add_argument("--lazy-maps", action="store_true",
                        help="also run ours with SPARSECONV_PLAN_MAPS=0 (the row ours_lazy_maps, alternating rounds too)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also run ours in deterministic mode (the row ours_deterministic)")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("SPARSECONV_CACHE_DIR", tempfile.mkdtemp(prefix="sparseconv-bench-"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model: {args.model}; device: {name}; torch {torch.__version__}; median of {args.repeats} passes (ms); "
          f"tuning cache {os.environ['SPARSECONV_CACHE_DIR']}")
    libraries = ["ours", *(["ours_deterministic"] if args.deterministic else []),
                 *(["ours_lazy_maps"] if args.lazy_maps else []), *args.peers]
    scenes = {scene: scene_coords(scene, args.scale).to(device) for scene in args.scenes}
    if args.profile:
        profile_ours(scenes[args.scenes[0]], getattr(torch, args.dtypes[0]), device, args.model)
    if args.maps_only:
        map_table(scenes, device, args)
        return
    columns = ["infer", "step", "infer=", "step=", "host", "gpu", "peak GB", "first", "1st step", "maps", "syncs",
               "warp"]
    print("| scene | N | dtype | library | " + " | ".join(columns) + " |")
    print("|---" * (4 + len(columns)) + "|")
    speedups, alternated, voxels = [], {}, {}
    for scene, coords in scenes.items():
        for dtype_name in args.dtypes:
            rows = {}
            for library in libraries:
                rows[library] = row = run_network(library, coords, getattr(torch, dtype_name), device, args.repeats,
                                                  args.model)
                cells = [row["error"]] if "error" in row else [fmt(row.get(c)) for c in columns]
                if "voxels" in row:
                    voxels[(scene, dtype_name, library)] = row["voxels"]
                label = library + (f" ({row['note']})" if "note" in row else "")
                print(f"| {scene} | {len(coords)} | {dtype_name} | {label} | " + " | ".join(cells) + " |", flush=True)
            if args.interleave and len(libraries) > 1:
                both = interleaved(coords, getattr(torch, dtype_name), device, libraries, rows, args.repeats, args.model)
                alternated[(scene, dtype_name)] = both
                anchor, ours = both.get("spconv"), both.get("ours")
                if anchor is not None and ours is not None:
                    speedups.append((scene, dtype_name, anchor["infer"] / ours["infer"], anchor["step"] / ours["step"],
                                     rows["ours"].get("peak GB"), rows["spconv"].get("peak GB")))
    if alternated:
        print("\nalternating rounds (the ratios below): new coordinates, median ms of --repeats rounds")
        print("| scene | dtype | library | infer | step |\n|---|---|---|---|---|")
        for (scene, dtype_name), both in alternated.items():
            for library, kinds in both.items():
                print(f"| {scene} | {dtype_name} | {library} | {kinds['infer']:.2f} | {kinds['step']:.2f} |")
    for scene, dtype_name, infer, step, ours_gb, their_gb in speedups:
        print(f"{scene} {dtype_name} {args.model}: ours over spconv, new coordinates, alternating rounds: inference "
              f"{infer:.2f}x, training step {step:.2f}x; peak memory {fmt(ours_gb)} vs {fmt(their_gb)} GB")
    if voxels:
        print("\nvoxels of each stage's output and of the height conv (the same network on both sides when equal):")
        for (scene, dtype_name, library), counts in voxels.items():
            print(f"  {scene} {dtype_name} {library}: {counts}")
    if args.maps:
        map_table(scenes, device, args)


def map_table(scenes: dict, device: torch.device, args) -> None:
    """The map-build table (:func:`map_build_ms`), ours and each peer but naive torch, every scene."""
    print("\nkernel-map build (ms): subm3, one 16-channel conv on a fresh tensor minus the same conv with its map "
          "cached (and the two convs); down2, the whole 16-channel k2 s2 conv on a fresh tensor (spconv cannot "
          "reuse its map)")
    libraries = ["ours", *(p for p in args.peers if p != "naive")]
    print("| scene | N | map | " + " | ".join(libraries) + " |")
    print("|---" * (3 + len(libraries)) + "|")
    for scene, coords in scenes.items():
        for layer in ("subm3", "down2"):
            times = [map_build_ms(library, coords, device, args.repeats, layer) for library in libraries]
            for part, label in (("build", layer), ("fresh", "subm3 conv, fresh"), ("kept", "subm3 conv, map kept")):
                if part == "build" or any(isinstance(t, dict) and part in t for t in times):
                    cells = [fmt(t.get(part)) if isinstance(t, dict) else t for t in times]
                    print(f"| {scene} | {len(coords)} | {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
