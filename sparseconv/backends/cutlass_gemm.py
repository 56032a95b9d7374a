"""CUTLASS tensor-core backends from csrc/sparse_gemm.cu, compiled at run time (see cuda_jit).

- ``cutlass_grouped`` (forward, dgrad): every offset in one launch, output-stationary: each
  block owns a tile of output rows sorted by neighbour mask and accumulates all its offsets in
  registers (offsets no row of the tile uses are skipped); one write per row, deterministic.
- ``cutlass_implicit_gemm`` (forward, dgrad): one gather-GEMM-scatter launch per offset
  (CUTLASS's gathered A and scattered D), accumulating into an fp32 output. Where every output
  row has at most one pair (the transposed k2 s2 conv, the dgrad of the strided one) there is
  nothing to accumulate: one launch covers all offsets and writes the output dtype directly.
- ``cutlass_splitk_wgrad`` (wgrad): dW_k = A[in_k]ᵀ · B[out_k] gathered along the pairs in both
  operands, the pairs cut into chunks (split-K) that all run in one launch, then each offset's
  chunks summed in a fixed order by a second kernel (deterministic).

The tile shape and pipeline depth (and the chunk length of wgrad) are inner configurations,
tuned with :func:`sparseconv.tune.autotune`, handed down as :func:`registry.inner_autotune`; the
tuner's namespaces choose between families.
fp16 and bf16 run with fp32 accumulation; fp32 runs through tf32 tensor ops, so only where
``torch.backends.cuda.matmul.allow_tf32`` allows it. Channel counts must allow 16-byte vector
loads (multiples of 8 for 16-bit types, 4 for fp32); other counts fall back to the other
backends, and a pin says why.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..coords.kernel_map import KernelMap
from .problem import ConvProblem
from . import cuda_jit, cuda_launch
from .mask_views import one_pair_per_row, product_table, sorted_rows, tile_offsets
from .registry import INNER_PREFIX, Backend, always_deterministic, inner_autotune, register

INNER = INNER_PREFIX + "cutlass_gemm."

SOURCE = "sparse_gemm.cu"
ELEMENT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_GRID_Z = 65535
KERNELS = ("sc_rows_ab", "sc_rows_abt", "sc_pairs_ab", "sc_pairs_abt", "sc_chunks_atb", "sc_single_ab", "sc_single_abt",
           "sc_chunks_sum")


@dataclass(frozen=True)
class Tile:
    """Threadblock tile (m, n, k), warp tile (m, n) and cp.async pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warp_m: int
    warp_n: int
    stages: int


@dataclass(frozen=True)
class WgradTile(Tile):
    chunk: int = 2048  # pairs per split-K chunk


TILES = (Tile(128, 128, 32, 64, 64, 3), Tile(128, 64, 32, 64, 32, 4), Tile(64, 64, 32, 32, 32, 4))
WGRAD_TILES = tuple(WgradTile(**asdict(t), chunk=c) for t, c in itertools.product(TILES, (2048, 8192)))


def defines(tile: Tile | WgradTile, dtype: torch.dtype) -> dict[str, int]:
    """The -D template parameters of one compiled variant."""
    return {"SC_ELEMENT": ELEMENT[dtype], "SC_TB_M": tile.block_m, "SC_TB_N": tile.block_n,
            "SC_TB_K": tile.block_k, "SC_WARP_M": tile.warp_m, "SC_WARP_N": tile.warp_n, "SC_STAGES": tile.stages}


def shipped_variants() -> list[dict[str, int]]:
    """Every variant the backends may compile (CI compile-checks each for sm_80 and sm_90)."""
    return [defines(tile, dtype) for dtype in ELEMENT for tile in TILES]


class _Kernel(NamedTuple):
    function: object  # CuPy's RawKernel: it keeps the module loaded, and knows the kernel's attributes
    handle: int  # its CUfunction on the device, what cuda_launch launches
    threads: int
    shared_bytes: int


