"""Launches of the Triton kernels (:mod:`.triton_kernels`) with less host time than ``kernel[grid](...)``.

Triton's launch binds the arguments and derives its specialisation key from each of them (~19 µs
of host time a launch on an H100 host; a MinkUNet training step makes ~170). :func:`launch` keeps,
under a key at least as fine as Triton's, the compiled kernel Triton's launch returned and calls
its launcher directly from then on; :class:`Bound` fixes a product's arguments but its operands
once per (map, product, parameters). Either launches through Triton's own path where direct
launches do not apply: the interpreter, a Triton older than 3.3, a parameter left to its default,
and while a launch hook (a profiler's, e.g. Proton's) is installed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from .. import config
from . import compiling, triton_kernels
from .cuda_launch import current_stream


def launch(kernel, grid: tuple[int, ...], *args, **options):
    """``kernel[grid](*args, **options)``, with ~10 µs less host time a launch once compiled."""
    _launch(kernel, grid, args, options, _key(kernel, args, options, tuple(map(_specialisation, args))))


def launch_ready(source: tuple[Callable, str], grid: tuple[int, ...], *args, **options) -> bool:
    """:func:`launch` of the kernel ``getattr(source[0](), source[1])`` where it is compiled for these
    arguments, in this process or by the background workers (:func:`.compiling.kernel_ready`);
    else False, launching nothing, and the workers compile it meanwhile: the caller builds its view with
    torch ops. A view kernel's first launch compiled it in the call (0.1-1.1 s each on an H100 host; a
    cold process's first MinkUNet inference compiled eight, 3.0 s of its 10 s). ``source``: the module
    function returning the kernels and the kernel's name (what a worker process looks it up by)."""
    return _launch_ready(source, grid, args, options) is not False


def _launch_ready(source: tuple[Callable, str], grid: tuple[int, ...], args: Sequence, options: Mapping
                  ) -> tuple | None | bool:
    """:func:`launch_ready`'s launch: False where it launched nothing, else what :func:`_launch` returned."""
    kernel = getattr(source[0](), source[1])
    key = _key(kernel, args, options, tuple(map(_specialisation, args)))
    if key not in _READY and key not in _COMPILED:
        warm_args = tuple(arg.dtype if isinstance(arg, torch.Tensor) else arg for arg in args)
        if not compiling.kernel_ready(args[0], (source[1], key[1:]), warm_kernel,
                                      (source, key[1], warm_args, dict(options))):
            return False
    held = _launch(kernel, grid, args, options, key)
    _READY.add(key)
    return held


_READY: set[tuple] = set()
"""The launch keys :func:`launch_ready` launched (the interpreter's too, which :data:`_COMPILED` does not hold)."""


class _Kept:
    """A launch whose arguments ``args`` are fixed but for those at ``varying``, given to each call, with the
    kernels compiled for it so far by the specialisation of the given ones (``form``): a call finding its form
    launches the compiled kernel with its trailing options (:func:`run`), without Triton's launch or a key."""

    __slots__ = ("args", "options", "varying", "_runners")

    def _keep(self, form: tuple, held: tuple | None) -> None:
        """Keep what :func:`_launch` returned (None: direct launches do not apply) for calls of ``form``."""
        if held is not None:
            compiled, trailing = held
            # (the compiled kernel, the options it takes after the arguments): no closure per launch
            self._runners[form] = (compiled, tuple(self.options[name] for name in trailing))


class ReadyLaunch(_Kept):
    """:func:`launch_ready` of one kernel whose arguments stay but for those at ``varying`` (tensors and sizes
    given to each call): where its last launches ran compiled for arguments specialised as these are, a call costs
    the host the compiled kernel's launch and the specialisations of the varying arguments alone (an inference
    norm's fused pass: ~10 arguments, whose key each call took most of its host time); otherwise it is
    :func:`launch_ready`'s call. While a launch hook is installed, :func:`run` goes through Triton's runner."""

    __slots__ = ("source",)

    def __init__(self, source: tuple[Callable, str], args: Sequence, options: Mapping, varying: Sequence[int]):
        self.source, self.args, self.options, self.varying = source, list(args), dict(options), tuple(varying)
        self._runners: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, ...], *values) -> bool:
        """Launch on ``grid`` with ``values`` at the ``varying`` positions; False (launching nothing) where the
        kernel is not compiled for them yet (:func:`launch_ready`)."""
        args = self.args.copy()
        for at, value in zip(self.varying, values):
            args[at] = value
        form = tuple(map(_specialisation, values))
        runner = self._runners.get(form)
        if runner is not None:
            compiled, tail = runner
            run(compiled, tuple(grid) + (1,) * (3 - len(grid)), (*args, *tail))
            return True
        held = _launch_ready(self.source, grid, args, self.options)
        if held is False:
            return False
        self._keep(form, held)
        return True


