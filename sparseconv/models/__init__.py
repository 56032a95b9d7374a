"""Sparse CNN models: MinkUNet segmentation networks and the sparse ResNet detection backbone."""

from .blocks import BasicBlock, conv_norm_relu
from .minkunet import MinkUNet, MinkUNet14, MinkUNet18, MinkUNet34
from .resnet import BackboneOutput, SparseResNetBackbone

__all__ = [
    "BackboneOutput",
    "BasicBlock",
    "MinkUNet",
    "MinkUNet14",
    "MinkUNet18",
    "MinkUNet34",
    "SparseResNetBackbone",
    "conv_norm_relu",
]
