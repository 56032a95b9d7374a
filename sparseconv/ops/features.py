"""Elementwise work on a layer's features in one pass: an inference batch norm's per-channel affine map
with the residual sum and the ReLU that follow it (a ResNet block's), fused into one Triton kernel.

torch runs ``feats * scale + shift`` (``addcmul``) with its broadcast (C,) operands through its generic,
unvectorised elementwise kernel, then the sum and the ReLU as kernels of their own: 2.6 ms of a street4
MinkUNet inference's 10.4 ms of GPU time (H200, 49 norms, 42 ReLUs, 16 sums), where reading and writing
each element once takes a fraction of that. The norm alone stays torch's ``addcmul``: a launch of ours
costs the host more than torch's op, and only what it fuses pays for it.

:func:`norm_affine` is that kernel given the norm's running statistics and parameters instead of the
(scale, shift) they make: it computes the pair per channel itself. Kept pairs went stale whenever
training changed a statistic, and making 42 of them again took ~500 small torch ops (~4 ms of host
time, H200 host) at the first inference after each training step: a validation loop's every pass.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..backends.mask_views import fused as _triton_runs
from ..backends.triton_kernels import defined_once
from ..backends.triton_launch import ReadyLaunch, launch_ready

BLOCK = 1024
"""Elements a program takes (Triton's default 4 warps: 8 a lane)."""


def channel_affine(feats: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                   residual: torch.Tensor | None = None, relu: bool = False, inplace: bool = False) -> torch.Tensor:
    """``feats * scale + shift``, plus ``residual`` if given, through a ReLU if ``relu``: a new tensor, or
    ``feats`` itself overwritten where ``inplace`` (the caller's promise that nothing else reads it).

    feats: (N, C) float16/bfloat16/float32; scale, shift: (C,) of its dtype and device; residual: (N, C)
    like feats. On a GPU with Triton (or under its interpreter), one kernel computes it in fp32 and
    rounds once; elsewhere torch's ops do, rounding after each, and so under torch.compile, which traces
    them (and fuses them itself) where it could not trace the kernel's launch. In place, torch's ops
    allocate nothing: on a CPU a new (N, C) output cost more than the arithmetic (first touches of its
    pages), 1.9 -> 0.7 ms for a 91k x 32 norm and ReLU, 7.8 -> 2.7 ms for 91k x 64 with the sum (2 threads).
    """
    if (residual is not None or relu) and _fusable(feats, scale, shift, residual) and not torch.compiler.is_compiling():
        out = feats if inplace else torch.empty_like(feats)  # (elementwise: each element read, then written)
        numel = feats.numel()
        # (not compiled yet: torch's ops below, while it compiles in the background, launch_ready)
        if not numel or launch_ready((_kernels, "channel_affine"), (-(-numel // BLOCK),), feats, scale, shift,
                                     feats if residual is None else residual, out, numel, feats.shape[1],
                                     BLOCK=BLOCK, RESIDUAL=residual is not None, RELU=relu):
            return out
    inplace = inplace and not torch.compiler.is_compiling() and (residual is None or residual.dtype == feats.dtype)
    out = torch.addcmul(shift, feats, scale, out=feats if inplace else None)
    if residual is not None:
        # promoted as the modules' own sum would be (a wider residual widens the result), where not in place
        out = out.add_(residual) if inplace else out + residual
    return out.relu_() if relu else out


def norm_affine(feats: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                residual: torch.Tensor | None = None, relu: bool = False, kept: dict | None = None,
                inplace: bool = False) -> torch.Tensor | None:
    """``(feats - running_mean) / sqrt(running_var + eps) * weight + bias`` (an inference batch norm), plus
    ``residual`` if given, through a ReLU if ``relu``, in one kernel computing in fp32: a new tensor, or ``feats``
    overwritten where ``inplace`` (the caller's promise that nothing else reads it: one allocation less a norm, 42
    a MinkUNet inference); None
    where the kernel does not run (operands it does not take, no GPU or interpreter, compiling in the
    background, under torch.compile): the caller makes the (scale, shift) pair for :func:`channel_affine`.

    feats: (N, C) float16/bfloat16/float32; running_mean, running_var, weight, bias: (C,) float of any
    width on its device (weight, bias None: 1, 0); residual: (N, C) like feats. ``kept``: a dict of the
    caller's (a norm module's) where the launch prepared for these statistics is kept: its next calls check
    the features and the residual only and launch the compiled kernel (:class:`_FusedNorm`).
    """
    if torch.compiler.is_compiling():
        return None
    slot = (feats.dtype, feats.device, residual is not None, relu)
    held = None if kept is None else kept.get(slot)
    if held is not None and held.fits(feats, running_mean, running_var, weight, bias, eps, residual):
        return held(feats, residual, inplace)
    vectors = [v for v in (running_mean, running_var, weight, bias) if v is not None]
    if not _fusable(feats, None, None, residual, vectors):
        return None
    if kept is not None:
        held = kept[slot] = _FusedNorm(feats, running_mean, running_var, weight, bias, eps, residual is not None,
                                       relu)
        return held(feats, residual, inplace)
    out = feats if inplace else torch.empty_like(feats)
    numel = feats.numel()
    args, options = _norm_launch(running_mean, running_var, weight, bias, eps, feats.shape[1], residual is not None,
                                 relu)
    for at, value in zip(_CALL_ARGS, (feats, feats if residual is None else residual, out, numel)):
        args[at] = value
    if not numel or launch_ready((_kernels, "norm_affine"), (-(-numel // BLOCK),), *args, **options):
        return out
    return None


def _norm_launch(running_mean: torch.Tensor, running_var: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float, channels: int, residual: bool, relu: bool
                 ) -> tuple[list, dict]:
    """The ``norm_affine`` kernel's arguments and options but for those of a call (:data:`_CALL_ARGS`: None here)."""
    scale, shift = (weight if weight is not None else running_var), (bias if bias is not None else running_mean)
    args = [None, running_mean, running_var, scale, shift, None, None, None, channels, float(eps)]
    return args, dict(BLOCK=BLOCK, WEIGHT=weight is not None, BIAS=bias is not None, RESIDUAL=residual, RELU=relu)


_CALL_ARGS = (0, 5, 6, 7)
"""The positions of a call's own ``norm_affine`` arguments: the features, the residual (the features where none),
the output and its numel."""


class _FusedNorm:
    """:func:`norm_affine`'s launch for one set of statistics and parameters (held, with their dtypes), one
    features dtype and channel count: a call checks what may change between calls (the features, the residual,
    the statistics' identity) and launches through :class:`~sparseconv.backends.triton_launch.ReadyLaunch`."""

    __slots__ = ("vectors", "dtypes", "eps", "channels", "launch")

    def __init__(self, feats: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                 weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, residual: bool, relu: bool):
        self.vectors = (running_mean, running_var, weight, bias)
        self.dtypes = tuple(None if v is None else v.dtype for v in self.vectors)
        self.eps, self.channels = eps, feats.shape[1]
        args, options = _norm_launch(running_mean, running_var, weight, bias, eps, self.channels, residual, relu)
        self.launch = ReadyLaunch((_kernels, "norm_affine"), args, options, _CALL_ARGS)

    def fits(self, feats: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
             weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None) -> bool:
        """Whether this launch computes the norm of these operands (of the dtype and device it was made for)."""
        held = self.vectors
        if not (running_mean is held[0] and running_var is held[1] and weight is held[2] and bias is held[3]
                and eps == self.eps and feats.dim() == 2 and feats.shape[1] == self.channels
                and feats.is_contiguous()):
            return False
        if self.dtypes != tuple(None if v is None else v.dtype for v in held):
            return False  # a statistic's .data replaced by another dtype's
        return _residual_fits(feats, residual)

    def __call__(self, feats: torch.Tensor, residual: torch.Tensor | None, inplace: bool = False
                 ) -> torch.Tensor | None:
        out = feats if inplace else torch.empty_like(feats)
        numel = feats.numel()
        if not numel:
            return out
        if self.launch((-(-numel // BLOCK),), feats, feats if residual is None else residual, out, numel):  # _CALL_ARGS
            return out
        return None


def _fusable(feats: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
             residual: torch.Tensor | None, statistics: list[torch.Tensor] = ()) -> bool:
    """Whether the kernels take these operands: contiguous (N, C) features (and residual) of one float
    dtype, contiguous (C,) scale and shift of it (or ``statistics`` of any float dtype), all on a device
    the Triton kernels run on."""
    if not (feats.dim() == 2 and feats.is_contiguous() and feats.dtype in _DTYPES and _triton_runs(feats)):
        return False
    for vector in (scale, shift):
        if vector is not None and not (vector.dtype == feats.dtype and vector.device == feats.device
                                       and vector.is_contiguous() and vector.shape == feats.shape[1:]):
            return False
    for vector in statistics:
        if not (vector.dtype in _DTYPES and vector.device == feats.device and vector.is_contiguous()
                and vector.shape == feats.shape[1:]):
            return False
    return _residual_fits(feats, residual)


def _residual_fits(feats: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the kernels take ``residual`` beside ``feats``: none, or contiguous, of its shape, dtype and device."""
    return residual is None or (residual.shape == feats.shape and residual.dtype == feats.dtype
                                and residual.device == feats.device and residual.is_contiguous())


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@defined_once
def _kernels():
    """The kernel, defined on first use (importing sparseconv never imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def channel_affine(x_ptr, scale_ptr, shift_ptr, residual_ptr, out_ptr, numel, channels,
                       BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, RELU: tl.constexpr):
        # Flat over the (N, C) elements: each row's channels are contiguous, so a channel is the offset
        # modulo C, and the loads of scale and shift are as contiguous as the features' (C a multiple of 16).
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        channel = offsets % channels
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        y = x * scale + shift
        if RESIDUAL:
            y += tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def norm_affine(x_ptr, mean_ptr, var_ptr, weight_ptr, bias_ptr, residual_ptr, out_ptr, numel, channels, eps,
                    BLOCK: tl.constexpr, WEIGHT: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                    RELU: tl.constexpr):
        # channel_affine's layout; each element makes its channel's pair from the (L1-resident) statistics.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        channel = offsets % channels
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        var = tl.load(var_ptr + channel, mask=inside, other=1.0).to(tl.float32)
        scale = tl.rsqrt(var + eps)
        if WEIGHT:
            scale *= tl.load(weight_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        y = (x - tl.load(mean_ptr + channel, mask=inside, other=0.0).to(tl.float32)) * scale
        if BIAS:
            y += tl.load(bias_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        if RESIDUAL:
            y += tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)

    return SimpleNamespace(channel_affine=channel_affine, norm_affine=norm_affine)
