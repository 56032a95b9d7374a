"""Warp's start on a machine without an NVIDIA driver: no warning a CPU-only user can do nothing about."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from sparseconv.coords.warp_kernels import NO_DRIVER

BUILD_A_MAP = textwrap.dedent("""
    import os
    import torch
    import warp
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMapKey

    init = warp.init

    def noisy_init():  # something else Warp's start writes to the process's stderr goes through
        os.write(2, b"another line from the native code\\n")
        init()

    warp.init = noisy_init
    coords = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.int32)
    x = SparseTensor(coords, torch.zeros(2, 1))
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    print(sum(kernel_map.pair_counts))
""")


def test_a_cpu_process_starts_warp_without_the_driver_warning_and_keeps_its_other_output():
    done = subprocess.run([sys.executable, "-c", BUILD_A_MAP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "4"  # the map: each voxel its own neighbour, and one the other's
    assert NO_DRIVER not in done.stderr
    assert "another line from the native code" in done.stderr
