"""Host time per conv call spent outside the kernels: autograd function, dispatch, tuner, backend.

A small submanifold 3^3 layer (default 2,000 voxels, C = 8 -> 8) on the CPU keeps compute small,
so what is left is the per-call Python/dispatch cost that makes small layers CPU-bound on a GPU.
Rows, measured in one run:

- ``noop pinned``: every product pinned to a backend registered by this script that only
  allocates its output, so the row is the library's own overhead (no gather, no GEMM);
- ``noop auto``: no pins, SPARSECONV_AUTOTUNE_EFFORT=none, and the noop backend has the highest
  heuristic score, so the tuner's pool path picks it: the overhead of an untimed auto choice;
- ``explicit_gemm``: every product pinned to the reference backend;
- ``auto``: no pins, after a first call has tuned (later calls only look the choice up);
- ``torch floor``: a bare ``torch.autograd.Function`` that only allocates its outputs, called
  the same way: what any custom op pays in torch itself, for comparison.

Columns: median µs per forward and per forward+backward, then per call of one product the
median µs inside the tuner's choice (``Tuner.run`` minus backend execution), inside backend
execution, and in the rest of the conv (argument checks, kernel-map lookup, autograd).

    python scripts/bench_dispatch.py
    python scripts/bench_dispatch.py --voxels 2000 --channels 8 --calls 2000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

import sparseconv.tune
from sparseconv import SparseTensor
from sparseconv.ops import sparse_conv3d
from sparseconv.ops.backends import Backend, register, unregister
from sparseconv.ops.problem import NAMESPACES

NOOP = "bench_noop"


def noop_run(namespace, problem, params, a, b, kernel_map):
    """An output of the product's shape, uninitialised: the cheapest backend that autograd accepts."""
    if namespace == "AB_gather_scatter":
        return a.new_empty((kernel_map.num_out, b.shape[2]))
    if namespace == "ABt_gather_scatter":
        return a.new_empty((kernel_map.num_in, b.shape[1]))
    return a.new_empty((kernel_map.kernel_volume, a.shape[1], b.shape[1]))


class BareFunction(torch.autograd.Function):
    """The torch floor: saves its inputs and allocates outputs, like the noop backend, nothing else."""

    @staticmethod
    def forward(ctx, feats, weight, num_out):
        ctx.save_for_backward(feats, weight)
        return feats.new_empty((num_out, weight.shape[2]))

    @staticmethod
    def backward(ctx, grad_out):
        feats, weight = ctx.saved_tensors
        return feats.new_empty(feats.shape), weight.new_empty(weight.shape), None


def floor(x: SparseTensor, weight: torch.Tensor, calls: int) -> dict[str, float]:
    feats = x.feats.clone().requires_grad_()

    def forward_backward():
        BareFunction.apply(feats, weight, len(x)).sum().backward()

    return {"fwd": median_us(lambda: BareFunction.apply(feats, weight, len(x)), calls),
            "fwd+bwd": median_us(forward_backward, calls)}


