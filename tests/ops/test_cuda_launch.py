"""The driver launch's argument packing (no GPU needed): each kernelParams entry points at its
argument's value, with the C size and alignment the kernels expect."""

from __future__ import annotations

import ctypes
import random
import threading

import numpy as np
import torch

from sparseconv.backends import cuda_launch


def _read_back(arguments: cuda_launch.ArgumentBuffer, kinds: str) -> list[int]:
    values = []
    for pointer, kind in zip(arguments.pointers, kinds):
        ctype = ctypes.c_uint64 if kind == "Q" else ctypes.c_int32
        assert pointer % ctypes.sizeof(ctype) == 0, "each argument sits at its natural alignment"
        values.append(ctype.from_address(pointer).value)
    return values


def test_every_argument_is_read_back_from_its_pointer():
    tensor = torch.empty(3)
    for _ in range(20):
        ints = [random.randint(-2**31, 2**31 - 1) for _ in range(4)]
        address = np.uint64(random.getrandbits(64))
        # ints between pointers: each pointer needs 4 bytes of padding before it
        args = (ints[0], tensor, ints[1], ints[2], address, ints[3], tensor[1:])
        values = _read_back(cuda_launch.pack(args), "iQiiQiQ")
        assert values == [ints[0], tensor.data_ptr(), ints[1], ints[2], int(address), ints[3], tensor[1:].data_ptr()]


def test_threads_pack_into_their_own_buffers():
    """autograd's device thread launches while the main thread may: one shared buffer would race."""
    both_packed = threading.Barrier(2)
    seen = {}

    def pack(value: int) -> None:
        arguments = cuda_launch.pack((value, np.uint64(value)))
        both_packed.wait()  # the other thread has packed the same signature by now
        seen[value] = _read_back(arguments, "iQ")

    threads = [threading.Thread(target=pack, args=(value,)) for value in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {1: [1, 1], 2: [2, 2]}
