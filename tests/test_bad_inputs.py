"""Bad inputs, empty inputs and bad cache files: each is a clear error naming the argument, or it works.

Three tables, one row per case, each run by one parametrised test:

- ``BAD_INPUTS``: (id, call, expected exception or None, regex the message must match). The regex
  names the argument; ``None`` rows must run without error (their call checks its own result).
- ``EMPTY``: every module on a SparseTensor with 0 rows, forward and backward.
- ``BAD_CACHES``: a broken tuning cache file under SPARSECONV_CACHE_DIR, then a tuned conv call.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from sparse_reference import random_coords

import sparseconv.tune
from sparseconv import SparseTensor, config
from sparseconv import nn as snn
from sparseconv.coords.keys import BATCH_MAX, COORD_MAX, COORD_MIN
from sparseconv.ops import sparse_conv3d
from sparseconv.tune.cache import TuneCache
from sparseconv.tune.cachefile import SCHEMA_VERSION

# -- inputs -------------------------------------------------------------------------------------


def cloud(c: int = 3, dtype=torch.float32, stride: int = 1, n: int = 40) -> SparseTensor:
    """A small random batch of 2 elements at ``stride``, coordinates in [-2 s, 3 s)."""
    coords = random_coords(n, 5, batch_size=2, stride=(stride,) * 3, low=-2 * stride)
    return SparseTensor(coords, torch.randn(len(coords), c, dtype=dtype), stride)


def coords_and_feats(n: int = 5, c: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    coords = torch.stack([torch.zeros(n, dtype=torch.int64), *(torch.arange(n),) * 3], dim=1)
    return coords, torch.randn(n, c)


def with_row(row: list[int]) -> SparseTensor:
    """A valid 5-row tensor with one more row ``row`` [batch, x, y, z]."""
    coords, feats = coords_and_feats()
    return SparseTensor(torch.cat([coords, torch.tensor([row])]), torch.randn(6, 2))


def unsorted_batch_ids_give_the_sorted_result() -> None:
    """Rows in any order (batch ids interleaved) give, row by row, what the sorted rows give."""
    coords = random_coords(120, 5, batch_size=3, low=-2)  # torch.unique sorts them
    feats = torch.randn(len(coords), 3, dtype=torch.float64)
    perm = torch.randperm(len(coords))
    assert not torch.equal(coords[perm][:, 0], coords[:, 0].sort().values), "the permutation left batches sorted"
    net = snn.Sequential(
        snn.SparseConv3d(3, 4, 3, dtype=torch.float64), snn.GroupNorm(2, 4, dtype=torch.float64),
        snn.SparseConv3d(4, 4, 2, 2, dtype=torch.float64), snn.SparseMaxPool3d(3, 1),
        snn.SparseConvTranspose3d(4, 2, 2, 2, dtype=torch.float64),
    )
    sorted_out = net(SparseTensor(coords, feats))
    shuffled_out = net(SparseTensor(coords[perm], feats[perm]))
    assert torch.equal(shuffled_out.coords, coords[perm])  # back on the input's rows, in its order
    torch.testing.assert_close(shuffled_out.feats, sorted_out.feats[perm])
    pooled = [snn.GlobalAvgPool()(SparseTensor(c, f)) for c, f in ((coords, feats), (coords[perm], feats[perm]))]
    torch.testing.assert_close(pooled[1], pooled[0])


def unsigned_coords_are_accepted() -> None:
    coords, feats = coords_and_feats()
    for dtype in (np.uint16, np.uint32, np.uint64):
        x = SparseTensor(coords.numpy().astype(dtype), feats)
        assert x.coords.dtype == torch.int32 and torch.equal(x.coords, coords.int())


def transposed_without_coarser_coordinates() -> None:
    """A tensor made at stride 2 has no stride-1 coordinates in its batch to go back onto."""
    snn.SparseConvTranspose3d(3, 3, 2, 2)(cloud(stride=2))


def transposed_below_stride_one() -> None:
    snn.SparseConvTranspose3d(3, 3, 2, 2)(cloud())


def transposed_stride_not_dividing() -> None:
    snn.SparseConvTranspose3d(3, 3, 3, 3)(cloud(stride=2))


def on_meta() -> SparseTensor:
    coords, feats = coords_and_feats()
    return SparseTensor(coords.to("meta"), feats.to("meta"))


def coords_and_feats_on(coords_device: str, feats_device: str) -> SparseTensor:
    coords, feats = coords_and_feats()
    return SparseTensor(coords.to(coords_device), feats.to(feats_device))


W = torch.randn(27, 3, 4)  # a valid weight for sparse_conv3d(cloud(), W, kernel_size=3)
ALGO_LIST = r"valid: \['auto', 'trimmed', 'all', .*'explicit_gemm'"
AXES = "must be >= 1 along every axis, got"
THREE = "must be a positive int or a tuple of 3 positive ints, got"


@dataclass(frozen=True)
class Bad:
    id: str
    call: Callable[[], object]
    error: type[Exception] | None  # None: must work (the call checks its result)
    match: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    marks: tuple = ()


BAD_INPUTS = [
    # coordinates
    Bad("coords-float", lambda: SparseTensor(torch.zeros(2, 4), torch.zeros(2, 1)),
        TypeError, r"coords must be an integer tensor, got torch\.float32"),
    Bad("coords-bool", lambda: SparseTensor(torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 1)),
        TypeError, r"coords must be an integer tensor, got torch\.bool"),
    Bad("coords-unsigned-wide", unsigned_coords_are_accepted, None),  # was NotImplementedError from torch.amin
    Bad("coords-shape-N3", lambda: SparseTensor(torch.zeros(5, 3, dtype=torch.int32), torch.zeros(5, 1)),
        ValueError, r"coords must have shape \(N, 4\) as \[batch, x, y, z\], got \(5, 3\)"),
    Bad("coords-1d", lambda: SparseTensor(torch.zeros(20, dtype=torch.int32), torch.zeros(5, 1)),
        ValueError, r"coords must have shape \(N, 4\).*got \(20,\)"),
    Bad("coords-not-a-tensor", lambda: SparseTensor([[0, 0, 0, 0]], torch.zeros(1, 1)),
        TypeError, r"coords must be a torch\.Tensor or numpy array, got list"),
    Bad("coords-meta-feats-cpu", lambda: coords_and_feats_on("meta", "cpu"),
        ValueError, r"coords and feats must be on one device, got coords on meta, feats on cpu"),
    Bad("coords-cpu-feats-cuda", lambda: coords_and_feats_on("cpu", "cuda"),
        ValueError, r"coords and feats must be on one device, got coords on cpu, feats on cuda",
        marks=(pytest.mark.gpu,)),
    Bad("coords-and-feats-on-meta", on_meta, ValueError, r"coords and feats must hold data.*meta"),  # was NotImplementedError
    Bad("negative-batch", lambda: with_row([-1, 0, 0, 0]),
        ValueError, r"coords: batch indices \(column 0\) must be >= 0, got -1"),
    Bad("batch-above-range", lambda: with_row([BATCH_MAX + 1, 0, 0, 0]),
        ValueError, rf"coords out of the supported range: batch indices span \[0, {BATCH_MAX + 1}\]"),
    Bad("x-above-range", lambda: with_row([0, COORD_MAX + 1, 0, 0]),
        ValueError, rf"coords out of the supported range: x, y, z span .*supported \[{COORD_MIN}, {COORD_MAX}\]"),
    Bad("y-below-range", lambda: with_row([0, 0, COORD_MIN - 1, 0]),
        ValueError, rf"coords out of the supported range: x, y, z span \[{COORD_MIN - 1}, "),
    Bad("z-far-above-int32", lambda: with_row([0, 0, 0, 2**40]),
        ValueError, rf"coords out of the supported range: x, y, z span \[0, {2**40}\]"),
    Bad("duplicate-coords", lambda: with_row([0, 1, 1, 1]),
        ValueError, r"coords has 1 duplicate rows \(e\.g\. \[0, 1, 1, 1\]\).*on_duplicate='sum' or 'mean'"),
    Bad("on-duplicate-misspelled", lambda: SparseTensor(*coords_and_feats(), on_duplicate="summ"),
        ValueError, r"on_duplicate must be one of \('error', 'sum', 'mean'\), got 'summ'"),
    Bad("off-grid-at-stride-2", lambda: SparseTensor(*coords_and_feats(), stride=2),
        ValueError, r"coords of a tensor at stride \(2, 2, 2\) must be multiples of it.*row 1 is \[0, 1, 1, 1\]"),
    Bad("unsorted-batch-ids-work", unsorted_batch_ids_give_the_sorted_result, None),
    # features
    Bad("feats-wrong-row-count", lambda: SparseTensor(coords_and_feats()[0], torch.zeros(4, 2)),
        ValueError, r"coords and feats must have the same number of rows, got coords N=5 and feats N=4"),
    Bad("feats-integer", lambda: SparseTensor(coords_and_feats()[0], torch.zeros(5, 2, dtype=torch.int64)),
        TypeError, r"feats must be floating point .*got torch\.int64"),
    Bad("feats-1d", lambda: SparseTensor(coords_and_feats()[0], torch.zeros(5)),
        ValueError, r"feats must have shape \(N, C\), got \(5,\)"),
    Bad("replace-wrong-row-count", lambda: cloud().replace(torch.zeros(3, 2)),
        ValueError, r"feats must have shape \(\d+, C\), got \(3, 2\)"),
    # layers whose channel count differs from the features' (were torch's matmul / shape errors)
    Bad("conv-in-channels", lambda: snn.SparseConv3d(4, 5, 3)(cloud(3)),
        ValueError, r"SparseConv3d expects 4 channels \(in_channels\), got a SparseTensor with 3"),
    Bad("conv-1x1-in-channels", lambda: snn.SparseConv3d(4, 5, 1)(cloud(3)),
        ValueError, r"SparseConv3d expects 4 channels \(in_channels\), got a SparseTensor with 3"),
    Bad("linear-in-features", lambda: snn.Linear(4, 2)(cloud(3)),
        ValueError, r"Linear expects 4 channels \(in_features\), got a SparseTensor with 3"),
    Bad("batchnorm-num-features", lambda: snn.BatchNorm(4)(cloud(3)),
        ValueError, r"BatchNorm expects 4 channels \(num_features\), got a SparseTensor with 3"),
    Bad("layernorm-normalized-shape", lambda: snn.LayerNorm(4)(cloud(3)),
        ValueError, r"LayerNorm expects 4 channels \(normalized_shape\), got a SparseTensor with 3"),
    Bad("groupnorm-num-channels", lambda: snn.GroupNorm(2, 4)(cloud(3)),
        ValueError, r"GroupNorm expects 4 channels, got a SparseTensor with 3"),
    Bad("groupnorm-groups-not-dividing", lambda: snn.functional.group_norm(cloud(3), 2),
        ValueError, r"num_groups must be a positive int dividing the 3 channels, got 2"),
    # weights and bias of the functional conv
    Bad("weight-2d", lambda: sparse_conv3d(cloud(), torch.randn(27, 3), kernel_size=3),
        ValueError, r"weight must have shape \(K=27, C_in=3, C_out\) .*got \(27, 3\)"),
    Bad("weight-kernel-volume", lambda: sparse_conv3d(cloud(), torch.randn(8, 3, 4), kernel_size=3),
        ValueError, r"weight must have shape \(K=27, C_in=3, C_out\) .*got \(8, 3, 4\)"),
    Bad("weight-in-channels", lambda: sparse_conv3d(cloud(), torch.randn(27, 2, 4), kernel_size=3),
        ValueError, r"weight must have shape \(K=27, C_in=3, C_out\) .*got \(27, 2, 4\)"),
    Bad("weight-not-a-tensor", lambda: sparse_conv3d(cloud(), W.numpy(), kernel_size=3),
        TypeError, r"weight must be a torch\.Tensor, got ndarray"),
    Bad("weight-dtype-vs-feats", lambda: snn.SparseConv3d(3, 4, 3, dtype=torch.float64)(cloud()),
        TypeError, r"weight \(torch\.float64\) .*must have the input features' dtype torch\.float32"),
    Bad("weight-dtype-vs-feats-1x1", lambda: snn.SparseConv3d(3, 4, 1, dtype=torch.float64)(cloud()),
        TypeError, r"weight \(torch\.float64\) .*must have the input features' dtype torch\.float32"),
    Bad("bias-dtype-vs-feats", lambda: sparse_conv3d(cloud(), W, W[0, 0].double(), kernel_size=3),
        TypeError, r"bias \(torch\.float64\) must have the input features' dtype torch\.float32"),
    Bad("bias-wrong-length", lambda: sparse_conv3d(cloud(), W, torch.zeros(5), kernel_size=3),
        ValueError, r"bias must have shape \(4,\), got \(5,\)"),
    Bad("bias-2d", lambda: sparse_conv3d(cloud(), W, torch.zeros(1, 4), kernel_size=3),
        ValueError, r"bias must have shape \(4,\), got \(1, 4\)"),
    # algorithm names: keyword pins (checked at construction) and environment variables
    Bad("fwd-algo-misspelled", lambda: snn.SparseConv3d(3, 4, fwd_algo="explicit_gem"),
        ValueError, rf"fwd_algo: unknown algorithm 'explicit_gem' .*{ALGO_LIST}.*did you mean 'explicit_gemm'\?"),
    Bad("dgrad-algo-misspelled", lambda: snn.SparseConv3d(3, 4, dgrad_algo="implict_gemm"),
        ValueError, rf"dgrad_algo: unknown algorithm 'implict_gemm' .*{ALGO_LIST}.*did you mean 'implicit_gemm'\?"),
    Bad("wgrad-algo-misspelled-in-list", lambda: snn.SparseConv3d(3, 4, wgrad_algo=["explicit_gemm", "splitk"]),
        ValueError, rf"wgrad_algo: unknown algorithm 'splitk' .*{ALGO_LIST}.*did you mean 'splitk_wgrad'\?"),
    Bad("fwd-algo-unknown-on-the-op", lambda: sparse_conv3d(cloud(), W, kernel_size=3, fwd_algo="fastest"),
        ValueError, rf"fwd_algo: unknown algorithm 'fastest' .*{ALGO_LIST}"),
    Bad("fwd-algo-mode-misspelled", lambda: snn.SparseConv3d(3, 4, fwd_algo="trimed"),
        ValueError, r"fwd_algo: unknown algorithm 'trimed' .*did you mean 'trimmed'\?"),
    Bad("fwd-algo-not-a-string", lambda: snn.SparseConv3d(3, 4, fwd_algo=3),
        TypeError, r"fwd_algo must be a mode string or a non-empty list of algorithm names, got 3"),
    Bad("wgrad-algo-empty-list", lambda: snn.SparseConv3d(3, 4, wgrad_algo=[]),
        TypeError, r"wgrad_algo must be a mode string or a non-empty list of algorithm names, got \[\]"),
    Bad("env-fwd-mode-misspelled", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, rf"SPARSECONV_FWD_ALGO_MODE: unknown algorithm 'explict_gemm' .*{ALGO_LIST}"
                    r".*did you mean 'explicit_gemm'\?",
        env={"SPARSECONV_FWD_ALGO_MODE": "explict_gemm"}),
    # a backward product's variable raises at the first conv, before any forward runs (not at backward)
    Bad("env-dgrad-mode-misspelled", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_DGRAD_ALGO_MODE: unknown algorithm 'explicit_gemm_grouper' "
                    r".*did you mean 'explicit_gemm_grouped'\?",
        env={"SPARSECONV_DGRAD_ALGO_MODE": "explicit_gemm_grouper"}),
    Bad("env-wgrad-mode-misspelled-in-list", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_WGRAD_ALGO_MODE: unknown algorithm 'splitk' .*did you mean 'splitk_wgrad'\?",
        env={"SPARSECONV_WGRAD_ALGO_MODE": "[explicit_gemm,splitk]"}),
    Bad("env-fwd-mode-empty-list", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_FWD_ALGO_MODE: empty algorithm mode '\[\]'",
        env={"SPARSECONV_FWD_ALGO_MODE": "[]"}),
    Bad("env-autotune-effort", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_AUTOTUNE_EFFORT must be one of \('none', 'quick', 'full'\), got 'fast'",
        env={"SPARSECONV_AUTOTUNE_EFFORT": "fast"}),
    # every other switch raises at the first conv too, not when (or if) the code reading it runs
    Bad("env-background-compile", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_BACKGROUND_COMPILE must be 1 or 0 .*got 'maybe'",
        env={"SPARSECONV_BACKGROUND_COMPILE": "maybe"}),
    Bad("env-shipped-tunings", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_SHIPPED_TUNINGS must be 1 or 0 .*got '2'", env={"SPARSECONV_SHIPPED_TUNINGS": "2"}),
    Bad("env-autotune-log", lambda: snn.SparseConv3d(3, 4)(cloud()),
        ValueError, r"SPARSECONV_AUTOTUNE_LOG must be 1 or 0 .*got 'ture'", env={"SPARSECONV_AUTOTUNE_LOG": "ture"}),
    # transposed convs need coarser coordinates of their batch to go back onto
    Bad("transposed-no-finer-coordinates", transposed_without_coarser_coordinates,
        ValueError, r"transposed conv from stride \(2, 2, 2\) to \(1, 1, 1\): no tensor of this batch has "
                    r"coordinates at stride \(1, 1, 1\).*generative=True"),
    Bad("transposed-below-stride-1", transposed_below_stride_one,
        ValueError, r"stride: a transposed conv with stride \(2, 2, 2\) cannot go below stride 1 "
                    r"from an input at stride \(1, 1, 1\)"),
    Bad("transposed-stride-not-dividing", transposed_stride_not_dividing,
        ValueError, r"stride: a transposed conv with stride \(3, 3, 3\) cannot go below stride 1 "
                    r"from an input at stride \(2, 2, 2\)"),
    # geometry arguments
    Bad("kernel-size-0", lambda: snn.SparseConv3d(3, 4, 0), ValueError, rf"kernel_size {AXES} \(0, 0, 0\)"),
    Bad("kernel-size-negative", lambda: snn.SparseConv3d(3, 4, (3, -1, 3)),
        ValueError, rf"kernel_size {AXES} \(3, -1, 3\)"),
    Bad("kernel-size-4-elements", lambda: snn.SparseConv3d(3, 4, (3, 3, 3, 3)),
        ValueError, rf"kernel_size {THREE} \(3, 3, 3, 3\)"),
    Bad("kernel-size-float", lambda: snn.SparseConv3d(3, 4, 3.0), TypeError, rf"kernel_size {THREE} float"),
    Bad("stride-0", lambda: snn.SparseConv3d(3, 4, 3, stride=0), ValueError, rf"stride {AXES} \(0, 0, 0\)"),
    Bad("stride-negative", lambda: snn.SparseConv3d(3, 4, 3, stride=-2), ValueError, rf"stride {AXES} \(-2, -2, -2\)"),
    Bad("stride-4-elements", lambda: snn.SparseConv3d(3, 4, 3, stride=[2, 2, 2, 2]),
        ValueError, rf"stride {THREE} \(2, 2, 2, 2\)"),
    Bad("dilation-0", lambda: snn.SparseConv3d(3, 4, 3, dilation=(1, 0, 1)), ValueError, rf"dilation {AXES} \(1, 0, 1\)"),
    Bad("dilation-negative", lambda: snn.SparseConv3d(3, 4, 3, dilation=-1),
        ValueError, rf"dilation {AXES} \(-1, -1, -1\)"),
    Bad("dilation-4-elements", lambda: snn.SparseConv3d(3, 4, 3, dilation=(2, 2, 2, 2)),
        ValueError, rf"dilation {THREE} \(2, 2, 2, 2\)"),
    Bad("op-stride-0", lambda: sparse_conv3d(cloud(), W, kernel_size=3, stride=0), ValueError, rf"stride {AXES}"),
    Bad("op-dilation-4-elements", lambda: sparse_conv3d(cloud(), W, kernel_size=3, dilation=(1, 1, 1, 1)),
        ValueError, rf"dilation {THREE} \(1, 1, 1, 1\)"),
    Bad("pool-kernel-size-0", lambda: snn.SparseMaxPool3d(0), ValueError, rf"kernel_size {AXES} \(0, 0, 0\)"),
    Bad("pool-stride-negative", lambda: snn.functional.avg_pool3d(cloud(), 2, -1),
        ValueError, rf"stride {AXES} \(-1, -1, -1\)"),
    Bad("tensor-stride-4-elements", lambda: SparseTensor(*coords_and_feats(), stride=(1, 1, 1, 1)),
        ValueError, rf"stride {THREE} \(1, 1, 1, 1\)"),
    # other entry points
    Bad("cat-other-coordinates", lambda: snn.cat(cloud(), cloud(n=60)),
        ValueError, r"cat: tensors\[1\] has .*tensors\[0\]"),
    Bad("global-pool-batch-size-too-small", lambda: snn.GlobalMaxPool()(cloud(), batch_size=1),
        ValueError, r"batch_size must be an int >= 2 \(1 \+ the largest batch index\), got 1"),
    Bad("to-dense-shape-too-small", lambda: snn.ToDense(shape=(1, 1, 1), origin=(-2, -2, -2))(cloud()),
        ValueError, r"shape \(1, 1, 1\) is too small"),
    Bad("dense-shape-negative", lambda: cloud().dense(shape=(4, -1, 4), origin=(-2, -2, -2)),
        ValueError, r"shape must be 3 non-negative ints \(X, Y, Z\), got \(4, -1, 4\)"),
    Bad("dense-origin-off-the-stride", lambda: cloud(stride=2).dense(origin=(1, 0, 0)),
        ValueError, r"origin must be a multiple of the stride \(2, 2, 2\), got \(1, 0, 0\)"),
    Bad("dense-coordinates-below-origin", lambda: SparseTensor(torch.tensor([[0, -3, 0, 0]]), torch.ones(1, 2)).dense(),
        ValueError, r"dense: coordinates lie below origin \(0, 0, 0\) \(min \(-3, 0, 0\)\)"),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in BAD_INPUTS])
def test_bad_input_is_a_clear_error_naming_the_argument(row: Bad, monkeypatch):
    for name, value in row.env.items():
        monkeypatch.setenv(name, value)
    if row.error is None:
        row.call()
        return
    with pytest.raises(row.error, match=row.match):
        row.call()


# -- empty tensors --------------------------------------------------------------------------------


def coarse_of(x: SparseTensor) -> SparseTensor:
    """The stride-2 side of a downsampling of ``x`` (so a transposed conv can go back)."""
    return snn.SparseConv3d(x.num_channels, x.num_channels, 2, 2)(x)


@dataclass(frozen=True)
class Empty:
    id: str
    make: Callable[[], Callable[[SparseTensor], object]]  # -> the module (or function) under test
    shape: tuple  # of the output for 0 rows of 4 channels
    stride: int = 1  # of the empty input
    before: Callable[[SparseTensor], SparseTensor] = staticmethod(lambda x: x)


EMPTY = [
    Empty("conv-submanifold", lambda: snn.SparseConv3d(4, 5, 3), (0, 5)),
    Empty("conv-1x1", lambda: snn.SparseConv3d(4, 5, 1), (0, 5)),
    Empty("conv-strided", lambda: snn.SparseConv3d(4, 5, 2, 2), (0, 5)),
    Empty("conv-dilated-anisotropic", lambda: snn.SparseConv3d(4, 5, (3, 1, 2), (2, 1, 1), 2), (0, 5)),
    Empty("conv-transposed", lambda: snn.SparseConvTranspose3d(4, 5, 2, 2), (0, 5), before=coarse_of),
    Empty("conv-generative", lambda: snn.SparseConv3d(4, 5, 3, generative=True), (0, 5)),
    Empty("conv-generative-transposed", lambda: snn.SparseConvTranspose3d(4, 5, 2, 2, generative=True), (0, 5), stride=2),
    Empty("max-pool", lambda: snn.SparseMaxPool3d(2), (0, 4)),
    Empty("avg-pool", lambda: snn.SparseAvgPool3d(3, 1), (0, 4)),
    Empty("batch-norm", lambda: snn.BatchNorm(4), (0, 4)),
    Empty("group-norm", lambda: snn.GroupNorm(2, 4), (0, 4)),
    Empty("instance-norm", lambda: snn.InstanceNorm(4, affine=True), (0, 4)),
    Empty("layer-norm", lambda: snn.LayerNorm(4), (0, 4)),
    Empty("relu", lambda: snn.ReLU(), (0, 4)),
    Empty("gelu", lambda: snn.GELU(), (0, 4)),
    Empty("dropout", lambda: snn.Dropout(0.5), (0, 4)),
    Empty("linear", lambda: snn.Linear(4, 3), (0, 3)),
    Empty("features-mlp", lambda: snn.Features(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU())), (0, 8)),
    Empty("cat", lambda: lambda x: snn.cat(x, x), (0, 8)),
    Empty("global-avg-pool", lambda: snn.GlobalAvgPool(), (0, 4)),
    Empty("global-max-pool", lambda: snn.GlobalMaxPool(), (0, 4)),
    Empty("global-avg-pool-batch-size-2", lambda: lambda x: snn.GlobalAvgPool()(x, batch_size=2), (2, 4)),
    Empty("to-dense", lambda: snn.ToDense(), (0, 4, 0, 0, 0)),
    Empty("to-dense-fixed-shape", lambda: snn.ToDense(shape=(2, 3, 1)), (0, 4, 2, 3, 1)),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in EMPTY])
def test_empty_tensor_gives_empty_outputs_and_zero_gradients(row: Empty):
    feats = torch.zeros(0, 4, requires_grad=True)
    x = row.before(SparseTensor(torch.zeros(0, 4, dtype=torch.int32), feats, row.stride))
    module = row.make()
    out = module(x)
    dense = out.feats if isinstance(out, SparseTensor) else out
    assert tuple(dense.shape) == row.shape
    assert torch.equal(dense, torch.zeros(row.shape))  # also: nothing NaN (no empty mean, no -inf max)
    (dense * torch.randn(row.shape)).sum().backward()
    assert feats.grad is not None and feats.grad.shape == (0, 4)
    for name, parameter in (module.named_parameters() if isinstance(module, torch.nn.Module) else ()):
        grad = parameter.grad
        assert grad is None or (grad.shape == parameter.shape and not grad.any()), name
    for name, buffer in (module.named_buffers() if isinstance(module, torch.nn.Module) else ()):
        assert not buffer.is_floating_point() or bool(torch.isfinite(buffer).all()), name  # no NaN running stats


# -- bad cache files ----------------------------------------------------------------------------

TUNED = ["explicit_gemm", "explicit_gemm_grouped"]  # a list pin: the conv call is timed and cached


def tuned_conv_call() -> None:
    """A user's conv call that reads and writes the tuning cache; checks its own result."""
    x = cloud(3, torch.float64)
    conv = snn.SparseConv3d(3, 4, 3, fwd_algo=TUNED, dtype=torch.float64)
    out = conv(x)
    reference = sparse_conv3d(x, conv.weight, conv.bias, 3, fwd_algo="explicit_gemm")
    torch.testing.assert_close(out.feats, reference.feats)
    assert conv.algorithms["AB_gather_scatter"].split("[")[0] in TUNED


