"""Bird's-eye pictures of a segmented scene (matplotlib, an optional dependency)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

# Colour-blind-safe qualitative colours (Okabe-Ito), one per class.
_COLOURS = ("#999999", "#E69F00", "#0072B2", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442")


def require_matplotlib() -> None:
    """ImportError saying how to install matplotlib, unless it can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "the bird's-eye plot needs matplotlib: pip install 'sparseconv[plot]' (or pip install matplotlib)"
        ) from error


def save_bev_comparison(
    path: str | Path,
    coords: torch.Tensor,
    prediction: torch.Tensor,
    label: torch.Tensor,
    class_names: Sequence[str],
    hide: Sequence[str] = (),
    title: str = "",
) -> Path:
    """Save a PNG of prediction | label | errors seen from above; returns the path.

    coords: (N, 4) int [batch, x, y, z] of one scene; prediction, label: (N,) int class ids;
    hide: class names left out (by label), e.g. a room's ceiling, which would cover everything.
    The topmost voxel of each column is drawn.
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if len(class_names) > len(_COLOURS):
        raise ValueError(f"class_names: at most {len(_COLOURS)} classes can be coloured, got {len(class_names)}")
    xyz = coords[:, 1:].cpu().numpy()
    prediction, label = prediction.cpu().numpy(), label.cpu().numpy()
    keep = ~np.isin(label, [class_names.index(name) for name in hide])
    # Drawing in order of height puts the topmost voxel of every column last, on top.
    order = np.argsort(xyz[keep, 2], kind="stable")
    xyz, prediction, label = xyz[keep][order], prediction[keep][order], label[keep][order]
    palette = np.array(_COLOURS[: len(class_names)])

    figure = Figure(figsize=(15, 5.4), layout="constrained")
    axes = figure.subplots(1, 3, sharex=True, sharey=True)
    # One square mark per voxel column: its side is a cell of the plot (~320 x 290 points per
    # panel), so a small room fills its panel as densely as a 600-voxel street.
    span = np.ptp(xyz[:, :2], axis=0) + 1 if len(xyz) else np.ones(2)
    cell = min(320 / span[0], 290 / span[1])
    base = float(np.clip(cell**2, 1.5, 60.0))
    wrong = prediction != label
    panels = (
        ("prediction", palette[prediction], np.full(len(xyz), base)),
        ("label", palette[label], np.full(len(xyz), base)),
        # Errors are few and small: larger red marks, drawn last so that nothing covers them.
        (
            f"errors ({wrong.mean():.1%} of voxels)",
            np.where(wrong, "#D00000", "#DDDDDD"),
            np.where(wrong, max(base, 6.0), base),
        ),
    )
    for ax, (name, colours, sizes) in zip(axes, panels):
        order = np.argsort(sizes, kind="stable")
        ax.scatter(xyz[order, 0], xyz[order, 1], c=colours[order], s=sizes[order], marker="s", linewidths=0)
        ax.set_title(name)
        ax.set_aspect("equal")
        ax.set_xlabel("x (voxels)")
    axes[0].set_ylabel("y (voxels)")
    # A hidden class stays in the legend when the prediction uses it on the voxels shown.
    predicted = set(np.unique(prediction).tolist())
    shown = [i for i, name in enumerate(class_names) if name not in hide or i in predicted]
    handles = [Patch(color=palette[i], label=class_names[i]) for i in shown]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(shown))
    if title:
        figure.suptitle(title)
    path = Path(path)
    figure.savefig(path, dpi=110)
    return path
