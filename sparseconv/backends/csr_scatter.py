"""explicit_gemm_csr: explicit_gemm's gathers and per-offset products, every offset's scatter-add at once
as one sparse (CSR) matrix times the stacked products, on a CPU.

torch's CPU ``index_add_`` runs serially: scattering a street1 subm3 map's 473k pairs of 16 channels
took 10 ms on 2 cores, where MKL's CSR x dense product, a one-hot row per output, took 2.0 ms (64
channels: 17.6 against 10.0 ms; torch 2.13, 2026-11-28). The weight gradient has no scatter: it stays
with the other backends. A whole subm3 forward with 16 channels took 14.6 ms against explicit_gemm's 25.7,
with 64 channels 78.7 against 57.2 (the stacked products' extra pass), yet in a MinkUNet the tuner picked
it for wider layers too (inference 2.56 s with it in every auto pool of 8 offsets or more, 3.43 s with it held
to 32 channels, one run each): the auto pool holds it wherever a kernel has 8 offsets or more.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from ..coords.kernel_map import KernelMap
from ..precision import product_dtype
from .problem import ConvProblem
from .registry import Backend, in_product_dtype, register

SCATTERING = ("AB_gather_scatter", "ABt_gather_scatter")
"""The products with a scatter (forward, dgrad)."""
DTYPES = (torch.float32, torch.float64)
"""What torch's CPU CSR x dense product takes."""


def _scatter_matrix(kernel_map: KernelMap, side: str, dtype: torch.dtype) -> torch.Tensor:
    """(rows of ``side``, pairs) CSR one-hot matrix: column p (the p-th pair of the non-identity offsets in
    offset order) has a one in the row pair p scatters into (its output for "out", its input for "in")."""
    def build(m: KernelMap) -> torch.Tensor:
        rows = [(out_idx if side == "out" else in_idx) for k, (in_idx, out_idx) in enumerate(m.per_offset)
                if k != m.identity_offset]
        target = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        count = m.num_out if side == "out" else m.num_in
        crow = torch.zeros(count + 1, dtype=torch.int64)
        crow[1:] = torch.bincount(target, minlength=count).cumsum(0)
        columns = torch.argsort(target, stable=True)
        with warnings.catch_warnings():  # torch's "sparse CSR support is in beta" note, once a process, says nothing here
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
            # valid by construction (rows from a bincount's cumsum, columns a permutation): no invariant pass
            return torch.sparse_csr_tensor(crow, columns, torch.ones(len(target), dtype=dtype),
                                           size=(count, len(target)), check_invariants=False)

    return kernel_map.derived(("csr_scatter", side, dtype), build)


def _product(a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap, transpose: bool) -> torch.Tensor:
    """forward (``transpose`` False: a (N_in, C_in), b (K, C_in, C_out) -> (N_out, C_out)) or dgrad (a (N_out, C_out)
    output grad -> (N_in, C_in))."""
    weights = b.transpose(1, 2) if transpose else b
    scatter = _scatter_matrix(kernel_map, "in" if transpose else "out", a.dtype)
    stacked = a.new_empty(scatter.shape[1], weights.shape[2])
    start = 0
    for k, (in_idx, out_idx) in enumerate(kernel_map.per_offset):
        if k != kernel_map.identity_offset and len(in_idx):
            end = start + len(in_idx)
            torch.mm(a.index_select(0, out_idx if transpose else in_idx), weights[k], out=stacked[start:end])
            start = end
    out = scatter @ stacked
    if kernel_map.identity_offset is not None:  # (added by the GEMM itself: no temporary, no pass of its own)
        out.addmm_(a, weights[kernel_map.identity_offset])
    return out


def run(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor,
        kernel_map: KernelMap) -> torch.Tensor:
    return _product(a, b, kernel_map, transpose=namespace == "ABt_gather_scatter")


def _pool(problem: ConvProblem, level: str) -> list[Mapping]:
    if level == "auto" and problem.kernel_volume < 8:  # few offsets: little to gain from one scatter
        return []
    return [{}]


def _supports(problem: ConvProblem) -> str | None:
    if problem.device.type != "cpu":
        return "runs on the CPU (where index_add_ is serial); GPUs have the scatter kernels of the other backends"
    if product_dtype(problem.dtype, problem.device) not in DTYPES:
        return f"torch's CPU sparse product takes float32 or float64 (float16 multiplied in float32), not {problem.dtype}"
    return None


def _heuristic(problem: ConvProblem) -> float:
    """Ahead of explicit_gemm (0) where no layer side exceeds 16 channels on a large map, or 64 on a map of up to
    49152 rows, behind explicit_gemm_grouped (1) on a small one: the untimed order, which sets what a CPU layer runs
    until its sweep is done (one candidate a call, within the timing budget: minutes of a CPU run). A street1 map
    (92k rows, 2 threads, 2026-12-02): 16 channels subm3 forward 10.3 ms against 19.3, dgrad 8.8 against 16.7, k2 s2
    2.9 against 4.9; at 32 channels subm3 41.1 against 29.9 (k2 s2: 6.2 against 7.9)."""
    rows, channels = max(problem.num_in, problem.num_out), max(problem.in_channels, problem.out_channels)
    # The demo's network tuned whole (2 cores, 2026-12-08, 1k-32k rows, 8-96 channels): ahead of explicit_gemm on
    # every forward and dgrad key but one, 1.1-2.3x at up to 48 channels (bench_tuner.py --converge's full tuning).
    return 0.5 if (channels <= 16 and rows > 4096) or (channels <= 64 and rows <= 49152) else 0.0


EXPLICIT_GEMM_CSR = register(Backend(name="explicit_gemm_csr", ops=frozenset(SCATTERING), run=in_product_dtype(run),
                                     supports=_supports, pool=_pool, heuristic=_heuristic))
