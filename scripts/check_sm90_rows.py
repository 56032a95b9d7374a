"""Correctness and speed of the Hopper kernels of csrc/rows_sm90.cu on one LiDAR-like layer.

Builds a submanifold 3x3x3 layer with torch alone (a few hundred thousand voxels of a noisy 2.5D
height field, ~8 neighbours each), so warp-lang is not needed; compiles every shipped variant
(cutlass_sm90.sm90_variants()) for sm_90a in parallel; checks each against a float32 torch
reference for fp16 / bf16, forward (ab) and dgrad (abt), C = 64, 128, 256 and one uneven
72 -> 40 case (channel tails, masked columns), and accumulate = 1 once per variant, with the
outputs poisoned with NaN; then times bf16 forward at C = 128 and 256 (persistent, as shipped, and
with a block per tile) next to Triton's rows_gemm
(mask_implicit_gemm, one offset group) and cuBLAS on the same useful work.

Needs an H100/H200 (sm_90), torch with CUDA, triton, cupy (cupy-cuda12x or cupy-cuda13x), nvcc
(a CUDA toolkit or the nvidia-cuda-nvcc wheel), nvidia-cutlass, numpy, msgpack and tqdm (imported
by sparseconv; the checkout is put on sys.path, so sparseconv need not be installed):

    python scripts/check_sm90_rows.py
    python scripts/check_sm90_rows.py --dry-run   # CPU only: problem, tables, reference, emulation
    python scripts/check_sm90_rows.py --scene street4 --groups 1 2 3   # a benchmark scene, offset groups
    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        python scripts/check_sm90_rows.py --profile-tile 128 256   # one bf16 C=256 forward launch

A case that does not finish within --hang-seconds is reported as a hang and ends the script
(a deadlocked kernel cannot be stopped from Python).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseconv.coords.kernel_map import KernelMap, offset_deltas
from sparseconv.ops.backends import cuda_jit, cutlass_gemm, cutlass_sm90, mask_triton

DTYPES = {0: torch.float16, 1: torch.bfloat16}
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
CHANNELS = ((64, 64), (128, 128), (256, 256), (72, 40))  # (C_in, C_out)
LABELLED = {"SC_ELEMENT", "SC_TB_N", "SC_TB_K", "SC_STAGES", "SC_CONSUMERS", "SC_PRODUCER_FENCE", "SC_EPILOGUE_PROBE"}
TRITON_TILES = ((64, 128, 32, 4, 3), (128, 128, 64, 8, 3))  # block m, n, k, warps, stages


# ------------------------------------------------------------------ problem (torch only) --------

def surface_voxels(side: int, keep: float, seed: int = 0) -> torch.Tensor:
    """(N, 3) int64 unique voxels of a noisy height field over a side x side grid, a fraction
    ``keep`` of its columns (one voxel per kept column, like one LiDAR return per ray)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    x, y = x.flatten(), y.flatten()
    height = 6 * torch.sin(x / 23.0) + 4 * torch.cos(y / 17.0) + 0.02 * (x + y)
    z = torch.round(height + 0.35 * torch.randn(x.shape, generator=g)).to(torch.int64)
    kept = torch.rand(x.shape, generator=g) < keep
    return torch.stack([x, y, z], 1)[kept]


def neighbour_table(coords: torch.Tensor) -> torch.Tensor:
    """(N, 27) int32: the row of voxel coords[i] + delta_k (sparseconv's offset order), or -1."""
    low = coords.min(0).values - 1
    extent = coords.max(0).values - low + 2
    shifted = coords - low

    def key(c: torch.Tensor) -> torch.Tensor:
        return (c[..., 0] * extent[1] + c[..., 1]) * extent[2] + c[..., 2]

    keys = key(shifted)
    sorted_keys, rows = torch.sort(keys)
    deltas = offset_deltas((3, 3, 3)).to(coords.device, torch.int64)
    queries = key(shifted[:, None, :] + deltas[None])  # (N, 27), never out of the padded box
    where = torch.searchsorted(sorted_keys, queries).clamp_max(len(sorted_keys) - 1)
    found = sorted_keys[where] == queries
    return torch.where(found, rows[where], torch.full_like(where, -1)).to(torch.int32)


