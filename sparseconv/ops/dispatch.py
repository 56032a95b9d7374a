"""One call per product: the tuner resolves the algorithm for the namespace and runs it.

Pins (``fwd_algo=`` ...) are checked at layer construction by :func:`check_algo`, so a typo
fails before the first batch, and passed down unchanged; the tuner honours them in backward too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch

from ..coords.kernel_map import KernelMap
from .problem import NAMESPACES, ConvProblem

PIN_ARGUMENT = dict(zip(NAMESPACES, ("fwd_algo", "dgrad_algo", "wgrad_algo")))

Pin = str | Sequence[str] | None


def check_algo(algo: Pin, namespace: str) -> str | tuple[str, ...] | None:
    """Validate a pin early: None, a mode (auto / trimmed / all), a backend name or a list of names."""
    if algo is None:
        return None
    _tune().pools.checked_mode(algo, namespace, PIN_ARGUMENT[namespace])
    return algo if isinstance(algo, str) else tuple(algo)


def dispatch(
    namespace: str,
    problem: ConvProblem,
    algo: Pin,
    a: torch.Tensor,
    b: torch.Tensor,
    kernel_map: KernelMap,
    record: dict[str, str] | None = None,
) -> torch.Tensor:
    """Run product ``namespace`` of ``problem`` with the algorithm the pin or the tuner picks."""
    return _tune().get_tuner().run(namespace, problem, algo, a, b, kernel_map, record)


@functools.cache
def _tune() -> ModuleType:
    """The tuner package, imported on first use: importing sparseconv must not load it.

    Kept instead of a function-level import because that costs ~1 µs, and a conv call makes up
    to six (three pin checks, three dispatches).
    """
    from .. import tune
    from ..tune import pools  # noqa: F401 - tune.pools is used through the package

    return tune
