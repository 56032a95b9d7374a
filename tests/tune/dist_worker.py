"""A rank of the distributed tuner test (spawned by test_distributed.py)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta


def run_rank(rank: int, world: int, init_file: str, cache_root: str, out_dir: str, sizes: list[int]) -> None:
    os.environ["SPARSECONV_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")
    import torch
    import torch.distributed as dist

    from sparseconv import SparseTensor
    from sparseconv.ops import sparse_conv3d
    from sparseconv.ops.backends import Backend, explicit, register

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))

    def delayed(name: str, delay_s: float) -> Backend:
        def run(namespace, problem, params, a, b, kernel_map):
            time.sleep(delay_s)
            return explicit.run(namespace, problem, params, a, b, kernel_map)
        return Backend(name, frozenset({"AB_gather_scatter"}), run)

    # Each rank's own timings favour a different backend: only agreement makes them choose alike.
    register(delayed("fake_a", 0.0 if rank == 0 else 0.02))
    register(delayed("fake_b", 0.02 if rank == 0 else 0.0))
    generator = torch.Generator().manual_seed(0)
    coords = torch.unique(torch.randint(0, 40, (sizes[rank], 4), generator=generator), dim=0)
    coords[:, 0] = 0
    coords = torch.unique(coords, dim=0)
    x = SparseTensor(coords, torch.randn(len(coords), 4, generator=generator))
    weight = torch.randn(27, 4, 4, generator=generator)
    # Rank 1 decides only once rank 0 has offered its choice, so that in the cold run rank 0's
    # offer is first whatever the load on the machine (a sleep here was not enough under CI load).
    # The order comes from a store of the test's own: the tuner's agreement never waits.
    order = dist.FileStore(init_file + ".order", world)
    if rank == 1:
        order.wait(["rank0_decided"], timedelta(seconds=60))
    record: dict[str, str] = {}
    sparse_conv3d(x, weight, fwd_algo=["fake_a", "fake_b"], record=record)
    if rank == 0:
        order.set("rank0_decided", "1")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"choice": record["AB_gather_scatter"], "n": len(coords)}, f)
    dist.destroy_process_group()
