"""The demo: train a small MinkUNet to segment synthetic scenes, then score it on a held-out scene.

``python -m sparseconv demo`` calls :func:`run_demo` and prints :func:`format_report`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import config
from ..data import CLASS_NAMES, make_scene
from ..metrics import confusion_matrix, iou_per_class
from ..models import MinkUNet14
from ..tensor import SparseTensor

logger = logging.getLogger("sparseconv")


@dataclass(frozen=True)
class DemoScene:
    """How the demo voxelises one kind of scene: voxel size (m), points relative to make_scene's
    scale 1, and the classes hidden in the bird's-eye picture."""

    voxel_size: float
    scale: float
    hidden_in_plot: tuple[str, ...] = ()


# Sized so that the default run takes about 2-2.5 minutes on a 2-core CPU (a user measured 2 min 35 s
# from empty caches, 1 min 56 s warm; the demo prints its own): ~14k voxels per street and ~16k per room. Eight distinct batches rather than four lift the
# held-out street mIoU from ~65 % to ~90 % (measured): with fewer scenes the net memorises them.
SCENES = {
    "street": DemoScene(voxel_size=0.2, scale=0.35),
    "room": DemoScene(voxel_size=0.1, scale=0.25, hidden_in_plot=("ceiling",)),
}
DEFAULT_WIDTH = 8
DEFAULT_STEPS = 200
TRAIN_BATCHES = 8
HELD_OUT_SEED = 10_000
LEARNING_RATE = 0.02


