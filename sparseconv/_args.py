"""Argument checks shared by the public entry points: each error names the argument."""

from __future__ import annotations

import torch

Triple = tuple[int, int, int]


def triple(value: int | tuple[int, ...] | list[int], name: str) -> Triple:
    """An int or 3 ints, each >= 1 -> a 3-tuple; ValueError/TypeError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int or a tuple of 3 positive ints, got {value!r}")
    if isinstance(value, int):
        value = (value,) * 3
    elif isinstance(value, torch.Size | tuple | list):
        value = tuple(value)
    else:
        raise TypeError(f"{name} must be a positive int or a tuple of 3 positive ints, got {type(value).__name__}")
    if len(value) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a positive int or a tuple of 3 positive ints, got {value!r}")
    if min(value) < 1:
        raise ValueError(f"{name} must be >= 1 along every axis, got {value!r}")
    return value
