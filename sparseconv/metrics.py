"""Semantic-segmentation metrics: confusion matrix and per-class intersection over union."""

from __future__ import annotations

import torch


def confusion_matrix(prediction: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """prediction, target: (N,) integer class ids in [0, num_classes) -> (num_classes, num_classes)
    int64 counts, rows the target class and columns the predicted one."""
    if prediction.shape != target.shape or prediction.dim() != 1:
        raise ValueError(
            f"prediction and target must be (N,) tensors of one shape, got {tuple(prediction.shape)} and "
            f"{tuple(target.shape)}"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    for name, ids in (("prediction", prediction), ("target", target)):
        if ids.is_floating_point() or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_classes)):
            raise ValueError(f"{name} must hold integer class ids in [0, {num_classes}), got {ids.dtype} ids")
    flat = target.to(torch.int64) * num_classes + prediction.to(torch.int64)
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def iou_per_class(confusion: torch.Tensor) -> torch.Tensor:
    """(C, C) confusion matrix -> (C,) float64 IoU = TP / (TP + FP + FN); NaN for a class that is
    neither present nor predicted (leave it out of the mean with ``nanmean``)."""
    confusion = confusion.to(torch.float64)
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    return torch.where(union > 0, hits / union.clamp(min=1), torch.full_like(hits, float("nan")))
