"""The dtype that sums of many products or features accumulate in."""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16 (a sum of K terms must not round K times), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def product_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype products of ``dtype`` operands are multiplied in on ``device``: float32 for float16 on a CPU,
    else ``dtype``. torch's CPU float16 GEMM has no fast kernel on x86 CPUs without AVX512-FP16: a
    20000x64 by 64x64 product took 27 ms in float16 against 1.6 ms cast to float32 and back (2 cores, AMD
    EPYC, 2026-12-01), and a MinkUNet training step 10-17 s against 0.8-1 s in float32. Its bfloat16 GEMM is
    fast (0.2 ms there) and keeps its dtype."""
    return torch.float32 if dtype == torch.float16 and device.type == "cpu" else dtype
