"""The tune cache's background writer: one daemon thread that writes what puts hand it, so a conv call
that stored a timing never waits for the file (its lock, a slow disk, an unwritable directory).

The thread starts on the first hand-off (never at import) and ends after :data:`IDLE_S` without work;
the next hand-off starts another. Hand-offs coalesce: keys handed while the thread is busy replace
the earlier keys not yet taken, which they contain (the cache hands every unflushed key).

Fork (a DataLoader worker): the thread does not survive it, and a lock it held at that moment would
stay held in the child forever. The child's writers forget their thread and pending work and rebuild
their locks (and the cache's, through ``reset_in_child``); the child's next hand-off starts its own
thread. What the parent had handed is the parent's to write.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

from .cachefile import Key

logger = logging.getLogger("sparseconv.tune.cache")

IDLE_S = 10.0
"""Seconds without work after which the thread ends: a training run tunes in bursts, then runs for hours."""

_WRITERS: weakref.WeakSet[CacheWriter] = weakref.WeakSet()
_fork_hook_installed = False


class CacheWriter:
    """Runs ``write(keys)`` on a daemon thread for the latest ``keys`` handed to it."""

    def __init__(self, write: Callable[[frozenset[Key]], None], reset_in_child: Callable[[], None], name: str) -> None:
        self._write = write
        self._reset_in_child = reset_in_child
        self._name = name
        self._wake = threading.Condition(threading.Lock())
        self._pending: frozenset[Key] | None = None  # handed, not yet taken by the thread
        self._busy = False  # the thread is writing what it took
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def hand(self, pending: frozenset[Key]) -> None:
        """Have ``pending`` written soon, on the thread; returns at once."""
        with self._wake:
            self._pending = pending
            started = self._thread is not None and self._pid == os.getpid()
            if not started:
                try:
                    self._start()
                    started = True
                except RuntimeError:  # no new thread (the interpreter is shutting down): write it here
                    self._pending = None
            self._wake.notify_all()  # (all: a wait() may be waiting on the same condition as the thread)
        if not started:
            self._write(pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until everything handed is written (or its write failed); False if ``timeout`` passed first."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending is None and not self._busy, timeout)

    # -- private -------------------------------------------------------------------------------

    def _start(self) -> None:
        _watch_forks()
        _WRITERS.add(self)
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        thread.start()  # (it waits for the lock the caller holds before it looks at anything)
        self._thread, self._pid = thread, os.getpid()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._wake.wait_for(lambda: self._pending is not None, IDLE_S):
                    self._thread = None  # (under the lock: a hand-off from now on starts a new thread)
                    return
                pending, self._pending = self._pending, None
                self._busy = True
            try:
                self._write(pending)
            except Exception:  # noqa: BLE001 - the thread must outlive a bad write; the entries stay unflushed
                logger.warning("tune cache writer: a write failed", exc_info=True)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _after_fork_in_child(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._pending, self._busy, self._thread = None, False, None
        self._reset_in_child()


def _watch_forks() -> None:
    """Install the fork hook, once, when the first writer starts (not at import: no side effects there)."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def _after_fork_in_child() -> None:
    for writer in list(_WRITERS):
        writer._after_fork_in_child()
