"""Ranks on the gloo backend agree on one choice per key and never wait on each other's tuning."""

from __future__ import annotations

import json
import multiprocessing
import shutil

import pytest
import torch.distributed as dist
from dist_worker import run_rank

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _job(tmp_path, name: str, sizes: list[int]) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    out = tmp_path / name
    out.mkdir()
    init_file = tmp_path / f"{name}.init"
    processes = [
        context.Process(target=run_rank, args=(r, len(sizes), str(init_file), str(tmp_path / "caches"), str(out), sizes))
        for r in range(len(sizes))
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
    hung = [p.pid for p in processes if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after 120 s"
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(sizes))]


def test_ranks_agree_cold_then_with_one_warm_and_one_cold_cache(tmp_path):
    cold = _job(tmp_path, "cold", [3000, 3000])
    assert cold[0]["n"] == cold[1]["n"]
    assert cold[0]["choice"] == cold[1]["choice"] == "fake_a"  # rank 0 offered first

    shutil.rmtree(tmp_path / "caches" / "rank0")  # rank 1 warm (its timings favour fake_b), rank 0 cold
    warm = _job(tmp_path, "warm", [3000, 3000])
    assert warm[0]["choice"] == warm[1]["choice"]


def test_ranks_with_different_problems_do_not_wait_for_each_other(tmp_path):
    results = _job(tmp_path, "mixed", [3000, 3000, 9000])
    assert results[0]["choice"] == results[1]["choice"]
    assert results[2]["n"] != results[0]["n"] and results[2]["choice"] in ("fake_a", "fake_b")
