"""``python -m sparseconv cache ...``: show, clear, export, merge and populate the tuning cache."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from ..backends.problem import NAMESPACES


def add_parser(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser("cache", help="inspect and manage the tuning cache")
    actions = cache.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="list cached tuning results")
    show.add_argument("--namespace", choices=NAMESPACES, help="only this product")
    show.add_argument("--best-only", action="store_true", help="one line per key: the winner")
    actions.add_parser("clear", help="delete every cached result")
    export = actions.add_parser("export", help="write the cache to FILE (to share it)")
    export.add_argument("file", type=Path)
    merge = actions.add_parser("merge", help="take the entries of FILE (the measured-fastest wins)")
    merge.add_argument("file", type=Path)
    populate = actions.add_parser("populate", help="tune a grid of problem sizes ahead of time")
    populate.add_argument("--rows", type=int, nargs="+", default=[4096, 16384, 65536])
    populate.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64, 128])
    populate.add_argument("--kernels", nargs="+", default=["3", "2s2"], help="k (submanifold) or ksS (strided)")
    populate.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    populate.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    populate.add_argument("--gpus", help="'all' or a count: one process per GPU (GPUs of one model split the grid)")


def run(args: argparse.Namespace) -> int:
    from ..tune import get_tuner

    cache = get_tuner().cache
    if args.action == "show":
        print(format_entries(cache.items(args.namespace), args.best_only, cache.path))
    elif args.action == "clear":
        cache.clear()
        print(f"cleared {cache.path}")
    elif args.action == "export":
        print(f"exported {cache.export(args.file)} entries to {args.file}")
    elif args.action == "merge":
        if not args.file.is_file():
            raise SystemExit(f"cache merge: {args.file} is not a file")
        print(f"took {cache.merge_file(args.file)} entries from {args.file} into {cache.path}")
    elif args.gpus:
        if args.device:
            raise SystemExit("cache populate: give --device or --gpus, not both")
        populate_devices(cuda_devices(args.gpus), args.rows, args.channels, args.kernels, args.dtype)
        print(f"{len(cache.items())} entries in {cache.path}")  # read now: what the processes wrote
    else:
        populate(args.rows, args.channels, args.kernels, getattr(torch, args.dtype), args.device)
        cache.flush(force=True)
        print(f"{len(cache.items())} entries in {cache.path}")
    return 0


def format_entries(items: list[tuple[str, str, dict]], best_only: bool, path: Path) -> str:
    lines = [f"{path}: {len(items)} entries"]
    for namespace, key, entry in sorted(items):
        timings = entry.get("timings", {})
        winner = entry.get("winner", "?")
        best = timings.get(winner, {}) if isinstance(timings, dict) else {}
        ms = f"{best['ms']:.3f} ms" if best.get("ms") is not None else ""
        lines.append(f"{namespace}  {key}\n    winner {winner} {ms}  (evidence {entry.get('evidence', 0)})")
        if best_only or not isinstance(timings, dict):
            continue
        for cid, t in sorted(timings.items(), key=lambda kv: (kv[1].get("ms") is None, kv[1].get("ms") or 0)):
            shown = f"{t['ms']:.3f}" if t.get("ms") is not None else "-"
            host = f", host {t['host_ms']:.3f}" if t.get("host_ms") is not None else ""
            reason = f" ({t['reason']})" if t.get("reason") else ""
            lines.append(f"      {cid:<42} {shown:>10} ms{host}  {t.get('verdict', '?')}{reason}")
    return "\n".join(lines)


def populate(rows: list[int], channels: list[int], kernels: list[str], dtype: torch.dtype, device: str | None) -> None:
    """Run forward and backward once per grid point, so every product is tuned and cached."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _populate_grid(list(itertools.product(rows, channels, kernels)), dtype, dev)


def _populate_grid(grid: list[tuple[int, int, str]], dtype: torch.dtype, dev: torch.device, position: int = 0) -> None:
    from tqdm import tqdm

    from ..tune import get_tuner

    description = "sparseconv cache populate" + (f" {dev}" if position else "")
    with get_tuner().budget.waived():  # tuning ahead: every key timed in full now
        for n, c, kernel in tqdm(grid, desc=description, unit="problem", position=position):
            _populate_one(n, c, kernel, dtype, dev)


def _populate_one(n: int, c: int, kernel: str, dtype: torch.dtype, dev: torch.device) -> None:
    """One forward and backward of a ``kernel`` conv of ``c`` channels on about ``n`` random voxels."""
    from ..nn import SparseConv3d
    from ..tensor import SparseTensor

    size, _, stride = kernel.partition("s")
    # A surface-like density (about a third of each voxel's 26 neighbours occupied), the
    # regime of voxelised scans, so the tuned keys are the ones real layers hit.
    side = max(4, round((n * 3) ** 0.5))
    xyz = torch.randint(0, side, (n, 2), device=dev)
    coords = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=dev), xyz,
                        torch.randint(0, 3, (n, 1), device=dev)], dim=1).unique(dim=0)
    x = SparseTensor(coords, torch.randn(len(coords), c, device=dev, dtype=dtype).requires_grad_())
    layer = SparseConv3d(c, c, int(size), int(stride or 1), bias=False, device=dev, dtype=dtype)
    layer(x).feats.sum().backward()


def cuda_devices(gpus: str) -> list[str]:
    """The devices ``--gpus`` names: "all" or the first N visible CUDA devices."""
    visible = torch.cuda.device_count()
    if not visible:
        raise SystemExit("cache populate --gpus: no CUDA device is visible (use --device cpu)")
    count = visible if gpus == "all" else int(gpus) if gpus.isdigit() else 0
    if count < 1 or count > visible:
        raise SystemExit(f"cache populate --gpus: expected 'all' or a count in 1..{visible} "
                         f"(the CUDA devices visible), got {gpus!r}")
    return [f"cuda:{i}" for i in range(count)]


def populate_devices(devices: list[str], rows: list[int], channels: list[int], kernels: list[str], dtype: str) -> None:
    """:func:`populate` in one process per device, all merging into the one cache file. Keys name
    the device model, so devices of one model split the grid and every other model gets it whole."""
    import torch.multiprocessing as mp

    from ..tune.key import device_identity

    identities = [device_identity(torch.device(device)) for device in devices]
    shares = split_grid(list(itertools.product(rows, channels, kernels)), devices, identities)
    context = mp.get_context("spawn")  # CUDA cannot run in a forked child
    processes = [context.Process(target=_populate_share, args=(device, share, dtype, position + 1))
                 for position, (device, share) in enumerate(shares)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    failed = [device for (device, _), process in zip(shares, processes) if process.exitcode != 0]
    if failed:
        raise SystemExit(f"cache populate: the processes of {failed} failed (their errors are above)")


def split_grid(grid: list, devices: list[str], identities: list[str]) -> list[tuple[str, list]]:
    """(device, its part of ``grid``): devices of one identity share the grid, round robin."""
    models: dict[str, list[str]] = {}
    for device, identity in zip(devices, identities, strict=True):
        models.setdefault(identity, []).append(device)
    return [(device, grid[i::len(group)]) for group in models.values() for i, device in enumerate(group)]


def _populate_share(device: str, grid: list[tuple[int, int, str]], dtype: str, position: int) -> None:
    from ..tune import get_tuner

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _populate_grid(grid, getattr(torch, dtype), dev, position)
    get_tuner().cache.flush(force=True)
