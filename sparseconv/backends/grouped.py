"""explicit_gemm_grouped: offsets bucketed by pair count and run as padded batched matmuls.

Per-offset loops pay one gather, one matmul and one scatter launch per kernel offset (27 or
125); grouping offsets with similar pair counts into one ``bmm`` cuts that to a few launches at
the cost of padding. ``max_waste`` bounds the padding: a group of G offsets padded to its
largest count L holds at most (1 + max_waste) times the real pairs. Padded slots gather a zero
row and scatter into a dropped row, so they add nothing. L is rounded up to a row bucket
(:func:`.row_buckets.row_step`: cuBLAS picks its algorithm per shape on the host, and every point cloud
brings new counts), and a group's rows run in chunks of at most :data:`WORKSPACE_BYTES` of gathered
operands and products (a group holds up to all of a layer's pairs: ~1 GB for a 96-channel subm3 at 657k voxels).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..coords.kernel_map import KernelMap
from ..precision import accumulator_dtype
from .problem import NAMESPACES, ConvProblem
from .registry import Backend, in_product_dtype, register
from .row_buckets import row_step

WASTE_SPACE = (0.25, 0.0, 0.1, 0.5, 1.0)  # the first is the default of a single-name pin
WORKSPACE_BYTES = 128 << 20
"""The most a chunk of a group's rows gathers and multiplies into at once."""


@dataclass(frozen=True)
class OffsetGroup:
    """offsets (G,) int64; in_idx, out_idx (G, L) int64, padded with num_in / num_out."""

    offsets: torch.Tensor
    in_idx: torch.Tensor
    out_idx: torch.Tensor


