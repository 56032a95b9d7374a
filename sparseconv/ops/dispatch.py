"""One call per product: the registered runner (the tuner) resolves the algorithm and runs it.

Pins (``fwd_algo=`` ...) are checked at layer construction by :func:`check_algo`, against the
backend table (:mod:`.backends.algos`), so a typo fails before the first batch; they are passed
down unchanged and the runner honours them in backward too.

Imports point down: the tuner sits above this module and registers itself here
(:func:`set_runner`, from ``sparseconv/tune/__init__.py``) instead of being called by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from ..coords.kernel_map import KernelMap
from .problem import PIN_ARGUMENT, ConvProblem

Pin = str | Sequence[str] | None

Runner = Callable[[str, ConvProblem, Pin, torch.Tensor, torch.Tensor, KernelMap, dict[str, str] | None], torch.Tensor]
"""runner(namespace, problem, pin, a, b, kernel_map, record) -> the product (see :func:`dispatch`)."""

_runner: Runner | None = None


def set_runner(runner: Runner | None) -> Runner | None:
    """Make ``runner`` run every product from now on; returns the one it replaces.

    ``sparseconv.tune`` registers its tuner when imported; a test or a tool may put another in
    front (and restore the returned one), and None goes back to loading the tuner on first use.
    """
    global _runner
    previous, _runner = _runner, runner
    return previous


def check_algo(algo: Pin, namespace: str) -> str | tuple[str, ...] | None:
    """Validate a pin early: None, a mode (auto / trimmed / all), a backend name or a list of names.

    Returns the pin (a list as a tuple); ValueError / TypeError naming the argument (``fwd_algo``
    ...), the valid names and the closest match.
    """
    if algo is None:
        return None
    _algos().checked_mode(algo, namespace, PIN_ARGUMENT[namespace])
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
    runner = _runner if _runner is not None else _load_runner()
    uses = kernel_map.uses
    if uses is not None:  # the map plan counts a map's products (KernelMap.lone)
        uses[0] += 1
    return runner(namespace, problem, algo, a, b, kernel_map, record)


def _load_runner() -> Runner:
    """Import the tuner, which registers itself; the first product of a process comes here.

    The one import in ops/ that points up (tests/test_layering.py allows exactly this one): it
    only triggers the registration, so importing sparseconv loads no tuner, no backend and no
    Triton, and nothing here depends on what the tuner is.
    """
    from .. import tune  # noqa: F401 - registers tune's runner through set_runner

    if _runner is None:
        raise RuntimeError("sparseconv.tune was imported but registered no runner (set_runner)")
    return _runner


@functools.cache
def _algos() -> ModuleType:
    """The name check, imported on first use: importing it loads every backend family (the
    registry fills on import), which importing sparseconv must not do.

    Kept instead of a function-level import because that costs ~1 µs, and a conv call makes
    three pin checks.
    """
    from .backends import algos

    return algos