def valid_doc_bytes() -> bytes:
    entries = {"other_namespace": {f"k{i}": {"evidence": 1, "updated": 1.0, "pad": "x" * 40} for i in range(10)}}
    return msgpack.packb({"schema": SCHEMA_VERSION, "entries": entries}, use_bin_type=True)


def read_only(directory: Path, monkeypatch) -> None:
    """Make ``directory`` read-only. Root ignores the mode bits, so for root the writes that a
    read-only directory refuses (the lock file, the temp file, the rename) fail with EACCES."""
    directory.chmod(0o555)
    if os.geteuid() != 0:
        return
    inside = str(directory) + os.sep

    def refuse(function, path_of):
        def wrapper(*args, **kwargs):
            if str(path_of(*args, **kwargs)).startswith(inside):
                raise PermissionError(errno.EACCES, "Permission denied (read-only test directory)")
            return function(*args, **kwargs)
        return wrapper

    def opened(path, flags, *args, **kwargs):
        return path if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) else ""

    monkeypatch.setattr(os, "open", refuse(os.open, opened))
    monkeypatch.setattr(os, "replace", refuse(os.replace, lambda src, dst, **_: dst))
    monkeypatch.setattr(tempfile, "mkstemp", refuse(tempfile.mkstemp, lambda *a, dir=None, **_: f"{dir}{os.sep}"))


