"""All ranks of a job use one choice per key, without ever waiting on each other.

Collectives would hang as soon as ranks tune different keys (different point clouds give
different N) or one rank's cache is warm and another's cold. Instead every rank, the first time
it uses a key, offers its choice to the job's key-value store with an atomic compare-and-set:
the first offer wins and every later rank reads it back. One store round trip per key per
process, no rank blocks on another.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sparseconv.tune")

STORE_PREFIX = "sparseconv/tune/"


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


def agree(namespace: str, key: str, choice: str) -> str:
    """The job-wide choice for (namespace, key): ours if we are first, else the first rank's."""
    store = _default_store()
    if store is None:
        return choice
    agreed = store.compare_set(f"{STORE_PREFIX}{namespace}/{key}", "", choice)
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
