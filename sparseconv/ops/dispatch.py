"""One call per product: the tuner (:func:`sparseconv.tune.run`) resolves the algorithm and runs it.

Pins (``fwd_algo=`` ...) are checked at layer construction by :func:`check_algo`, against the
backend table (:mod:`sparseconv.backends.algos`), so a typo fails before the first batch; they are
passed down unchanged and the tuner honours them in backward too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import config, tune
from ..backends import algos
from ..backends.problem import NAMESPACES, PIN_ARGUMENT, ConvProblem
from ..coords.batch import MapUse
from ..coords.kernel_map import KernelMap
from ..tune.pools import resolve_mode

Pin = str | Sequence[str] | None


def check_algo(algo: Pin, namespace: str) -> str | tuple[str, ...] | None:
    """Validate a pin early: None, a mode (auto / trimmed / all), a backend name or a list of names.

    Returns the pin (a list as a tuple); ValueError / TypeError naming the argument (``fwd_algo``
    ...), the valid names and the closest match.
    """
    if algo is None:
        return None
    algos.checked_mode(algo, namespace, PIN_ARGUMENT[namespace])
    return algo if isinstance(algo, str) else tuple(algo)


def check_settings() -> None:
    """Check every ``SPARSECONV_*`` setting now (:func:`config.check_environment`, and the algorithm modes
    against the backend table): ValueError naming the variable. Called at a batch's first map request, so that
    a bad wgrad mode fails before the forward pass runs, not at its backward (~10 µs, once a batch)."""
    config.check_environment()
    for namespace in NAMESPACES:
        # (product_settings checks effort and deterministic; resolve_mode the mode, as the tuner's first call would)
        resolve_mode(namespace, None, config.product_settings(namespace)[0])


@dataclass(frozen=True)
class AlgoPins:
    """The user's algorithm pins for the three products (None: let the library choose)."""

    fwd: str | tuple[str, ...] | None = None
    dgrad: str | tuple[str, ...] | None = None
    wgrad: str | tuple[str, ...] | None = None

    @classmethod
    def checked(cls, fwd: Pin, dgrad: Pin, wgrad: Pin) -> AlgoPins:
        return cls(
            check_algo(fwd, "AB_gather_scatter"),
            check_algo(dgrad, "ABt_gather_scatter"),
            check_algo(wgrad, "AtB_gather_gather"),
        )


def dispatch(
    namespace: str,
    problem: ConvProblem,
    algo: Pin,
    a: torch.Tensor,
    b: torch.Tensor,
    kernel_map: KernelMap,
    record: dict[str, str] | None = None,
    use: MapUse | None = None,
) -> torch.Tensor:
    """Run product ``namespace`` of ``problem`` with the algorithm the pin or the tuner picks; ``use``: the
    map's use in its batch (:func:`.batch.kernel_map`), which counts the product and keeps it prepared."""
    if use is not None:  # the map plan counts a map's products (MapUse.lone)
        use.used()
    return tune.run(namespace, problem, algo, a, b, kernel_map, record, use)

