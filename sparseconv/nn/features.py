"""Modules that act on the features alone and keep the coordinates: any torch module, activations,
dropout and per-voxel linear layers."""

from __future__ import annotations

import torch
from torch import nn

from ..tensor import SparseTensor


def features_of(input: SparseTensor, module: nn.Module) -> torch.Tensor:
    """input.feats (N, C), or a TypeError naming the module when ``input`` is not a SparseTensor."""
    if not isinstance(input, SparseTensor):
        raise TypeError(f"{type(module).__name__} takes a SparseTensor, got {type(input).__name__}")
    return input.feats


class OnFeatures:
    """Mixin for a torch module class: its forward runs on the (N, C) features of a SparseTensor.

    ``class ReLU(OnFeatures, nn.ReLU)`` keeps torch's arguments, parameters, state-dict keys and
    repr, so weights move between a dense model and a sparse one unchanged.
    """

    channels_argument: str | None = None
    """The torch attribute fixing the features' channel count (``in_features`` ...), checked so a
    mismatch names it instead of failing inside torch with the shapes of a matmul."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        feats = features_of(input, self)
        if self.channels_argument is not None:
            check_channels(self, feats, self.channels_argument)
        return input.replace(super().forward(feats))


def unwatched(module: nn.Module) -> bool:
    """Whether no forward hook watches ``module`` (a caller may then compute its output without calling it:
    a norm fused with the ReLU after it, :meth:`~sparseconv.nn.BatchNorm.forward_fused`)."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def check_channels(module: nn.Module, feats: torch.Tensor, argument: str) -> None:
    """ValueError naming ``argument`` unless feats (N, C) has the C that ``module.<argument>`` fixes."""
    expected = getattr(module, argument)
    expected = tuple(expected) if isinstance(expected, tuple | list | torch.Size) else (expected,)
    if tuple(feats.shape[1:]) != expected:
        shown = expected[0] if len(expected) == 1 else expected
        raise ValueError(
            f"{type(module).__name__} expects {shown} channels ({argument}), got a SparseTensor with {feats.shape[1]}"
        )


class Features(nn.Module):
    """Apply any torch module to the (N, C) features of a SparseTensor, keeping its coordinates.

    The module must map (N, C) to (N, C') row by row (activations, dropout, linear layers, MLPs).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module

    def forward(self, input: SparseTensor) -> SparseTensor:
        feats = features_of(input, self)
        return input.replace(self.module(feats))


class Linear(OnFeatures, nn.Linear):
    """nn.Linear on every voxel's features: (N, in_features) -> (N, out_features); a 1x1x1 conv."""

    channels_argument = "in_features"


class Dropout(OnFeatures, nn.Dropout):
    """nn.Dropout on the features (every feature of every voxel independently)."""


class ReLU(OnFeatures, nn.ReLU):
    """nn.ReLU on the features."""


class LeakyReLU(OnFeatures, nn.LeakyReLU):
    """nn.LeakyReLU on the features."""


class ELU(OnFeatures, nn.ELU):
    """nn.ELU on the features."""


class GELU(OnFeatures, nn.GELU):
    """nn.GELU on the features."""


class SiLU(OnFeatures, nn.SiLU):
    """nn.SiLU (swish) on the features."""


class Sigmoid(OnFeatures, nn.Sigmoid):
    """nn.Sigmoid on the features."""


class Tanh(OnFeatures, nn.Tanh):
    """nn.Tanh on the features."""
