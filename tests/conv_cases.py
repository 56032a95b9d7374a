"""Conv modes and random inputs shared by the conv tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sparse_reference import dense_reference, random_coords

from sparseconv import SparseTensor
from sparseconv.nn import SparseConv3d


@dataclass(frozen=True)
class Mode:
    name: str
    kernel_size: tuple | int
    stride: tuple | int = 1
    dilation: tuple | int = 1
    transposed: bool = False
    generative: bool = False
    input_stride: int = 1

    def __str__(self) -> str:
        return self.name


MODES = [
    Mode("submanifold_k1", 1),
    Mode("submanifold_k3", 3),
    Mode("submanifold_k5", 5),
    Mode("submanifold_k2_even", 2),
    Mode("submanifold_k3_at_stride2", 3, input_stride=2),
    Mode("strided_k2_s2", 2, stride=2),
    Mode("strided_k3_s2", 3, stride=2),
    Mode("strided_k3_s2_from_stride2", 3, stride=2, input_stride=2),
    Mode("strided_anisotropic", (3, 1, 2), stride=(2, 1, 2)),
    # Detection backbones' height reduction (spconv writes it (3, 1, 1) / (2, 1, 1) in z, y, x order).
    Mode("strided_k311_s211", (3, 1, 1), stride=(2, 1, 1)),
    Mode("submanifold_k113", (1, 1, 3)),
    Mode("transposed_k2_s2", 2, stride=2, transposed=True),
    Mode("transposed_k3_s2", 3, stride=2, transposed=True),
    Mode("transposed_anisotropic", (3, 1, 2), stride=(2, 1, 2), transposed=True),
    Mode("generative_transposed_k2_s2", 2, stride=2, transposed=True, generative=True),
    Mode("generative_transposed_k3_s1", 3, transposed=True, generative=True),
    Mode("generative_k3_s1", 3, generative=True),
    Mode("generative_k3_s2", 3, stride=2, generative=True),
    Mode("dilation2_k3", 3, dilation=2),
    Mode("dilation2_strided_k3_s2", 3, stride=2, dilation=2),
    Mode("dilation2_transposed_k3_s2", 3, stride=2, dilation=2, transposed=True),
    # A kernel equal to its stride but odd: its window is centred, so an input can lie in no window
    # (the map is not "each input once", and its transpose leaves such rows at zero).
    Mode("strided_k3_s3", 3, stride=3),
    Mode("transposed_k3_s3", 3, stride=3, transposed=True),
]


def triple(v):
    return (v,) * 3 if isinstance(v, int) else tuple(v)


def make_input(mode: Mode, channels: int, device, dtype=torch.float64, n: int = 120, extent: int = 9) -> SparseTensor:
    """A random SparseTensor for ``mode``. Transposed modes get the coarse output of a real
    downsampling, so the finer coordinates they go back onto are in the shared cache."""
    s = mode.input_stride
    coords = random_coords(n, extent, stride=(s, s, s), low=-5 * s, device=device)
    base = SparseTensor(coords, torch.randn(len(coords), channels, device=device, dtype=dtype), s)
    if not mode.transposed:
        return base
    down = SparseConv3d(channels, channels, mode.kernel_size, mode.stride, device=device, dtype=dtype)
    coarse = down(base)
    return coarse.replace(torch.randn(len(coarse), channels, device=device, dtype=dtype))


def make_conv(mode: Mode, c_in: int, c_out: int, device, dtype=torch.float64) -> SparseConv3d:
    conv = SparseConv3d(c_in, c_out, mode.kernel_size, mode.stride, mode.dilation,
                        transposed=mode.transposed, generative=mode.generative, device=device, dtype=dtype)
    with torch.no_grad():
        conv.bias.normal_()
    return conv


def reference(conv: SparseConv3d, x: SparseTensor, out: SparseTensor, feats: torch.Tensor) -> torch.Tensor:
    return dense_reference(x.coords, feats, x.stride, out.coords, out.stride, conv.dense_weight(),
                           conv.kernel_size, conv.stride, conv.dilation, conv.transposed, conv.bias)


def assert_conv_matches_reference(conv: SparseConv3d, x: SparseTensor, tolerance: float = 1e-10) -> SparseTensor:
    """``conv(x)``'s features and its gradients (input features, weight, bias) equal the dense reference's
    (float64 inputs: ``tolerance`` relative and absolute); returns the output."""
    feats = x.feats.clone().requires_grad_()
    out = conv(x.replace(feats))
    ref = reference(conv, x, out, feats)
    assert out.feats.shape == ref.shape and len(out) > 0
    torch.testing.assert_close(out.feats, ref, rtol=tolerance, atol=tolerance)
    probe = torch.randn_like(ref)
    params = [feats, conv.weight, conv.bias]
    ours = torch.autograd.grad((out.feats * probe).sum(), params)
    theirs = torch.autograd.grad((ref * probe).sum(), params)
    for name, a, b in zip(("feats", "weight", "bias"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m, name=name: f"grad of {name}: {m}")
    return out
