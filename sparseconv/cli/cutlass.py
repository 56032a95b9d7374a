"""``python -m sparseconv cutlass status|build``: is the CUTLASS family usable here, and compile it ahead of time.

``build`` fills the cubin cache (e.g. in a Docker image or before a multi-rank job), so that no
training process waits for nvcc on its first step; it needs no GPU when ``--arch`` is given.
"""

from __future__ import annotations

import argparse
import time

import torch

from .. import config
from ..backends import cuda_jit, cutlass_gemm, cutlass_sm90

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_parser(commands: argparse._SubParsersAction) -> None:
    cutlass = commands.add_parser("cutlass", help="CUTLASS backends: toolchain status, ahead-of-time compilation")
    actions = cutlass.add_subparsers(dest="action", required=True)
    actions.add_parser("status", help="say whether the CUTLASS backends can compile and run here, and why not")
    build = actions.add_parser("build", help="compile every shipped variant into the cubin cache, in parallel")
    build.add_argument("--arch", nargs="+", default=None, help="e.g. sm_80 sm_90 (default: the current GPU's)")
    build.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))


def run(args: argparse.Namespace) -> int:
    reason = cuda_jit.unavailable()
    if args.action == "status":
        print(status_lines(reason))
        return 0 if reason is None else 1
    if reason is not None:
        print(f"cannot compile: {reason}")
        return 1
    arches = args.arch or ([cuda_jit.arch_of(torch.device("cuda"))] if torch.cuda.is_available() else None)
    if not arches:
        print("no GPU here: name the architectures, e.g. --arch sm_80 sm_90")
        return 2
    jobs = [(cutlass_gemm.SOURCE, cutlass_gemm.defines(tile, DTYPES[d]), arch) for arch in arches
            for d in args.dtypes for tile in cutlass_gemm.TILES]
    if {"sm_90", cutlass_sm90.ARCH} & set(arches):  # an H100/H200 also runs cutlass_sm90's wgmma kernels
        jobs += [(cutlass_sm90.SOURCE, cutlass_sm90.defines(tile, DTYPES[d]), cutlass_sm90.ARCH)
                 for d in args.dtypes if DTYPES[d] in cutlass_sm90.ELEMENT for tile in cutlass_sm90.TILES]
    start = time.perf_counter()
    futures = [cuda_jit.compile_async(source, defines, arch) for source, defines, arch in jobs]
    failed = 0
    for future in futures:
        try:
            future.result()
        except RuntimeError as error:
            failed += 1
            print(error)
    print(f"{len(jobs) - failed} of {len(jobs)} variants ready in {config.cache_dir() / 'cuda'} "
          f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def status_lines(reason: str | None) -> str:
    if reason is not None:
        return f"CUTLASS backends unavailable: {reason}"
    tools = cuda_jit.toolchain()
    lines = [f"nvcc: {tools.nvcc} ({tools.nvcc_version})", f"CUTLASS headers: {tools.cutlass_include}",
             f"cubin cache: {config.cache_dir() / 'cuda'}"]
    try:
        import cupy

        lines.append(f"CuPy: {cupy.__version__}")
    except ImportError:
        lines.append("CuPy: not installed (pip install 'sparseconv[cuda13]'): kernels compile but cannot load")
    if torch.cuda.is_available():
        lines.append(f"GPU: {torch.cuda.get_device_name()} ({cuda_jit.arch_of(torch.device('cuda'))})")
    else:
        lines.append("GPU: none (compile-only: python -m sparseconv cutlass build --arch sm_90)")
    return "\n".join(lines)
