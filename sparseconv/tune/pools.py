"""Candidate pools: which candidates a namespace may use for a problem, under the call's mode.

A mode comes from the call's pin (``fwd_algo=`` ...) or else the namespace's environment
variable (``SPARSECONV_FWD_ALGO_MODE`` ...) or else ``auto``. Parsing and checking a mode (names,
levels, the "did you mean" hint) lives with the backend table in
:mod:`sparseconv.ops.backends.algos`, which the operator layer uses too; names are checked
strictly wherever they come from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .. import config
from ..ops.backends import registry
from ..ops.backends.algos import DEFAULT_MODE, LEVELS, AlgoMode, checked_mode, parse_mode
from ..ops.problem import PIN_ARGUMENT, ConvProblem
from .configs import Candidate

logger = logging.getLogger("sparseconv.tune")

FALLBACK = "explicit_gemm"

# The mode names are re-exported: tuner.py (and tests) take them from here with the pools.
__all__ = ["DEFAULT_MODE", "FALLBACK", "LEVELS", "PIN_ARGUMENT", "AlgoMode", "candidate_pool", "checked_mode",
           "parse_mode", "resolve_mode"]


def resolve_mode(namespace: str, pin: str | Sequence[str] | None) -> AlgoMode:
    """The call's pin if given, else the namespace's environment variable, else auto."""
    if pin is not None:
        return checked_mode(pin, namespace, PIN_ARGUMENT[namespace])
    variable, value = config.algo_mode(namespace)
    if value is not None:
        return checked_mode(value, namespace, variable)
    return DEFAULT_MODE


def candidate_pool(namespace: str, problem: ConvProblem, mode: AlgoMode, effort: str) -> list[Candidate]:
    """Candidates to consider, in preference order (heuristic score, then name).

    effort ``full`` widens ``auto`` to ``all``; a named backend that cannot run the problem is
    an error when it is the only one asked for, and is skipped with a logged reason in a list.
    """
    if mode.level is not None:
        level = "all" if effort == "full" and mode.level == "auto" else mode.level
        backends = [registry.get(n) for n in registry.names(namespace)]
    else:
        level = "all" if effort == "full" else "trimmed"
        backends = [registry.get(n) for n in mode.names]
    pool: list[tuple[float, Candidate]] = []
    for backend in backends:
        reason = backend.supports(problem)
        if reason is not None:
            if mode.single:
                raise ValueError(f"{mode.source}: algorithm {backend.name!r} cannot run this problem: {reason}")
            if mode.level is None:
                logger.info("%s: skipping %s: %s", mode.source, backend.name, reason)
            continue
        params_list = [backend.params_space[0]] if mode.single else backend.candidates_params(problem, level)
        if mode.level is None and not params_list:
            params_list = [backend.params_space[0]]
        score = backend.heuristic(problem)
        pool.extend((score, Candidate.of(backend.name, params)) for params in params_list)
    pool.sort(key=lambda item: (-item[0], item[1].id))
    return [candidate for _, candidate in pool]