def run_demo(
    scene: str = "street",
    batch_size: int = 2,
    scale: float | None = None,
    device: str | None = None,
    width: int | None = None,
    steps: int | None = None,
    *,
    seed: int = 0,
    plot: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Train MinkUNet14 on generated scenes for ``steps`` steps and evaluate it; returns the report.

    scene: "street" (LiDAR: ground, building, vehicle, pole/tree) or "room" (floor, wall,
    furniture, ceiling); batch_size: scenes per step; scale: multiplies the points per scene
    (default 1); device: default cuda when available, else cpu; width: channels of the stem
    (the model's width multiplier is width / 32; default 8); steps: default 200; seed: fixes the
    scenes, the initialisation and the batch order; plot: a PNG path for the bird's-eye picture
    of the held-out scene (needs matplotlib); progress: show a tqdm bar on stderr.

    The report is a dict of plain values (see :func:`format_report`): the run's settings, data
    sizes, per-step ``losses`` and ``step_seconds``, the held-out ``iou`` per class, ``miou`` and
    ``accuracy``, ``plot`` (the saved path or None), and ``wall_seconds``: the whole run, from generating
    the data to the report (the interpreter's start and imports before it are not in it).
    """
    if scene not in SCENES:
        raise ValueError(f"scene must be one of {sorted(SCENES)}, got {scene!r}")
    scale = 1.0 if scale is None else scale
    width = DEFAULT_WIDTH if width is None else width
    steps = DEFAULT_STEPS if steps is None else steps
    for name, value in (("batch_size", batch_size), ("width", width), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if plot is not None:
        # Fail now rather than after minutes of training.
        from ..viz import require_matplotlib

        if not Path(plot).parent.is_dir():
            raise ValueError(f"plot: the folder of {str(plot)!r} does not exist")
        require_matplotlib()
    wall_start = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = SCENES[scene]
    classes = CLASS_NAMES[scene]

    # fork_rng: the demo is reproducible from its seed without touching the caller's RNG state.
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        start = time.perf_counter()
        batches = [
            _scene_batch(scene, spec, batch_size, seed + i * batch_size, scale, dev) for i in range(TRAIN_BATCHES)
        ]
        held_out = _scene_batch(scene, spec, 1, seed + HELD_OUT_SEED, scale, dev)
        data_s = time.perf_counter() - start

        model = MinkUNet14(batches[0][0].num_channels, len(classes), width=width / 32, stem_kernel_size=3).to(dev)
        optimiser = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=1e-4)
        # OneCycleLR divides by pct_start * steps - 1, which is 0 for 0.1 at 10 steps.
        warmup = 0.1 if steps != 10 else 0.2
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, LEARNING_RATE, total_steps=steps, pct_start=warmup)
        loss_fn = nn.CrossEntropyLoss(weight=_class_weights([labels for _, labels in batches], len(classes)))

        losses, step_seconds = [], []
        bar = _progress_bar(steps, f"training on {scene} scenes", progress)
        # Each batch's first step meets new problem sizes, which the tuner times (then caches):
        # the first TRAIN_BATCHES steps are the tuning phase, every later step reuses the choices.
        tuning_steps = min(steps, TRAIN_BATCHES)
        timed_before, effort = _tuned_count(), config.autotune_effort()
        if bar is not None:
            bar.write(f"choosing kernels for this {_device_kind(dev)} as it trains (timing problems no tuning cache "
                      "holds; after the first steps, in at most a tenth of the time)...", file=sys.stderr)
        for step in range(steps):
            x, labels = batches[step % len(batches)]
            _sync(dev)
            start = time.perf_counter()
            loss = train_step(model, loss_fn, optimiser, x, labels)
            schedule.step()
            losses.append(loss.item())  # the host sync also makes the step time honest
            step_seconds.append(time.perf_counter() - start)
            if step + 1 == tuning_steps:
                tuned = _tuned_count() - timed_before
                tunings = _save_tunings() if tuned else None
                untimed = _untimed_count()
                if bar is not None:
                    bar.write(_tuning_line(sum(step_seconds), tuned, tuning_steps, effort, tunings, _cache_path(),
                                           untimed), file=sys.stderr)
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
                bar.update()
        if bar is not None:
            bar.close()

        model.eval()
        x, labels = held_out
        with torch.no_grad():
            prediction = model(x).feats.argmax(1)
        confusion = confusion_matrix(prediction, labels, len(classes))

    iou = iou_per_class(confusion)
    saved = None
    if plot is not None:
        from ..viz import save_bev_comparison

        title = (
            f"MinkUNet14 (width {width}) after {steps} steps, held-out {scene} scene: mIoU {float(iou.nanmean()):.1%}"
        )
        saved = str(save_bev_comparison(plot, x.coords, prediction, labels, classes, spec.hidden_in_plot, title))
        logger.info("bird's-eye picture saved to %s", saved)
    return {
        "scene": scene,
        "device": str(dev),
        "seed": seed,
        "width": width,
        "batch_size": batch_size,
        "voxel_size": spec.voxel_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_scenes": TRAIN_BATCHES * batch_size,
        "train_voxels": sum(len(x) for x, _ in batches),
        "held_out_seed": seed + HELD_OUT_SEED,
        "held_out_voxels": len(held_out[0]),
        "data_seconds": data_s,
        "losses": losses,
        "step_seconds": step_seconds,
        "tuning_steps": tuning_steps,
        "tuned_problems": tuned,
        "untimed_problems": untimed,
        "tunings_saved": tunings,
        "classes": list(classes),
        "iou": iou.tolist(),
        "class_voxels": confusion.sum(1).tolist(),
        "miou": float(iou.nanmean()),
        "accuracy": float(confusion.diagonal().sum() / confusion.sum().clamp(min=1)),
        "plot": saved,
        "tuner": _tuner_report(model),
        "runs_on": _runs_on(dev),
        "wall_seconds": time.perf_counter() - wall_start,
    }


def train_step(model: nn.Module, loss_fn: nn.Module, optimiser: torch.optim.Optimizer, x: SparseTensor,
               labels: torch.Tensor) -> torch.Tensor:
    """One training step of the demo's network on ``x``: forward, loss, backward, optimiser step; returns the loss."""
    loss = loss_fn(model(x).feats, labels)
    optimiser.zero_grad(set_to_none=True)
    loss.backward()
    optimiser.step()
    return loss


def format_report(report: dict) -> str:
    """The demo's report as the text the command line prints."""
    losses, seconds = report["losses"], report["step_seconds"]
    steps = len(losses)
    lines = [
        f"sparseconv demo — MinkUNet14 (width {report['width']}, {report['parameters'] / 1e6:.2f} M parameters) "
        f"segmenting synthetic {report['scene']} scenes on {report['device']}",
        f"data: {report['train_scenes']} training scenes, {report['train_voxels'] / report['train_scenes']:,.0f} "
        f"voxels each on average at {report['voxel_size']} m; held-out scene (seed {report['held_out_seed']}): "
        f"{report['held_out_voxels']:,} voxels; generated in {report['data_seconds']:.1f} s",
        f"training: {steps} steps of {report['batch_size']} scenes in {sum(seconds):.1f} s "
        f"({_median(seconds):.3f} s per step; the first took {seconds[0]:.2f} s: Warp JIT, kernel maps, "
        "algorithm choice)",
        _tuning_line(sum(seconds[: report["tuning_steps"]]), report["tuned_problems"], report["tuning_steps"],
                     report["tuner"]["effort"], report["tunings_saved"], report["tuner"]["cache"],
                     report.get("untimed_problems", 0)),
        "",
        "loss, mean over each tenth of the training:",
        *_loss_table(losses),
        "",
        f"held-out mIoU {report['miou']:.1%}, voxel accuracy {report['accuracy']:.1%}",
        f"  {'class':<12}{'IoU':>8}{'voxels':>10}",
    ]
    for name, iou, count in zip(report["classes"], report["iou"], report["class_voxels"]):
        lines.append(f"  {name:<12}{'n/a' if math.isnan(iou) else f'{iou:.1%}':>8}{count:>10,}")
    lines += _tuner_lines(report)
    if report["plot"]:
        lines += ["", f"bird's-eye picture (prediction | label | errors): {report['plot']}"]
    # Last, so that what the docs say a run takes can be checked against every run.
    wall = _duration(report["wall_seconds"])
    lines += ["", f"demo wall time: {wall} from generating the data to this report, on {report['runs_on']}"]
    return "\n".join(lines)


def _tuner_report(model: torch.nn.Module) -> dict:
    """What the tuner chose for every conv layer (forward, dgrad, wgrad) and where it keeps that."""
    from ..nn import SparseConv3d

    layers = {
        name: [module.algorithms.get(ns, "-") for ns in ("AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather")]
        for name, module in model.named_modules()
        if isinstance(module, SparseConv3d)
    }
    from ..tune import progress

    return {"layers": layers, "cache": _cache_path(), "effort": config.autotune_effort(),
            "progress": progress()._asdict()}


def _tuner_lines(report: dict) -> list[str]:
    """The per-layer algorithm choices and the tuner's cache path."""
    tuner = report.get("tuner")
    if not tuner:
        return []
    width = max((len(name) for name in tuner["layers"]), default=5)
    lines = ["", f"algorithms the tuner chose (effort {tuner['effort']}; forward / dgrad / wgrad):"]
    for name, (fwd, dgrad, wgrad) in tuner["layers"].items():
        lines.append(f"  {name:<{width}}  {fwd} / {dgrad} / {wgrad}")
    lines.append(f"tuning cache: {tuner['cache']}")
    done = tuner.get("progress")
    if done:
        adopted = (f" ({done['adopted']} of them adopting a timed neighbouring size's choice)"
                   if done.get("adopted") else "")
        lines.append(f"tuner at the end: {done['settled']} products tuned{adopted}, {done['untimed']} running a pick "
                     f"untimed (later calls time them), {done['compiling']} waiting for kernels compiling in the "
                     f"background; {done['timed_s']:.1f} s spent timing inside the steps")
    return lines


def _tuned_count() -> int:
    """Entries in the tuner's cache: each problem the tuner times adds one."""
    from ..tune import get_tuner

    return len(get_tuner().cache.items())


def _untimed_count() -> int:
    """Products running a pick untimed now (:attr:`sparseconv.tune.Progress.untimed`): later calls time them."""
    from ..tune import progress

    return progress().untimed


def _device_kind(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "CPU"


def _save_tunings() -> str:
    """Write the tuning phase's timings to the cache file now; what became of them: ``"saved"`` (in the file),
    ``"unwritable"`` (the file cannot be written: they stay in this process's memory) or ``"busy"`` (another
    process holds the file's lock: written at exit)."""
    from ..tune import get_tuner

    cache = get_tuner().cache
    cache.flush(force=True)  # (False too when the cache's writer thread had already written them all)
    if not cache.unflushed:
        return "saved"
    return "unwritable" if cache.unwritable else "busy"


def _cache_path() -> str:
    from ..tune import get_tuner

    return str(get_tuner().cache.path)


def _tuning_line(seconds: float, tuned: int, tuning_steps: int, effort: str, saved: str | None = None,
                 path: str = "", untimed: int = 0) -> str:
    """What the tuning phase (the first ``tuning_steps`` steps) cost, how many problems it timed, whether
    their timings reached the cache file at ``path`` (``saved``: :func:`_save_tunings`), and how many products
    run a pick untimed at its end (``untimed``: timed by later steps, within the timing budget)."""
    head = f"tuning: the first {tuning_steps} step{'s' if tuning_steps > 1 else ''} took {seconds:.1f} s"
    if tuned:
        if saved == "unwritable":
            return (f"{head}; {tuned} problems timed, NOT cached: {path} cannot be written, so a new process times "
                    "them again (SPARSECONV_CACHE_DIR sets where the cache goes)")
        if saved == "busy":
            return f"{head}; {tuned} problems timed; the cache {path} is locked by another process: written at exit"
        later = f"; {untimed} more run a pick untimed until later steps time them" if untimed else ""
        return f"{head}; {tuned} problems timed so far, cached in {path}{later}"
    if effort == "none":
        return f"{head}; nothing timed (SPARSECONV_AUTOTUNE_EFFORT=none: untimed choices)"
    return f"{head}; nothing timed: every choice came from the tuning cache or the shipped tunings"


def _progress_bar(total: int, description: str, show: bool):
    """A tqdm bar on stderr, or None (tqdm is imported only when a bar is shown)."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="step")


def _scene_batch(
    kind: str, spec: DemoScene, batch_size: int, seed: int, scale: float, device: torch.device
) -> tuple[SparseTensor, torch.Tensor]:
    """A batch of generated scenes as (SparseTensor (N, 5), labels (N,) int64) on ``device``."""
    coords, feats, labels = make_scene(
        kind, spec.voxel_size, batch_size=batch_size, seed=seed, scale=spec.scale * scale, with_labels=True
    )
    # Height above the floor (in metres / 4) is the one absolute position that carries meaning
    # here; x and y would only let the net memorise the training scenes.
    height = (coords[:, 3:4].to(torch.float32) + feats[:, 2:3]) * (spec.voxel_size / 4.0)
    x = SparseTensor(coords.to(device), torch.cat([feats, height], 1).to(device))
    return x, labels.to(device)


def _class_weights(labels: list[torch.Tensor], num_classes: int) -> torch.Tensor:
    """(num_classes,) weights 1 / sqrt(frequency), mean 1: rare classes (poles) still count."""
    counts = sum(torch.bincount(t, minlength=num_classes) for t in labels).to(torch.float32)
    weights = counts.clamp(min=1).rsqrt()
    return weights / weights.mean()


def _loss_table(losses: list[float]) -> list[str]:
    """Two aligned rows: step ranges and the mean loss over each (ten windows, fewer for short runs)."""
    windows = min(10, len(losses))
    edges = [round(i * len(losses) / windows) for i in range(windows + 1)]
    ranges = [f"{a + 1}-{b}" if b - a > 1 else f"{b}" for a, b in zip(edges, edges[1:])]
    means = [f"{sum(losses[a:b]) / (b - a):.3f}" for a, b in zip(edges, edges[1:])]
    width = max(len(s) for s in ranges + means) + 2
    return ["  steps" + "".join(s.rjust(width) for s in ranges), "  loss " + "".join(s.rjust(width) for s in means)]


def _runs_on(device: torch.device) -> str:
    """The device in a person's words: ``cpu (2 torch threads)`` or ``cuda:0 (NVIDIA H200)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} torch threads)"


def _duration(seconds: float) -> str:
    """``42.3 s`` under a minute, else ``2 min 35 s``."""
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