def scene_voxels(name: str) -> torch.Tensor:
    """(N, 3) int64 unique voxels of a benchmark scene (scripts/bench_layers.py SCENES), its
    batches side by side along x so that the torch neighbour table sees one grid."""
    from bench_layers import scene_coords

    coords = scene_coords(name).to(torch.int64)
    xyz = coords[:, 1:] - coords[:, 1:].amin(0)
    xyz[:, 0] += coords[:, 0] * (int(xyz[:, 0].max()) + 3)
    return xyz


class Prepared:
    """The kernel's arguments for one product, tile height and offset group [lo, hi) (default all):
    table (hi - lo, rows) int32 with the zero row ``sources`` for "none", order (rows,) int32,
    active (tiles, hi - lo) int32 counted from lo, count (tiles,) int32."""

    def __init__(self, kernel_map: KernelMap, forward: bool, block_m: int,
                 group: tuple[int, int] | None = None) -> None:
        self.group = group or (0, kernel_map.kernel_volume)
        self.table, self.order, self.sources = cutlass_gemm.gather_table(kernel_map, forward, self.group)
        self.active, self.count = cutlass_sm90._group_lists(kernel_map, forward, block_m, self.group)
        self.block_m = block_m
        self.rows = self.table.shape[1]


def reference(a: torch.Tensor, w: torch.Tensor, nbr: torch.Tensor, forward: bool) -> torch.Tensor:
    """float32 ground truth: forward out[o] = sum_k a[nbr[o, k]] @ W_k; dgrad dx[nbr[o, k]] += g[o] @ W_k^T."""
    a, w = a.float(), w.float()
    rows = nbr.shape[0]  # submanifold: num_in == num_out
    out = torch.zeros(rows, w.shape[2] if forward else w.shape[1], device=a.device)
    for k in range(nbr.shape[1]):
        out_idx = torch.nonzero(nbr[:, k] >= 0).flatten()
        in_idx = nbr[out_idx, k].long()
        if forward:
            out.index_add_(0, out_idx, a[in_idx] @ w[k])
        else:
            out.index_add_(0, in_idx, a[out_idx] @ w[k].t())
    return out


def emulate(source: torch.Tensor, w: torch.Tensor, prep: Prepared, forward: bool) -> torch.Tensor:
    """What the kernel computes from its arguments, in float32 torch: every slot sums only the
    offsets of the group listed for its tile, and lands on row order[slot]."""
    rows, kernel_volume, lo = prep.rows, prep.table.shape[0], prep.group[0]
    tiles = prep.count.numel()
    listed = torch.zeros(tiles, kernel_volume, dtype=torch.bool, device=source.device)
    slots = torch.arange(prep.active.shape[1], device=source.device)[None] < prep.count[:, None]
    listed[torch.arange(tiles, device=source.device)[:, None].expand_as(slots)[slots], prep.active[slots].long()] = True
    tile_of = torch.arange(rows, device=source.device) // prep.block_m
    src, wf = source.float(), w.float()
    acc = torch.zeros(rows, w.shape[2] if forward else w.shape[1], device=source.device)
    for k in range(kernel_volume):
        sel = listed[tile_of, k]
        b_k = wf[lo + k] if forward else wf[lo + k].t()
        acc[sel] += src[prep.table[k, sel].long()] @ b_k
    out = torch.empty_like(acc)
    out[prep.order.long()] = acc
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def operands(nbr: torch.Tensor, c_in: int, c_out: int, dtype: torch.dtype, device) -> dict:
    g = torch.Generator(device=device).manual_seed(c_in * 1000 + c_out)
    n = nbr.shape[0]
    return {
        "x": torch.randn(n, c_in, generator=g, device=device).to(dtype),
        "grad": torch.randn(n, c_out, generator=g, device=device).to(dtype),
        "w": (torch.randn(27, c_in, c_out, generator=g, device=device) / math.sqrt(8 * c_in)).to(dtype),
    }


# ------------------------------------------------------------------ dry run (CPU) ---------------

