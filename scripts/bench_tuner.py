"""A network tuned by the autotuner vs the same network with default pins, side by side.

Columns, one run: ours tuned (auto), ours with every product pinned to explicit_gemm (the
default before tuning existed), spconv and spconv-triton (n/a here: the network is ours), and
naive torch (every product pinned to an im2col gather + one matmul, registered by this script).
Times: median forward+backward step in ms with kernel maps cached; the tuned column's first
step (which runs the sweeps) is reported separately.

    python scripts/bench_tuner.py --device cpu --scene street

With --prior CACHE_FILE it instead scores the tuner's cost model on that cache file: keys are
dealt into folds, each fold's winners are predicted by a model fitted on the other folds, and a
table per namespace and device gives how often the measured winner is the model's first pick
(top-1) or among its first three (top-3, what effort quick times), and the mean slowdown of
running the model's first pick, the best of its first three, and one fixed candidate (the one
fastest on average over the training keys) instead of the measured winner.

    python scripts/bench_tuner.py --prior ~/.cache/sparseconv/autotune.msgpack

With --converge STEPS it instead trains the demo's network (MinkUNet14 on the demo's 8 batches, as
``python -m sparseconv demo`` does) for STEPS steps under the default effort quick (its timing budget: a tenth of
the wall time), then tunes the same process under effort full (every key timed whole), and times steps of the two,
and of naive torch (every product pinned to the im2col matmul), interleaved in one process (each effort keeps its own
choices): how close the tuning a user gets for free comes to tuning ahead, after STEPS steps. No timing under quick
after its STEPS steps (its budget is frozen: what it settled runs, the rest its picks untimed).

    python scripts/bench_tuner.py --device cpu --converge 400 --rounds 48
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

import torch
from torch import nn

from sparseconv import SparseTensor
from sparseconv.data import make_scene
from sparseconv.nn import BatchNorm, ReLU, Sequential, SparseConv3d, SparseConvTranspose3d
from sparseconv.ops import NAMESPACES
from sparseconv.tune import TuneCache
# Internal on purpose: --prior scores the tuner's cost model (tune.prior, tune.accuracy) itself, and the naive torch column
# is a backend this script registers in the registry (Backend, register), pinned like any algorithm.
from sparseconv.backends import Backend, register
from sparseconv.tune import accuracy, prior


def naive_run(namespace, problem, params, a, b, kernel_map):
    """im2col: all K neighbours gathered into one (N, K*C) matrix, one matmul; -1 hits a zero row."""
    nbr = kernel_map.neighbors.long()
    absent = nbr < 0
    if namespace == "AB_gather_scatter":
        cols = torch.cat([a, a.new_zeros(1, a.shape[1])])[nbr.masked_fill(absent, a.shape[0])]
        return cols.reshape(len(nbr), -1) @ b.reshape(-1, b.shape[2])
    if namespace == "ABt_gather_scatter":
        cols = (a @ b.reshape(-1, b.shape[2]).t()).reshape(len(nbr), nbr.shape[1], -1)
        out = a.new_zeros(kernel_map.num_in + 1, b.shape[1])
        return out.index_add_(0, nbr.masked_fill(absent, kernel_map.num_in).flatten(), cols.reshape(-1, b.shape[1]))[:-1]
    cols = torch.cat([a, a.new_zeros(1, a.shape[1])])[nbr.masked_fill(absent, a.shape[0])]
    return (cols.reshape(len(nbr), -1).t() @ b).reshape(kernel_map.kernel_volume, a.shape[1], b.shape[1])


def block(c_in, c_out, k=3, s=1, up=False, **pins):
    conv = SparseConvTranspose3d if up else SparseConv3d
    return Sequential(conv(c_in, c_out, k, s, bias=False, **pins), BatchNorm(c_out), ReLU(inplace=True))


def network(width: int, pins: dict) -> nn.Module:
    w = width
    return Sequential(
        block(4, w, **pins), block(w, w, **pins),
        block(w, 2 * w, 2, 2, **pins), block(2 * w, 2 * w, **pins),
        block(2 * w, 4 * w, 2, 2, **pins), block(4 * w, 4 * w, **pins),
        block(4 * w, 2 * w, 2, 2, up=True, **pins), block(2 * w, w, 2, 2, up=True, **pins),
        SparseConv3d(w, 8, 1, **pins),
    )


def step_ms(model: nn.Module, x: SparseTensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    model(x).feats.square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - begin)


def prior_table(path: str, folds: int, seed: int) -> str:
    """The cost model's held-out accuracy on the cache file ``path``, as a table."""
    if not os.path.isfile(path):
        raise SystemExit(f"--prior: {path!r} is not a file")
    entries = TuneCache(path).items()
    rows = accuracy.holdout_accuracy(entries, folds=folds, seed=seed)
    header = ["namespace", "device", "keys", "scored", "top-1", f"top-{prior.QUICK_TOP}", "slowdown top-1",
              f"best of top-{prior.QUICK_TOP}", "worst", "fixed pick"]
    table = [[r.namespace, r.device, str(r.keys), str(r.scored), f"{r.top1:.0%}", f"{r.top3:.0%}",
              f"{r.slowdown_top1:.3f}x", f"{r.slowdown_best_of_top3:.3f}x", f"{r.worst_best_of_top3:.2f}x",
              f"{r.slowdown_static:.3f}x"] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in table)) if table else len(h) for i, h in enumerate(header)]
    lines = [f"cost model on {path}: {len(entries)} entries, {folds}-fold cross-validation (seed {seed}); "
             "slowdowns are mean cost / measured winner's cost"]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in [header, *table]]
    return "\n".join(lines) if table else lines[0] + "\nno key with two or more timed candidates"