def kernels_of(module, device_index: int, names: tuple[str, ...], launch_info: str) -> dict[str, _Kernel]:
    """The kernels ``names`` of a loaded module with their {threads, dynamic shared bytes}, read
    from the module's (len(names), 2) int32 symbol ``launch_info``; each kernel's dynamic
    shared-memory limit is raised to its size."""
    import cupy

    with cupy.cuda.Device(device_index):
        info = cupy.ndarray((len(names), 2), cupy.int32, module.get_global(launch_info)).get()
        kernels = {}
        for name, (threads, shared) in zip(names, info.tolist()):
            kernels[name] = kernel_of(module, name, threads, shared)
    return kernels


def kernel_of(module, name: str, threads: int, shared_bytes: int) -> _Kernel:
    """Kernel ``name`` of a CuPy module, for the current device, with its dynamic shared-memory limit raised."""
    function = module.get_function(name)
    function.max_dynamic_shared_size_bytes = shared_bytes
    return _Kernel(function, function.kernel.ptr, threads, shared_bytes)


@functools.cache
def _kernels(tile: Tile, dtype: torch.dtype, device_index: int) -> dict[str, _Kernel]:
    module = cuda_jit.load(SOURCE, defines(tile, dtype), torch.device("cuda", device_index))
    return kernels_of(module, device_index, KERNELS, "sc_launch_info")


def prefetch(dtype: torch.dtype, device: torch.device) -> None:
    """Compile every tile of ``dtype`` for ``device`` in parallel, once per process."""
    _prefetch(dtype, cuda_jit.arch_of(device))


@functools.cache
def _prefetch(dtype: torch.dtype, arch: str) -> None:
    cuda_jit.compile_all(SOURCE, [defines(t, dtype) for t in TILES], arch)


def _launch(kernel: _Kernel, grid: tuple[int, int, int], device: torch.device, *args) -> None:
    _launch_all(device, [(kernel, grid, args)])


def _launch_all(device: torch.device, launches: list[tuple[_Kernel, tuple[int, int, int], tuple]]) -> None:
    """Launch ``(kernel, grid, args)`` in order on torch's current stream of ``device``."""
    index = device.index
    if torch.cuda.current_device() == index:
        _issue(index, launches)
        return
    with torch.cuda.device(index):  # the kernels' module is loaded in that device's context
        _issue(index, launches)


def _issue(index: int, launches: list[tuple[_Kernel, tuple[int, int, int], tuple]]) -> None:
    stream = cuda_launch.current_stream(index)
    for kernel, grid, args in launches:
        cuda_launch.launch(kernel.handle, grid, kernel.threads, kernel.shared_bytes, stream, args, index)


