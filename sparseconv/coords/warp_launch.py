"""Launching the coordinate floor's Warp kernels (:mod:`.warp_kernels`, defined on first use) on torch's current
stream, with each kernel's launch command recorded once and replayed with new bounds and arguments."""

from __future__ import annotations

import functools
import math
import struct
import threading
from collections.abc import Callable

import torch

from .host_copy import current_stream


@functools.cache
def kernels():
    """The Warp kernels (:mod:`.warp_kernels`), defined on first use: importing sparseconv must not start Warp."""
    from . import warp_kernels

    return warp_kernels.define()


def launch(kernel, dim, inputs, device: torch.device) -> None:
    """Launch a Warp kernel on ``device`` (tensors in ``inputs`` as Warp array descriptors, other
    values plain ints), on CUDA on torch's current stream.

    ``wp.launch`` resolves the device, module and hooks and packs every argument on each call.
    Instead the first launch of a kernel on a device (per thread) is recorded
    (``record_cmd=True``) and later ones rewrite that command's launch bounds and arguments in
    place (:class:`_Replay`) and launch it: 38 -> ~15 µs of host time a launch on an H200 host
    (a MinkUNet training step makes 6, a lone layer on a new tensor 2).
    """
    recorded = getattr(_RECORDED, "commands", None)
    if recorded is None:
        recorded = _RECORDED.commands = {}
    replay = recorded.get((kernel, device))
    stream = _warp_stream(device) if device.type == "cuda" else None
    if replay is None:
        wp = kernels().wp
        args = [_descriptor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        command = wp.launch(kernel, dim=dim, inputs=args, device=_warp_device(device) if stream is not None else "cpu",
                            record_cmd=True)
        recorded[(kernel, device)] = _Replay.of(command, inputs, dim)
        command.launch(stream)
        return
    replay(dim, inputs, stream)


class _Replay:
    """A recorded Warp launch (``wp.Launch``) replayed with new bounds and arguments written into its
    own parameter structures, where ``set_dim`` and ``set_param_at_index_from_ctype`` build new
    ones (~5 µs and ~4 µs a tensor on an H200 host): the array descriptors' bytes packed in place,
    the integers' values set, the bounds' extents set. Made only where those writes give the bytes
    Warp's own packing gives for the recording's arguments (:meth:`of`); else the command's own
    setters run."""

    __slots__ = ("command", "packers", "kernel_dim")

    def __init__(self, command, packers, kernel_dim: int | None) -> None:
        self.command, self.packers, self.kernel_dim = command, packers, kernel_dim

    @classmethod
    def of(cls, command, inputs, dim) -> _Replay:
        packers, kernel_dim = [], None
        try:
            params = command.params
            bounds = params[0]
            for index, value in enumerate(inputs):
                param = params[index + 1]
                if isinstance(value, torch.Tensor):
                    view = memoryview(param).cast("B")
                    if len(view) < _ARRAY.size or bytes(view) != bytes(_packed(value, len(view))):
                        raise TypeError("another array layout")
                    packers.append(_packer(view, value.dim(), value.element_size()))
                elif isinstance(value, int) and not isinstance(value, bool) and getattr(param, "value", None) == value:
                    packers.append(None)
                else:
                    raise TypeError("another scalar")
            extents = (dim,) if isinstance(dim, int) else tuple(dim)
            if (len(bounds.shape) == len(extents) and tuple(bounds.shape) == extents
                    and bounds.size == math.prod(extents) and bounds.coord_mult == 1):
                kernel_dim = len(extents)
        except (TypeError, AttributeError, ValueError):
            packers = None
        return cls(command, packers, kernel_dim)

    def __call__(self, dim, inputs, stream) -> None:
        command, packers = self.command, self.packers
        if packers is None:  # Warp's own setters
            command.set_dim(dim)
            for index, value in enumerate(inputs):
                command.set_param_at_index_from_ctype(index, _descriptor(value) if isinstance(value, torch.Tensor)
                                                      else value)
            command.launch(stream)
            return
        extents = (dim,) if isinstance(dim, int) else dim
        if len(extents) == self.kernel_dim and max(extents) < _TID_LIMIT:
            bounds = command.bounds
            for axis, extent in enumerate(extents):
                bounds.shape[axis] = extent
            bounds.size = math.prod(extents)
        else:  # another rank of launch, or extents Warp must check (wp.tid() is 32-bit)
            command.set_dim(dim)
        params = command.params
        for index, value in enumerate(inputs):
            pack = packers[index]
            if pack is None:
                params[index + 1].value = value
            else:
                pack(value)
        command.launch(stream)


_TID_LIMIT = 1 << 31
_ARRAY = struct.Struct("<QQ4i4iHH")
"""Warp's ``array_t`` (data, grad, shape[4], strides[4] in bytes, ndim, flags), checked against Warp's
own packing of each recorded launch's arrays (:meth:`_Replay.of`)."""


def _packer(view: memoryview, ndim: int, element_size: int) -> Callable[[torch.Tensor], None]:
    """What writes a launch parameter's array descriptor into ``view`` for a tensor of ``ndim`` dimensions
    and ``element_size`` bytes (a kernel's parameter has one dtype and rank): its data pointer, shape and
    strides alone, over a recording that :meth:`_Replay.of` checked (no gradient, the rank, no flags, zero
    padding), and for one or two dimensions without the general path's tuples (~2 µs a tensor of ~5)."""
    fields = struct.Struct(f"<Q8x{ndim}i{4 * (4 - ndim)}x{ndim}i")
    if ndim == 1:
        def pack(tensor: torch.Tensor) -> None:
            fields.pack_into(view, 0, tensor.data_ptr(), tensor.shape[0], tensor.stride(0) * element_size)
    elif ndim == 2:
        def pack(tensor: torch.Tensor) -> None:
            rows, cols = tensor.shape
            row, col = tensor.stride()
            fields.pack_into(view, 0, tensor.data_ptr(), rows, cols, row * element_size, col * element_size)
    else:
        def pack(tensor: torch.Tensor) -> None:
            fields.pack_into(view, 0, tensor.data_ptr(), *tensor.shape, *[s * element_size for s in tensor.stride()])
    return pack


def _pack_into(view: memoryview, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s array descriptor (what :func:`_descriptor` builds) into ``view``."""
    shape, size = tensor.shape, tensor.element_size()
    pad = (0,) * (4 - len(shape))
    _ARRAY.pack_into(view, 0, tensor.data_ptr(), 0, *shape, *pad, *[s * size for s in tensor.stride()], *pad,
                     len(shape), 0)


def _packed(tensor: torch.Tensor, length: int) -> bytearray:
    """:func:`_pack_into` into a zeroed buffer of ``length`` bytes (the structure's padding stays zero)."""
    buffer = bytearray(length)
    _pack_into(memoryview(buffer), tensor)
    return buffer


_RECORDED = threading.local()
"""Per thread, (kernel, device) -> its recorded ``wp.Launch`` (a :class:`_Replay`): a command's arguments
are set in place before it launches, so two threads must not share one (autograd runs backward on its own)."""


def _descriptor(tensor: torch.Tensor):
    """The Warp array descriptor of ``tensor`` (what ``wp.from_torch(return_ctype=True)`` returns,
    without its per-call dtype lookup and gradient handling: ~3x cheaper)."""
    made = _descriptor_type()
    if made is None:
        return kernels().wp.from_torch(tensor, return_ctype=True)
    size = tensor.element_size()
    return made(tensor.data_ptr(), 0, tensor.dim(), tensor.shape, [s * size for s in tensor.stride()])


@functools.cache
def _descriptor_type():
    """Warp's descriptor class if building one directly gives what from_torch gives, else None."""
    wp = kernels().wp
    sample = torch.arange(6, dtype=torch.int32).view(2, 3)[:, 1:]
    reference = wp.from_torch(sample, return_ctype=True)
    made = type(reference)
    try:
        built = made(sample.data_ptr(), 0, sample.dim(), sample.shape, [s * 4 for s in sample.stride()])
    except TypeError:
        return None
    return made if bytes(built) == bytes(reference) else None  # a ctypes structure: its bytes are its fields


# wp.stream_from_torch builds a new wp.Stream on every call: the wrapper is kept per torch stream.
_STREAMS: dict[int, tuple[torch.cuda.Stream, object]] = {}


@functools.lru_cache(maxsize=64)
def _warp_device(device: torch.device):
    return kernels().wp.device_from_torch(device)


def _warp_stream(device: torch.device):
    """The Warp stream wrapping torch's current stream on ``device`` (made once per stream)."""
    torch_stream = current_stream(device.index if device.index is not None else torch.cuda.current_device())
    kept = _STREAMS.get(id(torch_stream))  # by identity: current_stream keeps one object per stream
    if kept is None or kept[0] is not torch_stream:
        if len(_STREAMS) > 256:  # streams made and dropped in a loop: do not hold them all
            _STREAMS.clear()
        kept = _STREAMS[id(torch_stream)] = (torch_stream, kernels().wp.stream_from_torch(torch_stream))
    return kept[1]
