"""Host time against GPU time of one forward product per pinned backend, on one benchmark layer.

`bench_layers.py` times a call with CUDA events around it on an idle GPU, so the host work
before the first launch is in its numbers; in a network the host runs ahead and that work hides
behind the previous layer's kernels. This prints both, per backend (pinned: its first parameter
set, not the tuned one), and for the whole tuned ``sparse_conv3d`` call, on one layer of a
benchmark scene (a submanifold 3^3 conv, the k2 s2 downsampling or its transposed conv):

- host: the call's own Python/launch time (perf_counter, the GPU kept busy so nothing waits);
- events, idle GPU: as bench_layers.py measures it;
- events, host hidden: the GPU time of the call alone (a queued sleep covers the host part).

    python scripts/call_overhead.py --scene street4 --channels 256 --dtype bfloat16
    python scripts/call_overhead.py --scene street1 --layer up2 --backends implicit_gemm mask_implicit_gemm
    python scripts/call_overhead.py --backends cutlass_sm90 --profile 200   # where the host time goes
    python scripts/call_overhead.py --scene street1 --layer up2 --channels 32 --backward --profile 20
    python scripts/call_overhead.py --scene street1 --backends cutlass_sm90 cutlass_grouped cutlass_splitk_wgrad --launch-ab

``--backward`` times the tuned layer's backward instead: each backward product alone, the
backward alone on a retained graph, forward+backward as bench_layers.py runs it, a dense
torch layer of the same rows (the autograd engine's own cost) and the peers' forward+backward;
with ``--profile`` it prints where one forward+backward spends its host time (torch.profiler
over every thread, and cProfile inside our backward, which runs on autograd's device thread).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import os
import pstats
import statistics
import time

import torch

from anchors import import_anchor
from bench_layers import LAYERS, SCENES, anchor_layer, scene_coords

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops import sparse_conv3d
from sparseconv.ops.conv import AlgoPins, SparseConvFunction, _problem
from sparseconv.ops.dispatch import dispatch

SLEEP_CYCLES = 20_000_000  # ~10 ms of queued GPU work on an H100/H200


def events_ms(fn, hide_host: bool) -> float:
    if hide_host:
        torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host_ms(fn) -> float:
    torch.cuda._sleep(SLEEP_CYCLES)
    begin = time.perf_counter()
    fn()
    elapsed = 1e3 * (time.perf_counter() - begin)
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scene", default="street4", choices=list(SCENES))
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--layer", default="subm3", choices=list(LAYERS))
    parser.add_argument("--backends", nargs="+", default=["cutlass_sm90", "mask_implicit_gemm", "cutlass_grouped"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--anchors", nargs="*", default=["spconv", "spconv_triton"],
                        help="peer libraries whose forward call is timed the same way (none: skip)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also profile CALLS host calls per backend (cProfile, GPU kept busy) and print the top functions")
    parser.add_argument("--launch", action="store_true",
                        help="time one Triton launch of the mask kernel: through triton.jit's launcher, through the "
                             "compiled kernel it returns, beside a torch op and the whole pinned product")
    parser.add_argument("--launch-ab", action="store_true",
                        help="host time a call of each CUTLASS product of --backends, its kernels launched through the "
                             "driver (cuda_launch, the library's path) and through CuPy's RawKernel call, alternately")
    parser.add_argument("--backward", action="store_true",
                        help="time the tuned layer's backward products, backward and forward+backward instead")
    args = parser.parse_args()
    coords = scene_coords(args.scene)
    c, dtype, device = args.channels, getattr(torch, args.dtype), torch.device("cuda")
    feats = torch.randn(len(coords), c, device=device, dtype=dtype)
    x = SparseTensor(coords.to(device), feats)
    kernel, stride, transposed = LAYERS[args.layer]
    if transposed:  # the transposed conv runs on the downsampled tensor, back to the scene's coordinates
        x = sparse_conv3d(x, torch.randn(8, c, c, device=device, dtype=dtype), kernel_size=2, stride=2)
        x = x.replace(torch.randn(len(x), c, device=device, dtype=dtype))
    shape, step = (kernel,) * 3, (stride,) * 3
    kernel_map, _ = x.cache.kernel_map(KernelMapKey(x.coord_id, shape, step, (1, 1, 1), transposed, False))
    weight = torch.randn(kernel**3, c, c, device=device, dtype=dtype) / (kernel**3 * c) ** 0.5
    problem = _problem(kernel_map, c, c, shape, step, (1, 1, 1), transposed, False, dtype, device)
    if args.backward:
        return backward_rows(args, x, weight, kernel_map, problem, coords.to(device), feats)
    if args.launch:
        return launch_rows(args, x, weight, kernel_map, problem)
    if args.launch_ab:
        return launch_ab_rows(args, x, weight, kernel_map, problem)
    print(f"{torch.cuda.get_device_name()}: {args.scene} {args.dtype} C={c} {args.layer} forward, "
          f"{kernel_map.num_in}->{kernel_map.num_out} rows, {kernel_map.num_pairs} pairs; median of {args.repeats} (ms)")
    print("backend | host | events, idle GPU | events, host hidden")
    record: dict[str, str] = {}
    sparse_conv3d(x, weight, kernel_size=kernel, stride=stride, transposed=transposed, record=record)  # tunes
    calls = {name: lambda name=name: dispatch("AB_gather_scatter", problem, name, x.feats, weight, kernel_map)
             for name in args.backends}
    calls["dispatch, tuned (no sparse_conv3d wrapper)"] = lambda: dispatch(
        "AB_gather_scatter", problem, None, x.feats, weight, kernel_map)
    calls[f"sparse_conv3d, tuned: {record.get('AB_gather_scatter')}"] = lambda: sparse_conv3d(
        x, weight, kernel_size=kernel, stride=stride, transposed=transposed)
    add_anchors(calls, args, coords.to(device), feats, backward=False)
    time_rows(calls, args.repeats, args.profile)


def add_anchors(calls: dict, args, coords, feats, backward: bool) -> None:
    """A row per peer library in ``args.anchors``: its forward, or its forward+backward."""
    for anchor in args.anchors:
        spc = import_anchor(anchor)
        if isinstance(spc, str):
            print(f"{anchor} | {spc}")
            continue
        try:
            conv, x, x_leaf = anchor_layer(spc, args.layer, coords, feats, args.channels, feats.dtype)
        except Exception as error:  # noqa: BLE001 - a peer missing here, or without this dtype
            print(f"{anchor} | n/a ({type(error).__name__}: {error})"[:300])
            continue
        if backward:
            calls[f"{anchor} forward+backward"] = lambda conv=conv, leaf=x_leaf: conv(leaf).features.sum().backward()
        else:
            calls[anchor] = lambda conv=conv, x=x: conv(x)


def time_rows(calls: dict, repeats: int, profile: int = 0) -> None:
    """One table row per call: host, idle-GPU events and host-hidden events (medians, ms)."""
    for name, call in calls.items():
        try:
            for _ in range(3):
                call()
        except Exception as error:  # noqa: BLE001 - a backend that cannot run here says why
            print(f"{name} | n/a ({error})"[:300])
            continue
        torch.cuda.synchronize()
        host = statistics.median(host_ms(call) for _ in range(repeats))
        idle = statistics.median(events_ms(call, False) for _ in range(repeats))
        busy = statistics.median(events_ms(call, True) for _ in range(repeats))
        print(f"{name} | {host:.3f} | {idle:.3f} | {busy:.3f}", flush=True)
        if profile:
            profile_host(call, profile)


def backward_rows(args, x: SparseTensor, weight, kernel_map, problem, coords, feats) -> None:
    """The backward's rows (see the module docstring), then optionally where its host time goes."""
    kernel, stride, transposed = LAYERS[args.layer]
    layer = {"kernel_size": kernel, "stride": stride, "transposed": transposed}
    leaf_feats = x.feats.clone().requires_grad_()
    leaf_weight = weight.clone().requires_grad_()
    record: dict[str, str] = {}
    sparse_conv3d(x.replace(leaf_feats), leaf_weight, record=record, **layer).feats.sum().backward()  # tunes all three
    print(f"{torch.cuda.get_device_name()}: {args.scene} {args.dtype} C={args.channels} {args.layer} backward, "
          f"{kernel_map.num_in}->{kernel_map.num_out} rows, {kernel_map.num_pairs} pairs; median of {args.repeats} (ms)")
    print("tuned: " + " / ".join(record.get(ns, "?") for ns in ("AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather")))
    print("call | host | events, idle GPU | events, host hidden")
    grad_out = torch.randn(kernel_map.num_out, weight.shape[2], device=weight.device, dtype=weight.dtype)
    retained = sparse_conv3d(x.replace(leaf_feats), leaf_weight, **layer).feats
    dense = torch.nn.Linear(weight.shape[1], weight.shape[2], bias=False, device=weight.device, dtype=weight.dtype)
    calls = {
        "forward: sparse_conv3d": lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, **layer),
        "dgrad product: dispatch": lambda: dispatch("ABt_gather_scatter", problem, None, grad_out, weight, kernel_map),
        "wgrad product: dispatch": lambda: dispatch("AtB_gather_gather", problem, None, x.feats, grad_out, kernel_map),
        "backward alone (retained graph, ready grad)": lambda: retained.backward(grad_out, retain_graph=True),
        "forward+backward (.sum().backward())": lambda: sparse_conv3d(
            x.replace(leaf_feats), leaf_weight, **layer).feats.sum().backward(),
        "forward+backward, ready grad (no .sum())": lambda: sparse_conv3d(
            x.replace(leaf_feats), leaf_weight, **layer).feats.backward(grad_out),
        "forward+backward, autograd.grad (no leaf accumulation)": lambda: torch.autograd.grad(
            sparse_conv3d(x.replace(leaf_feats), leaf_weight, **layer).feats, (leaf_feats, leaf_weight), grad_out),
        "forward+backward, SparseConvFunction.apply on raw tensors": lambda: SparseConvFunction.apply(
            leaf_feats, leaf_weight, kernel_map, problem, AlgoPins(), None).sum().backward(),
        "forward+backward, gc disabled": lambda: _without_gc(lambda: sparse_conv3d(
            x.replace(leaf_feats), leaf_weight, **layer).feats.sum().backward()),
        "forward+backward, autograd multithreading off": lambda: _single_threaded(lambda: sparse_conv3d(
            x.replace(leaf_feats), leaf_weight, **layer).feats.sum().backward()),
        "dense torch Linear on the output rows, forward+backward": lambda: dense(
            torch.empty(kernel_map.num_out, weight.shape[1], device=weight.device, dtype=weight.dtype).requires_grad_()
        ).sum().backward(),
        "a Python autograd.Function around torch.mm, forward+backward": lambda: _MatMul.apply(
            torch.empty(kernel_map.num_out, weight.shape[1], device=weight.device, dtype=weight.dtype).requires_grad_(),
            leaf_weight[0]).sum().backward(),
    }
    add_anchors(calls, args, coords, feats, backward=True)
    time_rows(calls, args.repeats)
    if args.profile:
        profile_backward(lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, **layer).feats.sum().backward(),
                         args.profile)


