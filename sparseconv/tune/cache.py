"""The tuner's on-disk cache: one msgpack file shared by every process (and rank) on the machine.

File format: ``{"schema": SCHEMA_VERSION, "entries": {namespace: {key: entry}}}``. Writers take
the advisory lock ``<path>.lock``, re-read the file, merge per (namespace, key) by the
rule of :mod:`.merge` (newer backend versions, then the measured-fastest; no candidate's timing
lost), and replace the file atomically, so concurrent
writers never lose each other's entries and readers never see half a file.

A put never writes: the conv call that stored a timing hands its unflushed entries to a background
writer (:mod:`.cachewriter`) and goes on, so a held lock, a slow disk or an unwritable directory
never delays it. Forced flushes (the exit, SIGTERM, the CLI, the demo) write in the calling thread.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import glob
import logging
import math
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack

from . import shipped
from .cachefile import CORRUPT, Entries, Key, Unusable, entry_problem, read_entries, write_entries
from .cachewriter import CacheWriter
from .merge import merge as _merge

logger = logging.getLogger("sparseconv.tune.cache")

KEPT_CORRUPT = 3
"""Corrupt cache files moved aside that are kept (the newest): evidence for a bug report, not a pile."""

# Between lock polls: short against a write (a few ms), long enough not to spin a core.
_LOCK_POLL_S = 0.005


class TuneCache:
    """Entries by (namespace, key); in memory, merged with the file on load and flush."""

    def __init__(
        self, path: str | os.PathLike, *, lock_timeout_s: float = 10.0, flush_interval_s: float = 2.0
    ) -> None:
        self.path = pathlib.Path(path)
        self.lock_timeout_s = lock_timeout_s
        self.flush_interval_s = flush_interval_s
        self._entries: Entries = {}
        self._dirty: set[Key] = set()
        self._loaded = False
        self._last_attempt = -math.inf  # a put's hand-off or a flush, failed or not
        self._unwritable_warned = False
        self._newer_file = False  # the file belongs to a newer sparseconv: never written
        self._exit_registered = self._exit_flush = self._sigterm_installed = False
        self._make_locks()
        self._writer = CacheWriter(self._write_handed, self._make_locks, name="sparseconv-tune-cache-writer")

    def get(self, namespace: str, key: str) -> dict | None:
        """The entry for (namespace, key): this cache's, else the shipped one (:mod:`.shipped`), else
        None; treat it as read-only and put a new one to change it."""
        self._ensure_loaded()
        with self._mem_lock:
            entry = self._entries.get((namespace, key))
        if entry is None:
            # A read-only layer beneath the file: never merged into it, so only what is re-timed
            # (a changed backend's candidates) reaches the user's file, through put.
            entry = shipped.lookup(namespace, key)
        return entry

    def put(self, namespace: str, key: str, entry: dict) -> None:
        """Store ``entry`` (replacing what memory holds); if flush_interval_s has passed, hand the unflushed
        entries to the background writer. Never touches the file: it returns without waiting for it."""
        if not isinstance(namespace, str) or not isinstance(key, str):
            names = f"{type(namespace).__name__}, {type(key).__name__}"
            raise TypeError(f"namespace and key must be str, got {names}")
        problem = entry_problem(entry)
        if problem is not None:
            raise ValueError(f"entry for {namespace}/{key}: {problem}")
        try:
            msgpack.packb(entry, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"entry for {namespace}/{key} is not msgpack-able: {exc}") from None
        with self._mem_lock:
            self._entries[(namespace, key)] = dict(entry)
            self._dirty.add((namespace, key))
            now = time.monotonic()
            # Failed attempts count too: a contended lock must not make every put hand a write.
            if now - self._last_attempt < self.flush_interval_s:
                return
            self._last_attempt = now
            handed = frozenset(self._dirty)
        self._register_exit()  # what was handed is written before the process ends
        self._writer.hand(handed)

    def items(self, namespace: str | None = None) -> list[tuple[str, str, dict]]:
        """(namespace, key, entry) of every entry, or of one namespace, sorted."""
        self._ensure_loaded()
        with self._mem_lock:
            found = [(ns, k, e) for (ns, k), e in self._entries.items() if namespace in (None, ns)]
        return sorted(found, key=lambda item: item[:2])

    def flush(self, force: bool = False) -> bool:
        """Merge unflushed puts into the file, in the calling thread, if forced or flush_interval_s has passed;
        True if it wrote. Forced, it waits up to lock_timeout_s for the file's lock; else it tries the lock once
        (held elsewhere, the entries wait in memory for a later write or the exit)."""
        with self._io_lock:
            with self._mem_lock:
                if not self._dirty:
                    return False
                now = time.monotonic()
                if not force and now - self._last_attempt < self.flush_interval_s:
                    return False
                self._last_attempt = now
                pending = self._unflushed()
            return self._write_pending(pending, wait=force)

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Wait until what puts handed to the background writer is written, or its attempt failed (False if
        ``timeout`` seconds passed first). The exit waits for it by itself; tests and tools that read the
        file right after a put call this."""
        return self._writer.wait(timeout)

    def clear(self) -> None:
        """Forget every entry, in memory and in the file."""
        with self._load_lock, self._io_lock:
            with self._mem_lock:
                self._entries.clear()
                self._dirty.clear()
                self._loaded = True
            try:
                with self._file_lock() as held:
                    if held:
                        write_entries(self.path, {})
            except OSError as exc:
                self._warn_unwritable(exc)

    def export(self, path: str | os.PathLike) -> int:
        """Write every entry to the cache file ``path`` (atomically); returns the count; raises OSError."""
        self._ensure_loaded()
        with self._mem_lock:
            entries = dict(self._entries)
        write_entries(pathlib.Path(path), entries)
        return len(entries)

    def merge_file(self, path: str | os.PathLike) -> int:
        """Take the winning entries of the cache file ``path``, then flush; returns how many were taken."""
        try:
            other = read_entries(pathlib.Path(path))
        except Unusable as exc:  # OSError (missing, unreadable) is the caller's to see as is
            raise ValueError(f"merge_file: {os.fspath(path)!r} is not a tune cache: {exc.args[0]}") from None
        self._ensure_loaded()
        with self._mem_lock:
            taken = _merge(self._entries, other)
            self._dirty.update(taken)
        self.flush(force=True)
        return len(taken)

    def install_exit_hooks(self) -> None:
        """Flush (forced) at interpreter exit and on SIGTERM (main thread only); idempotent, never raises."""
        try:
            self._flush_at_exit()
            if self._sigterm_installed:
                return
            if threading.current_thread() is not threading.main_thread():
                logger.warning("tune cache %s: no SIGTERM flush (not called on the main thread)", self.path)
                return
            previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, functools.partial(self._on_sigterm, previous))
            self._sigterm_installed = True
        except Exception:  # noqa: BLE001 - hooks are a convenience; a failure must not stop the caller
            logger.warning("tune cache %s: could not install exit hooks", self.path, exc_info=True)

    # -- private -------------------------------------------------------------------------------

    def _make_locks(self) -> None:
        """New locks (at start, and in a forked child, where a lock the writer thread held stays held)."""
        # Order: _io_lock -> file lock -> _mem_lock, and _load_lock -> (_io_lock or file lock) -> _mem_lock.
        # _io_lock: one write at a time in this process; _load_lock: one load, apart from writes, so a conv's
        # first lookup never waits for the writer thread's write. _mem_lock is reentrant because the SIGTERM
        # handler runs on the main thread, possibly in the middle of one of its sections.
        self._io_lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._mem_lock = threading.RLock()
        self._lockers: set[int] = set()  # the threads (idents) in _file_lock: holding it, or about to
        self._signalled: tuple[int, functools.partial] | None = None  # a SIGTERM handler call held back

    def _write_pending(self, pending: Entries, wait: bool) -> bool:
        """Write ``pending`` (see :meth:`_write`); unforced and not written, the exit's flush will."""
        with self._io_lock:
            written = self._write(pending, wait=wait)
            if not written and not wait:
                self._flush_at_exit()
            return written

    def _write_handed(self, handed: frozenset[Key]) -> None:
        """The writer thread's write: the keys a put handed, as memory holds them now (a clear() since then
        dropped them, a later put replaced them); tries the file's lock once."""
        with self._io_lock:
            pending = self._unflushed(handed)
            if pending:
                self._write_pending(pending, wait=False)

    def _unflushed(self, keys: frozenset[Key] | None = None) -> Entries:
        """The unflushed entries (of ``keys`` only, if given) as memory holds them now."""
        with self._mem_lock:
            return {key: self._entries[key] for key in (self._dirty if keys is None else keys) if key in self._dirty}

    def _register_exit(self) -> None:
        if not self._exit_registered:
            atexit.register(self._at_exit)
            self._exit_registered = True

    def _flush_at_exit(self) -> None:
        """Have the exit flush (forced: it waits for the file's lock) every entry still unflushed then."""
        self._exit_flush = True
        self._register_exit()

    def _at_exit(self) -> None:
        try:
            # The writer is a daemon thread: the interpreter would stop it mid-write after the exit hooks.
            if not self._writer.wait(self.lock_timeout_s):
                logger.warning("tune cache %s: a write still running after %.1f s at exit; left to it",
                               self.path, self.lock_timeout_s)
                return
            if self._exit_flush:
                self.flush(force=True)
        except Exception:  # noqa: BLE001 - at exit raising helps no one
            logger.warning("tune cache %s: final flush failed", self.path, exc_info=True)

    def _on_sigterm(self, previous: Any, signum: int, frame: Any) -> None:
        if threading.get_ident() in self._lockers:
            # The handler interrupted this thread's write: dying now would drop it, and writing here would wait
            # for the lock this thread holds. Leaving the file lock calls back.
            self._signalled = (threading.get_ident(), functools.partial(self._on_sigterm, previous, signum, frame))
            return
        try:
            # Not through flush(): its _io_lock may be the writer thread's, which may be waiting for the
            # _mem_lock this (main) thread held when the signal came. The file lock alone orders the writes.
            pending = self._unflushed()
            if pending:
                self._write(pending, wait=True)
        except Exception:  # noqa: BLE001 - in a signal handler raising helps no one
            logger.warning("tune cache %s: final flush failed", self.path, exc_info=True)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            # SIG_DFL (or a C-level handler we cannot call): die by the signal, so the parent
            # sees the right exit status.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._load_lock:
            if self._loaded:
                return
            try:
                try:
                    disk = read_entries(self.path)
                except Unusable:
                    # Re-read under the lock (a writer may have just replaced it); only then move it aside.
                    # Not waiting for it: this is a conv call's first lookup (held elsewhere, the file stays).
                    with self._file_lock(wait=False) as held:
                        disk = self._read_locked(move_aside=held)
            except OSError as exc:
                logger.warning("tune cache %s not loaded (%s); starting empty", self.path, exc)
                disk = {}
            with self._mem_lock:
                _merge(self._entries, disk)
                self._loaded = True

    def _read_locked(self, move_aside: bool) -> Entries:
        """The file's entries; an unusable one is reported and, if ``move_aside``, renamed out of the way."""
        try:
            return read_entries(self.path)
        except Unusable as exc:
            reason, suffix = exc.args
            fate = "left in place"
            if suffix is None:
                self._newer_file = True
                fate = "left in place, and this process keeps its tunings in memory"
            elif move_aside:
                if suffix == CORRUPT:
                    suffix += f"-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
                aside = self.path.with_name(f"{self.path.name}.{suffix}")
                os.replace(self.path, aside)
                fate = f"moved aside to {aside}"
                if suffix.startswith(CORRUPT):
                    self._prune_corrupt()
            logger.warning("tune cache %s is unusable (%s); %s, starting fresh", self.path, reason, fate)
            return {}

    def _prune_corrupt(self) -> None:
        """Keep the newest :data:`KEPT_CORRUPT` corrupt files moved aside (under the lock): a cache corrupted
        again and again (a disk that fails, a job killed mid-write on a file system without atomic renames)
        must not fill the directory."""
        asides = []
        for aside in self.path.parent.glob(f"{glob.escape(self.path.name)}.{CORRUPT}-*"):
            try:
                asides.append((aside.stat().st_mtime, aside.name, aside))
            except OSError:  # (gone meanwhile)
                continue
        for *_, old in sorted(asides)[:-KEPT_CORRUPT]:
            try:
                old.unlink()
            except OSError:  # (another process pruned it, or it cannot be removed: it stays)
                pass

    @contextlib.contextmanager
    def _file_lock(self, wait: bool = True) -> Iterator[bool]:
        """Hold ``<path>.lock``; yields False, with a warning, after lock_timeout_s (at once, quietly, if not
        ``wait``); raises OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        me = threading.get_ident()
        self._lockers.add(me)
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait:
                        yield False
                        return
                    if time.monotonic() >= deadline:
                        msg = "tune cache %s: lock not had within %.1f s; skipped, unflushed entries kept"
                        logger.warning(msg, self.path, self.lock_timeout_s)
                        yield False
                        return
                    time.sleep(_LOCK_POLL_S)
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            self._lockers.discard(me)
            signalled = self._signalled
            if signalled is not None and signalled[0] == me:
                self._signalled = None
                signalled[1]()  # a SIGTERM that came while this thread wrote: flush the rest, then act on it

    def _write(self, pending: Entries, wait: bool = True) -> bool:
        """Merge ``pending`` with the file under the lock and write it; returns whether it wrote (``wait``:
        for the lock, see :meth:`_file_lock`)."""
        if self._newer_file:
            return False
        try:
            with self._file_lock(wait) as held:
                if not held:
                    return False
                disk = self._read_locked(move_aside=True)
                merged = dict(disk)
                _merge(merged, pending)
                write_entries(self.path, merged)
        except OSError as exc:
            self._warn_unwritable(exc)
            return False
        self._unwritable_warned = False
        with self._mem_lock:
            # Only what no put replaced while we wrote is clean; then learn what others wrote.
            written = [key for key, entry in pending.items() if self._entries.get(key) is entry]
            self._dirty.difference_update(written)
            _merge(self._entries, disk)
            self._loaded = True
        return True

    @property
    def unflushed(self) -> int:
        """How many entries wait in memory for a write of the file (handed to the writer thread, or not yet)."""
        with self._mem_lock:
            return len(self._dirty)

    @property
    def unwritable(self) -> bool:
        """Whether the last write of the file failed (an OSError: a read-only or missing directory, a full
        disk); the entries wait in memory meanwhile."""
        return self._unwritable_warned

    def _warn_unwritable(self, exc: OSError) -> None:
        if not self._unwritable_warned:
            self._unwritable_warned = True
            logger.warning("tune cache %s cannot be written (%s); keeping entries in memory", self.path, exc)
