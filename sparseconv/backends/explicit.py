"""explicit_gemm: gather -> matmul -> scatter-add per kernel offset, in torch.

The reference every other backend is checked against and the universal fallback: it runs on
any device and dtype torch can multiply. Half-precision products keep their (fp32-accumulated)
matmul and are summed across offsets in fp32, so the K-way sum does not round K times.

Deterministic, so deterministic mode always has a candidate: within one offset every output
row has at most one pair (the map is a table of one neighbour per row and offset) and every
input row feeds at most one output (coordinates are unique), so each ``index_add_`` adds one
value into each row it touches: on CUDA its atomics never meet, and the offsets' sums follow
each other in offset order, one launch after the other. (``index_add_`` races only where an
index repeats within one call, as in explicit_gemm_grouped's groups of offsets.)

Rows are gathered with ``index_select``, not indexing (``a[idx]``): on a CPU, indexing runs an
element-wise kernel, index_select copies whole rows (30k rows of 64 floats: 1.63 against 0.48 ms,
2 cores; the gathers took 0.87 s of a 3.2 s MinkUNet inference there).

On CUDA its products run on bucketed row counts (:mod:`.row_buckets`): each new point cloud's row
counts cost cuBLAS an algorithm pick on the host (~2 ms at a new shape, H200), once per kernel offset,
and this runs in every tuning sweep (the reference) and in every layer whose kernels still compile.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..coords.kernel_map import KernelMap
from ..precision import accumulator_dtype
from .problem import NAMESPACES, ConvProblem
from .registry import Backend, always_deterministic, in_product_dtype, register
from .row_buckets import bucketed_index, padded_mm, padded_reduction


def forward(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, padded: bool | None = None) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (K, C_in, C_out) weight -> (N_out, C_out) in a's dtype. ``padded`` (default: on
    CUDA): products of bucketed row counts (:mod:`.row_buckets`), the same values."""
    padded = a.is_cuda if padded is None else padded
    out = _first(a, b, kernel_map, kernel_map.num_out, padded, False)
    for k, (in_idx, out_idx) in enumerate(kernel_map.per_offset):
        if k != kernel_map.identity_offset and in_idx.numel():
            out.index_add_(0, out_idx, _gathered_mm(a, in_idx, b[k], padded).to(out.dtype))
    return out.to(a.dtype)


def dgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, padded: bool | None = None) -> torch.Tensor:
    """a: (N_out, C_out) output grad, b: (K, C_in, C_out) weight -> (N_in, C_in) input grad; ``padded``: as
    :func:`forward`'s."""
    padded = a.is_cuda if padded is None else padded
    out = _first(a, b, kernel_map, kernel_map.num_in, padded, True)
    for k, (in_idx, out_idx) in enumerate(kernel_map.per_offset):
        if k != kernel_map.identity_offset and in_idx.numel():
            out.index_add_(0, in_idx, _gathered_mm(a, out_idx, b[k].t(), padded).to(out.dtype))
    return out.to(a.dtype)


def _first(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, rows: int, padded: bool, transposed: bool
           ) -> torch.Tensor:
    """The accumulator a product's offsets add into: the identity offset's product itself where the map has one
    (every row its own neighbour: a plain matmul), else zeros. Starting from the product, not from zeros it is
    added to, saves a fill, a temporary and an addition: a 64-channel subm3 forward on a CPU 54 -> 47 ms."""
    k = kernel_map.identity_offset
    if k is None:
        return a.new_zeros((rows, b.shape[1] if transposed else b.shape[2]), dtype=accumulator_dtype(a.dtype))
    weight = b[k].t() if transposed else b[k]
    return (padded_mm(a, weight) if padded else torch.mm(a, weight)).to(accumulator_dtype(a.dtype))


def wgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, padded: bool | None = None) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (N_out, C_out) output grad -> (K, C_in, C_out) weight grad; ``padded``: as
    :func:`forward`'s (the reduced pair dimension bucketed, the padding zero rows).

    Half-precision operands are multiplied in fp32: each product reduces over all pairs of an
    offset (10^5 and more), and cuBLAS's half GEMM may split that reduction and add the parts
    in half precision (``allow_fp16_reduced_precision_reduction``), which on an H200 put this,
    the tuner's reference, ~9e-3 away from every fp32-accumulating backend.
    """
    padded = a.is_cuda if padded is None else padded
    dtype, accumulate = a.dtype, accumulator_dtype(a.dtype)
    a, b = a.to(accumulate), b.to(accumulate)
    out = a.new_zeros((kernel_map.kernel_volume, a.shape[1], b.shape[1]))
    for k, (in_idx, out_idx) in enumerate(kernel_map.per_offset):
        if k == kernel_map.identity_offset:
            out[k] = padded_reduction(a, b) if padded else torch.mm(a.t(), b)
        elif in_idx.numel() and padded:
            left = a.index_select(0, bucketed_index(in_idx))
            right = b.index_select(0, bucketed_index(out_idx))
            # The padding's rows add nothing to the reduction, not even a NaN of the row they repeat.
            left[in_idx.numel():] = 0
            right[in_idx.numel():] = 0
            out[k] = torch.mm(left.t(), right)
        elif in_idx.numel():
            out[k] = torch.mm(a.index_select(0, in_idx).t(), b.index_select(0, out_idx))
    return out.to(dtype)


def _gathered_mm(rows: torch.Tensor, index: torch.Tensor, matrix: torch.Tensor, padded: bool) -> torch.Tensor:
    """``rows[index] @ matrix``, with ``padded`` gathered by the bucketed index (its extra rows' products sliced off)."""
    if not padded:
        return torch.mm(rows.index_select(0, index), matrix)
    return torch.mm(rows.index_select(0, bucketed_index(index)), matrix)[: index.numel()]


_PRODUCTS = dict(zip(NAMESPACES, (forward, dgrad, wgrad)))


def run(
    namespace: str,
    problem: ConvProblem,
    params: Mapping,
    a: torch.Tensor,
    b: torch.Tensor,
    kernel_map: KernelMap,
) -> torch.Tensor:
    return _PRODUCTS[namespace](a, b, kernel_map)


EXPLICIT_GEMM = register(Backend(name="explicit_gemm", ops=frozenset(NAMESPACES), run=in_product_dtype(run),
                                 deterministic=always_deterministic))