def warm_kernel(source: tuple[Callable, str], index: int, args: tuple, options: dict) -> None:
    """Compile ``source``'s kernel (see :func:`launch_ready`) for ``args`` (pointers as their dtype) on the
    GPU ``index`` (run in a compile worker)."""
    warm(getattr(source[0](), source[1]), torch.device("cuda", index), *args, **options)


def _key(kernel, args: Sequence, options: Mapping, specs: tuple) -> tuple:
    """A launch's key (:data:`_COMPILED`), given its arguments' specialisations."""
    # The first argument's device, as a device index is cheaper to read there than current_device().
    return (kernel, args[0].get_device(), *specs, *options.items())


def _launch(kernel, grid: tuple[int, ...], args: Sequence, options: Mapping, key: tuple) -> tuple | None:
    """:func:`launch` given its key (:func:`_key`); returns (compiled kernel, names of the parameters
    given as options) where direct launches apply, else None."""
    held = _COMPILED.get(key)
    if held is None:
        compiled = kernel[grid](*args, **options)
        trailing = tuple(kernel.arg_names[len(args):]) if hasattr(kernel, "arg_names") else None
        if not (_direct_launches() and hasattr(compiled, "packed_metadata") and trailing is not None
                and all(name in options for name in trailing)):
            return None
        held = _COMPILED[key] = (compiled, trailing)
        return held
    compiled, trailing = held
    run(compiled, grid + (1,) * (3 - len(grid)), (*args, *[options[name] for name in trailing]))
    return held


_COMPILED: dict[tuple, tuple] = {}
"""launch key -> (Triton's compiled kernel, the names of its parameters given as options)."""


def run(compiled, grid: tuple[int, int, int], args: Sequence) -> None:
    """Launch Triton's ``compiled`` kernel on ``grid`` with every parameter, in signature order.

    Its launcher is called as Triton's own runner calls it, on torch's current stream, but
    without the runner's per-launch work for launch hooks (the current device and stream looked
    up through Triton's driver, the launch metadata built, the hook chains called before and
    after): 12.0 µs a launch instead of 15.2 on an H200 host (a training step makes ~170). With a hook
    installed the launch goes through the runner, so the hook sees every launch."""
    if _hooks_installed():
        compiled[grid](*args)
        return
    compiled.run(grid[0], grid[1], grid[2], _current_stream(_current_device()), compiled.function,
                 compiled.packed_metadata, None, None, None, *args)


def _hooks_installed() -> bool:
    """Whether a launch hook is set (Triton 3.4 on keeps them in ``knobs.runtime``, as a callable
    or None, or from 3.6 as a chain of callables; 3.3 on ``CompiledKernel``)."""
    owner = _hook_owner()
    return _active(owner.launch_enter_hook) or _active(owner.launch_exit_hook)


def _active(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


@functools.cache
def _hook_owner():
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "launch_enter_hook"):
        return runtime
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_current_stream = current_stream


class Bound(_Kept):
    """One launch of ``kernel`` whose arguments are fixed but for the tensors at positions
    ``varying``, given to each call (a product's operands and output; the map's views, sizes and
    options stay). A call costs the host the compiled kernel's own launch and a look at the given
    tensors' dtypes and alignment; a first call, the key of the varying ones only (the fixed ones'
    specialisations are taken once, here), so a new map's products find the kernels compiled for
    the last map's without Triton's launch."""

    # Slots: a step makes ~80 of these, each instance dict another object for Python's collector.
    __slots__ = ("grid", "kernel", "_specs")

    def __init__(self, kernel, grid: tuple[int, ...], args: Sequence, options: Mapping, varying: Sequence[int]):
        # three dimensions, as a compiled kernel's launcher takes them (Triton's launch too)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kernel, self.args, self.options = kernel, list(args), options
        self.varying = tuple(varying)
        self._specs = [None if at in self.varying else _specialisation(arg) for at, arg in enumerate(self.args)]
        self._runners: dict[tuple, tuple] = {}

    def __call__(self, *tensors: torch.Tensor) -> None:
        args = self.args.copy()
        for at, tensor in zip(self.varying, tensors):
            args[at] = tensor
        form = tuple((tensor.dtype, tensor.data_ptr() % 16 == 0) for tensor in tensors)
        runner = self._runners.get(form)
        if runner is not None:
            compiled, tail = runner
            run(compiled, self.grid, (*args, *tail))
            return
        specs = self._specs.copy()
        for at, tensor in zip(self.varying, tensors):
            specs[at] = _specialisation(tensor)
        key = _key(self.kernel, args, self.options, tuple(specs))
        self._keep(form, _launch(self.kernel, self.grid, args, self.options, key))

    def template(self, positions: Sequence[int]) -> Bound:
        """This launch without its arguments at ``positions`` (a map's views): what :meth:`bind` fills
        in for another map. It keeps their specialisations and shares the kernels compiled so far,
        but holds none of the tensors (a template outlives the batch whose views it was made from)."""
        held = self._copy(self.grid)
        for at in positions:
            held.args[at] = None
        return held

    def bind(self, grid: tuple[int, ...], changes: Mapping[int, object]) -> Bound:
        """This launch on ``grid`` with the arguments at ``changes``' positions replaced (another map's
        views and sizes). It shares the compiled kernels found so far while every new argument
        specialises as the one it replaces did (the same dtype and alignment, an integer's same
        divisibility), and starts without them otherwise."""
        bound = self._copy(tuple(grid) + (1,) * (3 - len(grid)))
        same = True
        for at, arg in changes.items():
            bound.args[at] = arg
            spec = _specialisation(arg)
            if spec != bound._specs[at]:
                bound._specs[at], same = spec, False
        if not same:
            bound._runners = {}
        return bound

    def _copy(self, grid: tuple[int, int, int]) -> Bound:
        copy = Bound.__new__(Bound)
        copy.grid, copy.kernel, copy.args, copy.options = grid, self.kernel, self.args.copy(), self.options
        copy.varying, copy._specs, copy._runners = self.varying, self._specs.copy(), self._runners
        return copy


