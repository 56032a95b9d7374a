"""Every `mask_implicit_gemm` (or `cutlass_sm90`) parameter set on one layer: time, rate, error, side by side.

The tuner times only its adaptive pool; this times the whole space (or the tiles you name) on
the submanifold 3^3 map of a benchmark scene, against the cuBLAS rate of the same useful work
(one dense matmul of pairs x C by C x C) and the measured bf16 matmul peak, and checks every
set against `explicit_gemm` (relative Frobenius error). Use it to choose tiles for the pools.
With --backend cutlass_sm90 it sweeps that backend's tiles x splits, its persistent launch and,
with --block-a-tile, also a block per tile (the kernel takes any grid).

    python scripts/sweep_mask_tiles.py --scenes street4 --channels 256 --dtypes bfloat16
    python scripts/sweep_mask_tiles.py --tiles 0 10 12 --splits 1 2 --products fwd dgrad
    python scripts/sweep_mask_tiles.py --backend cutlass_sm90 --block-a-tile
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from bench_layers import SCENES, ceilings, median_ms, scene_coords

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops.backends import cutlass_sm90, explicit, mask_triton
from sparseconv.ops.conv import _problem

PRODUCTS = {"fwd": "AB_gather_scatter", "dgrad": "ABt_gather_scatter"}


def sweep(kernel_map, c: int, dtype: torch.dtype, product: str, candidates: list[tuple[str, object]],
          repeats: int) -> list[tuple[str, float, float, float]]:
    """[(label, ms, TFLOP/s, relative error)] for each (label, run(namespace, problem, a, w)), fastest first."""
    namespace = PRODUCTS[product]
    device = kernel_map.neighbors.device
    a = torch.randn(kernel_map.num_in if product == "fwd" else kernel_map.num_out, c, device=device, dtype=dtype)
    w = torch.randn(kernel_map.kernel_volume, c, c, device=device, dtype=dtype) / math.sqrt(kernel_map.kernel_volume * c)
    problem = _problem(kernel_map, c, c, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, dtype, device)
    reference = explicit.run(namespace, problem, {}, a.double(), w.double(), kernel_map)
    flops = 2 * kernel_map.num_pairs * c * c
    results = []
    for label, run in candidates:
        out = run(namespace, problem, a, w)
        error = float((out.double() - reference).norm() / reference.norm())
        ms = median_ms(lambda run=run: run(namespace, problem, a, w), repeats)
        results.append((label, ms, flops / ms / 1e9, error))
    dense = torch.randn(kernel_map.num_pairs, c, device=device, dtype=dtype)
    ms = median_ms(lambda: dense @ w[0], repeats)
    results.append((f"cuBLAS {kernel_map.num_pairs}x{c} @ {c}x{c} (same useful work, no gather)", ms, flops / ms / 1e9, 0.0))
    return sorted(results, key=lambda r: r[1])


def mask_candidates(args, kernel_map) -> list[tuple[str, object]]:
    tiles = args.tiles if args.tiles is not None else range(len(mask_triton.TILES))
    params_list = [mask_triton._params(t, True, s) for t in tiles for s in args.splits]
    if args.unsorted:
        params_list += [mask_triton._params(t, False, 1) for t in tiles]
    return [("{block_m}x{block_n}x{block_k} w{num_warps} s{num_stages} sort={sort:d} splits={splits}".format(**p),
             lambda ns, problem, a, w, p=p: mask_triton.run(ns, problem, p, a, w, kernel_map)) for p in params_list]


def sm90_candidates(args, kernel_map) -> list[tuple[str, object]]:
    """Each tile x splits through the backend's own launch path, persistent (as shipped) and, with
    --block-a-tile, with a block per output tile."""
    tiles = args.tiles if args.tiles is not None else range(len(cutlass_sm90.TILES))
    candidates = []
    for index, splits, persistent in itertools.product(tiles, args.splits, (True, False) if args.block_a_tile else (True,)):
        tile = cutlass_sm90.TILES[index]
        groups = tuple(mask_triton.offset_groups(kernel_map.kernel_volume, splits))

        def run(ns, problem, a, w, tile=tile, groups=groups, persistent=persistent):
            forward = ns == PRODUCTS["fwd"]
            rows, cols = (kernel_map.num_out, w.shape[2]) if forward else (kernel_map.num_in, w.shape[1])
            out = torch.empty(rows, cols, device=a.device, dtype=a.dtype)
            sms = cutlass_sm90._multiprocessors
            if not persistent:
                cutlass_sm90._multiprocessors = lambda device_index: 1 << 30
            try:
                cutlass_sm90._rows.__wrapped__(tile, a, w, out, kernel_map, forward, groups)
            finally:
                cutlass_sm90._multiprocessors = sms
            return out

        label = (f"BM={tile.block_m} BN={tile.block_n} S={tile.stages} splits={splits}"
                 f"{'' if persistent else ' block a tile'}")
        candidates.append((label, run))
    return candidates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=["street4"], choices=list(SCENES))
    parser.add_argument("--channels", nargs="+", type=int, default=[256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--products", nargs="+", default=["fwd"], choices=list(PRODUCTS))
    parser.add_argument("--backend", default="mask_implicit_gemm", choices=["mask_implicit_gemm", "cutlass_sm90"])
    parser.add_argument("--tiles", nargs="+", type=int, default=None,
                        help="indices into the backend's TILES (default all)")
    parser.add_argument("--block-a-tile", action="store_true", help="cutlass_sm90: also launch a block per tile")
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--unsorted", action="store_true", help="also the unsorted sets (one group)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    peak_tflops, _ = ceilings()
    print(f"device: {torch.cuda.get_device_name()}; measured bf16 matmul {peak_tflops:.0f} TFLOP/s")
    for scene in args.scenes:
        coords = scene_coords(scene)
        x = SparseTensor(coords.cuda(), torch.zeros(len(coords), 1, device="cuda"))
        kernel_map, _ = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))
        for dtype_name in args.dtypes:
            for c in args.channels:
                for product in args.products:
                    print(f"\n{scene} ({len(coords)} voxels, {kernel_map.num_pairs} pairs) {dtype_name} C={c} {product}")
                    print("params | ms | TFLOP/s | % peak | rel. error")
                    candidates = (sm90_candidates if args.backend == "cutlass_sm90" else mask_candidates)(args, kernel_map)
                    for label, ms, tflops, error in sweep(kernel_map, c, getattr(torch, dtype_name), product,
                                                          candidates, args.repeats):
                        print(f"{label} | {ms:.3f} | {tflops:.0f} | {100 * tflops / peak_tflops:.0f}% | {error:.1e}")


if __name__ == "__main__":
    main()
