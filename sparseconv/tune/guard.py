"""The tuner's numeric guard: a candidate's result against ``explicit_gemm``'s, with a tolerance
per dtype that a correct kernel meets and a wrong one (swapped rows, a missed offset) does not."""

from __future__ import annotations

import torch

# Relative Frobenius error a candidate may differ from explicit_gemm by. fp32 on CUDA allows
# tf32 products (~3e-4 typical); half types allow one rounding of the output plus a different
# fp32 summation order.
GUARD_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
GUARD_TOLERANCE_CUDA_FP32 = 2e-3
ROUNDING_SLACK = 4
"""A candidate may also be off by this many times the error of rounding the reference to the
output dtype (a kernel that sums in several rounded parts rounds more than once)."""


def guard_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda":
        return GUARD_TOLERANCE_CUDA_FP32
    return GUARD_TOLERANCE.get(dtype, 1e-5)


def check_output(out: object, reference: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """None if ``out`` (of ``dtype``, default the reference's) passes the numeric guard against
    ``reference`` (which may be in a wider dtype), else why it fails."""
    dtype = dtype or reference.dtype
    if not isinstance(out, torch.Tensor) or out.shape != reference.shape or out.dtype != dtype:
        return f"returned {getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}, expected {tuple(reference.shape)} {dtype}"
    if not bool(torch.isfinite(out).all()):
        return "non-finite values"
    wide = reference.double()
    scale = max(float(wide.norm()), 1e-30)
    error = float((out.double() - wide).norm()) / scale
    # What rounding the exact result to ``dtype`` alone costs. It is ~3e-4 of the norm for normal
    # half values, but an fp16 network's gradients without loss scaling are subnormal (~1e-6,
    # a few mantissa bits), where every correct kernel is off by ~10% and the relative bound
    # alone rejected them all (H100, 2026-11-25).
    floor = float((reference.to(dtype).double() - wide).norm()) / scale if dtype != reference.dtype else 0.0
    tolerance = guard_tolerance(dtype, reference.device)
    if error <= tolerance + ROUNDING_SLACK * floor:
        return None
    return f"relative error {error:.2e} > {tolerance:.0e} + {ROUNDING_SLACK} x {floor:.1e} (rounding to {dtype})"
