"""The autotuner: per-namespace algorithm choice, a shared msgpack cache, and @autotune.

Nothing starts at import: the tuner and its cache file come to life on the first conv call
that needs a choice. The operator layer (``sparseconv.ops.dispatch``) calls :func:`run` for every
product; the tuner calls the backends of the registry (``sparseconv.backends``).
"""

from __future__ import annotations

import functools

import torch

from collections.abc import Sequence

from .. import config as _config
from ..backends import compiling as _compiling
from ..backends import registry as _registry
from ..backends.problem import ConvProblem
from ..coords.batch import MapUse
from ..coords.kernel_map import KernelMap
from . import shipped
from .cache import TuneCache
from .configs import Candidate, Config
from .decorator import autotune
from .key import TuneKey, make_key
from .choice import Progress
from .tuner import Tuner


@functools.cache
def get_tuner() -> Tuner:
    """The process-wide tuner (cache file under SPARSECONV_CACHE_DIR, read on first use). Made, it also
    tunes the backends' inner configurations (:func:`sparseconv.backends.registry.inner_autotune`)."""
    _registry.set_inner_tuner(autotune)
    return Tuner()


def reset() -> None:
    """Forget the process-wide tuner, its cache handle, its background compiles and the shipped tunings
    read (tests; a changed SPARSECONV_CACHE_DIR)."""
    if get_tuner.cache_info().currsize and get_tuner()._cache is not None:
        get_tuner()._cache.flush(force=True)
    get_tuner.cache_clear()
    _compiling.background.cache_clear()  # its queued jobs were the forgotten tuner's
    shipped.forget()


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Wait until the kernels compiling in the background have compiled (False if ``timeout``
    seconds passed first): a benchmark's warm-up calls this, then runs once more, before timing.

    On a GPU, a layer whose algorithm is decided (tuning cache or shipped tunings) but whose
    kernels are not compiled yet runs the reference while they compile in worker processes, and a
    map's views whose kernels are not compiled yet are built by torch's ops meanwhile
    (``SPARSECONV_BACKGROUND_COMPILE=0`` compiles them in the call instead)."""
    return get_tuner().wait_for_compiles(timeout)


def progress() -> Progress:
    """Where the process's tuning stands: products settled, running a pick untimed (timed by a later call),
    running the reference while their kernels compile in the background, and the seconds spent timing inside
    calls (:class:`~sparseconv.tune.choice.Progress`). Tuning never pauses a call for long; this says what is
    still to come."""
    return get_tuner().progress()


def run(
    namespace: str,
    problem: ConvProblem,
    pin: str | Sequence[str] | None,
    a: torch.Tensor,
    b: torch.Tensor,
    kernel_map: KernelMap,
    record: dict[str, str] | None = None,
    use: MapUse | None = None,
) -> torch.Tensor:
    """Product ``namespace`` of ``problem`` by the process-wide tuner's choice (the ops runner); ``use``: the
    map's use in its batch, where the prepared product is kept (:meth:`Tuner.run`)."""
    return get_tuner().run(namespace, problem, pin, a, b, kernel_map, record, use)


def prepare_planned(wanted: list[tuple[KernelMap, MapUse, list]]) -> None:
    """The map plan's call builder (:attr:`sparseconv.coords.batch.Builders.prepare`): the products the last
    batch's layers prepared, prepared on the new maps (:meth:`Tuner.prepare_ahead`). A new batch's layer
    otherwise keys, chooses and prepares its product at its first call, one layer at a time: ~100 µs of host
    time more than its next call, where the same work for all of a batch's maps in one pass costs a fraction
    (the host's caches stay warm through it)."""
    tuner, settings = get_tuner(), {}
    for kernel_map, use, recipes in wanted:
        for recipe in recipes:
            namespace = recipe[0]
            if namespace not in settings:  # read once a batch, not once a product (~25)
                settings[namespace] = _config.product_settings(namespace)
            tuner.prepare_ahead(kernel_map, use, recipe, settings[namespace])


__all__ = [
    "Candidate", "Config", "Progress", "TuneCache", "TuneKey", "Tuner", "autotune", "get_tuner", "make_key",
    "prepare_planned", "progress", "reset", "run", "wait_for_compiles",
]