def new_output(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Outputs the kernels write in full (tests poison this buffer to prove it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _pairs_int32(kernel_map: KernelMap) -> tuple[torch.Tensor, torch.Tensor]:
    """The map's CSR pairs (in_idx, out_idx) as the int32 index vectors CUTLASS gathers with."""
    in_idx, out_idx, _ = kernel_map.pairs
    return in_idx.to(torch.int32), out_idx.to(torch.int32)


def _size_bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------- cutlass_grouped ---------------

def gather_table(kernel_map: KernelMap, forward: bool,
                 group: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """((hi - lo, rows) int32 source row per sorted slot and offset of ``group`` = [lo, hi)
    (default: all offsets), (rows,) int32 row of each slot, source rows); rows sorted by their
    mask over the group's offsets. Cached on the map.

    "No neighbour" points at the source's row ``source rows``: ``cutlass_grouped`` appends an
    all-zero row per call, ``cutlass_sm90`` never reads it.
    """
    lo, hi = group or (0, kernel_map.kernel_volume)

    def build(m: KernelMap) -> tuple[torch.Tensor, torch.Tensor, int]:
        sources = m.num_in if forward else m.num_out
        order = sorted_rows(m, forward, True, group)
        table = product_table(m, forward)[order, lo:hi]
        table = torch.where(table >= 0, table, torch.full_like(table, sources))
        return table.t().contiguous().to(torch.int32), order.to(torch.int32), sources

    return kernel_map.derived(("cutlass_rows", forward, lo, hi), build)


@inner_autotune(TILES, key=("op", "dtype", "channels", "rows"), name=INNER + "_grouped")
def _grouped(tile: Tile, source: torch.Tensor, w: torch.Tensor, out: torch.Tensor, kernel_map: KernelMap,
             forward: bool) -> None:
    table, order, sources = gather_table(kernel_map, forward)
    active = kernel_map.derived(("cutlass_active", forward, tile.block_m),
                                lambda m: tile_offsets(m, forward, True, tile.block_m).to(torch.uint8))
    rows, cols = out.shape
    reduce = source.shape[1]
    kernel = _kernels(tile, source.dtype, out.device.index)["sc_rows_ab" if forward else "sc_rows_abt"]
    grid = (math.ceil(rows / tile.block_m), math.ceil(cols / tile.block_n), 1)
    _launch(kernel, grid, out.device, source, w, table, order, active, out, rows, reduce, cols, table.shape[0])


def run_grouped(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor,
                kernel_map: KernelMap) -> torch.Tensor:
    forward = namespace == "AB_gather_scatter"
    w = b.contiguous()
    c_in, c_out = w.shape[1], w.shape[2]
    rows, reduce, cols = (kernel_map.num_out, c_in, c_out) if forward else (kernel_map.num_in, c_out, c_in)
    out = new_output((rows, cols), a)
    if out.numel() == 0 or reduce == 0 or kernel_map.kernel_volume == 0:
        return out.zero_()
    prefetch(a.dtype, a.device)
    source = torch.cat([a.contiguous(), a.new_zeros((1, reduce))])
    _grouped(source, w, out, kernel_map, forward, op=namespace, dtype=str(a.dtype),
             channels=f"{c_in}x{c_out}", rows=f"{_size_bucket(rows)}k{kernel_map.kernel_volume}")
    return out


# ---------------------------------------------------------------- cutlass_implicit_gemm ---------

@inner_autotune(TILES, key=("op", "dtype", "channels", "rows"), name=INNER + "_pairs")
def _pairs(tile: Tile, a: torch.Tensor, w: torch.Tensor, kernel_map: KernelMap, forward: bool) -> torch.Tensor:
    """(rows, cols) fp32: the per-offset launches accumulate into it (a fresh one per call)."""
    in_idx, out_idx = kernel_map.derived("pairs_int32", _pairs_int32)
    gather, scatter = (in_idx, out_idx) if forward else (out_idx, in_idx)
    rows, cols = (kernel_map.num_out, w.shape[2]) if forward else (kernel_map.num_in, w.shape[1])
    reduce = a.shape[1]
    out = torch.zeros((rows, cols), dtype=torch.float32, device=a.device)
    kernel = _kernels(tile, a.dtype, out.device.index)["sc_pairs_ab" if forward else "sc_pairs_abt"]
    w_stride = w.shape[1] * w.shape[2] * w.element_size()
    w_at, gather_at, scatter_at = w.data_ptr(), gather.data_ptr(), scatter.data_ptr()
    launches, start = [], 0
    for k, count in enumerate(kernel_map.pair_counts):
        if count:
            grid = (math.ceil(count / tile.block_m), math.ceil(cols / tile.block_n), 1)
            launches.append((kernel, grid, (a, np.uint64(w_at + k * w_stride), np.uint64(gather_at + 4 * start),
                                            np.uint64(scatter_at + 4 * start), out, count, reduce, cols)))
        start += count
    _launch_all(out.device, launches)  # one device check and stream lookup for all the offsets
    return out


def _pair_blocks(kernel_map: KernelMap, size: int) -> torch.Tensor:
    """(blocks, 3) int32: (offset k, first pair, pair count <= size), each offset's pairs cut in order."""
    # numpy, not a Python loop over the blocks: a map has thousands, and the loop cost ~0.5 ms a
    # map on the host (cProfile of a MinkUNet training step, H100, 2026-11-25).
    counts = np.asarray(kernel_map.pair_counts, dtype=np.int64)
    per_offset = -(-counts // size)
    offset = np.repeat(np.arange(len(counts)), per_offset)
    first = (np.arange(int(per_offset.sum())) - np.repeat(np.cumsum(per_offset) - per_offset, per_offset)) * size
    start = np.repeat(np.cumsum(counts) - counts, per_offset) + first
    blocks = np.stack([offset, start, np.minimum(size, counts[offset] - first)], axis=1).astype(np.int32)
    return _to_device(blocks, kernel_map.neighbors.device)


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting: copied from pinned memory, asynchronously. A copy
    from pageable memory makes the host wait for all the GPU work queued before it, and these
    views are built in a training step's backward, with the GPU busy (two waits a map)."""
    host = torch.from_numpy(values)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@inner_autotune(TILES, key=("op", "dtype", "channels", "rows"), name=INNER + "_single")
def _single(tile: Tile, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, kernel_map: KernelMap,
            forward: bool) -> None:
    in_idx, out_idx = kernel_map.derived("pairs_int32", _pairs_int32)
    gather, scatter = (in_idx, out_idx) if forward else (out_idx, in_idx)
    tiles = kernel_map.derived(("cutlass_pair_blocks", tile.block_m), lambda m: _pair_blocks(m, tile.block_m))
    kernel = _kernels(tile, a.dtype, out.device.index)["sc_single_ab" if forward else "sc_single_abt"]
    grid = (tiles.shape[0], math.ceil(out.shape[1] / tile.block_n), 1)
    _launch(kernel, grid, out.device, a, w, gather, scatter, tiles, out, a.shape[1], out.shape[1])


def run_implicit(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor,
                 kernel_map: KernelMap) -> torch.Tensor:
    forward = namespace == "AB_gather_scatter"
    a, w = a.contiguous(), b.contiguous()
    c_in, c_out = w.shape[1], w.shape[2]
    rows, cols = (kernel_map.num_out, c_out) if forward else (kernel_map.num_in, c_in)
    if not (kernel_map.num_pairs and a.shape[1] and cols):
        return a.new_zeros((rows, cols))
    prefetch(a.dtype, a.device)
    key = dict(op=namespace, dtype=str(a.dtype), channels=f"{c_in}x{c_out}",
               rows=f"{_size_bucket(kernel_map.num_pairs)}k{kernel_map.kernel_volume}")
    single, covered = one_pair_per_row(kernel_map, forward)
    if single:
        out = new_output((rows, cols), a) if covered else a.new_zeros((rows, cols))
        _single(a, w, out, kernel_map, forward, **{**key, "op": namespace + ":single"})
        return out
    out = _pairs(a, w, kernel_map, forward, **key)
    return out.to(a.dtype)


# ---------------------------------------------------------------- cutlass_splitk_wgrad ----------

def _chunks(kernel_map: KernelMap, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((chunks, 2) int32 (first pair, pair count), (kernel volume + 1,) int32 first chunk of each
    offset): each offset's pairs cut in order into chunks of at most ``chunk`` pairs."""
    chunk = max(chunk, math.ceil(kernel_map.num_pairs / MAX_GRID_Z))  # one grid z-index per chunk
    blocks = _pair_blocks(kernel_map, chunk)
    per_offset = [math.ceil(count / chunk) for count in kernel_map.pair_counts]
    starts = _to_device(np.array([0, *itertools.accumulate(per_offset)], dtype=np.int32), blocks.device)
    return blocks[:, 1:].contiguous(), starts


@inner_autotune(WGRAD_TILES, key=("dtype", "channels", "pairs"), name=INNER + "_wgrad")
def _wgrad(tile: WgradTile, a: torch.Tensor, b: torch.Tensor, kernel_map: KernelMap) -> torch.Tensor:
    """(K, C_in, C_out) in a's dtype: each chunk's product in fp32, then each offset's chunks summed."""
    in_idx, out_idx = kernel_map.derived("pairs_int32", _pairs_int32)
    chunks, starts = kernel_map.derived(("cutlass_chunks", tile.chunk), lambda m: _chunks(m, tile.chunk))
    c_in, c_out = a.shape[1], b.shape[1]
    partial = torch.empty((chunks.shape[0], c_in, c_out), dtype=torch.float32, device=a.device)
    dw = new_output((kernel_map.kernel_volume, c_in, c_out), a)
    kernels = _kernels(tile, a.dtype, a.device.index)
    product, total = kernels["sc_chunks_atb"], kernels["sc_chunks_sum"]
    size = c_in * c_out
    _launch_all(a.device, [
        (product, (math.ceil(c_in / tile.block_m), math.ceil(c_out / tile.block_n), chunks.shape[0]),
         (a, b, in_idx, out_idx, chunks, partial, c_in, c_out)),
        (total, (math.ceil(size / (4 * total.threads)), kernel_map.kernel_volume, 1), (partial, starts, dw, size)),
    ])
    return dw


def run_wgrad(namespace: str, problem: ConvProblem, params: Mapping, a: torch.Tensor, b: torch.Tensor,
              kernel_map: KernelMap) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    c_in, c_out = a.shape[1], b.shape[1]
    if not (kernel_map.num_pairs and c_in and c_out):
        return a.new_zeros((kernel_map.kernel_volume, c_in, c_out))
    prefetch(a.dtype, a.device)
    return _wgrad(a, b, kernel_map, dtype=str(a.dtype), channels=f"{c_in}x{c_out}",
                  pairs=f"{_size_bucket(kernel_map.num_pairs)}k{kernel_map.kernel_volume}")


# ---------------------------------------------------------------- registration ------------------

def unsupported(problem: ConvProblem) -> str | None:
    """Why the CUTLASS backends cannot run ``problem`` here, or None."""
    if problem.device.type != "cuda":
        return "CUTLASS backends run on CUDA devices only"
    if problem.dtype not in ELEMENT:
        return f"CUTLASS backends take float16, bfloat16 or float32 (as tf32), not {problem.dtype}"
    if problem.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return ("float32 runs through tf32 tensor ops, which torch.backends.cuda.matmul.allow_tf32 forbids; "
                "exact float32 runs on the other backends")
    vector = 16 // problem.dtype.itemsize  # (an empty tensor's element_size: 274 allocations a street1 step)
    if problem.in_channels % vector or problem.out_channels % vector:
        return (f"{problem.dtype} channel counts must be multiples of {vector} for 16-byte loads, got "
                f"in_channels={problem.in_channels}, out_channels={problem.out_channels}")
    reason = cuda_jit.unavailable()
    if reason is not None:
        return reason
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed: pip install 'sparseconv[cuda13]' (or [cuda12])"
    if torch.cuda.get_device_capability(problem.device) < (8, 0):
        return "CUTLASS backends use sm_80 tensor ops: compute capability 8.0 or newer"
    return None


def _pool(problem: ConvProblem, level: str) -> list[Mapping]:
    return [{}] if problem.device.type == "cuda" else []


def _heuristic(problem: ConvProblem) -> float:
    return 0.5 if problem.device.type == "cuda" else -5.0


def _precompile(namespace: str, problem: ConvProblem, params: Mapping, kernel_map: KernelMap) -> None:
    """Every tile of the dtype (the inner @autotune times them all): Backend.precompile."""
    if problem.device.type == "cuda":
        prefetch(problem.dtype, problem.device)


def _compiles(namespace: str, problem: ConvProblem, params: Mapping) -> tuple:
    """What _precompile compiles: every tile of the dtype, whatever the layer (Backend.compiles)."""
    return "cutlass_gemm", problem.dtype, problem.device


# All three are deterministic (no atomics on values): grouped writes each row once; implicit's
# per-offset launches read-add-write rows that are unique within an offset, in stream order;
# splitk_wgrad sums its chunks in a fixed order. A tile (an @autotune choice) is fixed per process.
CUTLASS_GROUPED = register(Backend(
    name="cutlass_grouped", ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}), run=run_grouped,
    supports=unsupported, pool=_pool, heuristic=_heuristic, version=2,  # 2: rows sorted rarest offset first
    precompile=_precompile, compiles=_compiles, deterministic=always_deterministic))
CUTLASS_IMPLICIT_GEMM = register(Backend(
    name="cutlass_implicit_gemm", ops=frozenset({"AB_gather_scatter", "ABt_gather_scatter"}), run=run_implicit,
    supports=unsupported, pool=_pool, heuristic=_heuristic, precompile=_precompile, compiles=_compiles,
    deterministic=always_deterministic))
CUTLASS_SPLITK_WGRAD = register(Backend(
    name="cutlass_splitk_wgrad", ops=frozenset({"AtB_gather_gather"}), run=run_wgrad,
    supports=unsupported, pool=_pool, heuristic=_heuristic, precompile=_precompile, compiles=_compiles,
    deterministic=always_deterministic))