def _specialisation(arg):
    """What of a launch argument can select another binary: finer than Triton's key, never coarser
    (a tensor's dtype and 16-byte alignment; an integer's being 1, its divisibility by 16 and its
    width; a constant's value)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg >= 2**63
    if isinstance(arg, float):
        return float
    return arg


@functools.cache
def _direct_launches() -> bool:
    """Whether a compiled kernel takes every parameter in signature order, constants included
    (Triton 3.3 on; 3.2 took only the others), and the interpreter is off."""
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 3) and not config.triton_interpret()


_CACHES_LOCK = threading.Lock()


def warm(kernel, device: torch.device, *args, **options) -> None:
    """Compile ``kernel`` for a launch with ``args`` and ``options`` without running it: pointer
    arguments are given as their torch dtype (Triton assumes them 16-byte aligned, as torch's
    allocations are), integers as the launch's values, which Triton specialises on; where this thread loads
    a background compile's kernels (:func:`.compiling.loading`), load it too; where it records (:func:`recorded`),
    only note it. Thread-safe."""
    launches = getattr(_RECORDING, "launches", None)
    if launches is not None:
        launches.append((kernel, device, args, options))
        return
    with torch.cuda.device(device):  # Triton compiles for the current device of the calling thread
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            with _CACHES_LOCK:
                # A JITFunction makes its per-device kernel cache on first use, unlocked: threads
                # racing there each made one and kept only theirs, and the kernels compiled into
                # the others were compiled again at launch (H100, 2026-11-25).
                caches[torch.cuda.current_device()]
        compiled = kernel.warmup(*args, grid=(1,), **options)
        if compiling.loading():  # in this process, from the disk cache: its module loaded and launcher made
            compiled._init_handles()
            return
    _build_launcher(compiled)


_RECORDING = threading.local()


def recorded(hook: Callable, args: tuple) -> list[tuple[tuple, Hashable]] | None:
    """The kernels ``hook(*args)`` (a backend's ``precompile``) would compile, found without compiling any: for
    each, :func:`warm_kernel`'s arguments and the key of what it compiles (the one :func:`launch_ready` gives the
    same kernel, specialised alike), so that layers, products and map views needing one kernel share one background
    job, whatever else their hooks compile. None where the hook warms no kernel, fails, or warms one a worker cannot
    look up by name."""
    _RECORDING.launches = launches = []
    try:
        hook(*args)
    except Exception:  # noqa: BLE001 - the hook runs whole in a worker, where its failure is reported
        return None
    finally:
        _RECORDING.launches = None
    if not launches:
        return None  # compiles nothing, or not through warm
    found = []
    for kernel, device, warm_args, options in launches:
        name = getattr(kernel, "__name__", None)
        if name is None or getattr(triton_kernels.kernels(), name, None) is not kernel:
            return None
        index = device.index if device.index is not None else 0
        specs = tuple((arg, True) if isinstance(arg, torch.dtype) else _specialisation(arg) for arg in warm_args)
        found.append((((triton_kernels.kernels, name), index, warm_args, dict(options)),
                      (name, (index, *specs, *options.items()))))
    return found


def _build_launcher(compiled) -> None:
    """Build a kernel's launcher now, where it is compiled (a background worker, mostly), into Triton's cache.
    Triton 3.6 compiles a launcher per kernel signature with gcc at the kernel's first launch (~0.23 s each: two
    made 0.46 s of a new scene's first MinkUNet training step of 0.91 s, H200, 2026-11-29); the launch then loads
    it from the cache. Later Tritons launch through one prebuilt launcher, and this builds nothing."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 - an optimisation only: the first launch builds it, as without this
        pass
