"""Sparse layers: convolutions and feature-wise modules."""

from .conv import SparseConv3d, SparseConvTranspose3d
from .features import BatchNorm, Features, ReLU, Sequential

__all__ = ["BatchNorm", "Features", "ReLU", "Sequential", "SparseConv3d", "SparseConvTranspose3d"]