@dataclass(frozen=True)
class BadCache:
    id: str
    content: Callable[[], bytes] | None  # the file's bytes (None: no file)
    aside: str | None  # glob of where the bad file must be moved, None: it stays where it is
    writable: bool = True
    warns: bool = True
    missing_dir: bool = False
    mangle: Callable[[dict], None] | None = None  # applied to each record of a real tuned entry
    kept: bool = False  # another version's file: left exactly as it was, nothing written beside it


def every_timing(change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda entry: [change(record) for record in entry["timings"].values()]


BAD_CACHES = [
    BadCache("truncated-msgpack", lambda: valid_doc_bytes()[: len(valid_doc_bytes()) // 2], "corrupt-*"),
    BadCache("random-bytes", lambda: bytes([0xC1]) + random.Random(0).randbytes(300), "corrupt-*"),
    BadCache("trailing-garbage", lambda: valid_doc_bytes() + b"\x00garbage", "corrupt-*"),
    BadCache("valid-msgpack-list", lambda: msgpack.packb([1, 2, 3]), "corrupt-*"),
    BadCache("valid-msgpack-int-keys", lambda: msgpack.packb({1: 2}), "corrupt-*"),
    BadCache("entries-not-a-dict", lambda: msgpack.packb({"schema": SCHEMA_VERSION, "entries": [1]}), "corrupt-*"),
    BadCache("old-schema", lambda: msgpack.packb({"schema": 0, "entries": {"ns": {}}}), "old-schema-0"),
    BadCache("newer-schema", lambda: msgpack.packb({"schema": SCHEMA_VERSION + 1, "entries": {}}), None, kept=True),
    BadCache("foreign-schema-name", lambda: msgpack.packb({"schema": "warpconvnet-3", "entries": {}}), "old-schema-unknown"),
    BadCache("schema-a-bool", lambda: msgpack.packb({"schema": True, "entries": {}}), "old-schema-unknown"),
    BadCache("foreign-document", lambda: msgpack.packb({"format": "someone-elses", "data": [1, 2]}), "corrupt-*"),
    BadCache("read-only-dir-valid-file", valid_doc_bytes, None, writable=False),
    BadCache("read-only-dir-corrupt-file", lambda: b"\xc1\xc1\xc1", None, writable=False),
    BadCache("read-only-dir-no-file", None, None, writable=False),
    BadCache("missing-dir", None, None, warns=False, missing_dir=True),  # created, no warning needed
    # A valid file whose tuner entry has fields of the wrong type: the entry is dropped and re-timed
    # (these crashed the conv call inside the tuner with TypeError / KeyError / AttributeError).
    BadCache("entry-timings-a-string", None, None, mangle=lambda e: e.update(timings="fast")),
    BadCache("entry-timing-record-an-int", None, None, mangle=lambda e: e.update(timings={k: 3 for k in e["timings"]})),
    BadCache("entry-ms-a-string", None, None, mangle=every_timing(lambda t: t.update(ms="fast"))),
    BadCache("entry-ok-without-ms", None, None, mangle=every_timing(lambda t: t.pop("ms"))),
    BadCache("entry-host-ms-nan", None, None, mangle=every_timing(lambda t: t.update(host_ms=float("nan")))),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in BAD_CACHES])
def test_bad_cache_file_warns_and_the_conv_call_works_on_a_fresh_cache(row: BadCache, tmp_path, monkeypatch, caplog):
    directory = tmp_path / "cache-dir"
    if row.missing_dir:
        directory = tmp_path / "not" / "made" / "yet"
    else:
        directory.mkdir()
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(directory))
    sparseconv.tune.reset()
    path = config.cache_dir() / "autotune.msgpack"
    before = row.content() if row.content is not None else None
    if row.mangle is not None:
        tuned_conv_call()
        sparseconv.tune.reset()
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        for entry in doc["entries"]["AB_gather_scatter"].values():
            row.mangle(entry)
        before = msgpack.packb(doc)
    if before is not None:
        path.write_bytes(before)

    with pytest.MonkeyPatch.context() as faults:  # undone before the checks read the files
        if not row.writable:
            read_only(directory, faults)
        try:
            with caplog.at_level(logging.WARNING, logger="sparseconv"):
                tuned_conv_call()
                sparseconv.tune.reset()  # flushes
                tuned_conv_call()  # a second process's view: a fresh tuner on the same directory
                sparseconv.tune.reset()
        finally:
            if directory.exists():
                directory.chmod(0o755)

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(str(path) in m for m in warnings) if row.warns else not warnings, warnings
    if row.kept:
        assert path.read_bytes() == before
        assert sorted(p.name for p in directory.iterdir()) == [path.name, f"{path.name}.lock"]
        return
    if not row.writable:
        assert (path.read_bytes() if path.exists() else None) == before  # left as it was
        assert sorted(p.name for p in directory.iterdir()) == ([path.name] if before is not None else [])
        path.unlink(missing_ok=True)  # the exit hook of this process's cache may write here later
        return
    doc = msgpack.unpackb(path.read_bytes(), raw=False)  # replaced by a valid cache, never by junk
    assert doc["schema"] == SCHEMA_VERSION and list(doc["entries"]) == ["AB_gather_scatter"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparseconv"):
        assert len(TuneCache(path).items()) == len(doc["entries"]["AB_gather_scatter"]) > 0
    assert not caplog.records, caplog.text  # every entry written is usable
    if row.aside is not None:
        asides = list(directory.glob(f"{path.name}.{row.aside}"))
        assert len(asides) == 1 and asides[0].read_bytes() == before
    assert not list(directory.glob(".*.tmp"))  # no temp file left behind


def test_a_generative_conv_whose_voxels_leave_the_packable_range_names_it():
    # A voxel at the top of the range generates one past it (COORD_MAX is odd: COORD_MAX + 1 is on the stride-2 grid).
    coords = torch.tensor([[0, 0, 0, 0], [0, COORD_MAX, 0, 0]], dtype=torch.int32)
    conv = snn.SparseConv3d(4, 5, 3, 2, generative=True)
    with pytest.raises(ValueError, match=rf"generative conv: .*supported range: x, y, z in \[{COORD_MIN}, {COORD_MAX}\]"):
        conv(SparseTensor(coords, torch.randn(2, 4)))
    inside = SparseTensor(coords - torch.tensor([0, 1, 0, 0], dtype=torch.int32), torch.randn(2, 4))
    assert {tuple(c) for c in conv(inside).coords.tolist()} == {(0, -2, 0, 0), (0, 0, 0, 0), (0, COORD_MAX - 1, 0, 0)}
