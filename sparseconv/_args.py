"""Argument checks shared by the public entry points: each error names the argument."""

from __future__ import annotations

import torch

Triple = tuple[int, int, int]


def triple(value: int | tuple[int, ...] | list[int], name: str) -> Triple:
    """An int or 3 ints, each >= 1 -> a 3-tuple; ValueError/TypeError naming ``name`` otherwise."""
    # Every conv call checks three of these (modules pass their stored 3-tuples): the common
    # shapes take one type test instead of the general checks below (~1 µs each).
    if type(value) is int and value >= 1:
        return (value, value, value)
    if type(value) is tuple and len(value) == 3 and all(type(v) is int and v >= 1 for v in value):
        return value
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
