"""@autotune(configs, key): the tuner's machinery for a kernel's inner configurations.

Semantics follow tonno's decorator: the chosen config is injected as the first positional
argument; the keyword arguments named in ``key`` describe the problem size and are popped
before the call; the winner is cached per (device, key values) in the tuner's cache file under
the namespace ``autotune:<name>`` (``name=``, a stable name: a cache migration to change; default
``<module>.<qualname>``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cache import TuneCache
from .key import device_identity
from .timing import Timer, TimingPlan, plan_for

logger = logging.getLogger("sparseconv.tune")


def _default_encode(config: Any) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if hasattr(config, "_asdict"):
        return dict(config._asdict())
    raise TypeError(f"autotune: cannot encode config {config!r}; pass encode= and decode=")


def autotune(
    configs: Sequence[Any],
    key: Sequence[str],
    *,
    num_warmup: int | None = None,
    num_timing: int | None = None,
    encode: Callable[[Any], dict] | None = None,
    decode: Callable[[dict], Any] | None = None,
    cache: TuneCache | None = None,
    name: str | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate ``fn(config, *args, **kwargs)``; callers pass ``key`` names as keyword arguments.

    configs: NamedTuples or frozen dataclasses (or anything ``encode``/``decode`` round-trip).
    The device is that of the first tensor argument (CPU if none).
    """
    if not configs:
        raise ValueError("autotune: configs must not be empty")
    encode = encode or _default_encode
    config_type = type(configs[0])
    decode = decode or (lambda data: config_type(**data))
    by_encoding = {repr(sorted(encode(c).items())): c for c in configs}
    if len(by_encoding) != len(configs):
        raise ValueError("autotune: configs must be distinct")

    def wrap(fn: Callable) -> Callable:
        namespace = f"autotune:{name or f'{fn.__module__}.{fn.__qualname__}'}"
        chosen: dict[str, Any] = {}
        lock = threading.Lock()

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            missing = [k for k in key if k not in kwargs]
            if missing:
                raise TypeError(f"{fn.__qualname__}: missing autotune key argument(s) {missing}")
            key_values = {k: kwargs.pop(k) for k in key}
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            cache_key = f"{device_identity(device)}|" + "|".join(f"{k}={key_values[k]}" for k in key)
            config = chosen.get(cache_key)
            if config is None:
                with lock:
                    config = chosen.get(cache_key) or _choose(cache_key, device, args, kwargs)
                    chosen[cache_key] = config
            return fn(config, *args, **kwargs)

        def _stored_winner(entry: Any) -> Any:
            """The config an entry names, or None: a malformed entry (another version, a hand
            edit) is re-timed rather than crashing the call."""
            winner = entry.get("winner") if isinstance(entry, dict) else None
            if not isinstance(winner, dict):
                return None
            try:
                return by_encoding.get(repr(sorted(winner.items())))
            except TypeError:  # keys that do not sort
                return None

        def _choose(cache_key: str, device: torch.device, args, kwargs) -> Any:
            store = cache or _shared_cache()
            known = _stored_winner(store.get(namespace, cache_key))
            if known is not None:
                return known
            plan = plan_for(device)
            timer = Timer(device, TimingPlan(num_warmup if num_warmup is not None else plan.warmup,
                                             num_timing if num_timing is not None else plan.repeats, plan.flush_l2))
            timings = []
            for config in configs:
                try:
                    ms, samples = timer.median(lambda config=config: fn(config, *args, **kwargs))
                    timings.append((ms, samples, config))
                except Exception as error:  # noqa: BLE001 - a config that fails is skipped
                    logger.info("sparseconv: %s config %r failed: %s", namespace, config, error)
            if not timings:
                raise RuntimeError(f"{namespace}: every config failed for {cache_key}")
            ms, _, best = min(timings, key=lambda t: t[0])
            store.put(namespace, cache_key, {
                "winner": encode(best),
                "timings": [[encode(c), t] for t, _, c in timings],
                "evidence": sum(s for _, s, _ in timings),
                "updated": time.time(),
            })
            return best

        wrapper.autotune_namespace = namespace  # type: ignore[attr-defined]
        wrapper.chosen = chosen  # type: ignore[attr-defined]
        return wrapper

    return wrap


def _shared_cache() -> TuneCache:
    from . import get_tuner

    return get_tuner().cache
