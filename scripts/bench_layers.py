"""Layer benchmark on the GPU: ours (tuned) vs spconv vs spconv-triton vs naive torch, one run.

Workloads: synthetic LiDAR streets at 5 cm (batch 1 and 4) and rooms at 2 cm (batch 2);
submanifold 3^3 convs, a k=2 s=2 downsampling and its transposed conv, C in {32, 64, 128,
256}; fp16 and bf16. Times: CUDA events, warm-up, median of --repeats, kernel maps cached
(ours: the tensor's cache; the anchors: their indice_dict). Map builds are a separate row.
Also prints each cell's fraction of the measured bf16 matmul peak and of copy bandwidth, and
each backend family's own tuned best (Triton, CUTLASS: pinned per namespace) beside the
overall tuned choice, so the table shows which family wins a cell and by how much.

    python scripts/bench_layers.py                       # full grid (several minutes on an H200)
    python scripts/bench_layers.py --scenes street1 --channels 64 --layers subm3 --dtypes float16
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import tempfile
import time

import torch

import sparseconv.tune
from sparseconv import SparseTensor, sparse_conv3d
from sparseconv.cli import bench
from sparseconv.cli.bench import SCENES, anchor_tensor, import_anchor, scene_coords
from sparseconv.ops import NAMESPACES
# Internal on purpose: a cell also times each product alone (dispatch of one layer_problem), and the
# kernel-map rows build a tensor's map through SparseTensor.cache.kernel_map, which takes a KernelMapKey.
from sparseconv.backends.problem import layer_problem
from sparseconv.coords import KernelMapKey
from sparseconv.ops.dispatch import dispatch
from sparseconv.ops.batch import kernel_map as map_request

DEVICE = torch.device("cuda")
# Each family's own tuned best, pinned per namespace, beside the overall tuned choice.
FAMILIES = {
    "triton": {"fwd_algo": ["mask_implicit_gemm", "implicit_gemm"], "dgrad_algo": ["mask_implicit_gemm", "implicit_gemm"],
               "wgrad_algo": ["splitk_wgrad"]},
    "cutlass": {"fwd_algo": ["cutlass_sm90", "cutlass_grouped", "cutlass_implicit_gemm"],
                "dgrad_algo": ["cutlass_sm90", "cutlass_grouped", "cutlass_implicit_gemm"],
                "wgrad_algo": ["cutlass_splitk_wgrad"]},
}
LAYERS = {"subm3": (3, 1, False), "down2": (2, 2, False), "up2": (2, 2, True)}


CALLS_PER_SAMPLE = 1  # --calls


def median_ms(fn, repeats: int, warmup: int = 3, calls: int | None = None) -> float:
    """Median milliseconds of ``fn`` with the tuner's timer (CUDA events; perf_counter for --device cpu dry runs),
    a sample being the mean of ``calls`` (default CALLS_PER_SAMPLE) back-to-back calls."""
    return bench.median_ms(fn, DEVICE, repeats, warmup, calls or CALLS_PER_SAMPLE)


def ceilings() -> tuple[float, float, float]:
    """(bf16 matmul TFLOP/s timed as the cells are, the same with one call a sample, device copy GB/s
    counting read + write), measured now. The %peak column uses the first. How the matmul is timed
    moves it: on H200s, 10 calls a sample gave 679-688 TFLOP/s, one call a sample 631-677, and
    single calls behind a GPU-side sleep 781-800 (docs/performance.md)."""
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, 10)
    one_ms = median_ms(lambda: a @ b, 10, calls=1)
    src = torch.randn(1 << 28, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * 8192**3 / ms / 1e9, 2 * 8192**3 / one_ms / 1e9, 2 * src.numel() * 4 / copy_ms / 1e6


def naive_conv(feats: torch.Tensor, weight: torch.Tensor, kernel_map) -> torch.Tensor:
    """The plain torch recipe: per offset, gather rows, matmul, index_add into the output (autograd for backward)."""
    out = feats.new_zeros(kernel_map.num_out, weight.shape[2])
    for k, (in_idx, out_idx) in enumerate(kernel_map.per_offset):
        if in_idx.numel():
            out = out.index_add(0, out_idx, feats.index_select(0, in_idx) @ weight[k])
    return out


def anchor_layer(spc, layer: str, coords, feats, c: int, dtype):
    """(conv, input, input with leaf features) of a peer library for one benchmark layer."""
    leaf = feats.clone().requires_grad_()
    if layer == "subm3":
        conv = spc.SubMConv3d(c, c, 3, bias=False, indice_key="k").to(DEVICE).to(dtype)
        return conv, anchor_tensor(spc, coords, feats), anchor_tensor(spc, coords, leaf)
    down = spc.SparseConv3d(c, c, 2, 2, bias=False, indice_key="d").to(DEVICE).to(dtype)
    if layer == "down2":
        return down, anchor_tensor(spc, coords, feats), anchor_tensor(spc, coords, leaf)
    conv = spc.SparseInverseConv3d(c, c, 2, indice_key="d", bias=False).to(DEVICE).to(dtype)
    with torch.no_grad():
        x = down(anchor_tensor(spc, coords, feats))
    return conv, x, x.replace_feature(x.features.clone().requires_grad_())


def time_anchor(spc, layer: str, coords, feats, c: int, dtype, repeats: int) -> tuple[float, float]:
    conv, x, x_leaf = anchor_layer(spc, layer, coords, feats, c, dtype)
    fwd = median_ms(lambda: conv(x), repeats)
    fwd_bwd = median_ms(lambda: conv(x_leaf).features.sum().backward(), repeats)
    return fwd, fwd_bwd


def run_cell(scene_tensor: SparseTensor, layer: str, c: int, dtype, repeats: int, anchors: dict,
             families: list[str]) -> dict:
    kernel, stride, transposed = LAYERS[layer]
    coords = scene_tensor.coords
    feats = torch.randn(len(coords), c, device=DEVICE, dtype=dtype)
    x = scene_tensor.replace(feats)
    if transposed:
        down_weight = torch.randn(8, c, c, device=DEVICE, dtype=dtype) / math.sqrt(8 * c)
        x = sparse_conv3d(x, down_weight, kernel_size=2, stride=2)
        x = x.replace(torch.randn(len(x), c, device=DEVICE, dtype=dtype))
    weight = torch.randn(kernel**3, c, c, device=DEVICE, dtype=dtype) / math.sqrt(kernel**3 * c)
    leaf_feats = x.feats.clone().requires_grad_()
    leaf_weight = weight.clone().requires_grad_()
    args = dict(kernel_size=kernel, stride=stride, transposed=transposed)
    record: dict[str, str] = {}
    settled(lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, record=record, **args).feats.sum().backward())
    kernel_map = map_request(x.cache, _map_key(x, kernel, stride, transposed))[0]
    result = {
        "N": f"{kernel_map.num_in}->{kernel_map.num_out}",
        "pairs": kernel_map.num_pairs,
        "ours": median_ms(lambda: sparse_conv3d(x, weight, **args), repeats),
        "ours+bwd": median_ms(lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, **args).feats.sum().backward(), repeats),
        "chosen": "/".join(record.get(ns, "?").split("[")[0] for ns in NAMESPACES),
        "detail": "ours: " + " / ".join(record.get(ns, "?") for ns in NAMESPACES),
    }
    # Each product alone, with the tuned choice (an equal problem finds the same memo): where a
    # forward+backward loses, this says whether dgrad, wgrad or the autograd glue is the cost.
    problem = layer_problem(kernel_map, (c, c, (kernel,) * 3, (stride,) * 3, (1, 1, 1), transposed, False, dtype, DEVICE))
    grad_out = torch.randn(kernel_map.num_out, c, device=DEVICE, dtype=dtype)
    operands = {NAMESPACES[0]: (x.feats, weight), NAMESPACES[1]: (grad_out, weight), NAMESPACES[2]: (x.feats, grad_out)}
    products = [median_ms(lambda ns=ns: dispatch(ns, problem, None, *operands[ns], kernel_map), repeats)
                for ns in NAMESPACES]
    result["detail"] += " products ms (fwd/dgrad/wgrad): " + " / ".join(f"{t:.3f}" for t in products)
    for family, pins in FAMILIES.items():
        if family not in families:
            result[family] = result[family + "+bwd"] = "-"
            continue
        try:
            family_record: dict[str, str] = {}
            settled(lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, record=family_record, **args, **pins
                                          ).feats.sum().backward())
            result["detail"] += f" {family}: " + " / ".join(family_record.get(ns, "?") for ns in NAMESPACES)
            result[family] = median_ms(lambda: sparse_conv3d(x, weight, **args, **pins), repeats)
            result[family + "+bwd"] = median_ms(
                lambda: sparse_conv3d(x.replace(leaf_feats), leaf_weight, **args, **pins).feats.sum().backward(), repeats)
        except Exception as error:  # noqa: BLE001 - e.g. no toolchain: the table says so
            result[family] = result[family + "+bwd"] = f"n/a ({type(error).__name__})"
    result["naive"] = median_ms(lambda: naive_conv(x.feats, weight, kernel_map), repeats)
    result["naive+bwd"] = median_ms(lambda: naive_conv(leaf_feats, leaf_weight, kernel_map).sum().backward(), repeats)
    for name, spc in anchors.items():
        if isinstance(spc, str):
            result[name] = result[name + "+bwd"] = spc
            continue
        try:
            result[name], result[name + "+bwd"] = time_anchor(spc, layer, coords, feats, c, dtype, repeats)
        except Exception as error:  # noqa: BLE001 - e.g. no bf16 kernels
            result[name] = result[name + "+bwd"] = f"n/a ({type(error).__name__})"
    return result


def settled(forward_backward) -> None:
    """Tune a cell's forward, dgrad and wgrad (the first call), wait for the chosen kernels that compile in
    the background (the reference runs meanwhile: timed then, a cell measured explicit_gemm), and call once
    more, so that the call's record and every timed call name the settled choices."""
    forward_backward()
    sparseconv.tune.wait_for_compiles()
    forward_backward()


