"""All ranks of a job use one choice per key, without ever waiting on each other.

Collectives would hang as soon as ranks tune different keys (different point clouds give
different N) or one rank's cache is warm and another's cold. Instead every rank, the first time
it uses a key, offers its choice to the job's key-value store with an atomic compare-and-set:
the first offer wins and every later rank reads it back. One store round trip per key per
process, no rank blocks on another.

A cold key is timed by one rank only: the first to :func:`claim` it. While that rank times, the
others run the pool's first candidate, look again at their next call, and take the published
choice as soon as it is there. A claim outlives its rank only within one job attempt: a rank
that dies ends the attempt, and torchrun gives each attempt a new store.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("sparseconv.tune")

STORE_PREFIX = "sparseconv/tune/"
CLAIM_PREFIX = "sparseconv/tune-claim/"


def _default_store():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as error:  # noqa: BLE001 - a private API; without it, ranks decide alone
        logger.warning("sparseconv: no distributed store (%s); ranks choose algorithms independently", error)
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def agree(namespace: str, key: str, choice: str) -> str:
    """The job-wide choice for (namespace, key): ours if we are first, else the first rank's."""
    store = _default_store()
    if store is None:
        return choice
    return _text(store.compare_set(f"{STORE_PREFIX}{namespace}/{key}", "", choice))


def claim(namespace: str, key: str) -> str | None:
    """None if this process is to time (namespace, key): alone, or the first rank to claim it.
    Else the choice another rank published for it, or "" while that rank is still timing it."""
    store = _default_store()
    if store is None:
        return None
    published = f"{STORE_PREFIX}{namespace}/{key}"
    if store.check([published]):
        return _text(store.get(published))
    # host and pid: a token no other process of the job can hold, whatever its rank.
    token = f"{socket.gethostname()}:{os.getpid()}"
    if _text(store.compare_set(f"{CLAIM_PREFIX}{namespace}/{key}", "", token)) == token:
        return None
    # The claimer may have published between our two looks; get() of a missing key would block.
    return _text(store.get(published)) if store.check([published]) else ""
