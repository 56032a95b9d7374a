"""References for the tests: dense torch convolutions at the sparse coordinates, brute-force maps."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def random_coords(n: int, extent: int, batch_size: int = 2, stride=(1, 1, 1), low: int = 0, device="cpu") -> torch.Tensor:
    """Up to n unique random rows [batch, x, y, z], xyz multiples of stride in [low, low + extent * stride)."""
    batch = torch.randint(0, batch_size, (n, 1))
    xyz = torch.randint(0, extent, (n, 3)) * torch.tensor(stride) + low
    return torch.unique(torch.cat([batch, xyz], dim=1), dim=0).to(device)


def offsets(kernel_size) -> list[tuple[int, int, int]]:
    """Offsets delta in the documented order: x slowest, z fastest, delta = j - (k - 1) // 2."""
    return list(itertools.product(*[range(-((k - 1) // 2), k - (k - 1) // 2) for k in kernel_size]))


def brute_force_map(in_coords, out_coords, kernel_size, step, sign):
    """(N_out, K) list of lists: index of in_coords row at out + sign * delta * step, or -1."""
    index = {tuple(r): i for i, r in enumerate(in_coords.tolist())}
    table = []
    for b, x, y, z in out_coords.tolist():
        row = []
        for dx, dy, dz in offsets(kernel_size):
            q = (b, x + sign * dx * step[0], y + sign * dy * step[1], z + sign * dz * step[2])
            row.append(index.get(q, -1))
        table.append(row)
    return table


def dense_reference(
    in_coords, feats, in_stride, out_coords, out_stride, dense_weight, kernel_size, stride, dilation, transposed, bias=None
):
    """Dense conv3d / conv_transpose3d evaluated at out_coords -> (N_out, C_out), differentiable.

    Padding d * ((k - 1) // 2) makes the dense offsets match the sparse ones; the dense grid's
    origin is a common multiple of both strides below every coordinate.
    """
    grid, out_cells = _dense_grid(
        in_coords, feats, in_stride, out_coords, out_stride, kernel_size, stride, dilation, transposed
    )
    pad = [d * ((k - 1) // 2) for d, k in zip(dilation, kernel_size)]
    if transposed:
        out = F.conv_transpose3d(grid, dense_weight, stride=stride, dilation=dilation)
        index = out_cells + torch.tensor(pad, device=feats.device)
    else:
        out = F.conv3d(grid, dense_weight, stride=stride, dilation=dilation, padding=pad)
        index = out_cells
    result = out.permute(0, 2, 3, 4, 1)[(out_coords[:, 0].long(), *index.unbind(1))]
    return result if bias is None else result + bias


def dense_pool_reference(in_coords, feats, in_stride, out_coords, out_stride, kernel_size, stride, op):
    """Dense pooling evaluated at out_coords -> (N_out, C), differentiable; op: "max" (empty cells
    are -inf, so a window without input gives -inf), "sum" (zeros, divisor 1) or "count" (of inputs)."""
    if op == "count":
        feats = torch.ones_like(feats[:, :1])
    fill = float("-inf") if op == "max" else 0.0
    grid, out_cells = _dense_grid(
        in_coords, feats, in_stride, out_coords, out_stride, kernel_size, stride, (1, 1, 1), False, fill
    )
    pad = [(k - 1) // 2 for k in kernel_size]
    if op == "max":
        out = F.max_pool3d(grid, kernel_size, stride, padding=pad)
    else:
        out = F.avg_pool3d(grid, kernel_size, stride, padding=pad, divisor_override=1)
    return out.permute(0, 2, 3, 4, 1)[(out_coords[:, 0].long(), *out_cells.unbind(1))]


def _dense_grid(in_coords, feats, in_stride, out_coords, out_stride, kernel_size, stride, dilation, transposed, fill=0.0):
    """(B, C, X, Y, Z) grid of the input at its stride, ``fill`` in empty cells, large enough for
    every output cell; and the (N_out, 3) int64 cells of out_coords at the output stride."""
    device = feats.device
    big = [max(a, b) for a, b in zip(in_stride, out_stride)]
    every = torch.cat([in_coords[:, 1:], out_coords[:, 1:]]).to(torch.int64)
    origin = torch.div(every.amin(0), torch.tensor(big, device=device), rounding_mode="floor") * torch.tensor(big, device=device)
    in_cells = torch.div(in_coords[:, 1:].long() - origin, torch.tensor(in_stride, device=device), rounding_mode="floor")
    out_cells = torch.div(out_coords[:, 1:].long() - origin, torch.tensor(out_stride, device=device), rounding_mode="floor")
    margin = [d * k + 2 for d, k in zip(dilation, kernel_size)]
    batch = int(max(in_coords[:, 0].max(), out_coords[:, 0].max())) + 1
    if transposed:
        reach = [-(-int(m) // s) for m, s in zip(out_cells.amax(0).tolist(), stride)]
    else:
        reach = [int(m) * s for m, s in zip(out_cells.amax(0).tolist(), stride)]
    size = [max(int(a), r) + m for a, r, m in zip(in_cells.amax(0).tolist(), reach, margin)]
    grid = feats.new_full((batch, *size, feats.shape[1]), fill)
    grid = grid.index_put((in_coords[:, 0].long(), *in_cells.unbind(1)), feats)
    return grid.permute(0, 4, 1, 2, 3), out_cells


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the measure every tolerance in the tests is stated in)."""
    return float((out.detach().double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
