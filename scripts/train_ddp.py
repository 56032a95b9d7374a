"""Data-parallel training of MinkUNet14 on synthetic scenes: one process per GPU (NCCL) or per
CPU process (gloo), started by torchrun; without torchrun it runs one process (the baseline).

Every rank trains on scenes of its own (seeds never shared between ranks) and builds a new
SparseTensor every step, so kernel maps are built and keys met as in a real job; ranks see
different N. BatchNorms become SyncBatchNorms on CUDA (torch's SyncBatchNorm runs on GPUs only;
on CPU each rank keeps its own statistics). Rank 0 shows the progress bar and prints:

  samples/s       scenes per second over all ranks, steps after --warmup-steps (wall time of
                  rank 0; DDP's gradient all-reduce keeps the ranks in step), once the kernels
                  still compiling in the background after the warm-up steps are compiled
  waited          how long each rank waited for those compiles
  first step      each rank's first step, seconds: kernel maps, Warp JIT, and the tuner's sweeps
                  (empty cache unless SPARSECONV_CACHE_DIR holds one)
  choice table    per (namespace, key) the candidate each rank settled on; the script exits 1
                  if two ranks settled on different candidates for one key
  cache           the entries of the tuning cache file after every rank flushed

    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py                  # two GPUs
    python scripts/train_ddp.py                                                    # one GPU
    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py --device cpu --steps 2 --scale 0.05 --width 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from sparseconv import SparseTensor, tune
from sparseconv.data import CLASS_NAMES, make_scene
from sparseconv.models import MinkUNet14
from sparseconv.nn import SyncBatchNorm

# The demo's voxel sizes and point counts (scale 1): ~14k voxels per street, ~16k per room.
SCENES = {"street": (0.2, 0.35), "room": (0.1, 0.25)}
DISTINCT_BATCHES = 4  # per rank; steps cycle through them, each step building a new SparseTensor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of samples/s (default 5)")
    parser.add_argument("--batch-size", type=int, default=2, help="scenes per rank and step (default 2)")
    parser.add_argument("--scene", choices=sorted(SCENES), default="street")
    parser.add_argument("--scale", type=float, default=1.0, help="points per scene, relative to the demo's")
    parser.add_argument("--width", type=int, default=32, help="channels of the stem (32: MinkUNet14's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="rank 0 writes the results to this file")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    return args


def scene_batches(args: argparse.Namespace, rank: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """This rank's (coords (N, 4) int32, feats (N, 5) float32, labels (N,) int64) batches on ``device``."""
    voxel_size, scale = SCENES[args.scene]
    batches = []
    for i in range(DISTINCT_BATCHES):
        seed = args.seed + (rank * DISTINCT_BATCHES + i) * args.batch_size  # no scene on two ranks
        coords, feats, labels = make_scene(args.scene, voxel_size, args.batch_size, seed, scale * args.scale, True)
        # Height above the floor, the one absolute position that carries meaning (as in the demo).
        height = (coords[:, 3:4].float() + feats[:, 2:3]) * (voxel_size / 4.0)
        batches.append((coords.to(device), torch.cat([feats, height], 1).to(device), labels.to(device)))
    return batches


