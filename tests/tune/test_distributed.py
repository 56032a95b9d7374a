"""Ranks on the gloo backend agree on one choice per key, split the tuning of cold keys and never
wait on each other; killed writers leave a cache file the next process reads."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_worker import run_rank

from sparseconv.tune import TuneCache

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
JOB_TIMEOUT_S = 90  # far above a job's ~10 s; a rank waiting on another's sweep deadlocks instead


def _job(root: Path, scenario: str, world: int = 2) -> list[dict]:
    (root / "out").mkdir(parents=True)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(r, world, str(root), scenario)) for r in range(world)]
    for p in processes:
        p.start()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(processes) if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {JOB_TIMEOUT_S} s"
    assert [p.exitcode for p in processes] == [0] * world
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(world)]


def _keys(cache_dir: Path) -> set[str]:
    return {key for _, key, _ in TuneCache(cache_dir / "autotune.msgpack").items()}


def _table(result: dict) -> dict[str, str]:
    return {key: choice for _, key, choice in result["choices"]}


def test_a_cold_key_is_timed_by_one_rank_while_the_others_run_on_then_take_its_choice(tmp_path):
    rank0, rank1 = _job(tmp_path, "split")

    # Rank 1 ran the small problem while rank 0 was inside its sweep (the pool's first, fake_a),
    # timed its own large problem meanwhile, then ran rank 0's choice (fake_b: rank 0's timings).
    assert rank0["calls"]["small"] == ["fake_b"]
    assert rank1["calls"]["small"] == ["fake_a", "fake_b", "fake_b"]
    assert rank1["calls"]["large"] == ["fake_a"]  # its own timings
    small = next(iter(_table(rank0)))
    assert _table(rank1)[small] == _table(rank0)[small] == "fake_b"
    # Each key was timed by one rank: it is in that rank's cache only.
    caches = tmp_path / "caches"
    assert _keys(caches / "rank0") == {small}
    assert _keys(caches / "rank1") == set(_table(rank1)) - {small}


def test_a_warm_restarted_rank_runs_while_a_cold_one_sweeps_and_both_entries_reach_one_file(tmp_path):
    warm, cold = _job(tmp_path, "warm_cold")

    # The warm rank's three calls happened while the cold rank was inside its sweep of that key.
    assert warm["calls"]["small"] == ["fake_b"] * 3
    assert cold["calls"]["small"] == ["fake_b"]  # its own timings favour fake_a: it took the warm choice
    small = next(iter(_table(warm)))
    assert _table(cold)[small] == "fake_b"
    # One shared file: the cold rank's large key and both ranks' timings of the small key, each
    # candidate with its fastest time (fake_a from the cold rank, fake_b from the warm one).
    entries = {key: entry for _, key, entry in TuneCache(tmp_path / "caches" / "shared" / "autotune.msgpack").items()}
    assert set(entries) == set(_table(cold))
    timings = entries[small]["timings"]
    assert {t["verdict"] for t in timings.values()} == {"ok"}
    assert max(t["ms"] for t in timings.values()) < 10  # both 20 ms sleeps were beaten


KILLED_WRITER = """
    import sys, time
    from sparseconv.tune import TuneCache
    cache = TuneCache(sys.argv[1], flush_interval_s=3600)
    # ~4 MB written per flush, so that a write lasts long enough to be caught in the middle.
    record = {"ms": 1.0, "version": 1, "verdict": "ok", "samples": 3, "reason": "x" * 500}
    timings = {f"c{j}": record for j in range(40)}
    for i in range(200):
        cache.put("ns", f"k{i}", {"timings": timings, "evidence": 3, "updated": time.time()})
    for i in range(200, 100_000):
        cache.put("ns", f"k{i}", {"timings": timings, "evidence": 3, "updated": time.time()})
        cache.flush(force=True)
