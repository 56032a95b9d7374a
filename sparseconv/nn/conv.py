"""SparseConv3d and SparseConvTranspose3d modules."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .._args import triple
from ..ops.conv import checked_conv3d
from ..ops.dispatch import AlgoPins, Pin
from ..tensor import SparseTensor


class SparseConv3d(nn.Module):
    """Sparse 3D convolution layer; weight (K, C_in, C_out) with offsets ordered as in
    :mod:`sparseconv.coords.kernel_map`, bias (C_out,).

    ``transposed=True`` goes back onto the finer coordinates of the batch; ``generative=True``
    outputs every position the kernel reaches. ``fwd_algo`` / ``dgrad_algo`` / ``wgrad_algo``
    pin the algorithm of each product (checked here, at construction).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 3,
        stride: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        transposed: bool = False,
        generative: bool = False,
        fwd_algo: Pin = None,
        dgrad_algo: Pin = None,
        wgrad_algo: Pin = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = triple(kernel_size, "kernel_size")
        self.stride = triple(stride, "stride")
        self.dilation = triple(dilation, "dilation")
        self.transposed = bool(transposed)
        self.generative = bool(generative)
        self.pins = AlgoPins.checked(fwd_algo, dgrad_algo, wgrad_algo)
        self.algorithms: dict[str, str] = {}
        """Algorithm chosen per product ("AB_gather_scatter", ...) by the last forward / backward."""
        factory = {"device": device, "dtype": dtype}
        volume = math.prod(self.kernel_size)
        self.weight = nn.Parameter(torch.empty((volume, in_channels, out_channels), **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's Conv3d / ConvTranspose3d initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

        kaiming_uniform_(a=sqrt(5)) reduces to that bound; torch computes fan_in from dim 1 of
        its dense weight, which is C_in for Conv3d and C_out for ConvTranspose3d.
        """
        fan_in = (self.out_channels if self.transposed else self.in_channels) * self.weight.shape[0]
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: SparseTensor) -> SparseTensor:
        if not isinstance(input, SparseTensor):
            raise TypeError(f"{type(self).__name__} takes a SparseTensor, got {type(input).__name__}")
        if input.feats.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects {self.in_channels} channels (in_channels), got a SparseTensor "
                f"with {input.feats.shape[1]}"
            )
        if self.weight.device != input.feats.device:
            raise ValueError(f"{type(self).__name__}'s weight is on {self.weight.device} but the input is on "
                             f"{input.feats.device} (move the module with .to(device))")
        # The geometry and pins were checked at construction: skip sparse_conv3d's per-call checks.
        return checked_conv3d(input, self.weight, self.bias, self.kernel_size, self.stride, self.dilation,
                              self.transposed, self.generative, self.pins, self.algorithms)

    def dense_weight(self) -> torch.Tensor:
        """The weight in torch's layout: Conv3d (C_out, C_in, kx, ky, kz), or ConvTranspose3d
        (C_in, C_out, kx, ky, kz) when transposed."""
        grid = self.weight.reshape(*self.kernel_size, self.in_channels, self.out_channels)
        order = (3, 4, 0, 1, 2) if self.transposed else (4, 3, 0, 1, 2)
        return grid.permute(order).contiguous()

    def extra_repr(self) -> str:
        text = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, dilation={self.dilation}"
        )
        if self.transposed:
            text += ", transposed=True"
        if self.generative:
            text += ", generative=True"
        if self.bias is None:
            text += ", bias=False"
        return text


class SparseConvTranspose3d(SparseConv3d):
    """SparseConv3d with ``transposed=True``: back onto the finer coordinates of the batch."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 3,
        stride: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        generative: bool = False,
        fwd_algo: Pin = None,
        dgrad_algo: Pin = None,
        wgrad_algo: Pin = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, dilation, bias, True, generative,
            fwd_algo, dgrad_algo, wgrad_algo, device, dtype,
        )