def _map_key(x: SparseTensor, kernel: int, stride: int, transposed: bool) -> KernelMapKey:
    return KernelMapKey(x.coord_id, (kernel,) * 3, (stride,) * 3, (1, 1, 1), transposed, False)


def map_build_ms(coords: torch.Tensor, repeats: int) -> float:
    def build():
        x = SparseTensor(coords, torch.zeros(len(coords), 1, device=coords.device), validate=False)
        map_request(x.cache, _map_key(x, 3, 1, False))[0].pairs

    return median_ms(build, repeats)


def profile_cell(args) -> None:
    """Where one forward+backward spends its time (street1, first channel count and dtype)."""
    coords = scene_coords(args.scenes[0], args.scale)
    c, dtype = args.channels[0], getattr(torch, args.dtypes[0])
    x = SparseTensor(coords.to(DEVICE), torch.randn(len(coords), c, device=DEVICE, dtype=dtype).requires_grad_())
    weight = torch.randn(27, c, c, device=DEVICE, dtype=dtype, requires_grad=True)
    for _ in range(3):
        sparse_conv3d(x, weight).feats.sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            sparse_conv3d(x, weight).feats.sum().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40))


def fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value if value is not None else "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=list(SCENES), choices=list(SCENES))
    parser.add_argument("--channels", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: a dry run of the logic (no ceilings, no anchors)")
    parser.add_argument("--scale", type=float, default=1.0, help="scene size multiplier")
    parser.add_argument("--profile", action="store_true", help="profile one cell's forward+backward (torch.profiler) first")
    parser.add_argument("--log", action="store_true", help="log the tuner's sweeps and disqualifications to stderr")
    parser.add_argument("--calls", type=int, default=1,
                        help="back-to-back calls per timed sample (1: each call alone on an idle GPU, its host "
                             "time in full; more: the steady state of a loop, where host work hides behind kernels)")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES),
                        help="families to tune and time on their own (none: only the overall choice; faster)")
    args = parser.parse_args()
    if args.log:  # the disqualifications log at INFO; the sweep tables only with SPARSECONV_AUTOTUNE_LOG
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        os.environ["SPARSECONV_AUTOTUNE_LOG"] = "1"
    global DEVICE, CALLS_PER_SAMPLE
    DEVICE = torch.device(args.device)
    CALLS_PER_SAMPLE = args.calls
    os.environ.setdefault("SPARSECONV_CACHE_DIR", tempfile.mkdtemp(prefix="sparseconv-bench-"))
    peak_tflops, one_call_tflops, bandwidth_gbs = ceilings() if DEVICE.type == "cuda" else (float("nan"),) * 3
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    print(f"device: {name}; measured bf16 matmul {peak_tflops:.0f} TFLOP/s ({one_call_tflops:.0f} one call a sample), "
          f"copy {bandwidth_gbs:.0f} GB/s; median of {args.repeats} samples of {args.calls} call(s) (ms), kernel maps cached")
    if args.profile:
        profile_cell(args)
    anchors = {name: import_anchor(name) if DEVICE.type == "cuda" else "n/a (cpu)" for name in ("spconv", "spconv_triton")}
    header = ["scene", "dtype", "C", "layer", "N", "ours", "spconv", "sp-triton", "naive",
              "ours+bwd", "spconv+bwd", "sp-triton+bwd", "naive+bwd", "%peak", "%bw", "ours chose (fwd/dgrad/wgrad)",
              "triton", "cutlass", "triton+bwd", "cutlass+bwd"]
    print(" | ".join(header))
    ratios: dict[str, list[float]] = {"fwd": [], "fwd+bwd": []}
    peer_ratios: dict[str, list[float]] = {"fwd": [], "fwd+bwd": []}
    for scene in args.scenes:
        coords = scene_coords(scene, args.scale)
        base = SparseTensor(coords.to(DEVICE), torch.zeros(len(coords), 1, device=DEVICE))
        map_ms = map_build_ms(base.coords, args.repeats)
        print(f"{scene}: {len(coords)} voxels; our submanifold 3^3 kernel-map build {map_ms:.3f} ms")
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for c in args.channels:
                for layer in args.layers:
                    started = time.perf_counter()
                    r = run_cell(base, layer, c, dtype, args.repeats, anchors, args.families)
                    r["detail"] += f" cell {time.perf_counter() - started:.1f} s (tuning, compiles and all timings)"
                    elt = torch.finfo(dtype).bits // 8
                    n_in, n_out = (int(v) for v in r["N"].split("->"))
                    flops = 2 * r["pairs"] * c * c
                    bytes_min = (n_in + n_out) * c * elt + LAYERS[layer][0] ** 3 * c * c * elt
                    peak = flops / (r["ours"] * 1e-3) / (peak_tflops * 1e12)
                    bw = bytes_min / (r["ours"] * 1e-3) / (bandwidth_gbs * 1e9)
                    print(" | ".join([scene, dtype_name, str(c), layer, r["N"], fmt(r["ours"]), fmt(r["spconv"]),
                                      fmt(r["spconv_triton"]), fmt(r.get("naive")), fmt(r["ours+bwd"]),
                                      fmt(r["spconv+bwd"]), fmt(r["spconv_triton+bwd"]), fmt(r.get("naive+bwd")),
                                      f"{100 * peak:.0f}%", f"{100 * bw:.0f}%", r["chosen"],
                                      *(fmt(r[f + m]) for m in ("", "+bwd") for f in FAMILIES)]), flush=True)
                    print(f"# {scene} {dtype_name} {c} {layer} {r['detail']}", flush=True)
                    for mode, suffix in (("fwd", ""), ("fwd+bwd", "+bwd")):
                        peers = [r[p + suffix] for p in ("spconv", "spconv_triton") if isinstance(r[p + suffix], float)]
                        if isinstance(r["spconv" + suffix], float):
                            ratios[mode].append(r["spconv" + suffix] / r["ours" + suffix])
                        if peers:
                            peer_ratios[mode].append(min(peers) / r["ours" + suffix])
    for mode in ("fwd", "fwd+bwd"):
        if ratios[mode]:
            geo = math.exp(statistics.fmean(math.log(v) for v in ratios[mode]))
            print(f"{mode}: geometric-mean speed-up over spconv {geo:.2f}x over {len(ratios[mode])} cells")
        if peer_ratios[mode]:
            geo = math.exp(statistics.fmean(math.log(v) for v in peer_ratios[mode]))
            worst = min(peer_ratios[mode])
            print(f"{mode}: over the faster peer per cell {geo:.2f}x (worst cell {worst:.2f}x)")


if __name__ == "__main__":
    main()
