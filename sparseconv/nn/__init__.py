"""Sparse layers: convolutions, pooling, normalisation, feature-wise modules and containers.

Every module takes and returns a SparseTensor (global pooling and ToDense return torch tensors);
the functional forms are in :mod:`sparseconv.nn.functional`.
"""

from . import functional
from .containers import Sequential, ToDense
from .conv import SparseConv3d, SparseConvTranspose3d
from .features import (
    ELU,
    GELU,
    Dropout,
    Features,
    LeakyReLU,
    Linear,
    ReLU,
    Sigmoid,
    SiLU,
    Tanh,
)
from .functional import cat
from .graphed import GraphedModule, graphed
from .norm import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, SyncBatchNorm
from .pool import GlobalAvgPool, GlobalMaxPool, SparseAvgPool3d, SparseMaxPool3d

__all__ = [
    "ELU",
    "GELU",
    "BatchNorm",
    "Dropout",
    "Features",
    "GlobalAvgPool",
    "GlobalMaxPool",
    "GraphedModule",
    "GroupNorm",
    "InstanceNorm",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "SparseAvgPool3d",
    "SparseConv3d",
    "SparseConvTranspose3d",
    "SparseMaxPool3d",
    "SyncBatchNorm",
    "Tanh",
    "ToDense",
    "cat",
    "functional",
    "graphed",
]
