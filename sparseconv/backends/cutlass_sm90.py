"""``cutlass_sm90`` (forward, dgrad): Hopper wgmma products from csrc/rows_sm90.cu.

What ``cutlass_grouped`` does (every offset in one launch, output-stationary: each block owns a
tile of output rows sorted by neighbour mask and writes each once, deterministic), with per-tile
offset lists (:func:`mask_views.active_lists`) instead of a mask, on warp-specialized wgmma: one
warpgroup gathers rows with cp.async into a ring of SC_STAGES shared-memory stages (and brings
each stage's tile of W, packed beforehand by ``PACK_KERNELS`` into shared-memory order, in one
bulk copy), one or two warpgroups (BM = 64 or 128 rows) multiply them. Blocks are persistent,
one an SM, and take the next untaken tile from a per-launch counter (zeroed by the pack kernel)
when they finish one, so the next tile's gathers overlap this one's epilogue and tiles of uneven
cost balance. Compiled with ``cuda_jit`` for the architecture string ``"sm_90a"`` only: wgmma and setmaxnreg exist on sm_90a
alone, so the backend registers for compute capability 9.0 (H100/H200) and says so elsewhere.
float16 and bfloat16 with fp32 accumulation, channel counts multiples of 8; other problems fall
back to the other backends. The tile is an inner configuration tuned with ``@autotune``; the
backend's parameter ``splits`` cuts the offsets into groups as mask_implicit_gemm does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..coords.kernel_map import KernelMap
from .problem import ConvProblem
from . import cuda_jit, cutlass_gemm
from .mask_views import active_lists, offset_groups
from .registry import INNER_PREFIX, Backend, always_deterministic, inner_autotune, register

INNER = INNER_PREFIX + "cutlass_sm90."

SOURCE = "rows_sm90.cu"
ARCH = "sm_90a"
ELEMENT = {torch.float16: 0, torch.bfloat16: 1}
KERNELS = ("sc90_rows_ab", "sc90_rows_abt")
PACK_KERNELS = ("sc90_pack_ab", "sc90_pack_abt")  # W -> the W_packed argument of KERNELS
LAUNCH_INFO = "sc90_launch_info"  # (2, 2) int32: {threads, dynamic shared bytes} of KERNELS
BLOCK_K = 64  # channels a stage: one 128-byte swizzle row of 16-bit elements
PACK_THREADS = 256


@dataclass(frozen=True)
class Tile:
    """Output columns per block (the N of one wgmma), wgmma warpgroups (64 output rows each), and
    shared-memory stages: the deepest ring that stays near 200 KB of the 227 KB a block may have
    (24, 40, 32 and 48 KB a stage), leaving some for L1."""

    block_n: int
    consumers: int
    stages: int

    @property
    def block_m(self) -> int:
        return 64 * self.consumers


TILES = (Tile(128, 1, 8), Tile(256, 1, 5), Tile(128, 2, 6), Tile(256, 2, 4))


def defines(tile: Tile, dtype: torch.dtype) -> dict[str, int]:
    """The -D template parameters of one compiled variant."""
    return {"SC_ELEMENT": ELEMENT[dtype], "SC_TB_N": tile.block_n, "SC_TB_K": BLOCK_K, "SC_STAGES": tile.stages,
            "SC_CONSUMERS": tile.consumers}


def sm90_variants() -> list[dict[str, int]]:
    """Every variant the backend may compile (CI compile-checks each for sm_90a)."""
    return [defines(tile, dtype) for dtype in ELEMENT for tile in TILES]


def packed_numel(variant: Mapping[str, int], num_offsets: int, reduce: int, cols: int) -> int:
    """Elements of W_packed for one variant: every (offset, channel block, column block) tile, padded."""
    n, k = variant["SC_TB_N"], variant["SC_TB_K"]
    return num_offsets * -(-reduce // k) * -(-cols // n) * n * k


def kernels_of(module, device_index: int) -> dict[str, cutlass_gemm._Kernel]:
    """KERNELS and PACK_KERNELS of a loaded module of rows_sm90.cu, ready to launch on the device."""
    import cupy

    kernels = cutlass_gemm.kernels_of(module, device_index, KERNELS, LAUNCH_INFO)
    with cupy.cuda.Device(device_index):  # CuPy loads a module's functions for the current device
        kernels.update({name: cutlass_gemm.kernel_of(module, name, PACK_THREADS, 0) for name in PACK_KERNELS})
    return kernels


@functools.cache
def _kernels(tile: Tile, dtype: torch.dtype, device_index: int) -> dict[str, cutlass_gemm._Kernel]:
    module = cuda_jit.load(SOURCE, defines(tile, dtype), torch.device("cuda", device_index), ARCH)
    return kernels_of(module, device_index)


def pack_launch(kernels: Mapping[str, cutlass_gemm._Kernel], forward: bool, variant: Mapping[str, int],
                w: torch.Tensor, reduce: int, cols: int, products: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """W_packed for ``variant`` and the tile counters of ``products`` launches (allocated, not yet
    written), and the (kernel, grid, args) launch that packs W into the one and zeroes the other."""
    num_offsets = w.shape[0]
    packed = torch.empty(packed_numel(variant, num_offsets, reduce, cols), dtype=w.dtype, device=w.device)
    counters = torch.empty(products, dtype=torch.int32, device=w.device)
    assert products <= PACK_THREADS, "one pack block zeroes the counters"
    grid = (min(1024, math.ceil(packed.numel() / PACK_THREADS)), 1, 1)
    args = (w, packed, num_offsets, reduce, cols, counters, products)
    return packed, counters, (kernels[PACK_KERNELS[0 if forward else 1]], grid, args)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid(tiles: int, device_index: int) -> tuple[int, int, int]:
    """The kernels are persistent: one block an SM (their shared memory allows no second), each
    taking the next untaken of the ``tiles`` output tiles when it is done with one."""
    return (max(1, min(tiles, _multiprocessors(device_index))), 1, 1)


@functools.cache
def prefetch(dtype: torch.dtype) -> None:
    """Compile every tile of ``dtype`` in parallel, once per process."""
    cuda_jit.compile_all(SOURCE, [defines(t, dtype) for t in TILES], ARCH)


def _group_lists(kernel_map: KernelMap, forward: bool, block_m: int,
                 group: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """((tiles, hi - lo) int32 offsets each tile of ``block_m`` visits, counted from lo as the
    group's table is, (tiles,) int32 how many) for the offsets [lo, hi) of ``group``; cached."""
    lo = group[0]

    def build(m: KernelMap) -> tuple[torch.Tensor, torch.Tensor]:
        offsets, counts = active_lists(m, forward, True, block_m, group)
        return (offsets - lo).contiguous(), counts

    return kernel_map.derived(("sm90_lists", forward, block_m, *group), build)


@inner_autotune(TILES, key=("op", "dtype", "channels", "rows", "splits"), name=INNER + "_rows")
def _rows(tile: Tile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, kernel_map: KernelMap, forward: bool,
          groups: tuple[tuple[int, int], ...]) -> None:
    """out (rows, cols), written in full: the forward (ab) or dgrad (abt) product of ``a`` and W,
    one launch per offset group (the first stores, the later ones add; see mask_triton)."""
    rows, cols = out.shape
    reduce = a.shape[1]
    kernels = _kernels(tile, a.dtype, out.device.index)
    # Packed on every call: W changes with every optimizer step, and packing 27 x 256 x 256 is a
    # few microseconds against the product's hundreds.
    packed, counters, pack = pack_launch(kernels, forward, _variant(tile, a.dtype), w, reduce, cols, len(groups))
    launches = [pack]
    # A group's W tiles and tile counter by address: a view of each would cost the host more.
    offset_bytes = packed.numel() // w.shape[0] * packed.element_size()
    product = kernels[KERNELS[0 if forward else 1]]
    for step, (lo, hi) in enumerate(groups):
        table, order, sources = cutlass_gemm.gather_table(kernel_map, forward, (lo, hi))
        offsets, counts = _group_lists(kernel_map, forward, tile.block_m, (lo, hi))
        # "No neighbour" is row ``sources`` of ``a``: the kernel writes its zeros without reading
        # it, so ``a`` needs no appended zero row.
        args = (a, np.uint64(packed.data_ptr() + lo * offset_bytes), table, order, offsets, counts, out, rows,
                reduce, cols, sources, offsets.shape[1], int(step > 0), np.uint64(counters.data_ptr() + 4 * step))
        launches.append((product, grid(counts.numel() * math.ceil(cols / tile.block_n), out.device.index), args))
    cutlass_gemm._launch_all(out.device, launches)


@functools.cache
def _variant(tile: Tile, dtype: torch.dtype) -> dict[str, int]:
    """:func:`defines`, kept: every call asks it (read only)."""
    return defines(tile, dtype)


def run(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor,
        kernel_map: KernelMap) -> torch.Tensor:
    forward = namespace == "AB_gather_scatter"
    a, w = a.contiguous(), b.contiguous()
    c_in, c_out = w.shape[1], w.shape[2]
    rows, reduce, cols = (kernel_map.num_out, c_in, c_out) if forward else (kernel_map.num_in, c_out, c_in)
    out = cutlass_gemm.new_output((rows, cols), a)
    if out.numel() == 0 or reduce == 0 or kernel_map.kernel_volume == 0:
        return out.zero_()
    prefetch(a.dtype)
    groups = _groups(kernel_map.kernel_volume, int(params.get("splits", 1)))
    _rows(a, w, out, kernel_map, forward, groups, op=namespace, dtype=str(a.dtype), channels=f"{c_in}x{c_out}",
          rows=f"{cutlass_gemm._size_bucket(rows)}k{kernel_map.kernel_volume}", splits=len(groups))
    return out


@functools.cache
def _groups(kernel_volume: int, splits: int) -> tuple[tuple[int, int], ...]:
    return tuple(offset_groups(kernel_volume, splits))


def unsupported(problem: ConvProblem) -> str | None:
    """Why ``cutlass_sm90`` cannot run ``problem`` here, or None."""
    if problem.device.type != "cuda":
        return "cutlass_sm90 runs on CUDA devices only"
    if problem.dtype not in ELEMENT:
        return (f"cutlass_sm90 takes float16 or bfloat16, not {problem.dtype} (float32 runs on cutlass_grouped "
                "through tf32 and on the Triton backends)")
    reason = cutlass_gemm.unsupported(problem)  # channel multiples of 8, nvcc, CUTLASS headers, CuPy
    if reason is not None:
        return reason
    capability = torch.cuda.get_device_capability(problem.device)
    if capability != (9, 0):
        return (f"cutlass_sm90 is built for sm_90a (wgmma: H100/H200) only, this GPU is "
                f"sm_{capability[0]}{capability[1]}")
    return None


SPACE = ({"splits": 1}, {"splits": 2}, {"splits": 3})


def _pool(problem: ConvProblem, level: str) -> list[Mapping]:
    """All offsets in one group, and for 27-offset maps also in two: sorted by a 27-bit mask, a
    tile of a street scene visits offsets that only 58% of its rows have, by a 13-14 bit one 87%
    (mask_triton's pool, from the same H200 sweeps)."""
    if problem.device.type != "cuda":
        return []
    if level == "all":
        return list(SPACE)
    return list(SPACE[:2]) if problem.kernel_volume > 8 else list(SPACE[:1])


def _heuristic(problem: ConvProblem) -> float:
    # Untimed pick: on an H200 it led the Triton mask kernel at C = 256 and trailed it at C <= 128
    # (docs/performance.md).
    if problem.device.type != "cuda":
        return -5.0
    return 2.5 if max(problem.in_channels, problem.out_channels) > 128 else 1.0


def _precompile(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap) -> None:
    """Every tile of the dtype (the inner @autotune times them all): Backend.precompile."""
    if problem.device.type == "cuda":
        prefetch(problem.dtype)


def _compiles(namespace: str, problem: ConvProblem, params: Mapping) -> tuple:
    """What _precompile compiles: every tile of the dtype, whatever the layer (Backend.compiles)."""
    return "cutlass_sm90", problem.dtype


# Deterministic: the tile counter's atomicAdd only decides which block takes a tile; a tile's sum
# is the same whichever block computes it, and offset groups add in launch order.
CUTLASS_SM90 = register(Backend(
    name="cutlass_sm90", ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}), run=run, params_space=SPACE,
    supports=unsupported, pool=_pool, heuristic=_heuristic, version=2,  # 2: persistent blocks
    precompile=_precompile, compiles=_compiles, deterministic=always_deterministic))
