"""explicit_gemm_table: a product as one gather through the map's neighbour table and one matrix product, in
torch: no scatter, no atomics, no compiled kernel.

Output row ``i``'s K neighbours are gathered into one row of K * C_in values (an absent neighbour, -1 in the
table, reads a zero row appended to the input: torch's indexing counts -1 from the end), and that
(N_out, K * C_in) matrix times the weight seen as (K * C_in, C_out) is the output: the sum over offsets happens
inside the GEMM's own (fp32) accumulation. dgrad is the same through the transposed table; wgrad is the gathered
matrix's transpose times the output gradient, (K * C_in, C_out) at once. Rows run in chunks of at most
:data:`~.grouped.WORKSPACE_BYTES` of gathered operand.

It multiplies the absent neighbours' zeros too: K / (mean neighbours) times the FLOPs of the per-offset
products (~5x on a street scan's finest submanifold map, 5.2 neighbours of 27; 8x on an upsampling map). On a GPU those are cheap tensor-core
FLOPs against per-offset launches, index lists and float32 atomics: a cold process's layers run it while their
tuned kernels compile (:func:`sparseconv.tune.pools.meanwhile`). Deterministic: every output is written once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..coords.kernel_map import KernelMap
from ..precision import accumulator_dtype
from .grouped import WORKSPACE_BYTES, with_zero_row
from .problem import NAMESPACES, ConvProblem
from .registry import Backend, always_deterministic, in_product_dtype, register
from .row_buckets import padded_mm, padded_reduction


def _chunks(rows: int, row_bytes: int) -> range:
    """Chunk starts over ``rows`` rows of ``row_bytes`` gathered bytes each (at most WORKSPACE_BYTES a chunk)."""
    return range(0, rows, max(64, WORKSPACE_BYTES // max(1, row_bytes)))


def _row_chunks(source: torch.Tensor, table: torch.Tensor) -> range:
    """:func:`_chunks` of ``table``'s rows, each gathering K * C values of ``source``'s dtype."""
    return _chunks(table.shape[0], table.shape[1] * source.shape[1] * source.element_size())


def _gather(source: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(rows, K * C): each row of ``table``'s K rows of ``source``, side by side."""
    return source[table].view(-1, table.shape[1] * source.shape[1])


def _gathered_product(source: torch.Tensor, table: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``sum_k source[table[:, k]] @ matrix_k`` for ``matrix`` (K * C, C_out): (rows, C_out) in source's dtype."""
    # bucketed cuBLAS shapes on a GPU: the rows change with every point cloud (.row_buckets)
    product = padded_mm if source.is_cuda else torch.mm
    chunks = _row_chunks(source, table)
    if len(chunks) <= 1:  # one chunk (or no row): its product is the output
        return product(_gather(source, table), matrix)
    out = source.new_empty((table.shape[0], matrix.shape[1]))
    for start in chunks:
        rows = slice(start, start + chunks.step)
        out[rows] = product(_gather(source, table[rows]), matrix)
    return out


def table_product(a: torch.Tensor, table: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: (N_in, C_in), table: (N_out, K) rows of ``a`` (-1: none), b: (K, C_in, C_out) -> (N_out, C_out):
    ``sum_k a[table[:, k]] @ b[k]``. No host synchronisation (a graphed pass's product where Triton does not run)."""
    return _gathered_product(with_zero_row(a), table, b.reshape(-1, b.shape[2]))


def forward(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (K, C_in, C_out) weight -> (N_out, C_out)."""
    return table_product(a, kernel_map.neighbors, b)


def dgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap) -> torch.Tensor:
    """a: (N_out, C_out) output grad, b: (K, C_in, C_out) weight -> (N_in, C_in)."""
    return _gathered_product(with_zero_row(a), kernel_map.transposed_neighbors,
                             b.transpose(1, 2).reshape(-1, b.shape[1]))


def wgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (N_out, C_out) output grad -> (K, C_in, C_out). Half-precision operands are
    multiplied in float32, as the reference's are (each product reduces over all output rows)."""
    dtype, accumulate = a.dtype, accumulator_dtype(a.dtype)
    source, b, table = with_zero_row(a.to(accumulate)), b.to(accumulate), kernel_map.neighbors
    out = source.new_zeros((kernel_map.kernel_volume * a.shape[1], b.shape[1]))
    chunks = _row_chunks(source, table)
    for start in chunks:
        rows = slice(start, start + chunks.step)
        gathered = _gather(source, table[rows])
        out += padded_reduction(gathered, b[rows]) if a.is_cuda else torch.mm(gathered.t(), b[rows])
    return out.view(kernel_map.kernel_volume, a.shape[1], b.shape[1]).to(dtype)


_PRODUCTS = dict(zip(NAMESPACES, (forward, dgrad, wgrad)))


def run(
    namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap
) -> torch.Tensor:
    return _PRODUCTS[namespace](a, b, kernel_map)


def pool(problem: ConvProblem, level: str) -> list[Mapping]:
    # A GPU's choice while compiling (pools.meanwhile); timed in a GPU sweep of level all, or when named. On a
    # CPU its extra FLOPs cost: a street1 subm3 (5.2 neighbours of 27) took 7-10x explicit_gemm's time (2 cores).
    return [{}] if level == "all" and problem.device.type == "cuda" else []


EXPLICIT_GEMM_TABLE = register(Backend(name="explicit_gemm_table", ops=frozenset(NAMESPACES), run=in_product_dtype(run),
                                       pool=pool, deterministic=always_deterministic))
