"""The backend table shared by the tuner and the algorithm-name check (algos.py): what was timed is what runs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..coords.kernel_map import KernelMap
from ..precision import product_dtype
from .problem import NAMESPACES, ConvProblem

RunFn = Callable[[str, ConvProblem, Mapping, torch.Tensor, torch.Tensor, KernelMap], torch.Tensor]


PoolFn = Callable[[ConvProblem, str], Sequence[Mapping]]
PrecompileFn = Callable[[str, ConvProblem, Mapping, KernelMap], None]
POOL_LEVELS = ("auto", "trimmed", "all")


def _supports_everything(problem: ConvProblem) -> str | None:
    return None


def _no_preference(problem: ConvProblem) -> float:
    return 0.0


def never_deterministic(namespace: str, params: Mapping) -> bool:
    """The default mark: a backend is deterministic only where it says so."""
    return False


def always_deterministic(namespace: str, params: Mapping) -> bool:
    """Every product, every parameter set: each output element is summed in an order fixed by
    the inputs alone (no atomics on values, no scatter-add where two adds meet one element)."""
    return True


@dataclass(frozen=True)
class Backend:
    """One algorithm family.

    run(namespace, problem, params, a, b, kernel_map) computes the product named by
    ``namespace`` (see :data:`NAMESPACES`); ``supports(problem)`` returns None or the reason it
    cannot run the problem; ``params_space`` lists every parameter set, and ``pool(problem,
    level)`` the ones worth timing at a pool level (auto / trimmed / all; default: the first
    set for auto, all of them otherwise; an empty list leaves the backend out of that pool).
    ``heuristic(problem)`` scores the backend for an untimed pick (higher wins). ``version``
    changes whenever the backend's speed or numbers may change: its stored timings then go stale
    and it is timed again, while other backends' timings stay valid.
    ``deterministic(namespace, params)`` says whether that product with those parameters gives
    bitwise-equal results on every run with the same inputs (deterministic mode runs only
    those); a backend that does not say is taken as not deterministic.
    ``precompile(namespace, problem, params, kernel_map)``, if given, compiles the kernels that
    ``run`` would compile on its first call with these arguments, without running anything: the
    tuner calls it for a sweep's candidates on parallel threads before timing them, so it must be
    thread-safe and read only what the map already holds (never build a lazy view); raising
    disqualifies the candidate. It must be a module-level function: the tuner also runs it in a
    compile worker process, where ``kernel_map`` is a ``MapShape`` (sizes, kernel size, the
    identity offset and the once-flags; no tensors, no pair counts) and what it compiles must land
    in a disk cache (Triton's, the CUTLASS cubins') for this process's first call to find.
    """

    name: str
    ops: frozenset[str]
    run: RunFn
    params_space: tuple[Mapping, ...] = ({},)
    supports: Callable[[ConvProblem], str | None] = field(default=_supports_everything)
    pool: PoolFn | None = None
    heuristic: Callable[[ConvProblem], float] = field(default=_no_preference)
    version: int = 1
    deterministic: Callable[[str, Mapping], bool] = field(default=never_deterministic)
    precompile: PrecompileFn | None = None
    prepare: Callable[[str, ConvProblem, Mapping, KernelMap], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      ] | None = None
    """``prepare(namespace, problem, params, kernel_map)``: ``run`` as a function of contiguous
    operands ``(a, b)`` alone, everything else fixed (kept with the map by the backend): the tuner
    calls it for a settled choice and then calls that function, skipping ``run``'s lookups."""
    compiles: Callable[[str, ConvProblem, Mapping], Hashable] | None = None
    """``compiles(namespace, problem, params)``: what ``precompile`` compiles for these arguments;
    background compiles of equal values are one job. None: the candidate and the problem but for
    its row counts (no kernel specialises on them)."""
    warms_kernels: bool = False
    """``precompile`` compiles Triton kernels of :func:`.triton_kernels.kernels` through :func:`.triton_launch.warm`
    and nothing else, and may run in this process without compiling (:func:`.triton_launch.recorded`): its
    background compiles are one job per kernel, shared with every other product and view needing that kernel."""
    bridge: Callable[[ConvProblem], Mapping | None] | None = None
    """``bridge(problem)``: a parameter set of :attr:`params_space` generic enough that a few kernels serve every layer
    of a network (a fixed tile, no per-map view), or None where the backend has none for ``problem``: what a cold
    process compiles first and runs while the tuned kernels compile (:func:`sparseconv.tune.pools.bridge`)."""

    def candidates_params(self, problem: ConvProblem, level: str) -> list[Mapping]:
        """Parameter sets of this backend in the ``level`` pool for ``problem``."""
        if self.pool is not None:
            return list(self.pool(problem, level))
        return list(self.params_space[:1] if level == "auto" else self.params_space)


