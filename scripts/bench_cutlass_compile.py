"""Compile times of the CUTLASS variants: cold (empty cache, all tiles of a dtype in parallel) and cached.

    python scripts/bench_cutlass_compile.py                 # the GPU's architecture
    python scripts/bench_cutlass_compile.py --arch sm_90    # no GPU needed (compile only)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from sparseconv.ops.backends import cuda_jit, cutlass_gemm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=None, help="default: the current GPU's (sm_90 on an H100/H200)")
    args = parser.parse_args()
    arch = args.arch or cuda_jit.arch_of(torch.device("cuda"))
    os.environ["SPARSECONV_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparseconv-compile-")
    print(f"{cuda_jit.toolchain().nvcc_version}; arch {arch}; {os.cpu_count()} CPUs; "
          f"{len(cutlass_gemm.TILES)} tiles per dtype, 5 kernels per tile")
    print("dtype | cold, tiles in parallel (s) | slowest single tile (s) | cached (ms)")
    for dtype in cutlass_gemm.ELEMENT:
        variants = [cutlass_gemm.defines(t, dtype) for t in cutlass_gemm.TILES]
        start = time.perf_counter()
        cuda_jit.compile_all(cutlass_gemm.SOURCE, variants, arch)
        cold = time.perf_counter() - start
        cuda_jit._FUTURES.clear()  # as a new process would: find the cubins on disk
        single = 0.0
        for variant in variants:
            path = cuda_jit.cubin_path(cutlass_gemm.SOURCE, variant, arch)
            path.rename(path.with_suffix(".moved"))
            start = time.perf_counter()
            cuda_jit.compile_all(cutlass_gemm.SOURCE, [variant], arch)
            single = max(single, time.perf_counter() - start)
        cuda_jit._FUTURES.clear()
        start = time.perf_counter()
        cuda_jit.compile_all(cutlass_gemm.SOURCE, variants, arch)
        cached = time.perf_counter() - start
        print(f"{dtype} | {cold:.1f} | {single:.1f} | {1e3 * cached:.1f}")


if __name__ == "__main__":
    main()
