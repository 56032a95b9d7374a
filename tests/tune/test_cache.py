"""TuneCache: file format, merge rule, locking, recovery from bad files, exit hooks, the background writer.

A put hands its write to the cache's writer thread: a test that reads the file right after puts
first calls ``wait_for_writes``."""

from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest

from sparseconv.tune import cache as cache_module
from sparseconv.tune.cache import TuneCache
from sparseconv.tune.cachefile import SCHEMA_VERSION

LOGGER = "sparseconv.tune.cache"
# Child processes load cache.py by its file: importing the package pulls in torch (~1.5 s a
# process), and the module needs nothing else from it.
IMPORT_CACHE = f"""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("sparseconv.tune.cache", {cache_module.__file__!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    TuneCache = module.TuneCache
"""


def entry(evidence: int, updated: float | None = None, **extra) -> dict:
    return {"evidence": evidence, "updated": time.time() if updated is None else updated, **extra}


def read_file(path: Path) -> dict:
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    assert doc["schema"] == SCHEMA_VERSION
    return doc["entries"]


def write_doc(path: Path, doc) -> bytes:
    data = msgpack.packb(doc, use_bin_type=True)
    path.write_bytes(data)
    return data


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def python(code: str, *args: str) -> list[str]:
    """argv of a child Python that runs ``code`` (which may use TuneCache) with ``args``."""
    return [sys.executable, "-c", textwrap.dedent(IMPORT_CACHE) + textwrap.dedent(code), *args]


@pytest.fixture
def cache_path(tmp_path: Path) -> Path:
    return tmp_path / "tune" / "cache.msgpack"


def test_entries_round_trip_through_a_fresh_cache_on_the_same_path(cache_path):
    first = TuneCache(cache_path, flush_interval_s=0)
    written = {("AB_gather_scatter", "k1"): entry(3, backend="explicit", times={"explicit": 1.5e-3})}
    written[("AtB_gather_gather", "k2")] = entry(0, backend="grouped")
    for (namespace, key), value in written.items():
        first.put(namespace, key, value)

    assert first.wait_for_writes(30)
    assert cache_path.exists()  # the directory was created on the first write
    second = TuneCache(cache_path)
    assert {(ns, k): e for ns, k, e in second.items()} == written
    assert second.get("AB_gather_scatter", "k1") == written[("AB_gather_scatter", "k1")]
    assert second.get("AB_gather_scatter", "missing") is None
    assert [k for _, k, _ in second.items("AtB_gather_gather")] == ["k2"]


@pytest.mark.parametrize("winner_first", [True, False], ids=["winner-writes-first", "winner-writes-last"])
@pytest.mark.parametrize(
    "winner, loser",
    [
        (entry(5, 100.0, tag="win"), entry(3, 200.0, tag="lose")),
        (entry(4, 200.0, tag="win"), entry(4, 100.0, tag="lose")),
        (entry(2, 100.0, tag="win", timings={"b": {"version": 2}, "c": {"version": 1}}),
         entry(9, 200.0, tag="lose", timings={"b": {"version": 1}, "c": {"version": 1}})),
    ],
    ids=["more-evidence-beats-later-update", "evidence-tie-goes-to-later-update",
         "newer-backend-version-beats-more-evidence"],
)
def test_merge_keeps_more_evidence_then_later_update(cache_path, winner, loser, winner_first):
    # Two caches that never saw each other's entries write the same key, in either order.
    a, b = TuneCache(cache_path, flush_interval_s=0), TuneCache(cache_path, flush_interval_s=0)
    writes = [(a, winner), (b, loser)] if winner_first else [(b, loser), (a, winner)]
    for cache, value in writes:
        cache.put("ns", "key", value)
        assert cache.wait_for_writes(30)

    assert read_file(cache_path)["ns"]["key"]["tag"] == "win"
    # The cache whose entry lost learned the winner from disk when it wrote.
    assert TuneCache(cache_path).get("ns", "key")["tag"] == "win"
    if winner_first:  # the loser's cache read the winner from disk when it wrote, and kept it
        assert b.get("ns", "key")["tag"] == "win"


WRITER = """
    import pathlib, sys, time
    path, worker = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    (path.parent / f"ready-{worker}").touch()
    while not (path.parent / "go").exists():  # start all writers together, after their imports
        time.sleep(0.002)
    cache = TuneCache(path, flush_interval_s=0)
    for i in range(50):
        cache.put("ns", f"w{worker}-k{i}", {"evidence": 1, "updated": time.time(), "worker": worker})
        if i == 25:
            cache.put("ns", "shared", {"evidence": 10 + worker, "updated": time.time(), "worker": worker})
"""


