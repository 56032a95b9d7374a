"""A rank of the distributed tuner tests (spawned by test_distributed.py).

Ranks order their steps through a FileStore of the test's own (``order``), never through the
tuner: a step that waits on another rank's *tuning* would deadlock the scenario if the tuner
made ranks wait on each other, and the test's bounded join then fails instead of hanging.
"""

from __future__ import annotations

import functools
import json
import os
import time
from datetime import timedelta
from pathlib import Path

WAIT = timedelta(seconds=45)
SMALL, LARGE = 1000, 4000  # in different size buckets, so different keys


def run_rank(rank: int, world: int, root: str, scenario: str) -> None:
    """Play ``rank``'s part of ``scenario`` ("split" or "warm_cold") and write root/out/rank<r>.json."""
    root_path = Path(root)
    shared = scenario == "warm_cold"
    os.environ["SPARSECONV_CACHE_DIR"] = str(root_path / "caches" / ("shared" if shared else f"rank{rank}"))
    import torch
    import torch.distributed as dist

    from sparseconv import SparseTensor, tune
    from sparseconv.ops import sparse_conv3d
    from sparseconv.backends import Backend, explicit, register
    from sparseconv.tune import budget, tuner

    # as tests/conftest.py's whole_sweeps: a key's sweep in the call that meets it
    tuner.TimingBudget = functools.partial(budget.TimingBudget, burst=1.0, per_call=None)

    order = dist.FileStore(str(root_path / "order"), world)
    # A rank's own timings favour fake_b on rank 0 and fake_a elsewhere: only agreement makes
    # them choose alike. `hold` blocks a backend's first call (inside a sweep) on a signal.
    hold: dict[str, tuple[str, str]] = {}

    def backend(name: str, delay_s: float) -> Backend:
        # Replays its first result per input, so a loaded machine's noise stays far below delay_s.
        memo: dict[tuple, torch.Tensor] = {}

        def run(namespace, problem, params, a, b, kernel_map):
            if name in hold:
                signal, until = hold.pop(name)
                order.set(signal, "1")
                order.wait([until], WAIT)
            time.sleep(delay_s)
            key = (a.data_ptr(), b.data_ptr(), id(kernel_map))
            if key not in memo:
                memo[key] = explicit.run(namespace, problem, params, a, b, kernel_map)
            return memo[key].clone()
        return Backend(name, frozenset({"AB_gather_scatter"}), run)

    register(backend("fake_a", 0.02 if rank == 0 else 0.0))
    register(backend("fake_b", 0.0 if rank == 0 else 0.02))
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(27, 4, 4, generator=generator)
    clouds = {}
    for label, size in (("small", SMALL), ("large", LARGE)):
        coords = torch.unique(torch.randint(0, 40, (size, 4), generator=generator), dim=0)
        coords[:, 0] = 0
        coords = torch.unique(coords, dim=0)
        clouds[label] = SparseTensor(coords, torch.randn(len(coords), 4, generator=generator))
    calls: dict[str, list[str]] = {"small": [], "large": []}

    def conv(label: str) -> None:
        record: dict[str, str] = {}
        sparse_conv3d(clouds[label], weight, fwd_algo=["fake_a", "fake_b"], record=record)
        calls[label].append(record["AB_gather_scatter"])

    def init() -> None:
        dist.init_process_group("gloo", init_method=f"file://{root_path / 'init'}", rank=rank,
                                world_size=world, timeout=WAIT)

    if scenario == "split":
        # Rank 0 times the small key; rank 1 runs it while rank 0 is still inside that sweep,
        # and meanwhile times a key of its own (another N); then it takes rank 0's choice.
        init()
        if rank == 0:
            hold["fake_a"] = ("rank0_sweeping", "rank1_ran")
            conv("small")
            order.set("rank0_decided", "1")
        else:
            order.wait(["rank0_sweeping"], WAIT)
            conv("small")
            conv("large")
            order.set("rank1_ran", "1")
            order.wait(["rank0_decided"], WAIT)
            conv("small")
            conv("small")
    elif scenario == "warm_cold":
        # Rank 0 restarts with a warm cache (written after rank 1 loaded the shared file, so rank
        # 1 stays cold); it runs while rank 1 is inside its sweep of the same key.
        if rank == 0:
            order.wait(["rank1_loaded"], WAIT)
            conv("small")  # no process group yet: tunes alone, as the run before the restart
            tune.reset()  # flushes; the next tuner reads the file, as a restarted process does
            calls["small"].clear()
            init()
            order.wait(["rank1_sweeping"], WAIT)
            for _ in range(3):
                conv("small")
            order.set("rank0_done", "1")
        else:
            tune.get_tuner().cache.items()
            order.set("rank1_loaded", "1")
            init()
            hold["fake_a"] = ("rank1_sweeping", "rank0_done")
            conv("small")
            conv("large")
    else:
        raise ValueError(f"scenario must be 'split' or 'warm_cold', got {scenario!r}")
    result = {"calls": calls, "choices": tune.get_tuner().choices()}
    (root_path / "out" / f"rank{rank}.json").write_text(json.dumps(result))
    tune.reset()  # flush this rank's entries now, not at interpreter exit
    dist.destroy_process_group()
