"""Sparse convolution operators and their backends."""

from .conv import SparseConvFunction, sparse_conv3d
from .problem import NAMESPACES, ConvProblem

__all__ = ["NAMESPACES", "ConvProblem", "SparseConvFunction", "sparse_conv3d"]
