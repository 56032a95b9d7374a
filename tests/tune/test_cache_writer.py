"""The tune cache's background writer: a put never waits for the file, and what it handed still
reaches the file (later, at exit, on SIGTERM, and from a forked child)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from test_cache import entry, python, read_file

from sparseconv.tune import cache as cache_module
from sparseconv.tune.cache import TuneCache

SLOW_WRITE_S = 2.0


@pytest.fixture
def slow_disk(monkeypatch) -> threading.Event:
    """The first file write takes SLOW_WRITE_S more (a slow or busy disk); the event is set once it began."""
    write, began = cache_module.write_entries, threading.Event()

    def slow(path, entries):
        if not began.is_set():
            began.set()
            time.sleep(SLOW_WRITE_S)
        write(path, entries)

    monkeypatch.setattr(cache_module, "write_entries", slow)
    return began


def test_a_put_returns_without_waiting_for_a_slow_disk_and_its_entries_land_after(tmp_path, slow_disk):
    path = tmp_path / "tune" / "cache.msgpack"
    cache = TuneCache(path, flush_interval_s=0)
    assert cache.get("ns", "other") is None
    start = time.monotonic()
    cache.put("ns", "first", entry(1))  # due: its write is handed to the writer thread
    # Bounded "did not block" checks: written in the call, the put would take SLOW_WRITE_S.
    assert time.monotonic() - start < SLOW_WRITE_S / 2, "a put waited for the file write"
    assert slow_disk.wait(10)
    start = time.monotonic()
    cache.put("ns", "second", entry(2))  # while the writer thread is in its slow write, holding its locks
    assert cache.get("ns", "first")["evidence"] == 1
    assert time.monotonic() - start < SLOW_WRITE_S / 2, "a put waited for the writer thread's write"
    assert not path.exists() and cache.unflushed == 2
    assert cache.wait_for_writes(30)
    assert set(read_file(path)["ns"]) == {"first", "second"} and cache.unflushed == 0
    assert cache.flush(force=True) is False  # nothing left to write


KILLED_IN_A_PUT = """
    import os, signal, sys, threading, time
    cache = TuneCache(sys.argv[1], flush_interval_s=3600)
    cache.install_exit_hooks()
    write, began = module.write_entries, threading.Event()

    def slow(path, entries):
        began.set()
        time.sleep(1.0)
        write(path, entries)

    module.write_entries = slow
    for i in range(5):  # the first put hands k0 to the writer thread, which is slow to write it
        cache.put("ns", f"k{i}", {"evidence": 1, "updated": time.time()})
    assert began.wait(30)
    # The signal comes inside a put's section of the entries' lock, which the writer thread needs once its
    # file write is done: a handler that waited for that write (for the thread's flush lock) would wait forever.
    with cache._mem_lock:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    raise AssertionError("SIGTERM did not end the process")
"""


def test_sigterm_during_a_background_write_flushes_everything_and_dies(tmp_path):
    path = tmp_path / "cache.msgpack"
    try:
        result = subprocess.run(python(KILLED_IN_A_PUT, str(path)), check=False, capture_output=True, text=True, timeout=25)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the SIGTERM handler deadlocked with the writer thread: {hung.stderr!r}")
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert set(read_file(path)["ns"]) == {f"k{i}" for i in range(5)}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_background_write_can_put_and_flush(tmp_path, slow_disk):
    # A DataLoader worker forked while the writer thread holds the cache's locks: the thread is gone in the
    # child, and its locks would stay held there forever unless the fork hook gives the child new ones.
    path = tmp_path / "tune" / "cache.msgpack"
    cache = TuneCache(path, flush_interval_s=0)
    cache.put("ns", "parent", entry(1))
    assert slow_disk.wait(10)  # the writer thread is in its write now
    pid = os.fork()
    if pid == 0:  # the child: reports through its exit status only, and never returns into pytest
        status = 1
        try:
            cache.put("ns", "child", entry(2))  # starts the child's own writer thread
            cache.wait_for_writes(10)  # (it may find the parent's write holding the file lock: then)
            cache.flush(force=True)  # a forced flush waits for that lock
            status = 0 if "child" in read_file(path)["ns"] else 2
        finally:
            os._exit(status)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on a lock its parent's writer thread held")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.wait_for_writes(30)
    assert set(read_file(path)["ns"]) == {"parent", "child"}