def _without_gc(call) -> None:
    gc.disable()
    try:
        call()
    finally:
        gc.enable()


def _single_threaded(call) -> None:
    """Backward on the calling thread instead of autograd's device thread."""
    with torch.autograd.set_multithreading_enabled(False):
        call()


class _MatMul(torch.autograd.Function):
    """The smallest Python autograd node with two products in backward: the engine's own cost."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


def launch_rows(args, x: SparseTensor, weight, kernel_map, problem) -> None:
    """Host cost of one rows_gemm launch (mask_implicit_gemm's first tile, forward) by launch path."""
    from sparseconv.ops.backends import mask_triton
    from sparseconv.ops.backends import triton_kernels as tk

    params = mask_triton.SPACE[0]
    kernels = tk.kernels()
    bm, bn, bk = params["block_m"], params["block_n"], params["block_k"]
    a, w = x.feats.contiguous(), weight.contiguous()
    c_in, c_out = w.shape[1], w.shape[2]
    table = mask_triton.product_table(kernel_map, True)
    rows = mask_triton.sorted_rows(kernel_map, True, True)
    offsets, counts = mask_triton.active_lists(kernel_map, True, True, bm)
    slots, starts = mask_triton.tile_slots(kernel_map, True, True, bm)
    out = torch.empty(table.shape[0], c_out, device=a.device, dtype=a.dtype)
    grid = (counts.numel() * kernels.triton.cdiv(c_out, bn),)
    grid3 = (*grid, 1, 1)  # the compiled kernel's launcher takes all three dimensions
    runtime = (a, w, slots, starts, rows, offsets, counts, out, table.shape[0], c_in, c_out, offsets.shape[1],
               c_in * c_out, c_out, 1)
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRECISION": tk.precision(a.dtype), "ACCUMULATE": False}
    options = tk.launch_options(params)
    compiled = kernels.rows_gemm[grid](*runtime, **meta, **options)
    constexprs = list(meta.values())  # rows_gemm's last five parameters, in this order
    reference = out.clone()
    out.fill_(float("nan"))
    compiled[grid3](*runtime, *constexprs)
    print(f"compiled-kernel launch equals the jit launch: {bool(torch.equal(out, reference))}")
    print(f"{torch.cuda.get_device_name()}: {args.scene} {args.dtype} C={args.channels} {args.layer}, rows_gemm "
          f"{params}; median of {args.repeats} (ms)")
    print("call | host | events, idle GPU | events, host hidden")
    time_rows({
        "rows_gemm: triton.jit launcher, kernel[grid](...)": lambda: kernels.rows_gemm[grid](*runtime, **meta, **options),
        "rows_gemm: the CompiledKernel it returned, compiled[grid](...)": lambda: compiled[grid3](*runtime, *constexprs),
        "torch: out.add_(1)": lambda: out.add_(1),
        "the product: dispatch pinned to mask_implicit_gemm": lambda: dispatch(
            "AB_gather_scatter", problem, "mask_implicit_gemm", a, w, kernel_map),
    }, args.repeats, args.profile)


def cupy_launch_all(device: torch.device, launches: list) -> None:
    """cutlass_gemm._launch_all as it was before cuda_launch (a787e18): CuPy's RawKernel call,
    each argument converted to a NumPy scalar, inside CuPy's device and stream contexts."""
    import cupy
    import numpy as np

    from sparseconv.ops.backends import cuda_launch

    class Handle:
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, self.handle)

    handle = cuda_launch.current_stream(device.index)
    stream = _CUPY_STREAMS.get(handle)
    if stream is None:
        with cupy.cuda.Device(device.index):
            stream = _CUPY_STREAMS[handle] = (cupy.cuda.Stream.from_external(Handle(handle))
                                              if hasattr(cupy.cuda.Stream, "from_external")
                                              else cupy.cuda.ExternalStream(handle, device.index))
    with cupy.cuda.Device(device.index), stream:
        for kernel, grid, args in launches:
            kernel.function(grid, (kernel.threads,), tuple(
                np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a if isinstance(a, np.generic) else np.int32(a)
                for a in args), shared_mem=kernel.shared_bytes)


