"""What a new batch costs: a MinkUNet training step's forward and backward, new coordinates against the same
tensor again, host and wall time apart; and one layer's first call on a new map against its next call.

The network is bench_network.py's (TorchSparse++ MinkUNet shape, fp16), ours beside spconv when importable
(spconv's "same" reuses its index pairs, as its users' ``indice_dict`` does). Host time is until the call
returns, wall time until the device is idle after it; medians over alternating new / same passes.

    python scripts/bench_new_batch.py                          # street1 room2 street4, spconv if installed
    python scripts/bench_new_batch.py --scenes room2 --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import sparseconv
from sparseconv.cli.bench import Runner, scene_coords, subm_maps, sync
from sparseconv.nn import SparseConv3d
# Internal on purpose: the first-call trial builds the subm3 map before the layer's first call, through
# SparseTensor.cache.kernel_map, which takes a KernelMapKey.
from sparseconv.coords import KernelMapKey
from sparseconv.ops.batch import kernel_map as map_request


def split_step(runner: Runner, device: torch.device, repeats: int) -> dict[bool, list[float]]:
    """Per new / same: medians (ms) of forward host, forward wall, backward host, backward wall."""
    for _ in range(3):
        runner.step()
        runner.step(True)
    if runner.name == "ours":
        sparseconv.tune.wait_for_compiles()
    samples: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    for i in range(2 * repeats):
        same = bool(i % 2)
        runner.optimizer.zero_grad(set_to_none=True)
        x = runner.make_input(same)
        sync(device)
        t0 = time.perf_counter()
        out = runner.net(x)
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        if same and runner.name != "ours":
            runner._same.indice_dict = subm_maps(out)
        loss = nn.functional.cross_entropy(runner.logits(out).float(), runner.labels)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        sync(device)
        t5 = time.perf_counter()
        runner.optimizer.step()
        samples[same].append((t1 - t0, t2 - t0, t4 - t3, t5 - t3))
    return {same: [1e3 * statistics.median(column) for column in zip(*rows)] for same, rows in samples.items()}


def first_calls(coords: torch.Tensor, device: torch.device, channels: int, repeats: int) -> list[float]:
    """Medians (µs): a subm3 layer's first call on a new map (map and planned views built) and its next call,
    inference; then the same in training, forward and backward."""
    feats = torch.randn(len(coords), channels, device=device, dtype=torch.float16)
    conv = SparseConv3d(channels, channels, 3).to(device, torch.float16)

    def trial(train: bool) -> tuple[float, ...]:
        x = sparseconv.SparseTensor(coords, feats.detach().requires_grad_(train))
        map_request(x.cache, KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))
        sync(device)
        t0 = time.perf_counter()
        first = conv(x)
        t1 = time.perf_counter()
        second = conv(x)
        t2 = time.perf_counter()
        if not train:
            sync(device)
            return t1 - t0, t2 - t1
        sync(device)
        grad = torch.ones_like(first.feats)
        t3 = time.perf_counter()
        first.feats.backward(grad)
        t4 = time.perf_counter()
        second.feats.backward(grad)
        t5 = time.perf_counter()
        sync(device)
        return t1 - t0, t2 - t1, t4 - t3, t5 - t4

    medians = []
    for train in (False, True):
        with torch.enable_grad() if train else torch.no_grad():
            for _ in range(10):
                trial(train)
            sparseconv.tune.wait_for_compiles()
            rows = [trial(train) for _ in range(repeats)]
        medians += [1e6 * statistics.median(column) for column in zip(*rows)]
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=["street1", "room2", "street4"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--channels", type=int, default=32, help="the first-call layer's channels")
    parser.add_argument("--device", default="cuda", help="a CUDA device (the split times GPU passes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error("--device: a CUDA device is needed (host and wall time of GPU passes)")
    libraries = ["ours", "spconv"]
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; medians of {args.repeats}")
    print("| scene | library | forward host new / same ms | forward wall new / same | backward host new / same "
          "| backward wall new / same |")
    print("|---|---|---|---|---|---|")
    for scene in args.scenes:
        coords = scene_coords(scene).to(device)
        for library in libraries:
            try:
                runner = Runner(library, coords, torch.float16, device)
            except Exception as error:  # noqa: BLE001 - a peer not installed: its row says so
                print(f"| {scene} | {library} | n/a ({type(error).__name__}) | | | |")
                continue
            split = split_step(runner, device, args.repeats)
            cells = [f"{split[False][i]:.2f} / {split[True][i]:.2f}" for i in range(4)]
            print(f"| {scene} | {library} | " + " | ".join(cells) + " |")
            del runner
    coords = scene_coords(args.scenes[0]).to(device)
    first = first_calls(coords, device, args.channels, 2 * args.repeats)
    print(f"\nours, one {args.channels}-channel subm3 layer on {args.scenes[0]} (map and planned views built), µs of "
          "host time: first call on a new map / next call")
    print(f"  inference {first[0]:.1f} / {first[1]:.1f}; training forward {first[2]:.1f} / {first[3]:.1f}, "
          f"backward {first[4]:.1f} / {first[5]:.1f}")


if __name__ == "__main__":
    main()
