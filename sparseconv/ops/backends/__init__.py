"""Backends, one module per family; importing this package registers them."""

from . import explicit
from .registry import Backend, lookup, names, register, unregister

__all__ = ["Backend", "explicit", "lookup", "names", "register", "unregister"]
