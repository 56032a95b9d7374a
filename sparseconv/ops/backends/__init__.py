"""Backends, one module per family; importing this package registers them."""

from . import explicit, grouped, implicit_triton, mask_triton
from .registry import Backend, get, lookup, names, register, unregister

__all__ = ["Backend", "get", "explicit", "grouped", "implicit_triton", "mask_triton", "lookup", "names", "register", "unregister"]