def plan_groups(kernel_map: KernelMap, max_waste: float) -> list[OffsetGroup]:
    """Greedy grouping of the non-identity offsets, largest pair count first."""
    counts = kernel_map.pair_counts
    order = sorted(
        (k for k, c in enumerate(counts) if c and k != kernel_map.identity_offset), key=lambda k: -counts[k]
    )
    members: list[list[int]] = []
    for k in order:
        group = members[-1] if members else None
        if group is not None and counts[group[0]] * (len(group) + 1) <= (1 + max_waste) * (sum(counts[j] for j in group) + counts[k]):
            group.append(k)
        else:
            members.append([k])
    device = kernel_map.neighbors.device
    groups = []
    for group in members:
        step = row_step(counts[group[0]])
        length = -(-counts[group[0]] // step) * step
        in_idx = torch.full((len(group), length), kernel_map.num_in, dtype=torch.int64, device=device)
        out_idx = torch.full((len(group), length), kernel_map.num_out, dtype=torch.int64, device=device)
        for row, k in enumerate(group):
            pairs_in, pairs_out = kernel_map.per_offset[k]
            in_idx[row, : counts[k]] = pairs_in
            out_idx[row, : counts[k]] = pairs_out
        groups.append(OffsetGroup(torch.tensor(group, dtype=torch.int64, device=device), in_idx, out_idx))
    return groups


def _groups(kernel_map: KernelMap, params: Mapping) -> list[OffsetGroup]:
    waste = float(params.get("max_waste", 0.25))
    return kernel_map.derived(("explicit_gemm_grouped", waste), lambda m: plan_groups(m, waste))


def with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``x`` (N, C) with a zero row appended (index N, or -1: what padded and absent pairs gather)."""
    return torch.cat([x, x.new_zeros((1, x.shape[1]))])


def gathered(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` for a (G, L) ``index`` of rows, as (G, L, C): through ``index_select``, which copies whole
    rows where indexing runs an element-wise kernel on a CPU (6x8192 rows of 8 / 32 / 64 floats, 2 cores:
    0.13 / 0.18 / 0.66 ms against 0.62 / 1.70 / 2.97)."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, source.shape[1])


def _chunks(group: OffsetGroup, row_bytes: int) -> list[tuple[int, int]]:
    """(start, end) column ranges of ``group``'s (G, L) indices, each gathering and multiplying at most
    :data:`WORKSPACE_BYTES` (``row_bytes``: what one pair takes), in multiples of L's row step."""
    offsets, length = group.in_idx.shape
    step = row_step(length)
    chunk = max(step, WORKSPACE_BYTES // max(1, offsets * row_bytes) // step * step)
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def forward(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, params: Mapping) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (K, C_in, C_out) weight -> (N_out, C_out)."""
    out = a.new_zeros((kernel_map.num_out + 1, b.shape[2]), dtype=accumulator_dtype(a.dtype))
    if kernel_map.identity_offset is not None:
        out[:-1] += torch.mm(a, b[kernel_map.identity_offset])
    source = with_zero_row(a)
    row_bytes = a.shape[1] * a.element_size() + b.shape[2] * (a.element_size() + out.element_size())
    for g in _groups(kernel_map, params):
        weights = b[g.offsets]
        for start, end in _chunks(g, row_bytes):
            products = torch.bmm(gathered(source, g.in_idx[:, start:end]), weights)
            out.index_add_(0, g.out_idx[:, start:end].flatten(), products.reshape(-1, b.shape[2]).to(out.dtype))
    return out[:-1].to(a.dtype)


def dgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, params: Mapping) -> torch.Tensor:
    """a: (N_out, C_out) output grad, b: (K, C_in, C_out) weight -> (N_in, C_in)."""
    out = a.new_zeros((kernel_map.num_in + 1, b.shape[1]), dtype=accumulator_dtype(a.dtype))
    if kernel_map.identity_offset is not None:
        out[:-1] += torch.mm(a, b[kernel_map.identity_offset].t())
    source = with_zero_row(a)
    row_bytes = a.shape[1] * a.element_size() + b.shape[1] * (a.element_size() + out.element_size())
    for g in _groups(kernel_map, params):
        weights = b[g.offsets].transpose(1, 2)
        for start, end in _chunks(g, row_bytes):
            products = torch.bmm(gathered(source, g.out_idx[:, start:end]), weights)
            out.index_add_(0, g.in_idx[:, start:end].flatten(), products.reshape(-1, b.shape[1]).to(out.dtype))
    return out[:-1].to(a.dtype)


def wgrad(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, params: Mapping) -> torch.Tensor:
    """a: (N_in, C_in) feats, b: (N_out, C_out) output grad -> (K, C_in, C_out)."""
    out = a.new_zeros((kernel_map.kernel_volume, a.shape[1], b.shape[1]))
    if kernel_map.identity_offset is not None:
        out[kernel_map.identity_offset] = torch.mm(a.t(), b)
    a_padded, b_padded = with_zero_row(a), with_zero_row(b)
    row_bytes = (a.shape[1] + b.shape[1]) * a.element_size()
    for g in _groups(kernel_map, params):
        chunks = _chunks(g, row_bytes)
        if len(chunks) == 1:
            out[g.offsets] = torch.bmm(gathered(a_padded, g.in_idx).transpose(1, 2), gathered(b_padded, g.out_idx))
            continue
        total = None  # the chunks' products summed in at least float32 (as cuBLAS sums each), in order: repeatable
        for start, end in chunks:
            product = torch.bmm(gathered(a_padded, g.in_idx[:, start:end]).transpose(1, 2),
                                gathered(b_padded, g.out_idx[:, start:end]))
            total = product.to(accumulator_dtype(product.dtype)) if total is None else total.add_(product)
        out[g.offsets] = total.to(out.dtype)
    return out


_PRODUCTS = dict(zip(NAMESPACES, (forward, dgrad, wgrad)))


def run(
    namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap
) -> torch.Tensor:
    return _PRODUCTS[namespace](a, b, kernel_map, params)


def pool(problem: ConvProblem, level: str) -> list[Mapping]:
    # With few offsets there is little launch overhead to save: auto leaves grouping out.
    if level == "auto":
        return [] if problem.kernel_volume < 8 else [{"max_waste": 0.25}]
    if level == "trimmed":
        return [{"max_waste": w} for w in (0.1, 0.25, 0.5)]
    return [{"max_waste": w} for w in WASTE_SPACE]


def heuristic(problem: ConvProblem) -> float:
    # On the 2-core CPU (2026-11-21, k=3, C 16-64) grouping won below ~4k rows, where per-offset
    # call overhead dominates, and lost 1.5-3x at 10k-60k rows, where bmm's padded copies cost more. Above
    # explicit_gemm (0) on larger maps of up to 16 channels or 8 offsets, below the CSR scatter (0.5): there the
    # demo's weight gradients ran grouped 1.3-3x faster (2 cores, 2026-12-08, up to 32k rows; the forward and
    # dgrad keys went to the CSR scatter). Not measured on a GPU: -1 there, as before.
    if problem.kernel_volume < 8:
        return -1.0
    if max(problem.num_in, problem.num_out) <= 4096:
        return 1.0
    small = max(problem.in_channels, problem.out_channels) <= 16 or problem.kernel_volume <= 8
    return 0.25 if small and problem.device.type == "cpu" else -1.0


def deterministic(namespace: str, params: Mapping) -> bool:
    """wgrad writes each offset's product once; forward and dgrad scatter a group's offsets in one
    ``index_add_``, where a row meets once per offset of the group: on CUDA those atomics race."""
    return namespace == "AtB_gather_gather"


EXPLICIT_GEMM_GROUPED = register(
    Backend(
        name="explicit_gemm_grouped",
        ops=frozenset(NAMESPACES),
        run=in_product_dtype(run),
        params_space=tuple({"max_waste": w} for w in WASTE_SPACE),
        pool=pool,
        heuristic=heuristic,
        deterministic=deterministic,
    )
)