def dry_run() -> int:
    failures = 0
    coords = surface_voxels(600, 0.85)
    started = time.perf_counter()
    nbr = neighbour_table(coords)
    per_row = (nbr >= 0).sum(1).float()
    print(f"full-size problem: {coords.shape[0]} voxels, {int(per_row.sum())} pairs, "
          f"{per_row.mean():.2f} neighbours a voxel (self included), table in {time.perf_counter() - started:.1f} s")
    small = surface_voxels(40, 0.85, seed=1)
    nbr = neighbour_table(small)
    lookup = {tuple(c): i for i, c in enumerate(small.tolist())}
    deltas = offset_deltas((3, 3, 3)).tolist()
    brute = torch.tensor([[lookup.get((c[0] + d[0], c[1] + d[1], c[2] + d[2]), -1) for d in deltas]
                          for c in small.tolist()], dtype=torch.int32)
    ok = torch.equal(nbr, brute)
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} neighbour table equals a dictionary lookup ({small.shape[0]} voxels)")
    kernel_map = KernelMap(nbr, nbr.shape[0], (3, 3, 3))
    for c_in, c_out in ((16, 24), (72, 40)):
        ops = operands(nbr, c_in, c_out, torch.float32, "cpu")
        for forward in (True, False):
            a = ops["x"] if forward else ops["grad"]
            ref = reference(a, ops["w"], nbr, forward)
            source = torch.cat([a, a.new_zeros(1, a.shape[1])])
            for block_m, groups in ((64, 1), (128, 1), (128, 2)):
                preps = [Prepared(kernel_map, forward, block_m, g) for g in mask_triton.offset_groups(27, groups)]
                covered = all(
                    set(torch.nonzero((p.table != p.sources)[:, t * block_m:(t + 1) * block_m].any(1)).flatten().tolist())
                    <= set(p.active[t, : p.count[t]].tolist()) for p in preps for t in range(p.count.numel()))
                error = relative_error(sum(emulate(source, ops["w"], p, forward) for p in preps), ref)
                good = covered and error < 1e-5 and all(sorted(p.order.tolist()) == list(range(p.rows)) for p in preps)
                failures += not good
                print(f"{'PASS' if good else 'FAIL'} emulated {'ab ' if forward else 'abt'} BM={block_m} "
                      f"{groups} group(s) C={c_in}->{c_out}: error {error:.1e}, lists cover the table: {covered}")
    print(f"dry run: {failures} failures")
    return failures


# ------------------------------------------------------------------ GPU ------------------------