ARMS = {"quick": {"SPARSECONV_AUTOTUNE_EFFORT": "quick"}, "full": {"SPARSECONV_AUTOTUNE_EFFORT": "full"},
        "naive": {f"SPARSECONV_{p}_ALGO_MODE": "naive_im2col" for p in ("FWD", "DGRAD", "WGRAD")}}
"""--converge's arms: the environment each step runs under (each effort and pin keeps its own choices)."""


def converge(device: torch.device, steps: int, rounds: int) -> None:
    """--converge: see the module docstring."""
    # The demo's data and network (internal on purpose: the same batches a user's first run trains on).
    from sparseconv import tune
    from sparseconv.cli.demo import DEFAULT_WIDTH, SCENES, TRAIN_BATCHES, _scene_batch, train_step
    from sparseconv.data import CLASS_NAMES
    from sparseconv.models import MinkUNet14
    from sparseconv.tune.budget import TimingBudget

    torch.manual_seed(0)
    spec = SCENES["street"]
    batches = [_scene_batch("street", spec, 2, 2 * i, 1.0, device) for i in range(TRAIN_BATCHES)]
    model = MinkUNet14(batches[0][0].num_channels, len(CLASS_NAMES["street"]), width=DEFAULT_WIDTH / 32,
                       stem_kernel_size=3).to(device)
    optimiser, loss_fn = torch.optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss()

    def step(i: int, arm: str) -> float:
        x, labels = batches[i % len(batches)]
        with mock.patch.dict(os.environ, ARMS[arm]):  # restores what the environment held before
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            train_step(model, loss_fn, optimiser, x, labels).item()
            return time.perf_counter() - start

    start = time.perf_counter()
    for i in range(steps):
        step(i, "quick")
    quick_s, quick = time.perf_counter() - start, tune.progress()
    tune.get_tuner().budget = TimingBudget(share=0.0, burst=0.0)  # quick stops timing: what it has runs from now
    start = time.perf_counter()
    for i in range(len(batches)):
        step(i, "full")
        step(i, "naive")
    tune.wait_for_compiles()
    full_s = time.perf_counter() - start
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            samples[arm].append(step(r, arm))
    ms = {arm: 1e3 * statistics.median(values) for arm, values in samples.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {where}; the demo's MinkUNet14 on its {len(batches)} street batches "
          f"({sum(len(x) for x, _ in batches) // len(batches)} voxels a batch on average); median of {rounds} training "
          f"steps each, interleaved (ms)")
    header = ["", f"ours quick after {steps} steps", "ours full", "spconv", "spconv-triton", "naive torch"]
    row = ["step", f"{ms['quick']:.1f}", f"{ms['full']:.1f}", "n/a", "n/a", f"{ms['naive']:.1f}"]
    widths = [max(len(h), len(c)) for h, c in zip(header, row)]
    for line in (header, row):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    ratios = [q / f for q, f in zip(samples["quick"], samples["full"])]
    print(f"quick / full: {statistics.median(ratios):.3f} (median of per-round ratios); quick's {steps} steps took "
          f"{quick_s:.1f} s, {quick.timed_s:.1f} s of it timing: {quick.settled} products settled ({quick.adopted} "
          f"adopted), {quick.untimed} running a pick untimed; full's tuning {full_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prior", metavar="CACHE_FILE", help="score the cost model on this tuning cache file instead")
    parser.add_argument("--folds", type=int, default=5, help="with --prior: cross-validation folds")
    parser.add_argument("--seed", type=int, default=0, help="with --prior: how keys are dealt into folds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scene", choices=("street", "room"), default="street")
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--converge", type=int, metavar="STEPS", help="quick after STEPS demo steps against full")
    parser.add_argument("--rounds", type=int, default=48, help="with --converge: interleaved steps of each")
    args = parser.parse_args()
    if args.prior:
        print(prior_table(args.prior, args.folds, args.seed))
        return
    device = torch.device(args.device)
    os.environ.setdefault("SPARSECONV_CACHE_DIR", tempfile.mkdtemp(prefix="sparseconv-bench-"))
    # Pin-only: an empty pool keeps the baseline out of the tuned column's candidates.
    register(Backend("naive_im2col", frozenset(NAMESPACES), naive_run, pool=lambda problem, level: []))
    if args.converge:
        converge(device, args.converge, args.rounds)
        return

    coords, feats = make_scene(args.scene, batch_size=1, scale=args.scale)
    x = SparseTensor(coords.to(device), feats.to(device))
    configs = {
        "ours tuned": {},
        "ours explicit_gemm": {f"{p}_algo": "explicit_gemm" for p in ("fwd", "dgrad", "wgrad")},
        "naive torch": {f"{p}_algo": "naive_im2col" for p in ("fwd", "dgrad", "wgrad")},
    }
    # Build and warm every configuration first (the tuned one tunes here), then time their steps
    # interleaved (A B C A B C ...) so a drift in machine load hits all columns alike.
    models, first = {}, {}
    for name, pins in configs.items():
        torch.manual_seed(0)
        models[name] = network(args.width, pins).to(device)
        first[name] = step_ms(models[name], x, device)
        step_ms(models[name], x, device)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.steps):
        for name, model in models.items():
            samples[name].append(step_ms(model, x, device))
    results = {name: statistics.median(values) for name, values in samples.items()}
    chosen = {}
    for module in (m for m in models["ours tuned"].modules() if isinstance(m, SparseConv3d)):
        for namespace, algo in module.algorithms.items():
            chosen[(namespace, algo)] = chosen.get((namespace, algo), 0) + 1

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {where}; scene {args.scene} scale {args.scale}: {len(x)} voxels; width {args.width}; "
          f"median of {args.steps} forward+backward steps, interleaved, kernel maps cached (ms)")
    header = ["", "ours tuned", "ours explicit_gemm", "spconv", "spconv-triton", "naive torch"]
    rows = [["step", f"{results['ours tuned']:.1f}", f"{results['ours explicit_gemm']:.1f}", "n/a", "n/a",
             f"{results['naive torch']:.1f}"],
            ["first step", f"{first['ours tuned']:.1f}", f"{first['ours explicit_gemm']:.1f}", "n/a", "n/a",
             f"{first['naive torch']:.1f}"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(f"speed-up of tuning over explicit_gemm pins: {results['ours explicit_gemm'] / results['ours tuned']:.2f}x")
    print("tuned choices (product, algorithm: layers):")
    for (namespace, algo), count in sorted(chosen.items()):
        print(f"  {namespace:<20} {algo:<40} {count}")


if __name__ == "__main__":
    main()
