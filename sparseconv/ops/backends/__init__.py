"""Backends, one module per family; importing this package registers them."""

from . import explicit, grouped
from .registry import Backend, get, lookup, names, register, unregister

__all__ = ["Backend", "get", "explicit", "grouped", "lookup", "names", "register", "unregister"]
