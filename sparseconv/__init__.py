"""sparseconv: sparse 3D convolutional networks for point clouds, on CPU and GPU.

Importing it starts no thread, reads no file and touches no GPU; Warp starts on the first
kernel-map build.
"""

from . import models, nn, ops
from .config import deterministic as is_deterministic
from .config import set_deterministic
from .nn.graphed import graphed
from .ops import sparse_conv3d
from .ops.warmup import warmup
from .tensor import SparseTensor

__version__ = "0.1.0"
__all__ = ["SparseTensor", "graphed", "is_deterministic", "models", "nn", "ops", "set_deterministic", "sparse_conv3d", "warmup"]
