"""Every SPARSECONV_* environment variable, its default and meaning, read lazily in one place.

Nothing here runs at import; each accessor reads the environment when called, so a variable
set after ``import sparseconv`` (a notebook, a test) still takes effect.
"""

from __future__ import annotations

import difflib
import functools
import os
import warnings
from pathlib import Path

import torch

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
    "SPARSECONV_SHIPPED_TUNINGS": "1 (default): use the tunings shipped for common GPUs under the cache | 0: ignore them",
    "SPARSECONV_BACKGROUND_COMPILE": ("1 (default): on a GPU, a layer whose algorithm is decided (tuning cache or "
                                      "shipped tunings) but not compiled yet runs the reference while it compiles "
                                      "in worker processes, and a map view whose kernel is not compiled yet is built "
                                      "by torch ops meanwhile | 0: compile them in the call"),
    "SPARSECONV_COMPILE_WORKERS": ("worker processes compiling kernels in the background, at most (default: 4, fewer "
                                   "on a host with fewer cores; each holds a CUDA context, ~0.5 GB of the GPU, while "
                                   "it lives)"),
    "SPARSECONV_PLAN_MAPS": ("1 (default): a new batch builds the kernel maps the latest batches asked for at once "
                             "(few launches, one host sync) | 0: each map when a layer first asks for it"),
    "SPARSECONV_NVCC": "nvcc for the CUTLASS backends (default: $CUDA_HOME/bin/nvcc, then nvcc on PATH)",
    "SPARSECONV_CUTLASS_DIR": "CUTLASS checkout or include directory (default: the nvidia-cutlass package's headers)",
    "SPARSECONV_DETERMINISTIC": "1: only deterministic algorithms (bitwise-repeatable runs); 0: never; "
                                "unset: follow torch.use_deterministic_algorithms",
}


def algo_mode(namespace: str) -> tuple[str, str | None]:
    """(variable name, raw value or None) of the algorithm mode for ``namespace``."""
    name = ALGO_MODE_VARIABLES[namespace]
    return name, _parsed_mode(os.environ.get(name, ""))


def _parsed_mode(raw: str) -> str | None:
    return raw.strip() or None


def autotune_effort() -> str:
    return _parsed_effort(os.environ.get("SPARSECONV_AUTOTUNE_EFFORT", ""))


def _parsed_effort(raw: str) -> str:
    value = raw.strip().lower() or "quick"
    if value not in EFFORTS:
        raise ValueError(f"SPARSECONV_AUTOTUNE_EFFORT must be one of {EFFORTS}, got {value!r}")
    return value


