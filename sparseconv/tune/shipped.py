"""The shipped tuning database: measured winners for common GPUs, read-only, beneath the user's cache.

Files live in the package at ``sparseconv/tune/data/<device>.msgpack``, one per device, in the
user cache file's format (:mod:`sparseconv.tune.cachefile`); ``<device>`` is the key's device
identity (:func:`sparseconv.tune.key.device_identity`) with every run of other characters than
letters and digits turned into ``_``, e.g. ``cuda_NVIDIA_H100_80GB_HBM3_sm90_132SM``. A file is
read on the first lookup of a key of its device, never at import, and never written: what the
tuner re-times goes to the user's file. ``SPARSECONV_SHIPPED_TUNINGS=0`` turns the layer off.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import pathlib
import re
import threading
from typing import TYPE_CHECKING

from .. import config
from .cachefile import Entries, Unusable, read_entries, write_entries

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

logger = logging.getLogger("sparseconv.tune.shipped")

SUFFIX = ".msgpack"

_lock = threading.Lock()
_stems: frozenset[str] | None = None  # the data folder's device names, listed on first use
_loaded: dict[str, Entries] = {}  # device name -> its entries ({} for an unusable file)


def data_dir() -> Traversable:
    """The package's folder of shipped tuning files (``sparseconv/tune/data``)."""
    return importlib.resources.files(__package__).joinpath("data")


def device_file_name(identity: str) -> str:
    """The shipped file name of a device identity as keys record it: ``<identity, sanitised>.msgpack``."""
    return _sanitised(identity) + SUFFIX


def lookup(namespace: str, key: str) -> dict | None:
    """The shipped entry for (namespace, key), or None (none shipped, or the layer switched off)."""
    if not config.shipped_tunings():
        return None
    # Both key layouts (the tuner's "...|<device>" and @autotune's "<device>|...") hold the device
    # identity as one "|"-separated field; a file is read only when a key of its device is asked for.
    for stem in _available() & {_sanitised(field) for field in key.split("|")}:
        entry = _entries_of(stem).get((namespace, key))
        if entry is not None:
            return entry
    return None


def entries_for(identity: str) -> Entries:
    """Every shipped entry of the device ``identity`` ({} if none is shipped, or switched off)."""
    if not config.shipped_tunings() or _sanitised(identity) not in _available():
        return {}
    return dict(_entries_of(_sanitised(identity)))


def write(path: str | os.PathLike, entries: Entries) -> None:
    """Write ``entries`` as a shippable (user-cache format) file at ``path``, atomically; raises OSError."""
    write_entries(pathlib.Path(path), entries)


def forget() -> None:
    """Drop what was read, so the next lookup lists and reads the data folder again (tests)."""
    global _stems
    with _lock:
        _stems = None
        _loaded.clear()


def _sanitised(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def _available() -> frozenset[str]:
    global _stems
    if _stems is None:
        with _lock:
            if _stems is None:
                folder = data_dir()
                try:
                    names = [item.name for item in folder.iterdir()] if folder.is_dir() else []
                except OSError as exc:
                    logger.warning("shipped tunings %s not listed (%s); none used", folder, exc)
                    names = []
                _stems = frozenset(n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX))
    return _stems


def _entries_of(stem: str) -> Entries:
    entries = _loaded.get(stem)
    if entries is None:
        with _lock:
            entries = _loaded.get(stem)
            if entries is None:
                entries = _loaded[stem] = _load(stem)
    return entries


def _load(stem: str) -> Entries:
    """The entries of one shipped file; an unusable one is reported once and counts as empty."""
    resource = data_dir().joinpath(stem + SUFFIX)
    try:
        with importlib.resources.as_file(resource) as path:
            return read_entries(pathlib.Path(path))
    except Unusable as exc:
        reason = exc.args[0]
    except OSError as exc:
        reason = str(exc)
    logger.warning("shipped tunings %s are unusable (%s); ignored, this device tunes as without them", resource, reason)
    return {}