def test_concurrent_writer_processes_lose_no_entries_and_keep_the_best_shared_one(cache_path):
    cache_path.parent.mkdir(parents=True)
    workers = 4
    procs = [
        subprocess.Popen(
            python(WRITER, str(cache_path), str(w)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for w in range(workers)
    ]
    deadline = time.monotonic() + 60
    while not all((cache_path.parent / f"ready-{w}").exists() for w in range(workers)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "writers did not start"
        time.sleep(0.01)
    (cache_path.parent / "go").touch()
    for p in procs:
        _, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        assert "lock" not in stderr, stderr

    entries = read_file(cache_path)["ns"]
    expected = {f"w{w}-k{i}" for w in range(workers) for i in range(50)} | {"shared"}
    assert set(entries) == expected
    assert entries["shared"]["worker"] == workers - 1 and entries["shared"]["evidence"] == 10 + workers - 1
    assert not list(cache_path.parent.glob(".*.tmp"))  # no temp file left behind


def test_concurrent_threads_lose_no_entries(cache_path):
    cache = TuneCache(cache_path, flush_interval_s=0.005)

    def work(thread: int) -> None:
        for i in range(40):
            cache.put("ns", f"t{thread}-k{i}", entry(1))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.flush(force=True)

    assert len(cache.items()) == 240
    assert set(read_file(cache_path)["ns"]) == {f"t{t}-k{i}" for t in range(6) for i in range(40)}


def test_put_flushes_at_most_once_per_interval_and_force_writes_the_rest(cache_path):
    cache = TuneCache(cache_path, flush_interval_s=3600)
    cache.put("ns", "first", entry(1))  # nothing written yet, so the first put writes
    cache.put("ns", "second", entry(1))
    assert cache.wait_for_writes(30)
    assert set(read_file(cache_path)["ns"]) == {"first"}
    assert cache.flush() is False
    assert cache.flush(force=True) is True
    assert set(read_file(cache_path)["ns"]) == {"first", "second"}
    assert cache.flush(force=True) is False  # nothing left unflushed


def test_flush_under_a_held_lock_times_out_warns_and_writes_everything_after_release(cache_path, caplog):
    cache_path.parent.mkdir(parents=True)
    cache = TuneCache(cache_path, lock_timeout_s=0.2, flush_interval_s=0)
    holder = os.open(f"{cache_path}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        start = time.monotonic()
        cache.put("ns", "a", entry(1))  # its flush tries the lock once: the entries wait in memory, quietly
        cache.put("ns", "b", entry(2))
        assert cache.wait_for_writes(30)
        assert cache.flush() is False and not warnings_of(caplog)
        assert cache.flush(force=True) is False  # a forced one waits lock_timeout_s, then gives up, warning
        assert time.monotonic() - start < 5  # bounded by lock_timeout_s, not blocked forever
        assert not cache_path.exists()
        assert any("lock" in m and str(cache_path) in m for m in warnings_of(caplog))
        assert cache.get("ns", "b")["evidence"] == 2  # still served from memory
    finally:
        os.close(holder)  # releases the lock
    assert cache.flush() is True
    assert set(read_file(cache_path)["ns"]) == {"a", "b"}


def _valid_bytes() -> bytes:
    return msgpack.packb(
        {"schema": SCHEMA_VERSION, "entries": {"ns": {f"k{i}": entry(1, pad="x" * 50) for i in range(20)}}},
        use_bin_type=True,
    )


BAD_FILES = {
    "random-bytes": (lambda: bytes([0xC1]) + random.Random(0).randbytes(500), "corrupt-*"),
    "truncated": (lambda: _valid_bytes()[: len(_valid_bytes()) // 2], "corrupt-*"),
    "not-a-dict": (lambda: msgpack.packb([1, 2, 3]), "corrupt-*"),
    "old-schema": (lambda: msgpack.packb({"schema": 0, "entries": {"ns": {"k": entry(1)}}}), "old-schema-0"),
}


@pytest.mark.parametrize("first_use", ["get", "put"])
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_unusable_file_warns_is_moved_aside_and_a_fresh_cache_works(cache_path, caplog, kind, first_use):
    make, aside_pattern = BAD_FILES[kind]
    cache_path.parent.mkdir(parents=True)
    bad = make()
    cache_path.write_bytes(bad)

    cache = TuneCache(cache_path, flush_interval_s=0)
    if first_use == "get":
        assert cache.get("ns", "k") is None
    cache.put("ns", "fresh", entry(1))
    assert cache.wait_for_writes(30)

    messages = warnings_of(caplog)
    assert len(messages) == 1 and str(cache_path) in messages[0] and "moved aside" in messages[0], messages
    asides = list(cache_path.parent.glob(f"{cache_path.name}.{aside_pattern}"))
    assert len(asides) == 1 and asides[0].read_bytes() == bad
    assert read_file(cache_path) == {"ns": {"fresh": cache.get("ns", "fresh")}}
    assert TuneCache(cache_path).get("ns", "fresh") is not None


def test_only_the_newest_corrupt_files_moved_aside_are_kept(cache_path, caplog):
    # A cache corrupted again and again: each is moved aside, and the oldest go, so at most KEPT_CORRUPT stay.
    from sparseconv.tune.cache import KEPT_CORRUPT

    cache_path.parent.mkdir(parents=True)
    older = []
    for age in range(KEPT_CORRUPT + 2):  # earlier corruptions, oldest first
        old = cache_path.with_name(f"{cache_path.name}.corrupt-2026010{age}T000000-{100 + age}")
        old.write_bytes(b"old")
        os.utime(old, (1_000_000 + age, 1_000_000 + age))
        older.append(old)
    unrelated = cache_path.with_name("other.msgpack.corrupt-20260101T000000-1")  # another cache's: not ours
    unrelated.write_bytes(b"other")
    bad = bytes([0xC1]) + random.Random(1).randbytes(100)
    cache_path.write_bytes(bad)
    assert TuneCache(cache_path, flush_interval_s=0).get("ns", "k") is None
    asides = sorted(cache_path.parent.glob(f"{cache_path.name}.corrupt-*"))
    assert len(asides) == KEPT_CORRUPT and set(older[-(KEPT_CORRUPT - 1):]) < set(asides)
    assert [a.read_bytes() for a in asides if a not in older] == [bad] and unrelated.exists()


def test_malformed_entries_are_dropped_with_a_warning_and_the_rest_kept(cache_path, caplog):
    cache_path.parent.mkdir(parents=True)
    good = entry(2, tag="good")
    write_doc(cache_path, {"schema": SCHEMA_VERSION, "entries": {
        "ns": {"good": good, "not-a-dict": [1, 2], "no-evidence": {"updated": 1.0},
               "negative": entry(-1), "no-updated": {"evidence": 1}},
        "bad-namespace": "not a dict",
    }})

    cache = TuneCache(cache_path)
    assert cache.items() == [("ns", "good", good)]
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "dropped 5" in messages[0] and str(cache_path) in messages[0], messages
    assert not list(cache_path.parent.glob("*.corrupt-*"))  # the file as a whole was usable


def test_put_rejects_entries_the_merge_rule_cannot_order(cache_path):
    cache = TuneCache(cache_path)
    with pytest.raises(ValueError, match="evidence"):
        cache.put("ns", "k", {"updated": 1.0})
    with pytest.raises(ValueError, match="updated"):
        cache.put("ns", "k", {"evidence": 1, "updated": "yesterday"})
    with pytest.raises(TypeError, match="msgpack"):
        cache.put("ns", "k", entry(1, backend=object()))
    with pytest.raises(TypeError, match="str"):
        cache.put("ns", 3, entry(1))
    assert cache.items() == [] and not cache_path.exists()


def test_export_and_merge_file_carry_entries_between_paths(tmp_path):
    source = TuneCache(tmp_path / "a" / "cache.msgpack", flush_interval_s=0)
    source.put("ns", "only-in-source", entry(1))
    source.put("ns", "source-better", entry(9, tag="source"))
    source.put("ns", "target-better", entry(1, tag="source"))
    exported = tmp_path / "export" / "cache.msgpack"
    assert source.export(exported) == 3
    assert set(read_file(exported)["ns"]) == {"only-in-source", "source-better", "target-better"}

    target_path = tmp_path / "b" / "cache.msgpack"
    target = TuneCache(target_path, flush_interval_s=3600)
    target.put("ns", "source-better", entry(2, tag="target"))
    target.put("ns", "target-better", entry(5, tag="target"))

    assert target.merge_file(exported) == 2
    on_disk = read_file(target_path)["ns"]  # merge_file flushed despite the long interval
    assert {k: e.get("tag") for k, e in on_disk.items()} == {
        "only-in-source": None, "source-better": "source", "target-better": "target",
    }
    garbage = tmp_path / "garbage.msgpack"
    garbage.write_bytes(b"\xc1\xc1\xc1")
    with pytest.raises(ValueError, match="garbage.msgpack"):
        target.merge_file(garbage)


def test_clear_empties_memory_and_file(cache_path):
    cache = TuneCache(cache_path, flush_interval_s=0)
    cache.put("ns", "k1", entry(1))
    cache.put("other", "k2", entry(1))
    cache.clear()
    assert cache.items() == [] and cache.get("ns", "k1") is None
    assert read_file(cache_path) == {}
    assert TuneCache(cache_path).items() == []


def test_unwritable_directory_warns_once_and_keeps_working_in_memory(tmp_path, caplog):
    # A parent that is a regular file stops writes even for root, unlike chmod.
    (tmp_path / "a-file").write_text("not a directory")
    path = tmp_path / "a-file" / "tune" / "cache.msgpack"
    cache = TuneCache(path, flush_interval_s=0)
    for i in range(3):
        cache.put("ns", f"k{i}", entry(i))
    assert cache.flush(force=True) is False
    assert cache.get("ns", "k2")["evidence"] == 2 and len(cache.items()) == 3
    messages = warnings_of(caplog)
    assert len(messages) == 1 and str(path) in messages[0], messages


EXITING = """
    import os, signal, sys, threading, time
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # importing installed nothing
    assert threading.active_count() == 1  # and started no thread
    path, mode = sys.argv[1], sys.argv[2]
    if mode == "chained":
        def previous(signum, frame):
            os._exit(7)
        signal.signal(signal.SIGTERM, previous)
    cache = TuneCache(path, flush_interval_s=3600)
    if mode == "thread":  # off the main thread: atexit only, with a warning
        worker = threading.Thread(target=cache.install_exit_hooks)
        worker.start()
        worker.join()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    elif mode != "no-hooks":
        cache.install_exit_hooks()
        handler = signal.getsignal(signal.SIGTERM)
        cache.install_exit_hooks()
        assert signal.getsignal(signal.SIGTERM) is handler  # idempotent: not chained to itself
    assert threading.active_count() == 1  # the writer thread starts with the first put that needs it
    for i in range(5):
        cache.put("ns", f"k{i}", {"evidence": 1, "updated": time.time()})
    if len(sys.argv) > 3:
        assert cache.wait_for_writes(30)  # the first put's write, handed to the writer thread
    print("ready", flush=True)
    if len(sys.argv) > 3:
        time.sleep(60)
"""


@pytest.mark.parametrize("mode, status", [("default", -signal.SIGTERM), ("chained", 7)])
def test_sigterm_flushes_entries_then_the_process_dies_as_before(cache_path, mode, status):
    cache_path.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        python(EXITING, str(cache_path), mode, "sleep"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.poll() is not None else line
        assert set(read_file(cache_path)["ns"]) == {"k0"}  # only the first put was written so far
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == status
    assert set(read_file(cache_path)["ns"]) == {f"k{i}" for i in range(5)}


@pytest.mark.parametrize("mode, flushed", [("default", 5), ("thread", 5), ("no-hooks", 1)])
def test_normal_exit_flushes_entries_through_atexit(cache_path, mode, flushed):
    cache_path.parent.mkdir(parents=True)
    argv = python(EXITING, str(cache_path), mode)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert set(read_file(cache_path)["ns"]) == {f"k{i}" for i in range(flushed)}
    assert ("main thread" in result.stderr) == (mode == "thread")


def test_a_conv_never_waits_for_a_cache_lock_another_process_holds_and_its_entries_land_after(tmp_path):
    # A held lock (another process merging its tunings, a slow disk) must not stall a training step: the conv's
    # tuner puts its timings and goes on; they reach the file at a later flush. The lock is held from another
    # open file (as another process holds it) for up to 30 s, the cache allows 60 s of waiting: a conv that
    # waited would return only after the holder let go (then its flush would have written the file).
    import torch

    import sparseconv.tune
    from sparseconv import SparseTensor
    from sparseconv.ops import sparse_conv3d

    cache = sparseconv.tune.get_tuner().cache
    cache.lock_timeout_s, cache.flush_interval_s = 60.0, 0.0
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    locked, release, released = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        fd = os.open(f"{cache.path}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked.set()
            release.wait(30)
        finally:
            os.close(fd)
            released.set()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        torch.manual_seed(0)
        coords = torch.unique(torch.randint(0, 6, (60, 4), dtype=torch.int32) * torch.tensor([0, 1, 1, 1]), dim=0)
        x = SparseTensor(coords, torch.randn(len(coords), 3))
        sparse_conv3d(x, torch.randn(27, 3, 4), kernel_size=3)  # auto: its candidates are timed, then put
        assert not released.is_set(), "the conv waited for the lock"
        assert cache.wait_for_writes(30)  # its writer thread tried the lock once, and left the entries
        timed = cache.items()
        assert timed and not cache.path.exists()  # in memory, not yet in the file
    finally:
        release.set()
        holder.join()
    assert cache.flush(force=True) is True
    assert {(namespace, key) for namespace, key, _ in timed} <= {
        (namespace, key) for namespace, keys in read_file(cache.path).items() for key in keys}