def cache_dir() -> Path:
    value = os.environ.get("SPARSECONV_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sparseconv"


def autotune_log() -> bool:
    """Off unless set to 1 (true, yes, on); ValueError for a value that is neither on nor off."""
    value = os.environ.get("SPARSECONV_AUTOTUNE_LOG", "").strip().lower()
    if value in ("",) + _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(f"SPARSECONV_AUTOTUNE_LOG must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def shipped_tunings() -> bool:
    return _switch("SPARSECONV_SHIPPED_TUNINGS")


def background_compile() -> bool:
    return _switch("SPARSECONV_BACKGROUND_COMPILE")


def compile_workers() -> int | None:
    """SPARSECONV_COMPILE_WORKERS as a positive int, None if unset."""
    value = os.environ.get("SPARSECONV_COMPILE_WORKERS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SPARSECONV_COMPILE_WORKERS must be a positive integer, got {value!r}")
    return int(value)


def plan_maps() -> bool:
    return _switch("SPARSECONV_PLAN_MAPS")


def _switch(name: str) -> bool:
    """A variable that is on unless set to 0 (false, no, off)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("",) + _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def check_environment() -> None:
    """Parse every SPARSECONV_* switch and setting that has a fixed set of values now (ValueError naming the
    variable), and warn once for each SPARSECONV_* name that is none of :data:`VARIABLES` (a misspelt one
    would otherwise be ignored), with the closest known name. The algorithm modes are checked against the
    backend table by ``ops.dispatch.check_settings``, which calls this at a batch's first map request: a bad
    value fails before the first product runs, not when (or if) the code that reads it first runs. An
    environment whose SPARSECONV_* entries passed already is not parsed again (scanning every variable
    and parsing each took ~30 µs a batch on a 2-core CPU host)."""
    global _checked
    settings = _sparseconv_items()
    if settings == _checked:
        return
    autotune_effort()
    autotune_log()
    for switch in ("SPARSECONV_SHIPPED_TUNINGS", "SPARSECONV_BACKGROUND_COMPILE", "SPARSECONV_PLAN_MAPS"):
        _switch(switch)
    compile_workers()
    _parsed_deterministic(os.environ.get("SPARSECONV_DETERMINISTIC", ""), False)
    for name in os.environ:
        if name.startswith("SPARSECONV_") and name not in VARIABLES and name not in _WARNED:
            _WARNED.add(name)
            close = difflib.get_close_matches(name, VARIABLES, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {sorted(VARIABLES)}"
            warnings.warn(f"{name} is not a sparseconv setting and is ignored{hint}", stacklevel=2)
    _checked = settings


def _sparseconv_items() -> tuple:
    """The environment's SPARSECONV_* (name, value) pairs, read from its raw mapping where there is one
    (:func:`_raw_environ`: no decoding of every other variable)."""
    environ = os.environ
    raw = _raw_environ(environ)
    source, prefix = (raw, _encoded_name("SPARSECONV_")) if raw is not None else (environ, "SPARSECONV_")
    return tuple(sorted(item for item in source.items() if item[0].startswith(prefix)))


_WARNED: set[str] = set()  # unknown SPARSECONV_* names warned about in this process
_checked: tuple | None = None  # the SPARSECONV_* entries of the last environment that passed


def triton_interpret() -> bool:
    """Triton's own TRITON_INTERPRET=1: its kernels then run on the CPU (slowly), as CI does."""
    return os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true", "True")


def nvcc() -> str | None:
    return os.environ.get("SPARSECONV_NVCC", "").strip() or None


def cutlass_dir() -> Path | None:
    value = os.environ.get("SPARSECONV_CUTLASS_DIR", "").strip()
    return Path(value).expanduser() if value else None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_deterministic: bool | None = None  # set_deterministic's setting; None: the variable, then torch


def set_deterministic(mode: bool | None) -> bool | None:
    """Run only deterministic algorithms (True), any (False), or follow SPARSECONV_DETERMINISTIC
    and then torch.use_deterministic_algorithms (None, the default); returns the previous setting.

    Process-wide, like torch's switch: every layer, forward and backward, follows it.
    """
    global _deterministic
    if mode is not None and not isinstance(mode, bool):
        raise TypeError(f"set_deterministic: mode must be True, False or None, got {mode!r}")
    previous, _deterministic = _deterministic, mode
    return previous


def deterministic() -> bool:
    """Whether only deterministic algorithms may run: :func:`set_deterministic`'s setting, else
    SPARSECONV_DETERMINISTIC, else ``torch.are_deterministic_algorithms_enabled()``."""
    if _deterministic is not None:
        return _deterministic
    return _parsed_deterministic(os.environ.get("SPARSECONV_DETERMINISTIC", ""),
                                 torch.are_deterministic_algorithms_enabled())


def _parsed_deterministic(raw: str, torch_setting: bool) -> bool:
    value = raw.strip().lower()
    if not value:
        return torch_setting
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"SPARSECONV_DETERMINISTIC must be one of {_TRUE + _FALSE} or unset, got {value!r}")


def product_settings(namespace: str) -> tuple[str | None, bool, str]:
    """(:func:`algo_mode`'s value, :func:`deterministic`, :func:`autotune_effort`) for a product of
    ``namespace``: what the tuner reads on every conv call, parsed once per distinct set of raw
    values (reading and parsing each on its own cost ~5 µs a call)."""
    return _product_settings(_getenv(ALGO_MODE_VARIABLES[namespace]), _getenv("SPARSECONV_DETERMINISTIC"),
                             _getenv("SPARSECONV_AUTOTUNE_EFFORT"), _deterministic,
                             torch.are_deterministic_algorithms_enabled())


def _getenv(name: str) -> str:
    """``os.environ.get(name, "")``, cheap for an unset name too: ``Mapping.get`` raises and catches a
    KeyError for one (1.8 µs against 0.1 for a dict lookup on a 2-core CPU host), and the tuner reads
    three usually unset variables a product call. An unset name is told by the environment mapping's
    own dict of encoded names (CPython's ``os._Environ``); anything else asks ``os.environ``."""
    environ = os.environ
    raw = _raw_environ(environ)
    if raw is not None and _encoded_name(name) not in raw:
        return ""
    return environ.get(name, "")


def _raw_environ(environ) -> dict | None:
    raw = getattr(environ, "_data", None)
    return raw if isinstance(raw, dict) and callable(getattr(environ, "encodekey", None)) else None


@functools.lru_cache(maxsize=32)
def _encoded_name(name: str):
    return os.environ.encodekey(name)  # the platform's encoding of a name (bytes on POSIX)


@functools.lru_cache(maxsize=64)
def _product_settings(mode: str, deterministic_raw: str, effort: str, deterministic_set: bool | None,
                      torch_deterministic: bool) -> tuple[str | None, bool, str]:
    return (_parsed_mode(mode),
            deterministic_set if deterministic_set is not None else _parsed_deterministic(deterministic_raw,
                                                                                        torch_deterministic),
            _parsed_effort(effort))


def deterministic_warn_only() -> bool:
    """Whether deterministic mode comes from ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` alone: a pinned non-deterministic algorithm then warns instead of raising."""
    if _deterministic is not None or os.environ.get("SPARSECONV_DETERMINISTIC", "").strip():
        return False
    return torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
