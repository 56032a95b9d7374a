"""The tuning cache's file format, read and written whole: ``{"schema": SCHEMA_VERSION, "entries":
{namespace: {key: entry}}}``, checked entry by entry on read (a file edited by hand or by another tool
must not crash a conv call), written atomically. The user's cache (:mod:`.cache`) and the shipped
tunings (:mod:`.shipped`) are files of this format.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pathlib
import tempfile
from typing import Any

import msgpack

SCHEMA_VERSION = 1

logger = logging.getLogger("sparseconv.tune.cache")

Key = tuple[str, str]
Entries = dict[Key, dict]
CORRUPT = "corrupt"


class Unusable(Exception):
    """The cache file cannot be used as a whole; args: (reason, suffix to move it aside under, or
    None: leave it in place and never write it, as for a newer sparseconv's file)."""


def entry_problem(entry: Any) -> str | None:
    """Why ``entry`` cannot be cached, or None when it has the fields the merge rule and the
    tuner read (a file edited by hand or by another tool must not crash a conv call)."""
    if not isinstance(entry, dict):
        return f"not a dict but {type(entry).__name__}"
    evidence, updated = entry.get("evidence"), entry.get("updated")
    if isinstance(evidence, bool) or not isinstance(evidence, int) or evidence < 0:
        return f"evidence must be an int >= 0, got {evidence!r}"
    if not _is_time(updated):
        return f"updated must be a finite time.time() float, got {updated!r}"
    timings = entry.get("timings")
    if isinstance(timings, dict):  # the tuner's {candidate id: record}
        for candidate, record in timings.items():
            problem = _timing_problem(record)
            if problem is not None:
                return f"timings[{candidate!r}]: {problem}"
    elif timings is not None and not isinstance(timings, list):  # a list: @autotune's [[config, ms]]
        return f"timings must be a dict or a list, got {type(timings).__name__}"
    return None


def _timing_problem(record: Any) -> str | None:
    """Why a tuner timing record is unusable: the fields the tuner compares must have their types."""
    if not isinstance(record, dict):
        return f"not a dict but {type(record).__name__}"
    for name in ("ms", "host_ms"):
        value = record.get(name)
        if value is not None and not (_is_time(value) and value >= 0):
            return f"{name} must be a finite number >= 0 or None, got {value!r}"
    if record.get("verdict") == "ok" and record.get("ms") is None:
        return "verdict 'ok' without ms"
    version = record.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        return f"version must be an int, got {version!r}"
    return None


def _is_time(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def read_entries(path: pathlib.Path) -> Entries:
    """Entries of the cache file at ``path``, {} if there is none; raises Unusable or OSError."""
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (ValueError, msgpack.UnpackException) as exc:  # bad bytes: ValueError subclasses or OutOfData
        raise Unusable(f"not valid msgpack: {type(exc).__name__}: {exc}", CORRUPT) from None
    if not isinstance(doc, dict) or "schema" not in doc:
        raise Unusable(f"not a cache document: {type(doc).__name__} without 'schema'", CORRUPT)
    if type(doc["schema"]) is int and doc["schema"] > SCHEMA_VERSION:
        # Another installed version shares the directory: its file is not ours to replace.
        raise Unusable(f"schema {doc['schema']}, newer than this sparseconv's {SCHEMA_VERSION}", None)
    if type(doc["schema"]) is not int or doc["schema"] != SCHEMA_VERSION:  # True == 1, but is no schema
        tag = doc["schema"] if type(doc["schema"]) is int else "unknown"
        raise Unusable(f"schema {doc['schema']!r}, expected {SCHEMA_VERSION}", f"old-schema-{tag}")
    if not isinstance(doc.get("entries"), dict):
        raise Unusable("'entries' is not a dict", CORRUPT)
    entries: Entries = {}
    dropped: list[str] = []
    for namespace, table in doc["entries"].items():
        if not isinstance(namespace, str) or not isinstance(table, dict):
            dropped.append(f"namespace {namespace!r}: not a str mapping to a dict")
            continue
        for key, entry in table.items():
            problem = entry_problem(entry) if isinstance(key, str) else "key is not a str"
            if problem is None:
                entries[(namespace, key)] = entry
            else:
                dropped.append(f"{namespace}/{key}: {problem}")
    if dropped:
        msg = "tune cache %s: dropped %d malformed entries (%s)"
        logger.warning(msg, path, len(dropped), "; ".join(dropped[:5]))
    return entries


def write_entries(path: pathlib.Path, entries: Entries) -> None:
    """Write ``entries`` to ``path`` through a synced temp file and os.replace; raises OSError."""
    nested: dict[str, dict[str, dict]] = {}
    for (namespace, key), entry in sorted(entries.items()):
        nested.setdefault(namespace, {})[key] = entry
    data = msgpack.packb({"schema": SCHEMA_VERSION, "entries": nested}, use_bin_type=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600; other users' processes read this cache too
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
