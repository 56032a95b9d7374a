"""The demo: a small sparse encoder-decoder on a synthetic scene, forward and backward, timed per layer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .data import make_scene
from .nn import BatchNorm, ReLU, Sequential, SparseConv3d, SparseConvTranspose3d
from .tensor import SparseTensor


def _block(c_in: int, c_out: int, kernel_size: int = 3, stride: int = 1, transposed: bool = False) -> Sequential:
    conv = SparseConvTranspose3d if transposed else SparseConv3d
    return Sequential(conv(c_in, c_out, kernel_size, stride, bias=False), BatchNorm(c_out), ReLU(inplace=True))


class DemoUNet(nn.Module):
    """Three-level encoder-decoder: submanifold convs, k2/s2 downsampling, transposed upsampling
    back onto the encoder's coordinates, additive skips."""

    def __init__(self, in_channels: int = 4, width: int = 32, num_classes: int = 8) -> None:
        super().__init__()
        w = width
        self.stages = nn.ModuleDict(
            {
                "stem": _block(in_channels, w),
                "down1": Sequential(_block(w, 2 * w, 2, 2), _block(2 * w, 2 * w)),
                "down2": Sequential(_block(2 * w, 4 * w, 2, 2), _block(4 * w, 4 * w)),
                "up2": _block(4 * w, 2 * w, 2, 2, transposed=True),
                "up1": _block(2 * w, w, 2, 2, transposed=True),
                "head": SparseConv3d(w, num_classes, 1),
            }
        )

    def forward(self, x: SparseTensor, on_stage: Callable[[str, Callable[[], SparseTensor]], SparseTensor] | None = None) -> SparseTensor:
        run = on_stage or (lambda name, fn: fn())
        s = self.stages
        x0 = run("stem", lambda: s["stem"](x))
        x1 = run("down1", lambda: s["down1"](x0))
        x2 = run("down2", lambda: s["down2"](x1))
        y1 = run("up2", lambda: s["up2"](x2))
        y1 = y1.replace(y1.feats + x1.feats)
        y0 = run("up1", lambda: s["up1"](y1))
        y0 = y0.replace(y0.feats + x0.feats)
        return run("head", lambda: s["head"](y0))


@dataclass
class StageTiming:
    name: str
    num_out: int
    channels: int
    stride: tuple[int, int, int]
    forward_ms: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(
    scene: str = "street",
    batch_size: int = 2,
    scale: float = 1.0,
    device: str | None = None,
    width: int = 32,
    iterations: int = 3,
    seed: int = 0,
) -> dict:
    """Build the scene and network, run ``iterations`` forward+backward passes; return what the CLI prints.

    Step 0 compiles Warp's kernels and builds every kernel map, step 1 builds them for a new
    batch, later steps reuse step 1's maps; the per-stage timings are those of the last step.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    coords, feats = make_scene(scene, batch_size=batch_size, seed=seed, scale=scale)
    scene_s = time.perf_counter() - t0
    model = DemoUNet(feats.shape[1], width).to(dev)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    history = []
    for step in range(max(iterations, 3)):
        # Steps 0 and 1 see a new batch (step 0 also compiles Warp's kernels); later steps reuse
        # step 1's tensor, so its kernel maps are cached and only the convolutions are timed.
        if step < 2:
            x = SparseTensor(coords.to(dev), feats.to(dev))
        labels = torch.randint(0, 8, (len(x),), device=dev, generator=torch.Generator(dev).manual_seed(seed))
        timings: list[StageTiming] = []

        def timed(name: str, fn: Callable[[], SparseTensor]) -> SparseTensor:
            _sync(dev)
            start = time.perf_counter()
            out = fn()
            _sync(dev)
            timings.append(StageTiming(name, len(out), out.num_channels, out.stride, 1e3 * (time.perf_counter() - start)))
            return out

        _sync(dev)
        start = time.perf_counter()
        out = model(x, timed)
        loss = nn.functional.cross_entropy(out.feats, labels)
        _sync(dev)
        forward_ms = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        _sync(dev)
        backward_ms = 1e3 * (time.perf_counter() - start)
        history.append((forward_ms, backward_ms, loss.item(), timings))
    per_batch = torch.bincount(coords[:, 0].long(), minlength=batch_size).tolist()
    return {
        "device": str(dev),
        "scene": scene,
        "scene_s": scene_s,
        "voxels_per_sample": per_batch,
        "history": history,
        "cache": repr(x.cache),
    }


def format_report(report: dict) -> str:
    first, fresh, last = report["history"][0], report["history"][1], report["history"][-1]
    lines = [
        f"sparseconv demo — scene '{report['scene']}' on {report['device']}",
        f"voxels per sample: {report['voxels_per_sample']} (scene built in {report['scene_s']:.2f} s)",
        "",
        f"{'stage':<8}{'N_out':>10}{'C':>6}{'stride':>12}{'forward ms':>13}",
    ]
    for t in last[3]:
        lines.append(f"{t.name:<8}{t.num_out:>10}{t.channels:>6}{str(t.stride[0]):>12}{t.forward_ms:>13.2f}")
    lines += [
        "",
        f"first step (Warp JIT + kernel maps): forward {first[0]:.1f} ms, backward {first[1]:.1f} ms",
        f"new batch (kernel maps built):       forward {fresh[0]:.1f} ms, backward {fresh[1]:.1f} ms",
        f"same batch (kernel maps cached):     forward {last[0]:.1f} ms, backward {last[1]:.1f} ms",
        f"loss: {first[2]:.4f} -> {last[2]:.4f} over {len(report['history'])} SGD steps",
        f"coordinate cache: {report['cache']}",
    ]
    return "\n".join(lines)