_CUPY_STREAMS: dict[int, object] = {}


def launch_ab_rows(args, x: SparseTensor, weight, kernel_map, problem) -> None:
    """Host µs a call (median of 15 rounds of 50 back-to-back calls behind a queued GPU sleep) of
    each CUTLASS product, launched both ways, twice each, alternating."""
    from sparseconv.ops.backends import cutlass_gemm, get

    grad_out = torch.randn(kernel_map.num_out, weight.shape[2], device=weight.device, dtype=weight.dtype)
    operands = {"AB_gather_scatter": (x.feats, weight), "ABt_gather_scatter": (grad_out, weight),
                "AtB_gather_gather": (x.feats, grad_out)}
    paths = {"CuPy RawKernel call": cupy_launch_all, "driver (cuda_launch)": cutlass_gemm._launch_all}
    print(f"{torch.cuda.get_device_name()}: {args.scene} {args.dtype} C={args.channels} {args.layer}; host us a call")
    print("product | launch path | host us (first) | host us (second)")
    try:
        for name in (n for n in args.backends if n.startswith("cutlass")):
            backend = get(name)
            for namespace in sorted(backend.ops):
                a, b = operands[namespace]
                call = functools.partial(backend.run, namespace, problem, {}, a, b, kernel_map)
                times: dict[str, list[float]] = {path: [] for path in paths}
                for _ in range(2):
                    for path, launch_all in paths.items():
                        cutlass_gemm._launch_all = launch_all
                        call()
                        torch.cuda.synchronize()
                        times[path].append(_batched_host_us(call))
                for path, (first, second) in times.items():
                    print(f"{name} {namespace} | {path} | {first:.1f} | {second:.1f}", flush=True)
    finally:
        cutlass_gemm._launch_all = paths["driver (cuda_launch)"]


def _batched_host_us(call, calls: int = 50, rounds: int = 15) -> float:
    per_call = []
    for _ in range(rounds):
        torch.cuda._sleep(5 * SLEEP_CYCLES)
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append(1e6 * (time.perf_counter() - begin) / calls)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def profile_backward(call, calls: int) -> None:
    """torch.profiler over ``calls`` forward+backward calls (all threads, by own CPU time), then
    cProfile inside SparseConvFunction.backward, which autograd runs on its device thread."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if os.environ.get("OUT"):  # the device machine's result folder: a timeline to read back
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], "backward_trace.json"))
    profiler = cProfile.Profile()
    original = SparseConvFunction.backward

    def profiled(ctx, grad_out):
        profiler.enable()
        try:
            return original(ctx, grad_out)
        finally:
            profiler.disable()

    SparseConvFunction.backward = staticmethod(profiled)
    try:
        torch.cuda._sleep(SLEEP_CYCLES * 4)
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    finally:
        SparseConvFunction.backward = staticmethod(original)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def profile_host(call, calls: int) -> None:
    """cProfile ``calls`` calls while queued GPU work keeps launches from waiting; top 25 by own time."""
    torch.cuda._sleep(SLEEP_CYCLES * 4)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