_BACKENDS: dict[str, Backend] = {}


def in_product_dtype(run: RunFn) -> RunFn:
    """``run`` with operands in the dtype a product on their device multiplies in (:func:`~sparseconv.precision.
    product_dtype`: float16 on a CPU in float32), its result cast back to theirs: for the torch backends, whose
    products are torch's GEMMs."""

    @functools.wraps(run)
    def run_in_product_dtype(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor,
                             b: torch.Tensor, kernel_map: KernelMap) -> torch.Tensor:
        wide = product_dtype(a.dtype, a.device)
        if wide == a.dtype:
            return run(namespace, problem, params, a, b, kernel_map)
        return run(namespace, problem, params, a.to(wide), b.to(wide), kernel_map).to(a.dtype)

    return run_in_product_dtype


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the table (its name must be new, lowercase snake case)."""
    if backend.name in _BACKENDS:
        raise ValueError(f"backend {backend.name!r} is already registered")
    if not backend.name.replace("_", "").isalnum() or backend.name.lower() != backend.name:
        raise ValueError(f"backend names are lowercase snake case, got {backend.name!r}")
    unknown = set(backend.ops) - set(NAMESPACES)
    if unknown:
        raise ValueError(f"backend {backend.name!r} names unknown namespaces {sorted(unknown)}; valid: {NAMESPACES}")
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend (tests inject fakes and take them out again)."""
    _BACKENDS.pop(name, None)


def get(name: str) -> Backend:
    return _BACKENDS[name]


def names(namespace: str | None = None) -> list[str]:
    """Registered backend names, those implementing ``namespace`` if given."""
    return sorted(n for n, b in _BACKENDS.items() if namespace is None or namespace in b.ops)


# ------------------------------------------------------------ inner configurations -------------

InnerTuner = Callable[..., Callable[[Callable], Callable]]
"""``tuner(configs, key, name=) -> decorator``: what :func:`sparseconv.tune.autotune` is."""

_inner_tuner: InnerTuner | None = None

INNER_PREFIX = "sparseconv.ops.backends."
"""What the inner configurations' cache names begin with (the backends' package until 2026-11-28): the names the
shipped tunings and users' caches know them by, kept when the package moved (a renamed namespace is retuned)."""


def set_inner_tuner(tuner: InnerTuner | None) -> InnerTuner | None:
    """Hand down the decorator that tunes a backend's inner configurations; returns the previous one.

    The one place that sets it: :func:`sparseconv.tune.get_tuner`, when it makes the process's tuner (every
    product runs through it, so before any backend's kernel runs). The backends sit below the tuner and
    never import it; their inner configurations are timed and cached by its machinery all the same.
    """
    global _inner_tuner
    previous, _inner_tuner = _inner_tuner, tuner
    return previous


def inner_autotune(configs: Sequence, key: Sequence[str], name: str) -> Callable[[Callable], Callable]:
    """``@inner_autotune(configs, key, name)`` on ``fn(config, *args, **key_kwargs)``: the registered
    tuner's decorator, bound on the first call (a kernel runs inside a product, which the tuner runs);
    ``name``: the configurations' cache namespace, ``autotune:<name>``; ``__wrapped__`` is ``fn``, to run
    one config by hand."""

    def wrap(fn: Callable) -> Callable:
        tuned: Callable | None = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal tuned
            if tuned is None:
                if _inner_tuner is None:
                    raise RuntimeError(
                        f"{fn.__qualname__}: no inner tuner registered (sparseconv.tune.get_tuner() sets it)")
                tuned = _inner_tuner(configs, key, name=name)(fn)
            return tuned(*args, **kwargs)

        return call

    return wrap