"""


def test_a_writer_killed_mid_write_leaves_a_cache_file_the_next_process_reads(tmp_path, caplog):
    path = tmp_path / "autotune.msgpack"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(path)])
    try:
        deadline = time.monotonic() + 60
        # Kill it while a write is in progress (its temp file exists), after a complete write.
        while not (path.exists() and path.stat().st_size > 4_000_000
                   and any(name.endswith(".tmp") for name in os.listdir(tmp_path))):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never got going"
            time.sleep(0.0002)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL

    entries = TuneCache(path).items()
    assert "unusable" not in caplog.text and "malformed" not in caplog.text
    assert len(entries) >= 200 and all(len(entry["timings"]) == 40 for _, _, entry in entries)
    survivor = TuneCache(path, flush_interval_s=0)
    survivor.put("ns", "after", {"evidence": 1, "updated": time.time()})
    assert survivor.wait_for_writes(30)  # (the put handed its write to the cache's writer thread)
    assert len(TuneCache(path).items()) == len(entries) + 1  # and it writes on from there


def test_train_ddp_script_trains_two_gloo_ranks_that_agree_and_share_one_cache(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "SPARSECONV_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           # every key met settles in its first call (in two steps a key's sweep spread over calls would not)
           "SPARSECONV_AUTOTUNE_EFFORT": "full"}
    env.pop("TRITON_INTERPRET", None)  # interpreted Triton candidates would make the sweeps minutes long
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(root / "scripts" / "train_ddp.py"), "--device", "cpu", "--steps", "2", "--warmup-steps", "1",
               "--scale", "0.01", "--width", "2", "--json", str(tmp_path / "result.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ranks agree on every key" in done.stdout and "samples/s" in done.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2 and result["disagreements"] == 0 and result["samples_per_s"] > 0
    keys = [{(ns, key) for ns, key, _ in rank["choices"]} for rank in result["ranks"]]
    # Ranks see different scenes, so each has keys of its own; it timed them, and both ranks'
    # entries reached the one shared file.
    on_disk = {(ns, key) for ns, key, _ in TuneCache(tmp_path / "cache" / "autotune.msgpack").items()}
    assert on_disk & (keys[0] - keys[1]) and on_disk & (keys[1] - keys[0])


@pytest.fixture
def store(monkeypatch):
    from sparseconv.tune import distributed

    hash_store = dist.HashStore()
    monkeypatch.setattr(distributed, "_default_store", lambda: hash_store)
    return hash_store


def test_claim_lets_one_process_time_a_key_and_the_others_take_its_published_choice(store):
    from sparseconv.tune.distributed import CLAIM_PREFIX, STORE_PREFIX, agree, claim

    assert claim("ns", "mine") is None and claim("ns", "mine") is None  # ours, also when asked again
    store.set(f"{CLAIM_PREFIX}ns/k", f"otherhost:1:{time.time()}")
    assert claim("ns", "k") == ""  # another process is timing it
    assert agree("ns", "k", "fake_b") == "fake_b"  # what that process publishes
    assert claim("ns", "k") == "fake_b"


def test_a_claim_left_unpublished_too_long_is_taken_over(store):
    from sparseconv.tune.distributed import CLAIM_PREFIX, CLAIM_TIMEOUT_S, claim

    store.set(f"{CLAIM_PREFIX}ns/k", f"deadhost:1:{time.time() - CLAIM_TIMEOUT_S - 1}")
    assert claim("ns", "k") is None
    assert store.get(f"{CLAIM_PREFIX}ns/k").decode().startswith(f"{socket.gethostname()}:{os.getpid()}:")


def test_populate_on_several_devices_splits_the_grid_and_merges_one_file(tmp_path, monkeypatch):
    from sparseconv.tune import get_tuner
    from sparseconv.cli.cache import populate_devices

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # interpreted Triton candidates: minutes
    # Two processes on devices of one model (here the CPU): each tunes one of the two sizes.
    populate_devices(["cpu", "cpu"], [512, 2048], [4], ["3"], "float32")
    entries = get_tuner().cache.items("AB_gather_scatter")
    assert len({key.split("|")[1] for _, key, _ in entries}) == 2  # both sizes' keys, one file


def test_devices_of_one_model_split_the_populate_grid_and_another_model_gets_it_whole():
    from sparseconv.cli.cache import split_grid

    shares = split_grid([1, 2, 3], ["cuda:0", "cuda:1", "cuda:2"], ["H200", "H200", "A100"])
    assert shares == [("cuda:0", [1, 3]), ("cuda:1", [2]), ("cuda:2", [1, 2, 3])]
