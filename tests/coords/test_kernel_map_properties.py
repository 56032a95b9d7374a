"""Kernel maps built by sparse_conv3d equal a brute-force enumeration of the documented convention.

The reference is written from :mod:`sparseconv.coords.kernel_map`'s docstring alone, in
coordinates rather than row numbers (so row order cannot hide a mistake): offset index
``(jx * ky + jy) * kz + jz``, ``delta = j - (k - 1) // 2``; a regular conv reads
``in[p + delta * dilation * s_in]``, a transposed one ``in[p - delta * dilation * s_out]``.
Output coordinates: the input's (submanifold), the unique floor-to-multiple of the output
stride (strided), the finer coordinates the batch came from (transposed), every output-grid
position some input reaches (generative). Geometries are anisotropic in kernel, stride and
dilation; coordinates lie in a small box that straddles zero.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseconv import SparseTensor
from sparseconv.coords import KernelMapKey
from sparseconv.ops import sparse_conv3d

MODES = ("submanifold", "strided", "transposed", "generative", "generative_transposed")
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
Coord = tuple[int, int, int, int]


def reference_triples(in_coords: list[Coord], out_coords: list[Coord], kernel_size, dilation, unit, sign):
    """{(input coordinate, output coordinate, offset index)} by the documented convention:
    output p reads input ``p + sign * delta * dilation * unit`` through the offset of ``delta``."""
    present = set(in_coords)
    triples = set()
    for p in out_coords:
        for k, j in enumerate(itertools.product(*(range(n) for n in kernel_size))):
            q = (p[0], *(c + sign * (jj - (n - 1) // 2) * d * u
                         for c, jj, n, d, u in zip(p[1:], j, kernel_size, dilation, unit)))
            if q in present:
                triples.add((q, p, k))
    return triples


def reached(in_coords: list[Coord], kernel_size, dilation, unit, sign, out_stride) -> set[Coord]:
    """Every position on the output grid that reads some input (the generative output)."""
    out = set()
    for q in in_coords:
        for j in itertools.product(*(range(n) for n in kernel_size)):
            p = (q[0], *(c - sign * (jj - (n - 1) // 2) * d * u
                         for c, jj, n, d, u in zip(q[1:], j, kernel_size, dilation, unit)))
            if all(c % s == 0 for c, s in zip(p[1:], out_stride)):
                out.add(p)
    return out


@st.composite
def clouds(draw) -> list[tuple[int, int, int, int]]:
    """Unique [batch, x, y, z] cells (in units of the tensor's stride) in a small box around zero."""
    batches = draw(st.integers(1, 3))
    low = draw(st.integers(-5, 1))
    extent = draw(st.integers(1, 6))
    cell = st.tuples(st.integers(0, batches - 1), *[st.integers(low, low + extent - 1)] * 3)
    return sorted(set(draw(st.lists(cell, min_size=1, max_size=40))))


@st.composite
def geometries(draw) -> dict:
    axis = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * 3)  # noqa: E731 - anisotropic per axis
    return {
        "kernel_size": draw(axis(1, 4)),
        "stride": draw(axis(1, 3)),
        "dilation": draw(axis(1, 2)),
        # transposed: whether the downsampling that made the coarse input had this conv's geometry
        # (its map is then reused, transposed) or another kernel (a fresh query)
        "mirrored": draw(st.booleans()),
        "down_kernel": draw(axis(1, 3)),
        "input_stride": draw(axis(1, 2)),
    }


def _coords(t: SparseTensor) -> list[Coord]:
    return [tuple(r) for r in t.coords.tolist()]


