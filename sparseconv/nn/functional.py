"""Functional forms of the layers that are not convolutions: pooling, global pooling, per-sample
normalisation and channel concatenation.

Local pooling reuses the convolution's kernel maps (offsets and output coordinates exactly as in
:mod:`sparseconv.coords.kernel_map`), so a pool and a conv of the same kernel size and stride on
the same tensor produce the same output coordinate set and share one map.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._args import Triple, triple
from ..coords.kernel_map import KernelMap, KernelMapKey
from ..ops import batch
from ..precision import accumulator_dtype
from ..tensor import SparseTensor

__all__ = [
    "avg_pool3d",
    "cat",
    "global_avg_pool",
    "global_max_pool",
    "group_norm",
    "instance_norm",
    "max_pool3d",
]


def max_pool3d(
    input: SparseTensor, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None
) -> SparseTensor:
    """Max over the present inputs in each output's window: feats (N_in, C) -> SparseTensor (N_out, C).

    stride defaults to kernel_size, as in torch. Output coordinates are those of a conv with the
    same kernel size and stride. Empty cells are not inputs (a dense ``max_pool3d`` with ``-inf``
    in them); an output whose window holds no input (possible only when a kernel is narrower than
    its stride) is 0 with zero gradient. Tied maxima share the gradient equally.
    """
    kernel_map, out_id = _pool_map(input, kernel_size, stride)
    in_idx, out_idx, _ = kernel_map.pairs
    feats = input.feats
    index = out_idx[:, None].expand(-1, feats.shape[1])
    out = feats.new_zeros((kernel_map.num_out, feats.shape[1]))
    out = out.scatter_reduce(0, index, feats.index_select(0, in_idx), reduce="amax", include_self=False)
    return SparseTensor._derived(out, input.cache, out_id)


def avg_pool3d(
    input: SparseTensor, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None
) -> SparseTensor:
    """Mean over the present inputs in each output's window: feats (N_in, C) -> SparseTensor (N_out, C).

    Unlike dense ``avg_pool3d`` (which divides by the window volume, ``count_include_pad``), the
    divisor is the number of occupied cells in the window, so empty space does not dilute the
    features. Output coordinates and defaults as :func:`max_pool3d`; an empty window gives 0.
    """
    kernel_map, out_id = _pool_map(input, kernel_size, stride)
    in_idx, out_idx, _ = kernel_map.pairs
    feats = input.feats
    sums = _accumulator(feats, (kernel_map.num_out, feats.shape[1]))
    sums = sums.index_add(0, out_idx, feats.index_select(0, in_idx).to(sums.dtype))
    counts = torch.bincount(out_idx, minlength=kernel_map.num_out).clamp_(min=1)
    out = (sums / counts[:, None].to(sums.dtype)).to(feats.dtype)
    return SparseTensor._derived(out, input.cache, out_id)


def global_avg_pool(input: SparseTensor, batch_size: int | None = None) -> torch.Tensor:
    """Mean of the features of each batch element: (N, C) -> (B, C); an empty element gives 0.

    batch_size: B (default: 1 + the largest batch index), for batches whose last elements are empty.
    """
    batch, size = _batch_index(input, batch_size)
    feats = input.feats
    sums = _accumulator(feats, (size, feats.shape[1])).index_add(0, batch, feats.to(accumulator_dtype(feats.dtype)))
    counts = torch.bincount(batch, minlength=size).clamp_(min=1)
    return (sums / counts[:, None].to(sums.dtype)).to(feats.dtype)


def global_max_pool(input: SparseTensor, batch_size: int | None = None) -> torch.Tensor:
    """Max of the features of each batch element: (N, C) -> (B, C); an empty element gives 0."""
    batch, size = _batch_index(input, batch_size)
    feats = input.feats
    index = batch[:, None].expand(-1, feats.shape[1])
    return feats.new_zeros((size, feats.shape[1])).scatter_reduce(0, index, feats, reduce="amax", include_self=False)


def group_norm(
    input: SparseTensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> SparseTensor:
    """Group norm with statistics per batch element and group of C / num_groups channels:
    feats (N, C) -> (N, C); weight, bias (C,) or None.

    Equals torch's ``group_norm`` on each element's (1, C, N_b) slice (biased variance). Half
    precision inputs are normalised in float32 and returned in their dtype.
    """
    feats = input.feats
    channels = feats.shape[1]
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1 or channels % num_groups:
        raise ValueError(f"num_groups must be a positive int dividing the {channels} channels, got {num_groups!r}")
    batch, size = _batch_index(input, None)
    x = feats.to(accumulator_dtype(feats.dtype)).reshape(len(input), num_groups, channels // num_groups)
    count = (torch.bincount(batch, minlength=size).clamp_(min=1) * (channels // num_groups)).to(x.dtype)[:, None]
    # Two passes (mean, then the mean of squared deviations) keep the variance accurate for
    # features with a large mean, where E[x^2] - E[x]^2 cancels catastrophically.
    mean = x.new_zeros((size, num_groups)).index_add(0, batch, x.sum(2)) / count
    centred = x - mean[batch][:, :, None]
    var = x.new_zeros((size, num_groups)).index_add(0, batch, centred.square().sum(2)) / count
    out = (centred * torch.rsqrt(var + eps)[batch][:, :, None]).reshape(len(input), channels).to(feats.dtype)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return input.replace(out)


def instance_norm(
    input: SparseTensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> SparseTensor:
    """Instance norm: every channel normalised over the voxels of its batch element; (N, C) -> (N, C)."""
    return group_norm(input, input.num_channels, weight, bias, eps)


def cat(*tensors: SparseTensor) -> SparseTensor:
    """Concatenate the features of tensors on the same coordinates: (N, C_1), (N, C_2), ... -> (N, sum C_i).

    The coordinates must be the same rows in the same order (tensors of one coordinate set, as in
    U-Net skip connections, pass without a comparison); the result lives on the first's.
    """
    if len(tensors) == 1 and isinstance(tensors[0], list | tuple):
        tensors = tuple(tensors[0])
    if not tensors:
        raise ValueError("cat needs at least one SparseTensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, SparseTensor):
            raise TypeError(f"cat: tensors[{i}] must be a SparseTensor, got {type(t).__name__}")
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.cache is not first.cache or t.coord_id != first.coord_id:
            _check_same_coords(first, t, i)
    return SparseTensor._derived(torch.cat([t.feats for t in tensors], dim=1), first.cache, first.coord_id)


def _check_same_coords(first: SparseTensor, other: SparseTensor, i: int) -> None:
    what = f"cat: tensors[{i}]"
    if other.device != first.device:
        raise ValueError(f"{what} is on {other.device}, tensors[0] on {first.device}")
    if other.stride != first.stride:
        raise ValueError(f"{what} has stride {other.stride}, tensors[0] has {first.stride}")
    if len(other) != len(first):
        raise ValueError(f"{what} has {len(other)} voxels, tensors[0] has {len(first)}: the coordinates differ")
    mismatch = (other.coords != first.coords).any(dim=1)
    if bool(mismatch.any()):
        row = int(mismatch.nonzero()[0, 0])
        same_set = torch.equal(
            torch.unique(first.coords, dim=0), torch.unique(other.coords, dim=0)
        )
        hint = " (the same voxels in another row order)" if same_set else ""
        raise ValueError(
            f"{what} has other coordinates than tensors[0]{hint}: row {row} is "
            f"{other.coords[row].tolist()} vs {first.coords[row].tolist()}"
        )


def _pool_map(
    input: SparseTensor, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None
) -> tuple[KernelMap, int]:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a SparseTensor, got {type(input).__name__}")
    kernel: Triple = triple(kernel_size, "kernel_size")
    step: Triple = kernel if stride is None else triple(stride, "stride")
    key = KernelMapKey(input.coord_id, kernel, step, (1, 1, 1), transposed=False, generative=False)
    if torch.compiler.is_compiling():  # Dynamo traces: it cannot trace a map build (see ops/compiled.py)
        from ..ops import compiled

        return compiled.pool_map(input, key)
    kernel_map, _, out_id = batch.kernel_map(input.cache, key)
    return kernel_map, out_id


def _batch_index(input: SparseTensor, batch_size: int | None) -> tuple[torch.Tensor, int]:
    """(N,) int64 batch index of every row and the number of batch elements B."""
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a SparseTensor, got {type(input).__name__}")
    size = input.batch_size
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < size:
            raise ValueError(f"batch_size must be an int >= {size} (1 + the largest batch index), got {batch_size!r}")
        size = batch_size
    return input.coords[:, 0].to(torch.int64), size


def _accumulator(feats: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return feats.new_zeros(shape, dtype=accumulator_dtype(feats.dtype))
