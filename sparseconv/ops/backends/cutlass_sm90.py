"""Hopper (sm_90a) output-stationary products from sparseconv/csrc/rows_sm90.cu (the backend is to come).

``sc90_rows_ab`` / ``sc90_rows_abt`` do what ``cutlass_grouped``'s kernels do (every offset in one
launch, one write per output row) with per-tile offset lists (``mask_triton.active_lists``)
instead of a mask, on warp-specialized wgmma: one warpgroup gathers rows with cp.async into a
ring of SC_STAGES shared-memory stages (and brings each stage's tile of W, packed beforehand by
``PACK_KERNELS`` into shared-memory order, in one bulk copy), one or two warpgroups (BM = 64 or
128 rows) multiply them. Compiled with ``cuda_jit`` for the architecture string ``"sm_90a"`` only: wgmma and
setmaxnreg exist on sm_90a alone, so a cubin of this source never runs on other GPUs.
Requirements: float16 or bfloat16, channel counts multiples of 8.
"""

from __future__ import annotations

SOURCE = "rows_sm90.cu"
ARCH = "sm_90a"
KERNELS = ("sc90_rows_ab", "sc90_rows_abt")
PACK_KERNELS = ("sc90_pack_ab", "sc90_pack_abt")  # W -> the W_packed argument of KERNELS
LAUNCH_INFO = "sc90_launch_info"  # (2, 2) int32: {threads, dynamic shared bytes} of KERNELS

# (SC_TB_N, SC_CONSUMERS, SC_STAGES): the deepest ring that stays near 200 KB of the 227 KB of
# shared memory a block may have (24, 40, 32 and 48 KB a stage), leaving some for L1.
_TILES = ((128, 1, 8), (256, 1, 5), (128, 2, 6), (256, 2, 4))


def sm90_variants() -> list[dict[str, int]]:
    """The -D parameters of every variant shipped (CI compile-checks each for sm_90a): half and
    bfloat16 (SC_ELEMENT 0, 1) x the tiles above, BM = 64 * SC_CONSUMERS, SC_TB_K = 64."""
    return [{"SC_ELEMENT": element, "SC_TB_N": n, "SC_TB_K": 64, "SC_STAGES": stages, "SC_CONSUMERS": consumers}
            for element in (0, 1) for n, consumers, stages in _TILES]


def packed_numel(variant: dict[str, int], num_offsets: int, reduce: int, cols: int) -> int:
    """Elements of W_packed for one variant: every (offset, channel block, column block) tile, padded."""
    n, k = variant["SC_TB_N"], variant["SC_TB_K"]
    return num_offsets * -(-reduce // k) * -(-cols // n) * n * k