@pytest.mark.parametrize("mode", MODES)
@PROPERTY
@given(cells=clouds(), g=geometries(), seed=st.integers(0, 2**31 - 1))
def test_kernel_map_and_conv_equal_the_brute_force_enumeration(mode, cells, g, seed):
    generator = torch.Generator().manual_seed(seed)
    kernel_size, dilation = g["kernel_size"], g["dilation"]
    stride = (1, 1, 1) if mode == "submanifold" else g["stride"]
    transposed, generative = mode in ("transposed", "generative_transposed"), mode.startswith("generative")
    # A generative transposed conv goes down to a finer grid, so its input sits at a multiple of the stride.
    s_in = tuple(a * b for a, b in zip(g["input_stride"], stride)) if mode == "generative_transposed" else g["input_stride"]
    coords = torch.tensor(cells, dtype=torch.int32) * torch.tensor([1, *s_in], dtype=torch.int32)
    source = SparseTensor(coords, torch.randn(len(coords), 2, dtype=torch.float64, generator=generator), s_in)
    fine = None
    if mode == "transposed":
        down_kernel, down_dilation = (kernel_size, dilation) if g["mirrored"] else (g["down_kernel"], (1, 1, 1))
        down = torch.randn(kernel_volume(down_kernel), 2, 2, dtype=torch.float64, generator=generator)
        fine = source
        source = sparse_conv3d(fine, down, None, down_kernel, stride, down_dilation, fwd_algo="explicit_gemm")
    weight = torch.randn(kernel_volume(kernel_size), source.num_channels, 3, dtype=torch.float64, generator=generator)

    out = sparse_conv3d(source, weight, None, kernel_size, stride, dilation, transposed, generative,
                        fwd_algo="explicit_gemm")

    s_src = source.stride
    s_out = tuple(a // b for a, b in zip(s_src, stride)) if transposed else tuple(a * b for a, b in zip(s_src, stride))
    assert out.stride == s_out
    in_coords, out_coords = _coords(source), _coords(out)
    unit, sign = (s_out, -1) if transposed else (s_src, 1)
    if generative:
        expected_out = reached(in_coords, kernel_size, dilation, unit, sign, s_out)
    elif transposed:
        expected_out = set(_coords(fine))
        assert out_coords == _coords(fine)  # back onto the very rows the downsampling came from
    else:
        expected_out = {(b, *((c // s) * s for c, s in zip(xyz, s_out))) for b, *xyz in in_coords}
    assert len(out_coords) == len(set(out_coords))
    assert set(out_coords) == expected_out
    triples = reference_triples(in_coords, out_coords, kernel_size, dilation, unit, sign)

    # The conv's numbers are the sum over exactly these triples.
    expected = {p: torch.zeros(3, dtype=torch.float64) for p in out_coords}
    row = {q: i for i, q in enumerate(in_coords)}
    for q, p, k in triples:
        expected[p] += source.feats[row[q]] @ weight[k]
    torch.testing.assert_close(out.feats, torch.stack([expected[p] for p in out_coords]) if out_coords
                               else out.feats.new_zeros(0, 3), rtol=1e-10, atol=1e-10)

    if kernel_volume(kernel_size) == 1 and stride == (1, 1, 1) and not generative:
        return  # a matmul: no map is built
    kernel_map, out_id = source.cache.kernel_map(
        KernelMapKey(source.coord_id, kernel_size, stride, dilation, transposed, generative))
    assert out_id == out.coord_id and (kernel_map.num_in, kernel_map.num_out) == (len(in_coords), len(out_coords))
    in_idx, out_idx, offset_ptr = kernel_map.pairs
    offset_of = torch.repeat_interleave(torch.arange(kernel_map.kernel_volume), offset_ptr.diff())
    pairs = {(in_coords[i], out_coords[o], k) for i, o, k in zip(in_idx.tolist(), out_idx.tolist(), offset_of.tolist())}
    assert len(pairs) == len(in_idx) and pairs == triples
    table = {(out_coords[o], k): in_coords[i] for o, r in enumerate(kernel_map.neighbors.tolist())
             for k, i in enumerate(r) if i >= 0}
    assert table == {(p, k): q for q, p, k in triples}
    adjoint = {(in_coords[i], k): out_coords[o] for i, r in enumerate(kernel_map.transposed_neighbors.tolist())
               for k, o in enumerate(r) if o >= 0}
    assert adjoint == {(q, k): p for q, p, k in triples}  # the table dgrad walks
    assert kernel_map.pair_counts == [sum(1 for t in triples if t[2] == k) for k in range(kernel_map.kernel_volume)]


def kernel_volume(kernel_size) -> int:
    return kernel_size[0] * kernel_size[1] * kernel_size[2]
