"""warmup: tune a model's conv products eagerly, before torch.compile or CUDA-graph capture runs it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..tensor import SparseTensor


def warmup(model: nn.Module, example_input: object) -> None:
    """Run ``model`` forward and backward once, eagerly, on ``example_input`` (a SparseTensor, or a
    tuple of the model's arguments) so that every conv product it makes is tuned.

    Tuning times candidate kernels, which a trace or a CUDA-graph capture cannot do (the tuner
    refuses there); a compiled model then finds every choice made. Its passes time every new key at
    once, outside the timing budget (:meth:`~sparseconv.tune.budget.TimingBudget.waived`), where a
    plain call would run a pick untimed and time the key later. If layers ran the reference
    while their kernels compiled in the background (:func:`sparseconv.tune.wait_for_compiles`),
    it waits for them and runs the model once more, so that every choice is compiled and loaded
    before a capture. It also hands the kernel-map keys of this batch to
    :mod:`sparseconv.ops.compiled`, so a compiled model builds a new batch's maps in one go.
    Afterwards the parameters' gradients and the buffers (BatchNorm statistics) are as before; the
    backward pass uses all-ones output gradients (tuning depends on shapes only).
    A ``torch.compile``-d module is run through its original module.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("sparseconv.warmup runs eagerly: call it before the compiled model, not inside it")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from ..tune import get_tuner

    model = getattr(model, "_orig_mod", model)  # an OptimizedModule (torch.compile) would trace instead
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    tuner = get_tuner()
    with tuner.budget.waived():  # every key timed now (no stand-in, whatever the timing budget holds)
        for _ in range(2):
            _forward_backward(model, args)
            if not tuner.compiling():
                break
            tuner.wait_for_compiles()
    inputs = [a for a in args if isinstance(a, SparseTensor)]
    if inputs:
        from . import compiled  # here: it loads Dynamo

        compiled.learn_maps(inputs[0].cache)


def _forward_backward(model: nn.Module, args: tuple) -> None:
    """One forward and backward of ``model``, leaving its gradients and buffers as they were."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.enable_grad():
            outputs = [t for t in _tensors(model(*args)) if t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    finally:
        for p, grad in grads.items():
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in a model's output (SparseTensor features, tensors, nested tuples, lists, dicts)."""
    if isinstance(value, SparseTensor):
        yield value.feats
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
