"""Every SPARSECONV_* environment variable, its default and meaning, read lazily in one place.

Nothing here runs at import; each accessor reads the environment when called, so a variable
set after ``import sparseconv`` (a notebook, a test) still takes effect.
"""

from __future__ import annotations

import os
from pathlib import Path

ALGO_MODE_VARIABLES = {
    "AB_gather_scatter": "SPARSECONV_FWD_ALGO_MODE",
    "ABt_gather_scatter": "SPARSECONV_DGRAD_ALGO_MODE",
    "AtB_gather_gather": "SPARSECONV_WGRAD_ALGO_MODE",
}
EFFORTS = ("none", "quick", "full")

VARIABLES = {
    "SPARSECONV_FWD_ALGO_MODE": "forward algorithm mode: auto (default) | trimmed | all | NAME | [NAME,NAME]",
    "SPARSECONV_DGRAD_ALGO_MODE": "dgrad algorithm mode, same values",
    "SPARSECONV_WGRAD_ALGO_MODE": "wgrad algorithm mode, same values",
    "SPARSECONV_AUTOTUNE_EFFORT": ("none (no timing: the cost model's first pick, else the heuristic one) | quick "
                                   "(default: the adaptive pool, or only the cost model's top 3 once it has data) | "
                                   "full (every candidate)"),
    "SPARSECONV_CACHE_DIR": "directory of the tuning cache file (default ~/.cache/sparseconv)",
    "SPARSECONV_AUTOTUNE_LOG": "1: log every tuning sweep as a table, and the winner",
    "SPARSECONV_NVCC": "nvcc for the CUTLASS backends (default: $CUDA_HOME/bin/nvcc, then nvcc on PATH)",
    "SPARSECONV_CUTLASS_DIR": "CUTLASS checkout or include directory (default: the nvidia-cutlass package's headers)",
}


def algo_mode(namespace: str) -> tuple[str, str | None]:
    """(variable name, raw value or None) of the algorithm mode for ``namespace``."""
    name = ALGO_MODE_VARIABLES[namespace]
    value = os.environ.get(name, "").strip()
    return name, value or None


def autotune_effort() -> str:
    value = os.environ.get("SPARSECONV_AUTOTUNE_EFFORT", "quick").strip().lower() or "quick"
    if value not in EFFORTS:
        raise ValueError(f"SPARSECONV_AUTOTUNE_EFFORT must be one of {EFFORTS}, got {value!r}")
    return value


def cache_dir() -> Path:
    value = os.environ.get("SPARSECONV_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sparseconv"


def autotune_log() -> bool:
    return os.environ.get("SPARSECONV_AUTOTUNE_LOG", "").strip().lower() in ("1", "true", "yes", "on")


def triton_interpret() -> bool:
    """Triton's own TRITON_INTERPRET=1: its kernels then run on the CPU (slowly), as CI does."""
    return os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true", "True")


def nvcc() -> str | None:
    return os.environ.get("SPARSECONV_NVCC", "").strip() or None


def cutlass_dir() -> Path | None:
    value = os.environ.get("SPARSECONV_CUTLASS_DIR", "").strip()
    return Path(value).expanduser() if value else None
