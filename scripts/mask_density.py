"""How much of the mask kernel's MMA work is on real rows, per scene, tile height and offset groups.

For the submanifold 3^3 map of each benchmark scene (built on the CPU), sorts rows as
`mask_implicit_gemm` does and counts, per tile, the rows times the offsets the tile visits;
prints pairs / visited rows, the fraction of the multiply-adds that are not on zero rows.

    python scripts/mask_density.py [--scenes street4 room2] [--block-m 64 128]
"""

from __future__ import annotations

import argparse

import torch

from bench_layers import SCENES

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.data import make_scene
from sparseconv.ops.backends import mask_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=["street4", "room2"], choices=list(SCENES))
    parser.add_argument("--block-m", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3])
    args = parser.parse_args()
    print("scene | voxels | pairs | product | block_m | " + " | ".join(f"useful, {s} group(s)" for s in args.splits))
    for scene in args.scenes:
        kind, voxel, batch, scale = SCENES[scene]
        coords, _ = make_scene(kind, voxel_size=voxel, batch_size=batch, scale=scale)
        x = SparseTensor(coords, torch.zeros(len(coords), 1))
        kernel_map, _ = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))
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
