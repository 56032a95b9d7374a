"""The backend table shared by the dispatcher (and later the tuner): what was chosen is what runs."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ...coords.kernel_map import KernelMap
from ..problem import NAMESPACES, ConvProblem

RunFn = Callable[[str, ConvProblem, Mapping, torch.Tensor, torch.Tensor, KernelMap], torch.Tensor]


def _supports_everything(problem: ConvProblem) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """One algorithm family.

    run(namespace, problem, params, a, b, kernel_map) computes the product named by
    ``namespace`` (see :data:`NAMESPACES`); ``supports(problem)`` returns None or the reason it
    cannot run the problem; ``params_space`` lists the parameter sets a tuner may try.
    """

    name: str
    ops: frozenset[str]
    run: RunFn
    params_space: tuple[Mapping, ...] = ({},)
    supports: Callable[[ConvProblem], str | None] = field(default=_supports_everything)


_BACKENDS: dict[str, Backend] = {}


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


def names(namespace: str | None = None) -> list[str]:
    """Registered backend names, those implementing ``namespace`` if given."""
    return sorted(n for n, b in _BACKENDS.items() if namespace is None or namespace in b.ops)


def lookup(name: str, namespace: str, source: str) -> Backend:
    """The backend called ``name`` for ``namespace``; ValueError naming ``source``, the valid names and the closest match."""
    valid = names(namespace)
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{source}: unknown algorithm {name!r} for {namespace}; valid: {valid}{hint}")
    return _BACKENDS[name]
