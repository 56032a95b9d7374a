"""One call per product: resolve the algorithm for a namespace and run it.

This is the seam the tuner plugs into: with no pin, ``resolve`` returns the default backend
today and the tuner's choice once it exists; with a pin, the named backend runs as is.
"""

from __future__ import annotations

import torch

from ..coords.kernel_map import KernelMap
from .backends import lookup
from .problem import NAMESPACES, ConvProblem

DEFAULT_ALGO = "explicit_gemm"
PIN_ARGUMENT = dict(zip(NAMESPACES, ("fwd_algo", "dgrad_algo", "wgrad_algo")))


def check_algo(algo: str | None, namespace: str) -> str | None:
    """Validate a user pin early (at layer construction): None or a registered backend name."""
    if algo is None:
        return None
    if not isinstance(algo, str):
        raise TypeError(f"{PIN_ARGUMENT[namespace]} must be an algorithm name (str) or None, got {type(algo).__name__}")
    lookup(algo, namespace, PIN_ARGUMENT[namespace])
    return algo


def dispatch(
    namespace: str,
    problem: ConvProblem,
    algo: str | None,
    a: torch.Tensor,
    b: torch.Tensor,
    kernel_map: KernelMap,
) -> torch.Tensor:
    """Run the product ``namespace`` of ``problem`` with the pinned ``algo`` or the default one."""
    source = PIN_ARGUMENT[namespace]
    name = DEFAULT_ALGO if algo is None else algo
    backend = lookup(name, namespace, source)
    reason = backend.supports(problem)
    if reason is not None:
        raise ValueError(f"{source}: algorithm {name!r} cannot run this problem: {reason}")
    return backend.run(namespace, problem, backend.params_space[0], a, b, kernel_map)