class Segmenter(nn.Module):
    """MinkUNet14 on a batch given as tensors: (coords (N, 4), feats (N, C)) -> logits (N, classes).

    DDP sees tensors in and out; the SparseTensor is built inside, new every step."""

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.net = MinkUNet14(in_channels, num_classes, width=width / 32, stem_kernel_size=3)

    def forward(self, coords: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.net(SparseTensor(coords, feats)).feats


def choice_table(tables: list[list[list[str]]]) -> tuple[list[str], int]:
    """Rows of (namespace, key, each rank's candidate) and how many keys two ranks disagree on."""
    found: dict[tuple[str, str], dict[int, str]] = {}
    for rank, table in enumerate(tables):
        for namespace, key, candidate in table:
            found.setdefault((namespace, key), {})[rank] = candidate
    width = max((len(c) for row in found.values() for c in row.values()), default=4) + 2
    lines = [f"{'namespace':<20} {'key':<60} " + "".join(f"{'rank ' + str(r):<{width}}" for r in range(len(tables)))]
    disagreements = 0
    for (namespace, key), by_rank in sorted(found.items()):
        differs = len(set(by_rank.values())) > 1
        disagreements += differs
        cells = "".join(f"{by_rank.get(r, '-'):<{width}}" for r in range(len(tables)))
        lines.append(f"{namespace:<20} {key:<60} {cells}{'  DIFFERENT' if differs else ''}")
    return lines, disagreements


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    distributed = "WORLD_SIZE" in os.environ
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)

    classes = CLASS_NAMES[args.scene]
    batches = scene_batches(args, rank, device)
    model: nn.Module = Segmenter(batches[0][1].shape[1], len(classes), args.width).to(device)
    if distributed and device.type == "cuda":
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, desc=f"training on {world} {device.type} process(es)", unit="step")
    step_seconds, compile_wait, loss = [], 0.0, None
    for step in range(args.steps):
        if step == args.warmup_steps:
            # samples/s is the steady state: kernels still compiling in the background (the
            # reference runs meanwhile) are waited for here, on every rank, and the wait reported.
            waited = time.perf_counter()
            tune.wait_for_compiles()
            compile_wait = time.perf_counter() - waited
        coords, feats, labels = batches[step % len(batches)]
        start = time.perf_counter()
        loss = loss_fn(model(coords, feats), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        loss_value = loss.item()  # waits for the device, so the step time is honest
        step_seconds.append(time.perf_counter() - start)
        if progress is not None:
            progress.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
            progress.update()
    if progress is not None:
        progress.close()

    mine = {"choices": [list(c) for c in tune.get_tuner().choices()], "step_seconds": step_seconds,
            "compile_wait": compile_wait}
    tune.reset()  # flush this rank's tunings into the shared cache file
    results = [None] * world
    if distributed:
        dist.all_gather_object(results, mine)  # also waits until every rank has flushed
    else:
        results = [mine]
    status = 0
    if rank == 0:
        timed = step_seconds[args.warmup_steps:]
        samples_per_s = world * args.batch_size * len(timed) / sum(timed)
        lines, disagreements = choice_table([r["choices"] for r in results])
        entries = tune.get_tuner().cache.items()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"{world} rank(s) on {device.type} ({name}), "
              f"{args.scene} x {args.batch_size} per rank, scale {args.scale}, width {args.width}, "
              f"effort {os.environ.get('SPARSECONV_AUTOTUNE_EFFORT', 'quick')}")
        print(f"samples/s {samples_per_s:.2f} (steps {args.warmup_steps + 1}-{args.steps}, "
              f"median step {sorted(timed)[len(timed) // 2]:.3f} s)")
        print("first step s: " + ", ".join(f"rank {r} {res['step_seconds'][0]:.2f}" for r, res in enumerate(results)))
        print("waited for background compiles after the warm-up steps, s: "
              + ", ".join(f"rank {r} {res['compile_wait']:.2f}" for r, res in enumerate(results)))
        print("\n".join(lines))
        verdict = f"ranks disagree on {disagreements} key(s)" if disagreements else "ranks agree on every key"
        print(f"{verdict}; cache {tune.get_tuner().cache.path}: {len(entries)} entries")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "device": str(device), "args": vars(args),
                           "samples_per_s": samples_per_s, "ranks": results,
                           "disagreements": disagreements, "cache_entries": len(entries)}, f, indent=1)
        status = 1 if disagreements else 0
    if distributed:
        # Tear the group down together and with no DDP reducer (and its gloo work) left alive, as
        # torch's docs advise: a rank aborted at exit after destroying it alone in 2 of 7 CI runs,
        # and again (1 of 4) while the last loss was alive: its graph's gradient hooks hold the reducer.
        del model, optimiser, loss
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
