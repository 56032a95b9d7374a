"""Algorithm modes and candidate pools: which candidates a namespace may use for a problem.

A mode comes from the call's pin (``fwd_algo=`` ...) or else the namespace's environment
variable (``SPARSECONV_FWD_ALGO_MODE`` ...) or else ``auto``: ``auto`` | ``trimmed`` | ``all``
| a backend name (use it, no timing) | a list ``[a,b]`` or Python list (time only these).
Names are checked strictly wherever they come from.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .. import config
from ..ops.backends import registry
from ..ops.problem import ConvProblem
from .configs import Candidate

logger = logging.getLogger("sparseconv.tune")

LEVELS = registry.POOL_LEVELS
PIN_ARGUMENT = {"AB_gather_scatter": "fwd_algo", "ABt_gather_scatter": "dgrad_algo", "AtB_gather_gather": "wgrad_algo"}
FALLBACK = "explicit_gemm"


@dataclass(frozen=True)
class AlgoMode:
    """``level`` for a pool mode (auto / trimmed / all), else the named backends; ``source`` says where it came from."""

    level: str | None
    names: tuple[str, ...]
    source: str
    listed: bool = False  # the names came as a list ([a], a,b or a Python list): time them

    @property
    def single(self) -> bool:
        """A bare backend name: run its default parameters, untimed."""
        return self.level is None and len(self.names) == 1 and not self.listed


def parse_mode(value: str | Sequence[str], namespace: str, source: str) -> AlgoMode:
    """A mode from a string (``auto``, ``name``, ``[a,b]``, ``a,b``) or a list of names; strict."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in LEVELS:
            return AlgoMode(text.lower(), (), source)
        names = [n.strip() for n in text.strip("[]").split(",") if n.strip()]
        listed = text.startswith("[") or "," in text
        if not names:
            raise ValueError(f"{source}: empty algorithm mode {value!r}; use auto, trimmed, all, a name or [a,b]")
    elif isinstance(value, Sequence) and value and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
        listed = True
    else:
        raise TypeError(f"{source} must be a mode string or a non-empty list of algorithm names, got {value!r}")
    valid = registry.names(namespace)
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid + list(LEVELS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{source}: unknown algorithm {name!r} for {namespace}; valid: {list(LEVELS) + valid}{hint}"
            )
    return AlgoMode(None, tuple(dict.fromkeys(names)), source, listed)


DEFAULT_MODE = AlgoMode("auto", (), "default")

# Parsed modes by (value, namespace, source), with the backends each names. Every conv call
# resolves three modes; parsing one (a registry scan and sort per name) cost ~3 µs, a third of
# the tuner's per-call time on a small layer. Entries are keyed on the raw value, so a changed
# pin or environment variable parses afresh, and a hit is used only while the backends it names
# are still the registered ones, so an unregistered or replaced backend is checked again.
_PARSED: dict[tuple, tuple[AlgoMode, tuple[registry.Backend, ...]]] = {}
_PARSED_LIMIT = 1024


def checked_mode(value: str | Sequence[str], namespace: str, source: str) -> AlgoMode:
    """:func:`parse_mode`, remembered while the backends it names stay registered."""
    if isinstance(value, str):
        memo = (value, namespace, source)
    elif isinstance(value, list | tuple) and all(isinstance(n, str) for n in value):
        memo = (tuple(value), namespace, source)
    else:
        return parse_mode(value, namespace, source)  # not a valid mode: let it say why
    hit = _PARSED.get(memo)
    if hit is not None and _registered(hit[1]):
        return hit[0]
    mode = parse_mode(value, namespace, source)
    if len(_PARSED) >= _PARSED_LIMIT:  # a program generating pins must not grow this forever
        _PARSED.clear()
    _PARSED[memo] = (mode, tuple(registry.get(name) for name in mode.names))
    return mode


def _registered(backends: tuple[registry.Backend, ...]) -> bool:
    try:
        for backend in backends:
            if registry.get(backend.name) is not backend:
                return False
    except KeyError:
        return False
    return True


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
