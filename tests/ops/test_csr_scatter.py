"""explicit_gemm_csr (CPU): every conv mode's forward and gradients (its forward and dgrad) equal the dense reference (float64), and
it is left out where it cannot run (GPU tensors, half precision)."""

from __future__ import annotations

import pytest
import torch
from conv_cases import MODES, assert_conv_matches_reference, make_conv, make_input

from sparseconv.backends import registry
from sparseconv.backends.problem import ConvProblem

NAME = "explicit_gemm_csr"


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_every_mode_equals_the_dense_reference_with_every_product_pinned_to_it(mode):
    x = make_input(mode, 3, "cpu")
    conv = make_conv(mode, 3, 4, "cpu")
    conv.pins = type(conv.pins).checked(NAME, NAME, "explicit_gemm")  # (no scatter in wgrad: not its product)
    assert_conv_matches_reference(conv, x)


def test_it_runs_on_the_cpu_in_float32_and_float64_and_float16_multiplied_in_float32_only():
    backend = registry.get(NAME)
    base = dict(in_channels=8, out_channels=8, kernel_size=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                transposed=False, generative=False, num_in=100, num_out=100)
    for dtype in (torch.float32, torch.float64, torch.float16):
        assert backend.supports(ConvProblem(**base, dtype=dtype, device=torch.device("cpu"))) is None
    assert "bfloat16" in backend.supports(ConvProblem(**base, dtype=torch.bfloat16, device=torch.device("cpu")))
    assert "CPU" in backend.supports(ConvProblem(**base, dtype=torch.float32, device=torch.device("cuda")))


def test_the_auto_pool_holds_it_for_kernels_of_eight_offsets_or_more():
    backend = registry.get(NAME)
    base = dict(num_in=100, num_out=100, stride=(1, 1, 1), dilation=(1, 1, 1), transposed=False, generative=False,
                dtype=torch.float32, device=torch.device("cpu"))
    assert backend.candidates_params(ConvProblem(in_channels=16, out_channels=32, kernel_size=(3, 3, 3), **base),
                                     "auto") == [{}]
    assert backend.candidates_params(ConvProblem(in_channels=64, out_channels=64, kernel_size=(2, 2, 2), **base),
                                     "auto") == [{}]
    assert backend.candidates_params(ConvProblem(in_channels=16, out_channels=16, kernel_size=(1, 1, 2), **base),
                                     "auto") == []
    assert backend.candidates_params(ConvProblem(in_channels=64, out_channels=64, kernel_size=(3, 3, 3), **base),
                                     "trimmed") == [{}]


def test_the_untimed_order_puts_it_first_up_to_16_channels_and_up_to_64_on_maps_of_up_to_49152_rows():
    """What a CPU layer runs until its sweep is done follows the pool's order: the CSR scatter ahead of explicit_gemm
    on a map whose sides have at most 16 channels, or at most 64 on up to 49152 rows, behind it on wider layers of
    larger maps; explicit_gemm_grouped ahead of both on a small map, between them on a large one of 16 channels."""
    from sparseconv.tune.pools import DEFAULT_MODE, candidate_pool

    def order(rows: int, c_in: int, c_out: int) -> list[str]:
        problem = ConvProblem(rows, rows, c_in, c_out, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, torch.float32,
                              torch.device("cpu"))
        names = [c.backend for c in candidate_pool("AB_gather_scatter", problem, DEFAULT_MODE, "quick")]
        return [n for n in names if n in (NAME, "explicit_gemm", "explicit_gemm_grouped")]

    assert order(90_000, 16, 16) == [NAME, "explicit_gemm_grouped", "explicit_gemm"]
    assert order(90_000, 4, 16)[:1] == [NAME]
    assert order(90_000, 16, 32).index("explicit_gemm") < order(90_000, 16, 32).index(NAME)
    assert order(90_000, 64, 64).index("explicit_gemm") < order(90_000, 64, 64).index(NAME)
    assert order(20_000, 32, 48) == [NAME, "explicit_gemm", "explicit_gemm_grouped"]  # grouped: -1 on a large map
    assert order(2_000, 16, 16) == ["explicit_gemm_grouped", NAME, "explicit_gemm"]


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_the_scatter_matrix_has_one_one_per_pair_in_its_row_in_pair_order(mode):
    from sparseconv.backends.csr_scatter import _scatter_matrix

    x = make_input(mode, 3, "cpu")
    make_conv(mode, 3, 4, "cpu")(x)
    maps = [m for m in x.cache.kernel_maps() if m.kernel_volume > 1]
    assert maps or mode.kernel_size in (1, (1, 1, 1)), "every mode but a 1x1x1 conv's makes a map"
    for kernel_map in maps:
        for side in ("out", "in"):
            matrix = _scatter_matrix(kernel_map, side, torch.float64)
            rows = [(o if side == "out" else i) for k, (i, o) in enumerate(kernel_map.per_offset)
                    if k != kernel_map.identity_offset]
            target = torch.cat(rows)
            expected = torch.zeros(matrix.shape, dtype=torch.float64)
            expected[target, torch.arange(len(target))] = 1
            assert torch.equal(matrix.to_dense(), expected), (kernel_map.kernel_size, side)
            columns, crow = matrix.col_indices(), matrix.crow_indices()
            for r in range(matrix.shape[0]):
                assert (columns[crow[r]:crow[r + 1]].diff() > 0).all(), "a row's columns in pair order"
