"""sparse_conv3d: the autograd function whose forward, dgrad and wgrad each make one dispatch call."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from .._args import triple
from ..coords.batch import MapUse
from ..coords.kernel_map import KernelMap, KernelMapKey
from ..tensor import SparseTensor
from ..backends.problem import ConvProblem, layer_problem
from . import batch
from .dispatch import AlgoPins, Pin, dispatch
from .pointwise import pointwise


MATMUL = "matmul"
"""What ``record`` says for the products of a 1x1x1 stride-1 conv, which torch.mm computes."""


class SparseConvFunction(torch.autograd.Function):
    """feats (N_in, C_in), weight (K, C_in, C_out) -> (N_out, C_out), through ``kernel_map`` (``use``: its use
    in the batch, where the products prepared on it are kept)."""

    @staticmethod
    def forward(ctx, feats, weight, kernel_map: KernelMap, use: MapUse | None, problem: ConvProblem, pins: AlgoPins,
                record):
        ctx.save_for_backward(feats, weight)
        ctx.kernel_map, ctx.use, ctx.problem, ctx.pins, ctx.record = kernel_map, use, problem, pins, record
        return dispatch("AB_gather_scatter", problem, pins.fwd, feats, weight, kernel_map, record, use)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        feats, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_feats = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_feats = dispatch(
                "ABt_gather_scatter", ctx.problem, ctx.pins.dgrad, grad_out, weight, ctx.kernel_map, ctx.record, ctx.use
            )
        if ctx.needs_input_grad[1]:
            grad_weight = dispatch(
                "AtB_gather_gather", ctx.problem, ctx.pins.wgrad, feats, grad_out, ctx.kernel_map, ctx.record, ctx.use
            )
        return grad_feats, grad_weight, None, None, None, None, None


def sparse_conv3d(
    input: SparseTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel_size: int | Sequence[int] = 3,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    transposed: bool = False,
    generative: bool = False,
    fwd_algo: Pin = None,
    dgrad_algo: Pin = None,
    wgrad_algo: Pin = None,
    record: dict[str, str] | None = None,
) -> SparseTensor:
    """Sparse 3D convolution of ``input`` (N_in, C_in) with weight (K, C_in, C_out) -> SparseTensor (N_out, C_out).

    Output coordinates: the input's (stride 1), the floor-to-multiple of the new stride
    (strided), the finer coordinates of this batch (transposed), or every position the kernel
    reaches (generative). Offsets and conventions: :mod:`sparseconv.coords.kernel_map`.
    Pins: a backend name (used as is), a list of names (the tuner times only these; a list of one
    tunes that backend's parameters), or a mode
    (auto / trimmed / all); None follows SPARSECONV_*_ALGO_MODE. ``record``, if given, receives
    the algorithm chosen for each product as it runs (forward now, dgrad and wgrad in backward).
    A 1x1x1 kernel at stride 1 (not generative) is a plain ``torch.mm``: it builds no map, pins do
    not apply, and ``record`` says ``"matmul"``.
    """
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a SparseTensor, got {type(input).__name__}")
    kernel_size = triple(kernel_size, "kernel_size")
    stride = triple(stride, "stride")
    dilation = triple(dilation, "dilation")
    pins = AlgoPins.checked(fwd_algo, dgrad_algo, wgrad_algo)
    _check_weight(weight, bias, kernel_size, input.feats)
    return checked_conv3d(input, weight, bias, kernel_size, stride, dilation, bool(transposed), bool(generative),
                          pins, record)


def checked_conv3d(
    input: SparseTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_size: tuple[int, int, int],
    stride: tuple[int, int, int],
    dilation: tuple[int, int, int],
    transposed: bool,
    generative: bool,
    pins: AlgoPins,
    record: dict[str, str] | None,
) -> SparseTensor:
    """:func:`sparse_conv3d` once its arguments are checked and normalised (triples, bools, checked
    pins, a weight of the right shape on the input's device): a module checks them at construction
    and calls this, saving the ~10 µs a call the checks cost its host (a MinkUNet makes ~50 calls)."""
    feats = input.feats
    if torch.is_autocast_enabled(feats.device.type):
        dtype = torch.get_autocast_dtype(feats.device.type)
        feats, weight = feats.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif weight.dtype != feats.dtype or (bias is not None and bias.dtype != feats.dtype):
        raise TypeError(
            f"weight ({weight.dtype}) and bias ({None if bias is None else bias.dtype}) must have the "
            f"input features' dtype {feats.dtype} (or run under torch.autocast)"
        )

    if torch.compiler.is_compiling():  # Dynamo traces: custom ops instead (imported here, as it loads Dynamo)
        from . import compiled

        return compiled.sparse_conv3d(input, feats, weight, bias, kernel_size, stride, dilation, transposed, generative,
                                      pins)
    if weight.shape[0] == 1 and stride == (1, 1, 1) and not generative:
        # Every row is its own only neighbour: a matmul on the same coordinates, no map, no tuner.
        # squeeze, not weight[0]: its backward is a view of the gradient, where select's backward
        # fills a zeroed weight-sized tensor (two launches a 1x1 layer in a training step).
        # On a GPU its rows are padded to a size bucket (pointwise.py: cuBLAS's per-shape host cost).
        out = pointwise(feats, weight.squeeze(0), bias)
        if record is not None:
            record["AB_gather_scatter"] = MATMUL
            if out.requires_grad:
                record.update({"ABt_gather_scatter": MATMUL, "AtB_gather_gather": MATMUL})
        return SparseTensor._derived(out, input.cache, input.coord_id)
    key = KernelMapKey(input.coord_id, kernel_size, stride, dilation, transposed, generative)
    layer = (weight.shape[1], weight.shape[2], kernel_size, stride, dilation, transposed, generative,
             feats.dtype, feats.device)
    capacity = input.cache.batch.capacity
    if capacity is not None:  # a graphed pass or its recording (sparseconv.graphed): no tuner
        out, out_id = capacity.conv(input.cache, feats, weight, key, layer)
        return SparseTensor._derived(out if bias is None else out + bias, input.cache, out_id)
    kernel_map, use, out_id = batch.kernel_map(input.cache, key)
    problem = layer_problem(kernel_map, layer, use.lone)
    if torch.is_grad_enabled() and (feats.requires_grad or weight.requires_grad):
        out = SparseConvFunction.apply(feats, weight, kernel_map, use, problem, pins, record)
        use.forward_done()  # after the map's last forward product, what only backward reads is dropped
    else:  # nothing to differentiate: the forward product alone, without an autograd node (~5 µs)
        out = dispatch("AB_gather_scatter", problem, pins.fwd, feats, weight, kernel_map, record, use)
    if bias is not None:
        out = out + bias
    return SparseTensor._derived(out, input.cache, out_id)


def _check_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, kernel_size: tuple[int, int, int], feats: torch.Tensor
) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    volume = math.prod(kernel_size)
    if weight.dim() != 3 or weight.shape[0] != volume or weight.shape[1] != feats.shape[1]:
        raise ValueError(
            f"weight must have shape (K={volume}, C_in={feats.shape[1]}, C_out) for kernel_size "
            f"{kernel_size} and {feats.shape[1]} input channels, got {tuple(weight.shape)}"
        )
    if weight.device != feats.device:
        raise ValueError(f"weight is on {weight.device} but the input is on {feats.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[2],)):
        raise ValueError(f"bias must have shape ({weight.shape[2]},), got {tuple(getattr(bias, 'shape', ()))}")
    if bias is not None and bias.device != feats.device:
        raise ValueError(f"bias is on {bias.device} but the input is on {feats.device}")