def load(path: Path, device_index: int) -> dict:
    """The kernels of one compiled variant (the library's loader; the path may hold extra -D flags)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return cutlass_sm90.kernels_of(cupy.RawModule(path=str(path)), device_index)


def run_kernel(kernels: dict, forward: bool, variant: dict, preps: Prepared | list[Prepared], source: torch.Tensor,
               w: torch.Tensor, out: torch.Tensor, accumulate: bool, persistent: bool = True) -> None:
    """Pack W for the variant (timed with the product: a layer packs on every call), then multiply,
    one launch per offset group of ``preps`` (the later ones add, as cutlass_sm90._rows does);
    persistent = False launches a block per tile instead (the kernel takes any grid)."""
    preps = [preps] if isinstance(preps, Prepared) else preps
    rows, cols = out.shape
    reduce = source.shape[1]
    packed, counters, pack = cutlass_sm90.pack_launch(kernels, forward, variant, w, reduce, cols, len(preps))
    per_offset = packed.numel() // w.shape[0]
    launches = [pack]
    for step, prep in enumerate(preps):
        tiles = math.ceil(rows / prep.block_m) * math.ceil(cols / variant["SC_TB_N"])
        args = (source, packed[prep.group[0] * per_offset:], prep.table, prep.order, prep.active, prep.count, out,
                rows, reduce, cols, prep.sources, prep.active.shape[1], int(accumulate or step > 0), counters[step:])
        grid = cutlass_sm90.grid(tiles, out.device.index) if persistent else (tiles, 1, 1)
        launches.append((kernels[cutlass_sm90.KERNELS[0 if forward else 1]], grid, args))
    cutlass_gemm._launch_all(out.device, launches)


class Watchdog:
    """Ends the process if a case does not finish: a deadlocked kernel never returns."""

    def __init__(self, label: str, seconds: float) -> None:
        self.timer = threading.Timer(seconds, self._fire, (label, seconds))

    @staticmethod
    def _fire(label: str, seconds: float) -> None:
        print(f"HANG {label}: not finished after {seconds:.0f} s (deadlock?); stopping", flush=True)
        os._exit(3)

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()


def median_ms(fn, warmup: int = 5, repeats: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        # Keep the GPU busy while Python launches, so that launch overhead is not timed.
        torch.cuda._sleep(1_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def matmul_peak(device) -> float:
    """TFLOP/s of one 8192^3 bf16 matmul, measured now."""
    square = torch.randn(2, 8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: square[0] @ square[1]) / 1e9


def label_of(variant: dict) -> str:
    fence = " fence" if variant.get("SC_PRODUCER_FENCE") else ""
    fence += " no stores" if variant.get("SC_EPILOGUE_PROBE") else ""
    fence += "".join(f" {k}={v}" for k, v in variant.items() if k not in LABELLED)
    return (f"{DTYPES[variant['SC_ELEMENT']]!s:14} BM={64 * variant['SC_CONSUMERS']:3} BN={variant['SC_TB_N']:3} "
            f"BK={variant['SC_TB_K']} S={variant['SC_STAGES']}{fence}").replace("torch.", "")


def gpu(args) -> int:
    import cupy

    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device) != (9, 0):
        print(f"needs an sm_90 GPU (H100/H200), found {torch.cuda.get_device_name(device)}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    variants = cutlass_sm90.sm90_variants()
    if args.profile_tile:
        variants = [v for v in variants if v["SC_ELEMENT"] == 1
                    and (64 * v["SC_CONSUMERS"], v["SC_TB_N"]) == tuple(args.profile_tile)]
    if args.probe:
        variants = variants + [{**v, "SC_EPILOGUE_PROBE": 1} for v in variants]
    for define in args.define:  # variants with extra -D flags, beside the shipped ones
        name, value = define.split("=")
        variants = variants + [{**v, name: int(value)} for v in variants if name not in v]
    if args.producer_fence:  # the fallback signalling of rows_sm90.cu, to compare with the default
        variants = [{**v, "SC_PRODUCER_FENCE": 1} for v in variants]
    started = time.perf_counter()
    futures = [cuda_jit.compile_async(cutlass_sm90.SOURCE, v, cutlass_sm90.ARCH) for v in variants]

    coords = (scene_voxels(args.scene) if args.scene else surface_voxels(args.side, 0.85)).to(device)
    nbr = neighbour_table(coords)
    num_pairs = int((nbr >= 0).sum())
    kernel_map = KernelMap(nbr, nbr.shape[0], (3, 3, 3))
    print(f"{torch.cuda.get_device_name(device)}: {nbr.shape[0]} voxels, {num_pairs} pairs "
          f"({num_pairs / nbr.shape[0]:.2f} a voxel)")
    optin = cupy.cuda.Device(device.index).attributes.get("MaxSharedMemoryPerBlockOptin", 232448)

    kernels, failures = {}, 0
    for variant, future in zip(variants, futures):
        try:
            kernels[label_of(variant)] = (variant, load(future.result(), device.index))
        except Exception as error:  # noqa: BLE001 - report every variant
            failures += 1
            print(f"FAIL compile/load {label_of(variant)}: {error!r}"[:2000])
    print(f"compiled and loaded {len(kernels)} of {len(variants)} variants in {time.perf_counter() - started:.1f} s")
    for label, (variant, ks) in list(kernels.items()):
        k = ks["sc90_rows_ab"]
        regs = getattr(k.function, "num_regs", None)
        note = ""
        if variant["SC_CONSUMERS"] == 2 and regs != 168:
            note = "  <- expected 168 (setmaxnreg 72/216 assumes it)"
        print(f"  {label}: {k.threads} threads, {k.shared_bytes} B shared, {regs} registers{note}")
        if k.shared_bytes > optin:
            print(f"  skip {label}: needs {k.shared_bytes} B of shared memory, the device allows {optin}")
            del kernels[label]

    if args.profile_tile:
        return profile_launch(kernels, kernel_map, nbr, device)

    prepared: dict[tuple[bool, int, tuple[int, int]], Prepared] = {}
    inputs: dict[tuple, dict] = {}
    references: dict[tuple, torch.Tensor] = {}

    def preps_of(forward: bool, block_m: int, groups: int) -> list[Prepared]:
        for group in mask_triton.offset_groups(kernel_map.kernel_volume, groups):
            if (forward, block_m, group) not in prepared:
                prepared[(forward, block_m, group)] = Prepared(kernel_map, forward, block_m, group)
        return [prepared[(forward, block_m, g)] for g in mask_triton.offset_groups(kernel_map.kernel_volume, groups)]

    def case(variant, ks, forward: bool, c_in: int, c_out: int, accumulate: bool, groups: int = 1) -> bool:
        dtype = DTYPES[variant["SC_ELEMENT"]]
        prep = preps_of(forward, 64 * variant["SC_CONSUMERS"], groups)
        if (dtype, c_in, c_out) not in inputs:
            inputs[(dtype, c_in, c_out)] = operands(nbr, c_in, c_out, dtype, device)
        ops = inputs[(dtype, c_in, c_out)]
        a = ops["x"] if forward else ops["grad"]
        ref_key = (dtype, c_in, c_out, forward)
        if ref_key not in references:
            references[ref_key] = reference(a, ops["w"], nbr, forward)
        ref = references[ref_key]
        # The "no neighbour" row is NaN here: the kernel must fill its zeros without reading it.
        source = torch.cat([a, a.new_full((1, a.shape[1]), float("nan"))])
        if accumulate:
            out = torch.randn(ref.shape, device=device).to(dtype)
            ref = ref + out.float()
        else:
            out = torch.full(ref.shape, float("nan"), device=device, dtype=dtype)
        run_kernel(ks, forward, variant, prep, source, ops["w"], out, accumulate)
        torch.cuda.synchronize()
        nan = int(torch.isnan(out).sum())
        error = relative_error(out, ref)
        good = nan == 0 and error < TOLERANCE[dtype]
        print(f"{'PASS' if good else 'FAIL'} {label_of(variant)} {'ab ' if forward else 'abt'} "
              f"C={c_in}->{c_out}{' accumulate' if accumulate else ''}{f' {groups} groups' if groups > 1 else ''}: "
              f"error {error:.2e}, NaN {nan}", flush=True)
        return good

    passing = set(kernels)
    for label, (variant, ks) in kernels.items():
        cases = [(forward, c_in, c_out, False, 1) for c_in, c_out in CHANNELS for forward in (True, False)]
        cases.append((True, 128, 128, True, 1))
        cases += [(forward, 72, 40, False, groups) for groups in args.groups if groups > 1 for forward in (True, False)]
        for forward, c_in, c_out, accumulate, groups in cases:
            name = f"{label} {'ab' if forward else 'abt'} C={c_in}->{c_out} {groups} groups"
            try:
                with Watchdog(name, args.hang_seconds):
                    good = case(variant, ks, forward, c_in, c_out, accumulate, groups)
            except Exception as error:  # noqa: BLE001 - report every case
                good = False
                print(f"FAIL {name}: {error!r}"[:2000], flush=True)
            if not good:
                failures += 1
                passing.discard(label)

    if args.skip_timing:
        print(f"{failures} failures")
        return int(failures > 0)

    peak = matmul_peak(device)
    print(f"\nbf16 forward, {num_pairs} pairs; measured 8192^3 bf16 matmul peak {peak:.0f} TFLOP/s")
    print(f"{'kernel':58} {'C':>4} {'ms':>8} {'TFLOP/s':>8} {'% peak':>7}")
    for c in (128, 256):
        ops = inputs[(torch.bfloat16, c, c)] if (torch.bfloat16, c, c) in inputs else operands(
            nbr, c, c, torch.bfloat16, device)
        x, w = ops["x"], ops["w"]
        flops = 2 * num_pairs * c * c
        source = torch.cat([x, x.new_zeros(1, c)])
        rows_out = torch.empty(nbr.shape[0], c, device=device, dtype=torch.bfloat16)
        entries = []
        for label, (variant, ks) in kernels.items():
            if variant["SC_ELEMENT"] != 1 or (label not in passing and not variant.get("SC_EPILOGUE_PROBE")):
                continue
            for groups in args.groups:
                prep = preps_of(True, 64 * variant["SC_CONSUMERS"], groups)
                for persistent in (True, False) if groups == 1 else (True,):
                    fn = (lambda v=variant, k=ks, p=prep, s=source, w=w, o=rows_out, q=persistent:
                          run_kernel(k, True, v, p, s, w, o, False, q))
                    name = f"sc90 {label}{'' if persistent else ' block a tile'}"
                    entries.append((f"{name}{f' {groups} groups' if groups > 1 else ''}", fn))
        for m, n, k, warps, stages in TRITON_TILES:
            params = {"block_m": m, "block_n": n, "block_k": k, "num_warps": warps, "num_stages": stages,
                      "sort": True, "splits": 1}
            entries.append((f"triton rows_gemm {m}x{n}x{k} w{warps} s{stages}",
                            lambda p=params, x=x, w=w: mask_triton.run("AB_gather_scatter", None, p, x, w, kernel_map)))
        dense = torch.randn(num_pairs, c, device=device, dtype=torch.bfloat16)
        entries.append((f"torch.mm {num_pairs}x{c} @ {c}x{c} (no gather)", lambda d=dense, w=w: d @ w[0]))
        for name, fn in entries:
            try:
                with Watchdog(f"timing {name} C={c}", args.hang_seconds):
                    ms = median_ms(fn)
                rate = flops / ms / 1e9
                print(f"{name:58} {c:4} {ms:8.3f} {rate:8.1f} {100 * rate / peak:6.1f}%", flush=True)
            except Exception as error:  # noqa: BLE001
                print(f"FAIL timing {name} C={c}: {error!r}"[:2000], flush=True)
        entries.clear()
    print(f"\n{failures} failures, {time.perf_counter() - started:.0f} s")
    return int(failures > 0)


def profile_launch(kernels: dict, kernel_map: KernelMap, nbr: torch.Tensor, device) -> int:
    """One persistent bf16 C=256 forward launch of the one compiled variant, between
    cudaProfilerStart and Stop (for ``ncu --profile-from-start off``), after three unprofiled ones."""
    if len(kernels) != 1:
        print(f"--profile-tile matches {len(kernels)} variants, expected 1")
        return 2
    (variant, ks), = kernels.values()
    prep = Prepared(kernel_map, True, 64 * variant["SC_CONSUMERS"])
    ops = operands(nbr, 256, 256, torch.bfloat16, device)
    source = torch.cat([ops["x"], ops["x"].new_zeros(1, 256)])
    out = torch.empty(nbr.shape[0], 256, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        run_kernel(ks, True, variant, prep, source, ops["w"], out, False)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run_kernel(ks, True, variant, prep, source, ops["w"], out, False)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one launch of {label_of(variant)}, C=256 forward, {int((nbr >= 0).sum())} pairs")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU only: problem construction, tables, reference")
    parser.add_argument("--side", type=int, default=600, help="grid side of the height field (0.85 side^2 voxels)")
    parser.add_argument("--scene", choices=("street1", "street4", "room2"),
                        help="a benchmark scene's voxels (scripts/bench_layers.py) instead of the height field")
    parser.add_argument("--groups", nargs="+", type=int, default=[1],
                        help="offset groups to time (one launch each, the later ones adding); > 1 is also checked")
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--profile-tile", nargs=2, type=int, metavar=("BM", "BN"),
                        help="no checks: one bf16 C=256 forward launch of this tile for a profiler (see above)")
    parser.add_argument("--producer-fence", action="store_true",
                        help="build with -DSC_PRODUCER_FENCE=1 (wait_group + fence + arrive instead of the noinc arrive)")
    parser.add_argument("--define", nargs="+", default=[], metavar="NAME=VALUE",
                        help="also build and time each variant with -DNAME=VALUE (rows_sm90.cu's tuning macros)")
    parser.add_argument("--probe", action="store_true",
                        help="also time each variant built with -DSC_EPILOGUE_PROBE=1 (no output stores; fails its checks)")
    args = parser.parse_args()
    if args.dry_run:
        return int(dry_run() > 0)
    return gpu(args)


if __name__ == "__main__":
    sys.exit(main())
