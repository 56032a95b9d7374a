"""Launches of the cubins' kernels through the CUDA driver: ``cuLaunchKernel`` by ctypes, on torch's stream.

CuPy loads the modules (:func:`cuda_jit.load`); the launches skip it. Its ``RawKernel.__call__``
looks the kernel up per device, converts each argument through its own type dispatch and, with
the device and stream contexts a launch needs, was about half of a ``cutlass_sm90`` call's host
time under cProfile (docs/performance.md). Here a launch packs its arguments with one ``struct``
call into a per-thread buffer and hands the driver one pointer per argument into it.
``cuLaunchKernel`` copies the arguments before it returns, so the buffer is free again at once.

An argument is a tensor (its data pointer), an ``np.uint64`` (an address, e.g. a tensor's
pointer plus an offset) or an integer (a C ``int``): the kernels in csrc/ take
nothing else.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

CUDA_ERROR_INVALID_CONTEXT = 201  # the thread has no current context: torch never made one current here


@functools.cache
def _driver() -> ctypes.CDLL:
    """libcuda with the signatures used here (ctypes would pass pointers as 32-bit ints without them)."""
    driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    pointer, uint = ctypes.c_void_p, ctypes.c_uint
    driver.cuLaunchKernel.argtypes = [pointer, uint, uint, uint, uint, uint, uint, uint, pointer, pointer, pointer]
    driver.cuLaunchKernel.restype = ctypes.c_int
    driver.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    driver.cuGetErrorString.restype = ctypes.c_int
    driver.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    driver.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    driver.cuCtxSetCurrent.argtypes = [pointer]
    for name in ("cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"):
        getattr(driver, name).restype = ctypes.c_int
    return driver


@dataclass(frozen=True)
class ArgumentBuffer:
    """Where one signature's arguments are packed: ``layout`` ('@' native alignment, 'Q' a pointer,
    'i' an int) into ``buffer``, and ``pointers``, the kernelParams array, one entry per argument."""

    layout: struct.Struct
    buffer: ctypes.Array
    pointers: ctypes.Array

    @classmethod
    def of(cls, kinds: str) -> ArgumentBuffer:
        layout = struct.Struct("@" + kinds)
        buffer = ctypes.create_string_buffer(max(1, layout.size))
        base = ctypes.addressof(buffer)
        # A field's offset: the size of the layout up to and including it (native mode pads before
        # each field to its alignment and adds nothing after the last), less its own size.
        offsets = [struct.calcsize("@" + kinds[: i + 1]) - struct.calcsize(kind) for i, kind in enumerate(kinds)]
        pointers = (ctypes.c_void_p * max(1, len(kinds)))(*[base + offset for offset in offsets])
        return cls(layout, buffer, pointers)


_THREAD = threading.local()  # each thread packs into its own buffers: autograd's device thread launches too


def pack(args: Sequence) -> ArgumentBuffer:
    """The calling thread's buffer for ``args``' signature, with ``args`` packed into it."""
    kinds, values = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            kinds.append("Q")
            values.append(arg.data_ptr())
        elif isinstance(arg, np.uint64):
            kinds.append("Q")
            values.append(int(arg))
        else:
            kinds.append("i")
            values.append(arg)
    signature = "".join(kinds)
    buffers = getattr(_THREAD, "buffers", None)
    if buffers is None:
        buffers = _THREAD.buffers = {}
    found = buffers.get(signature)
    if found is None:
        found = buffers[signature] = ArgumentBuffer.of(signature)
    found.layout.pack_into(found.buffer, 0, *values)
    return found


def index_of(device: torch.device) -> int:
    """The index of a CUDA ``device`` ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream(device_index: int) -> int:
    """torch's current CUDA stream on the device, as a raw handle (the private getter Triton's
    launcher uses is ~20x cheaper than ``torch.cuda.current_stream``; the public one otherwise)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def launch(function: int, grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int,
           args: Sequence, device_index: int) -> None:
    """Launch the CUfunction ``function`` (a kernel of a module loaded on device ``device_index``,
    which must be the current device) over ``grid`` blocks of ``threads`` on ``stream``."""
    arguments = pack(args)
    driver = _driver()
    result = driver.cuLaunchKernel(function, *grid, threads, 1, 1, shared_bytes, stream, arguments.pointers, None)
    if result == CUDA_ERROR_INVALID_CONTEXT:
        # A thread whose CUDA work so far came from torch's caches (no runtime call bound the
        # device's primary context to it yet): bind it, as torch's first runtime call would.
        _bind_primary_context(device_index)
        result = driver.cuLaunchKernel(function, *grid, threads, 1, 1, shared_bytes, stream, arguments.pointers, None)
    if result:
        raise RuntimeError(f"cuLaunchKernel failed on cuda:{device_index} with grid {grid}, {threads} threads and "
                           f"{shared_bytes} shared bytes: {error_string(result)}")


def _bind_primary_context(device_index: int) -> None:
    driver, device, context = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check("cuDeviceGet", driver.cuDeviceGet(ctypes.byref(device), device_index), device_index)
    _check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), device_index)
    _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context), device_index)


def _check(name: str, code: int, device_index: int) -> None:
    if code:
        raise RuntimeError(f"{name} failed for cuda:{device_index}: {error_string(code)}")


def error_string(code: int) -> str:
    """The driver's text for CUresult ``code``, with the code."""
    text = ctypes.c_char_p()
    if _driver().cuGetErrorString(code, ctypes.byref(text)) or text.value is None:
        return f"CUresult {code}"
    return f"{text.value.decode()} (CUresult {code})"
