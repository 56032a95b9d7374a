"""Every tile of mask_implicit_gemm on the scenes' submanifold 3^3 maps, against its auto pool's best.

The sweep behind the pool's narrow tiles (`mask_triton.TABLE_TILES`, `POOL_TILES[16]` / `[32]`): for each
scene, channel pair and dtype it times the product over the map's table alone (no tile plan, `plan=False`: what a
lone map's pool times) and over its views (row orders and tile plans, built once before the timing), forward and
dgrad, with CUDA events (views kept: the kernels alone). Each candidate is checked against explicit_gemm in
float64 first. Prints the best of the current auto pool and the four best of the whole space per row.

    python scripts/sweep_mask_tiles.py --scenes street1 room2 --channels 16x16 4x32 16x32 32x32
"""

from __future__ import annotations

import argparse

import torch

from bench_layers import median_ms, scene_coords

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops.backends import explicit, get, mask_triton
from sparseconv.ops.problem import ConvProblem

SUBM3 = ((3, 3, 3), (1, 1, 1), (1, 1, 1), False, False)
PRODUCTS = {"forward": "AB_gather_scatter", "dgrad": "ABt_gather_scatter"}


def tile_name(params) -> str:
    name = "m{block_m}n{block_n}k{block_k}w{num_warps}s{num_stages}".format(**params)
    return name + (f" sort={params['sort']} table" if not mask_triton.planned(params) else f" g{params['splits']}")


def sweep(coords: torch.Tensor, c_in: int, c_out: int, dtype: torch.dtype, product: str, table: bool,
          repeats: int) -> tuple[float, list[tuple[float, str]]]:
    """(best ms of the auto pool, [(ms, tile)] of the whole space, fastest first) for one product."""
    device = coords.device
    x = SparseTensor(coords, torch.randn(len(coords), c_in, device=device, dtype=dtype))
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, *SUBM3))[0]
    weight = torch.randn(27, c_in, c_out, device=device, dtype=dtype) / c_in ** 0.5
    problem = ConvProblem(kernel_map.num_in, kernel_map.num_out, c_in, c_out, *SUBM3[:3], False, False, dtype, device,
                          table)  # lone: the pool with its table tiles
    namespace = PRODUCTS[product]
    a = x.feats if product == "forward" else torch.randn(kernel_map.num_out, c_out, device=device, dtype=dtype)
    reference = explicit.run(namespace, problem, {}, a.double(), weight.double(), kernel_map)
    backend, times = get("mask_implicit_gemm"), {}
    for params in mask_triton.SPACE:
        if mask_triton.planned(params) == table:
            continue
        out = backend.run(namespace, problem, params, a, weight, kernel_map)
        error = float((out.double() - reference).norm() / reference.norm())
        if not error < 2e-2:
            raise AssertionError(f"{tile_name(params)}: relative error {error:.1e} against explicit_gemm")
        times[tile_name(params)] = median_ms(lambda p=params: backend.run(namespace, problem, p, a, weight, kernel_map),
                                             repeats)
    pool = {tile_name(p) for p in mask_triton.pool(problem, "auto") if mask_triton.planned(p) != table}
    ranked = sorted((ms, name) for name, ms in times.items())
    return min(ms for ms, name in ranked if name in pool), ranked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=["street1", "room2"])
    parser.add_argument("--channels", nargs="+", default=["16x16", "4x32", "16x32", "32x32"], help="C_in x C_out")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mask_tiles.py times Triton kernels with CUDA events: it needs a GPU")
    print("| scene | C | dtype | product | views | auto pool's best (µs) | fastest four (µs) |")
    print("|---|---|---|---|---|---|---|")
    for scene in args.scenes:
        coords = scene_coords(scene).cuda()
        for channels in args.channels:
            c_in, c_out = (int(c) for c in channels.split("x"))
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                for product in PRODUCTS:
                    for table in (True, False):
                        if table and product == "dgrad":
                            continue  # a lone map serves its forward product alone
                        best, ranked = sweep(coords, c_in, c_out, dtype, product, table, args.repeats)
                        top = ", ".join(f"{1e3 * ms:.1f} {name}" for ms, name in ranked[:4])
                        views = "none (table)" if table else "row orders, tile plans"
                        print(f"| {scene} | {c_in}->{c_out} | {dtype_name} | {product} | {views} | {1e3 * best:.1f} "
                              f"| {top} |", flush=True)


if __name__ == "__main__":
    main()
