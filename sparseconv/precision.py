"""The dtype that sums of many products or features accumulate in."""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16 (a sum of K terms must not round K times), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
