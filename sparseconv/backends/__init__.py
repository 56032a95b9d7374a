"""Backends, one module per family; importing this package registers them."""

from . import csr_scatter, cutlass_gemm, cutlass_sm90, explicit, grouped, implicit_triton, mask_triton
from . import planned_views, table_gemm
from .registry import Backend, get, names, register, unregister

__all__ = ["Backend", "csr_scatter", "cutlass_gemm", "cutlass_sm90", "get", "explicit", "grouped", "implicit_triton", "mask_triton", "names", "planned_views", "register", "table_gemm",
           "unregister"]
