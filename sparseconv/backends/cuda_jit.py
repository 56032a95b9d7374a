"""Run-time compilation of the CUDA C++ in csrc/ (see :func:`csrc_dir`): nvcc → cubin, cached on disk, loaded through CuPy.

Why nvcc and not NVRTC: CUTLASS's headers include the toolkit's C++ library headers (cuda/std,
cuda_fp16/bf16) that NVRTC alone does not ship, and nvcc is what the `nvidia-cuda-nvcc` wheel
or any CUDA toolkit brings. Why a cubin loaded by CuPy and not torch's C++-extension JIT: the
kernels take plain pointers and sizes, so there is no host code to build, no torch headers to
parse (a torch extension takes minutes, a cubin here ~10 s) and no artifact tied to torch's ABI.

A cubin is keyed by the source's hash, the -D template parameters, the architecture and the
versions of nvcc and CUTLASS; writes are atomic, so processes sharing the cache directory never
see half a file. Compilations run in a thread pool (nvcc is a subprocess), so many variants
build in parallel, and nothing compiles until a backend that needs a variant runs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import config
from .cuda_launch import index_of

CSRC_FILES = ("rows_sm90.cu", "sparse_gemm.cu")
COMPILE_TIMEOUT_S = 600


@functools.cache
def csrc_dir() -> Path:
    """The folder holding the CUDA C++ sources (:data:`CSRC_FILES`).

    In an installed wheel they are package data at ``sparseconv/_csrc/`` (pyproject.toml maps
    the repository's top-level ``csrc/`` there); in a checkout or an editable install they are
    ``csrc/`` beside the package. A real path, not an ``importlib.resources`` traversable: nvcc
    is a subprocess and needs a file name. The wheel's copy is looked for first, so an installed
    package never reads a stray ``csrc/`` next to it in site-packages.
    """
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "_csrc", package.parent / "csrc"):
        if all((candidate / name).is_file() for name in CSRC_FILES):
            return candidate
    raise FileNotFoundError(
        f"the CUDA C++ sources {list(CSRC_FILES)} are neither in {package / '_csrc'} (an installed wheel) "
        f"nor in {package.parent / 'csrc'} (a checkout); reinstall sparseconv"
    )


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_include: Path
    cutlass_version: str


def _cutlass_include() -> Path | None:
    configured = config.cutlass_dir()
    candidates = [configured / "include", configured] if configured else []
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) / "source" / "include" for p in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    return next((p for p in candidates if (p / "cutlass" / "cutlass.h").is_file()), None)


def _nvcc() -> str | None:
    configured = config.nvcc()
    if configured:
        return configured if Path(configured).is_file() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


@functools.cache
def _toolchain() -> Toolchain | str:
    nvcc = _nvcc()
    if nvcc is None:
        return "nvcc not found: install a CUDA toolkit (or the nvidia-cuda-nvcc wheel) or set SPARSECONV_NVCC"
    include = _cutlass_include()
    if include is None:
        return "CUTLASS headers not found: pip install nvidia-cutlass, or set SPARSECONV_CUTLASS_DIR"
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"{nvcc} --version failed: {error}"
    cutlass_version = hashlib.sha256((include / "cutlass" / "version.h").read_bytes()).hexdigest()[:16]
    return Toolchain(nvcc, version.strip().splitlines()[-1], include, cutlass_version)


def toolchain() -> Toolchain:
    """The compiler and headers found on this machine; RuntimeError saying what is missing."""
    found = _toolchain()
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def unavailable() -> str | None:
    """None if CUDA C++ can be compiled here, else why not (missing nvcc or CUTLASS headers)."""
    found = _toolchain()
    return found if isinstance(found, str) else None


def arch_of(device: torch.device) -> str:
    """'sm_90' for an H100/H200: the cubin is built for exactly the device's architecture."""
    return _arch(index_of(device))


@functools.cache
def _arch(device_index: int) -> str:  # asked on every call of a CUTLASS product
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def _target(arch: str) -> str:
    """nvcc's target flag: ``-arch=sm_XY``, or for an architecture-specific target such as
    ``sm_90a`` (wgmma, setmaxnreg) the explicit ``-gencode=arch=compute_90a,code=sm_90a``, since
    nvcc 13.0's ``-arch=sm_90a`` shorthand fails on wgmma."""
    if arch.endswith("a"):
        return f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}"
    return f"-arch={arch}"


def _command(tools: Toolchain, source: Path, defines: Mapping[str, int], arch: str, output: Path) -> list[str]:
    return [
        tools.nvcc, "-cubin", _target(arch), "-std=c++17", "-O3", "--expt-relaxed-constexpr",
        "-DNDEBUG", f"-I{tools.cutlass_include}", *(f"-D{k}={v}" for k, v in sorted(defines.items())),
        "-o", str(output), str(source),
    ]


def cubin_path(source: str, defines: Mapping[str, int], arch: str) -> Path:
    """Where the cubin of ``source`` (a file in :func:`csrc_dir`) with ``defines`` for ``arch`` is cached."""
    tools = toolchain()
    digest = hashlib.sha256()
    for part in ((csrc_dir() / source).read_bytes(), repr(sorted(defines.items())).encode(), arch.encode(),
                 tools.nvcc_version.encode(), tools.cutlass_version.encode()):
        digest.update(part)
    return config.cache_dir() / "cuda" / f"{Path(source).stem}-{arch}-{digest.hexdigest()[:24]}.cubin"


def _compile(source: str, defines: Mapping[str, int], arch: str, path: Path) -> Path:
    if path.is_file():
        return path
    tools = toolchain()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".cubin", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run(_command(tools, csrc_dir() / source, defines, arch, Path(temporary)),
                                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source} {dict(defines)} for {arch}:\n{result.stderr[-4000:]}")
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_FUTURES: dict[Path, concurrent.futures.Future] = {}
_LOCK = threading.Lock()


def compile_async(source: str, defines: Mapping[str, int], arch: str) -> concurrent.futures.Future:
    """Start compiling (or find the cached cubin); the future's result is the cubin's path.

    A failed compile stays failed for the rest of the process (its future re-raises), so a
    tuner sweep does not pay for the same failing nvcc run again on every new layer shape.
    """
    global _POOL
    path = cubin_path(source, defines, arch)
    with _LOCK:
        future = _FUTURES.get(path)
        if future is None:
            if _POOL is None:
                _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1)),
                                                              thread_name_prefix="sparseconv-nvcc")
            future = _POOL.submit(_compile, source, dict(defines), arch, path)
            _FUTURES[path] = future
    return future


def compile_all(source: str, variants: Iterable[Mapping[str, int]], arch: str) -> list[Path]:
    """Compile every variant in parallel; the cubins' paths in order (first failure raises)."""
    futures = [compile_async(source, v, arch) for v in variants]
    return [f.result() for f in futures]


@functools.cache
def _module(path: Path, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(path=str(path))


def load(source: str, defines: Mapping[str, int], device: torch.device, arch: str | None = None):
    """The CuPy RawModule of a variant on ``device`` (compiled first if needed; blocks until then),
    built for ``arch`` (default: the device's own, see :func:`arch_of`)."""
    path = compile_async(source, defines, arch or arch_of(device)).result()
    return _module(path, index_of(device))
