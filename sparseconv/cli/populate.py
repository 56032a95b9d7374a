"""``python -m sparseconv tune populate|export``: tune a whole model ahead of time, and write a
device's tunings as a file to ship (``sparseconv/tune/data/<device>.msgpack``, see :mod:`.shipped`).

``cache populate`` tunes a grid of single layers; ``tune populate`` runs a network forward and
backward over scenes, so the keys tuned are exactly the ones that network meets on them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tune import shipped
from .bench import SCENES
from ..tune.key import device_identity

MODELS = ("minkunet",)
DTYPES = ("float32", "float16", "bfloat16")
IN_CHANNELS = 4
NUM_CLASSES = 20


@dataclass(frozen=True)
class PopulateSummary:
    """What a populate run did: passes (forward + backward) run, keys it tuned (new or re-timed
    entries of this device in the user's cache), this device's entries there now, and seconds."""

    passes: int
    keys_tuned: int
    keys_cached: int
    seconds: float
    device: str


def add_parser(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser("tune", help="tune a model ahead of time; write a device's tunings to ship")
    actions = tune.add_subparsers(dest="action", required=True)
    populate_ = actions.add_parser("populate", help="run a model forward and backward over scenes so every key is tuned")
    populate_.add_argument("--model", choices=MODELS, default="minkunet",
                           help="minkunet (default): TorchSparse++'s MinkUNet, two stem convs, 4 input channels")
    populate_.add_argument("--scenes", nargs="+", choices=list(SCENES), default=["street1"])
    populate_.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                           help="default: float16 on cuda, float32 on cpu")
    populate_.add_argument("--steps", type=int, default=1, help="passes per scene and dtype (default 1: enough to tune)")
    populate_.add_argument("--scale", type=float, default=1.0, help="multiplies every scene's size")
    populate_.add_argument("--width", type=float, default=1.0, help="multiplies the model's channels")
    populate_.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    populate_.add_argument("--export", type=Path, default=None, metavar="PATH",
                           help="then write this device's tunings to PATH (a folder: PATH/<device>.msgpack)")
    export_ = actions.add_parser("export", help="write this device's tunings (cache over shipped) to a shippable file")
    export_.add_argument("path", type=Path, metavar="PATH", help="a file, or a folder to write <device>.msgpack in")
    export_.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def run(args: argparse.Namespace) -> int:
    device = _device(args.device)
    if args.action == "populate":
        dtypes = args.dtypes or (["float16"] if device.type == "cuda" else ["float32"])
        summary = populate(args.model, args.scenes, dtypes, args.steps, device, scale=args.scale, width=args.width)
        passes = f"{summary.passes} pass{'es' if summary.passes != 1 else ''}"
        print(f"tuned {summary.keys_tuned} keys in {summary.seconds:.1f} s ({passes}); "
              f"{summary.keys_cached} entries for {summary.device} in the cache")
    if args.action == "export" or args.export is not None:
        path, count = export(args.path if args.action == "export" else args.export, device)
        if count == 0:
            print(f"no tunings of {device_identity(device)} to export: run `python -m sparseconv tune populate` first",
                  file=sys.stderr)
            return 1
        print(f"exported {count} entries for {device_identity(device)} to {path}")
    return 0


def populate(
    model: str = "minkunet",
    scenes: Sequence[str] = ("street1",),
    dtypes: Sequence[str] = ("float32",),
    steps: int = 1,
    device: str | torch.device | None = None,
    *,
    scale: float = 1.0,
    width: float = 1.0,
    progress: bool = True,
) -> PopulateSummary:
    """Run ``model`` forward and backward ``steps`` times per scene and dtype, so the tuner tunes
    (and caches) every key it meets; shows a tqdm bar on stderr unless ``progress`` is False."""
    from tqdm import tqdm

    _check(model, scenes, dtypes, steps, scale, width)
    dev = _device(device)
    identity = device_identity(dev)
    before = _this_device(identity)
    start = time.perf_counter()
    bar = tqdm(total=len(dtypes) * len(scenes) * steps, desc="sparseconv tune populate", unit="pass",
               file=sys.stderr, disable=not progress)
    from ..tune import get_tuner

    # tuning ahead: every key timed in full now
    with bar, torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), get_tuner().budget.waived():
        torch.manual_seed(0)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            net = _model(model, width).to(dev, dtype).train()
            for scene in scenes:
                coords = _scene_coords(scene, scale).to(dev)
                for _ in range(steps):
                    bar.set_postfix(scene=scene, dtype=dtype_name, refresh=False)
                    _pass(net, coords, dtype)
                    _settle(net, coords, dtype, dev)
                    bar.set_postfix(scene=scene, dtype=dtype_name, keys=len(_this_device(identity)), refresh=False)
                    bar.update()
    seconds = time.perf_counter() - start
    get_tuner().cache.flush(force=True)
    after = _this_device(identity)
    tuned = sum(1 for key, updated in after.items() if before.get(key) != updated)
    return PopulateSummary(len(dtypes) * len(scenes) * steps, tuned, len(after), seconds, identity)


SETTLE_PASSES = 4
"""Extra passes at most, per pass, for the products whose kernels compiled in the background."""


def _settle(net, coords: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> None:
    """On a GPU a product whose kernels are not compiled yet runs the reference while they compile
    in the background, and is timed and stored at a later call: wait for them and pass again until
    none is left (a single pass stored 30 of street1's 74 keys on an H200 without this)."""
    from ..tune import get_tuner, wait_for_compiles

    for _ in range(SETTLE_PASSES):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if not get_tuner().compiling():
            return
        wait_for_compiles()
        _pass(net, coords, dtype)


def export(path: str | os.PathLike, device: str | torch.device | None = None) -> tuple[Path, int]:
    """Write the tunings of ``device`` (the user's cache over the shipped ones) to ``path``, or to
    ``path/<device>.msgpack`` if it is a folder; returns (the file, its entry count); raises OSError."""
    from ..tune import get_tuner

    identity = device_identity(_device(device))
    entries = shipped.entries_for(identity)
    entries.update(((ns, key), entry) for ns, key, entry in get_tuner().cache.items() if identity in key.split("|"))
    target = Path(path)
    if target.is_dir():
        target = target / shipped.device_file_name(identity)
    if entries:
        shipped.write(target, entries)
    return target, len(entries)


def _check(model: str, scenes: Sequence[str], dtypes: Sequence[str], steps: int, scale: float, width: float) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    for name, given, valid in (("scenes", scenes, SCENES), ("dtypes", dtypes, DTYPES)):
        if isinstance(given, str) or not given or any(g not in valid for g in given):
            raise ValueError(f"{name} must be a non-empty list of {list(valid)}, got {given!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    for name, value in (("scale", scale), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cuda' or 'cpu', got {device!r} ({exc})") from None


def _this_device(identity: str) -> dict[tuple[str, str], float]:
    """{(namespace, key): updated} of the user's cache entries of the device ``identity``."""
    from ..tune import get_tuner

    return {(ns, key): entry.get("updated") for ns, key, entry in get_tuner().cache.items()
            if identity in key.split("|")}


def _model(name: str, width: float) -> torch.nn.Module:
    from ..models import MinkUNet

    # The network of the speed issue (TorchSparse++'s MinkUNet), as scripts/bench_network.py builds it.
    return MinkUNet(IN_CHANNELS, NUM_CLASSES, stem_kernel_size=3, stem_convs=2, width=width)


def _scene_coords(name: str, scale: float) -> torch.Tensor:
    from ..data import make_scene

    kind, voxel_size, batch, base = SCENES[name]
    return make_scene(kind, voxel_size=voxel_size, batch_size=batch, scale=base * scale)[0]


def _pass(net: torch.nn.Module, coords: torch.Tensor, dtype: torch.dtype) -> None:
    """One forward and backward on a new tensor of ``coords`` (new maps, as every training batch)."""
    from ..tensor import SparseTensor

    x = SparseTensor(coords, torch.randn(len(coords), IN_CHANNELS, device=coords.device, dtype=dtype))
    net.zero_grad(set_to_none=True)
    out = net(x)
    # Cross-entropy, as in training: its gradients are as small as a real network's (an fp16
    # network's are subnormal), which is what the tuner's guard must see.
    labels = torch.randint(0, NUM_CLASSES, (len(coords),), device=coords.device)
    torch.nn.functional.cross_entropy(out.feats.float(), labels).backward()
