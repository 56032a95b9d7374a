"""triton_kernels.launch: a specialisation launched before skips Triton's binding, and the kernel
it then calls is the one Triton would have picked (alignment, integer values and constexprs)."""

from __future__ import annotations

import pytest
import torch

from sparseconv.ops.backends import triton_kernels as tk


@pytest.fixture
def scale_kernel():
    """A kernel whose result depends on every kind of argument Triton specialises on."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def scaled_copy(x_ptr, out_ptr, n, step, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=ok) * step + SHIFT, mask=ok)

    return scaled_copy


@pytest.mark.gpu
def test_repeated_launches_match_triton_for_every_specialisation(scale_kernel):
    fast = tk._fast_launches()
    assert fast is not None, "Triton on this GPU machine lacks the launcher the fast path uses"
    base = torch.randn(5000, device="cuda")
    cases = []
    for offset in (0, 1, 4):  # 16-byte aligned, not aligned, aligned again
        for n in (1, 16, 17, 4000):
            for step in (1, 2, 16):
                for shift in (0.0, 3.0):
                    cases.append((offset, n, step, shift))
    before = len(fast.kernels)
    for _ in range(2):  # the second round runs every specialisation through the fast path
        for offset, n, step, shift in cases:
            x = base[offset: offset + n]
            out = torch.full((n + 3,), float("nan"), device="cuda")[:n]
            tk.launch(scale_kernel, (triton_cdiv(n, 128),), x, out, n, step, BLOCK=128, SHIFT=shift)
            torch.testing.assert_close(out, x * step + shift, msg=f"offset {offset}, n {n}, step {step}")
    assert len(fast.kernels) > before


@pytest.mark.gpu
def test_launch_hooks_send_every_launch_through_triton(scale_kernel, monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    x = torch.randn(300, device="cuda")
    out = torch.empty_like(x)
    for _ in range(2):
        tk.launch(scale_kernel, (3,), x, out, 300, 2, BLOCK=128, SHIFT=1.0)
    torch.testing.assert_close(out, 2 * x + 1)
    assert len(seen) == 2


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
