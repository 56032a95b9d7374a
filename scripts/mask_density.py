"""How much of the mask kernel's MMA work is on real rows, per scene, tile height and offset groups.

For the submanifold 3^3 map of each benchmark scene (built on the CPU), sorts rows as
`mask_implicit_gemm` does and counts, per tile, the rows times the offsets the tile visits;
prints pairs / visited rows, the fraction of the multiply-adds that are not on zero rows.

    python scripts/mask_density.py [--scenes street4 room2] [--block-m 64 128]
    python scripts/mask_density.py --scenes street4 --orders   # other row orders, one group, forward
"""

from __future__ import annotations

import argparse

import torch

from bench_layers import SCENES, scene_coords

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops.backends import mask_triton


def morton(coords: torch.Tensor) -> torch.Tensor:
    """Batch, then the Z-order of x, y, z: spatial neighbours next to each other."""
    xyz = coords[:, 1:].long() - coords[:, 1:].long().amin(0)
    code = torch.zeros(len(coords), dtype=torch.int64)
    for bit in range(20):
        for axis in range(3):
            code |= ((xyz[:, axis] >> bit) & 1) << (3 * bit + axis)
    return torch.argsort(code | coords[:, 0].long() << 60, stable=True)


def compare_orders(coords: torch.Tensor, table: torch.Tensor, block_ms: list[int]) -> None:
    """Useful fraction of one offset group's tiles under other row orders than the shipped one
    (``mask_triton.row_order``) for the (rows, offsets) neighbour ``table``."""
    present = table >= 0
    shipped = mask_triton.row_order(table, True).long()
    rarest = torch.argsort(present.sum(0), stable=True)
    popcount_major = torch.argsort(present.sum(1).long() << 32 | shipped.argsort(), stable=True)
    orders = {"rarest offset first (shipped)": shipped,
              "commonest offset first": mask_triton.bitmask_order(present, rarest.flip(0)),
              "neighbour count, then shipped": popcount_major,
              "Morton (spatial)": morton(coords), "none (coordinate order)": torch.arange(len(present))}
    pairs, width = int(present.sum()), present.shape[1]
    for name, order in orders.items():
        cells = []
        for block_m in block_ms:
            tiles = -(-len(order) // block_m)
            padded = torch.zeros(tiles * block_m, width, dtype=torch.bool)
            padded[: len(order)] = present[order]
            cells.append(f"{pairs / (int(padded.view(tiles, block_m, width).any(1).sum()) * block_m):.3f}")
        print(" | ".join([name, *cells]))


def scene_map(scene: str):
    """(coords, submanifold 3^3 kernel map) of a benchmark scene, built on the CPU."""
    coords = scene_coords(scene)
    x = SparseTensor(coords, torch.zeros(len(coords), 1))
    return coords, x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=["street4", "room2"], choices=list(SCENES))
    parser.add_argument("--block-m", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--orders", action="store_true", help="compare row orders instead (one group, forward)")
    args = parser.parse_args()
    if args.orders:
        for scene in args.scenes:
            coords, kernel_map = scene_map(scene)
            present = kernel_map.neighbors >= 0
            masks = torch.unique((present.long() << torch.arange(present.shape[1])).sum(1))
            print(f"{scene}: {len(coords)} rows, {len(masks)} distinct neighbour masks")
            print("order | " + " | ".join(f"useful, block_m {m}" for m in args.block_m))
            compare_orders(coords, kernel_map.neighbors, args.block_m)
        return
    print("scene | voxels | pairs | product | block_m | " + " | ".join(f"useful, {s} group(s)" for s in args.splits))
    for scene in args.scenes:
        coords, kernel_map = scene_map(scene)
        for forward in (True, False):
            for block_m in args.block_m:
                cells = []
                for splits in args.splits:
                    visited = sum(int(mask_triton.tile_offsets(kernel_map, forward, True, block_m, group).sum()) * block_m
                                  for group in mask_triton.offset_groups(kernel_map.kernel_volume, splits))
                    cells.append(f"{kernel_map.num_pairs / visited:.2f}")
                print(" | ".join([scene, str(len(coords)), str(kernel_map.num_pairs), "forward" if forward else "dgrad",
                                  str(block_m), *cells]))


if __name__ == "__main__":
    main()
