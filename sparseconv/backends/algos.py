"""Algorithm names and modes, checked against the backend table: what a pin or variable may say.

A mode is ``auto`` | ``trimmed`` | ``all`` (a pool level) | a backend name (use it, no timing)
| a list ``[a,b]``, ``a,b`` or a Python list (time only these). Names are checked strictly:
an unknown one is a ValueError naming the argument, listing the valid names and the closest.

It sits beside the registry, below both the operator layer (``ops.dispatch.check_algo`` checks
a layer's pins at construction) and the tuner (``tune.pools`` resolves the mode of each call),
so neither has to import the other to check a name.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from . import registry

LEVELS = registry.POOL_LEVELS


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


DEFAULT_MODE = AlgoMode("auto", (), "default")


def parse_mode(value: str | Sequence[str], namespace: str, source: str) -> AlgoMode:
    """A mode from a string (``auto``, ``name``, ``[a,b]``, ``a,b``) or a list of names; strict.

    ``source`` names the argument or variable the value came from (``fwd_algo``,
    ``SPARSECONV_FWD_ALGO_MODE``) and starts every error message.
    """
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