def random_input(voxels: int, channels: int, device: torch.device) -> SparseTensor:
    """About ``voxels`` unique voxels in a cube dense enough for ~1/3 of the 27 neighbours to exist."""
    side = max(4, round((3 * voxels) ** (1 / 3)))
    generator = torch.Generator().manual_seed(0)
    xyz = torch.randperm(side**3, generator=generator)[:voxels]
    coords = torch.stack([torch.zeros_like(xyz), xyz // side**2, xyz // side % side, xyz % side], 1)
    return SparseTensor(coords.to(device), torch.randn(voxels, channels, generator=generator).to(device))


class PhaseClock:
    """Accumulates perf_counter time inside ``Tuner.run`` and inside backend execution."""

    def __init__(self) -> None:
        self.tuner = self.backend = 0.0
        self.products = 0

    @contextmanager
    def installed(self):
        import sparseconv.tune.tuner as tuner_module

        run, execute = tuner_module.Tuner.run, tuner_module._execute

        def timed_run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.tuner += time.perf_counter() - begin
                self.products += 1

        def timed_execute(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.backend += time.perf_counter() - begin

        tuner_module.Tuner.run, tuner_module._execute = timed_run, timed_execute
        try:
            yield self
        finally:
            tuner_module.Tuner.run, tuner_module._execute = run, execute


def median_us(fn: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return 1e6 * statistics.median(samples)


def measure(x: SparseTensor, weight: torch.Tensor, pins: dict, calls: int) -> dict[str, float]:
    feats = x.feats.clone().requires_grad_()
    x = x.replace(feats)

    def forward():
        return sparse_conv3d(x, weight, **pins)

    def forward_backward():
        sparse_conv3d(x, weight, **pins).feats.sum().backward()

    for _ in range(20):  # tunes (auto), builds the map and its derived views, warms the allocator
        forward_backward()
    row = {"fwd": median_us(forward, calls), "fwd+bwd": median_us(forward_backward, calls)}
    clock = PhaseClock()
    with clock.installed():
        begin = time.perf_counter()
        for _ in range(calls):
            forward_backward()
        total = time.perf_counter() - begin
    per_product = 1e6 / clock.products
    row["choose"] = (clock.tuner - clock.backend) * per_product
    row["backend"] = clock.backend * per_product
    row["rest"] = (total - clock.tuner) * per_product
    return row


def profile(x: SparseTensor, weight: torch.Tensor, pins: dict, calls: int, lines: int) -> None:
    feats = x.feats.clone().requires_grad_()
    x = x.replace(feats)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        sparse_conv3d(x, weight, **pins).feats.sum().backward()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voxels", type=int, default=2000)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="cProfile the noop row (top functions by own time)")
    args = parser.parse_args()
    os.environ.setdefault("SPARSECONV_CACHE_DIR", tempfile.mkdtemp(prefix="sparseconv-bench-"))
    device = torch.device(args.device)
    x = random_input(args.voxels, args.channels, device)
    weight = torch.randn(27, args.channels, args.channels, device=device, requires_grad=True)

    rows = {}
    register(Backend(NOOP, frozenset(NAMESPACES), noop_run, heuristic=lambda problem: 100.0))
    try:
        noop = {f"{p}_algo": NOOP for p in ("fwd", "dgrad", "wgrad")}
        rows["noop pinned"] = measure(x, weight, noop, args.calls)
        if args.profile:
            profile(x, weight, noop, args.calls, 30)
        os.environ["SPARSECONV_AUTOTUNE_EFFORT"] = "none"
        rows["noop auto"] = measure(x, weight, {}, args.calls)
    finally:
        os.environ.pop("SPARSECONV_AUTOTUNE_EFFORT")
        unregister(NOOP)
        sparseconv.tune.reset()  # forget the choices of the noop backend
    rows["explicit_gemm"] = measure(x, weight,
                                    {f"{p}_algo": "explicit_gemm" for p in ("fwd", "dgrad", "wgrad")}, args.calls)
    record: dict[str, str] = {}
    rows["auto"] = measure(x, weight, {}, args.calls)
    sparse_conv3d(x.replace(x.feats.clone().requires_grad_()), weight, record=record).feats.sum().backward()
    rows["torch floor"] = floor(x, weight, args.calls)

    print(f"{device}, {torch.get_num_threads()} threads, {args.voxels} voxels, C={args.channels}, "
          f"submanifold 3^3, {args.calls} calls; auto chose {record}")
    print(f"{'pins':<14} {'fwd µs':>8} {'fwd+bwd µs':>11} | per product: {'choose µs':>9} {'backend µs':>10} {'rest µs':>8}")
    for name, row in rows.items():
        phases = "".join(f" {row[p]:>{w}.1f}" if p in row else f" {'-':>{w}}"
                         for p, w in (("choose", 9), ("backend", 10), ("rest", 8)))
        print(f"{name:<14} {row['fwd']:>8.1f} {row['fwd+bwd']:>11.1f} |             {phases}")


if __name__ == "__main__":
    main()
