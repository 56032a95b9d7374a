"""All ranks of a job use one choice per key, without ever waiting on each other.

Collectives would hang as soon as ranks tune different keys (different point clouds give
different N) or one rank's cache is warm and another's cold. Instead every rank, the first time
it uses a key, offers its choice to the job's key-value store with an atomic compare-and-set:
the first offer wins and every later rank reads it back. One store round trip per key per
process, no rank blocks on another.

A cold key is timed by one rank only: the first to :func:`claim` it. While that rank times, the
others run the reference on a GPU (nothing to compile; the pool's first candidate elsewhere),
look again at their next call, and take the published choice as soon as it is there (on a GPU
its kernels compile in a worker process first, as a cached choice's do). A rank that dies
mid-sweep normally ends the job attempt, and torchrun gives each attempt a new store; where a
store outlives its processes, a claim left unpublished for CLAIM_TIMEOUT_S is taken over by the
next rank that meets the key.
"""

from __future__ import annotations

import logging
import os
import socket
import time

logger = logging.getLogger("sparseconv.tune")

STORE_PREFIX = "sparseconv/tune/"
CLAIM_PREFIX = "sparseconv/tune-claim/"
CLAIM_TIMEOUT_S = 600.0
"""Longer than any one key's sweep (seconds, even with compiles), short against a job."""


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


def _ours(token: str) -> bool:
    return token.rsplit(":", 1)[0] == f"{socket.gethostname()}:{os.getpid()}"


def _claimed_at(token: str) -> float:
    try:
        return float(token.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return float("inf")  # not a token of ours: never taken over


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
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time()}"
    name = f"{CLAIM_PREFIX}{namespace}/{key}"
    holder = _text(store.compare_set(name, "", token))
    if holder == token or _ours(holder):
        return None
    if time.time() - _claimed_at(holder) > CLAIM_TIMEOUT_S and _text(store.compare_set(name, holder, token)) == token:
        msg = "sparseconv: %s %s was claimed by %s and never published; timing it here"
        logger.warning(msg, namespace, key, holder)
        return None
    # The claimer may have published between our two looks; get() of a missing key would block.
    return _text(store.get(published)) if store.check([published]) else ""


class Ranks:
    """The tuner's agreement with the job's other ranks (:func:`claim` a key to time, :func:`agree` on its
    choice) through the job's store; alone in the job, each process decides for itself."""

    def claim(self, namespace: str, key: str) -> str | None:
        return claim(namespace, key)

    def agree(self, namespace: str, key: str, choice: str) -> str:
        return agree(namespace, key, choice)
