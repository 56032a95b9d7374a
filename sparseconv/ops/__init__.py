"""Sparse convolution operators: the autograd functions, dispatch into the tuner, torch.compile ops, warmup."""

from .conv import SparseConvFunction, sparse_conv3d
from ..backends.problem import NAMESPACES, ConvProblem

__all__ = ["NAMESPACES", "ConvProblem", "SparseConvFunction", "sparse_conv3d"]
