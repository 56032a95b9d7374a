"""Normalisation of the features: over the whole batch (BatchNorm, SyncBatchNorm), per batch
element (GroupNorm, InstanceNorm) or per voxel (LayerNorm).

Each subclasses the torch module of the same name, so arguments, parameters and state-dict keys
are torch's. Per-element statistics use the batch index ``coords[:, 0]``: one element's voxels
never affect another's output, whatever the batch holds.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..ops.features import channel_affine, norm_affine
from ..tensor import SparseTensor
from . import functional as F
from .conv import SparseConv3d
from .features import OnFeatures, ReLU, check_channels, features_of, unwatched


_FUSED_LAUNCHES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
"""Each BatchNorm's prepared fused launches (:func:`~sparseconv.ops.features.norm_affine`'s ``kept``), apart from
the module: they hold compiled kernels, which neither ``torch.save`` nor ``copy.deepcopy`` of a model may meet."""

_NATIVE = torch.version.hip is None
"""Whether torch.batch_norm of (N, C) features is native_batch_norm (ROCm's MIOpen takes 2 dimensions)."""


class BatchNorm(OnFeatures, nn.BatchNorm1d):
    """nn.BatchNorm1d over the features of all voxels of the batch: (N, C) -> (N, C).

    In inference (eval mode with running statistics, autograd off) it is the per-channel affine
    map those statistics make, ``feats * scale + shift``: one fused op whose (scale, shift) are
    kept until a parameter or statistic changes (their version counters), instead of torch's
    batch_norm call (cuDNN's descriptors: ~40 us of host time a call on an H100 host, where a
    whole MinkUNet layer's kernels take less).
    """

    channels_argument = "num_features"

    def forward(self, input: SparseTensor) -> SparseTensor:
        if self.training:
            return self._train(input)
        if torch.is_grad_enabled() or self.running_mean is None or self.running_var is None:
            return super().forward(input)
        feats = features_of(input, self)
        check_channels(self, feats, self.channels_argument)
        scale, shift = self._affine(feats.dtype)
        return input.replace(torch.addcmul(shift, feats, scale))

    def forward_fused(self, input: SparseTensor, residual: SparseTensor | None = None,
                      relu: bool = False, inplace: bool = False) -> SparseTensor | None:
        """This norm, then ``+ residual`` (a SparseTensor on the same coordinates) and a ReLU if ``relu``,
        in one pass (:func:`sparseconv.ops.features.channel_affine`) where the norm is the inference
        affine map (eval mode, running statistics, autograd off) and no hook watches it; None otherwise,
        and the caller runs its modules. What :class:`~sparseconv.nn.Sequential` and the ResNet blocks
        do with a norm followed by a ReLU. ``inplace``: ``input``'s features may be overwritten (the
        caller's intermediate, which nothing else reads)."""
        if (self.training or torch.is_grad_enabled() or self.running_mean is None or self.running_var is None
                or not unwatched(self)):
            return None
        feats = features_of(input, self)
        check_channels(self, feats, self.channels_argument)
        other = None
        if residual is not None:
            other = features_of(residual, self)
            if other.shape != feats.shape:
                return None  # the modules' own sum names the mismatch
        out = norm_affine(feats, self.running_mean, self.running_var, self.weight, self.bias, self.eps, other, relu,
                          _FUSED_LAUNCHES.setdefault(self, {}), inplace)
        if out is None:
            scale, shift = self._affine(feats.dtype)
            out = channel_affine(feats, scale, shift, other, relu, inplace)
        return SparseTensor._derived(out, input.cache, input.coord_id)

    def _train(self, input: SparseTensor) -> SparseTensor:
        """Training with running statistics at a set momentum (the usual case): what torch's
        forward does there, the count, then the native batch norm with batch statistics, without
        the checks and branches of its two Python layers (``_BatchNorm.forward``'s own time alone:
        0.84 ms of a MinkUNet training step's 49 calls in a py-spy profile on an H200 host).
        Anything else goes through torch's forward."""
        feats = features_of(input, self)
        check_channels(self, feats, self.channels_argument)
        if not (self.track_running_stats and self.momentum is not None and self.num_batches_tracked is not None
                and feats.dim() == 2 and feats.shape[0] > 1):
            return input.replace(nn.BatchNorm1d.forward(self, feats))
        self.num_batches_tracked.add_(1)
        if _NATIVE:
            # What torch.batch_norm runs for (N, C) features (cuDNN takes 3 dimensions and more), without
            # its two dispatch layers and the empty reserve tensor they make (~10 µs a call).
            out = torch.native_batch_norm(feats, self.weight, self.bias, self.running_mean, self.running_var,
                                          True, self.momentum, self.eps)[0]
        else:
            out = torch.batch_norm(feats, self.weight, self.bias, self.running_mean, self.running_var,
                                   True, self.momentum, self.eps, torch.backends.cudnn.enabled)
        return SparseTensor._derived(out, input.cache, input.coord_id)  # the features' shape and device

    def _affine(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) of the running statistics and affine parameters, computed in at least
        float32 (as batch_norm does) and cast to ``dtype``; recomputed when any of them changed (and on
        every call under torch.compile, which traces the computation but not the tensors' versions and
        addresses that the kept pair is stamped with)."""
        if torch.compiler.is_compiling():
            return self._affine_of(dtype)
        tensors = (self.running_mean, self.running_var, self.weight, self.bias)
        stamp = (dtype, self.eps, *((t._version, t.data_ptr()) if t is not None else None for t in tensors))
        held = self.__dict__.get("_inference_affine")
        if held is None or held[0] != stamp:
            held = self.__dict__["_inference_affine"] = (stamp, self._affine_of(dtype))
        return held[1]

    def _affine_of(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        wide = torch.promote_types(dtype, torch.float32)
        scale = torch.rsqrt(self.running_var.to(wide) + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.to(wide)
        shift = -self.running_mean.to(wide) * scale
        if self.bias is not None:
            shift = shift + self.bias.to(wide)
        return scale.to(dtype), shift.to(dtype)


def fused_norm_relu(norm: nn.Module, relu: nn.Module | None, input: SparseTensor,
                    residual: SparseTensor | None = None, made_by: nn.Module | None = None) -> SparseTensor | None:
    """``relu(norm(input) [+ residual])`` in one pass (:meth:`BatchNorm.forward_fused`) where ``norm`` is a
    BatchNorm that can and ``relu``, the module after it, is a ReLU no hook watches (None: a functional ReLU);
    None otherwise, and the caller runs the modules. :class:`~sparseconv.nn.Sequential` and the ResNet blocks
    call it. ``made_by``: the module whose output ``input`` is, within the caller's pass: a conv no hook
    watches made a new tensor nothing else reads, which the pass then overwrites."""
    if type(norm) is not BatchNorm or not (relu is None or (type(relu) is ReLU and unwatched(relu))):
        return None
    inplace = type(made_by) is SparseConv3d and unwatched(made_by)
    return norm.forward_fused(input, residual, relu=True, inplace=inplace)


class SyncBatchNorm(OnFeatures, nn.SyncBatchNorm):
    """nn.SyncBatchNorm over the voxels of every process's batch (CUDA under torch.distributed;
    without a process group it computes what BatchNorm does)."""

    channels_argument = "num_features"

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """``module`` with every sparse BatchNorm replaced by a SyncBatchNorm holding its state.

        Use this rather than torch's converter, which would turn sparse BatchNorms into dense
        ones that reject SparseTensors.
        """
        if isinstance(module, BatchNorm):
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats, process_group,
            )
            # The same Parameter and buffer objects, as torch's converter does, so an optimiser
            # built before the conversion still updates them.
            for name in ("weight", "bias"):
                if getattr(module, name) is not None:
                    setattr(converted, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(converted, name, getattr(module, name))
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return module


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm with statistics per batch element: (N, C) -> (N, C).

    ``GroupNorm(1, C)`` is a layer norm over all voxels and channels of each element.
    """

    def forward(self, input: SparseTensor) -> SparseTensor:
        _check_channels(self, input, self.num_channels)
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class InstanceNorm(nn.InstanceNorm1d):
    """Every channel normalised over the voxels of its batch element: (N, C) -> (N, C).

    torch's InstanceNorm1d arguments and defaults (``affine=False``); running statistics are
    not supported because the statistics are per element by definition.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if track_running_stats:
            raise ValueError("track_running_stats=True is not supported by the sparse InstanceNorm; use BatchNorm")
        super().__init__(num_features, eps, momentum, affine, False, device, dtype)

    def forward(self, input: SparseTensor) -> SparseTensor:
        _check_channels(self, input, self.num_features)
        return F.instance_norm(input, self.weight, self.bias, self.eps)


class LayerNorm(OnFeatures, nn.LayerNorm):
    """nn.LayerNorm over each voxel's C channels (torch's and WarpConvNet's LayerNorm on point
    features); for statistics over a whole batch element use ``GroupNorm(1, C)``."""

    channels_argument = "normalized_shape"


def _check_channels(module: nn.Module, input: SparseTensor, channels: int) -> None:
    if features_of(input, module).shape[1] != channels:
        raise ValueError(
            f"{type(module).__name__} expects {channels} channels, got a SparseTensor with {input.num_channels}"
        )
