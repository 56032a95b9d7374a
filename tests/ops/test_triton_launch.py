"""triton_launch: a compiled kernel is launched directly only for arguments that select the binary
Triton compiled for them, and through Triton's runner while a launch hook is installed (checked
with a stand-in kernel: no GPU, no compiler; a real hook on the GPU)."""

import functools

import pytest
import torch

from sparseconv.backends import compiling
from sparseconv.backends import triton_launch as tk


class Compiled:
    """What Triton's launch returns: a compiled kernel, whose launcher ``run`` takes the grid, the
    stream, its function and metadata, the launch metadata and hooks, then every argument; its
    runner ``[grid](*all_arguments)`` (what a launch takes while a hook is installed) calls it."""

    packed_metadata = b""
    function = 7

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def run(self, x, y, z, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert function == self.function and metadata is self.packed_metadata
        self.launches.append(("direct", (x, y, z), args))

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("runner", grid, args))


class Kernel:
    """A stand-in JITFunction: ``[grid](*args, **options)`` records a launch through Triton."""

    arg_names = ["a_ptr", "out_ptr", "rows", "BLOCK"]

    def __init__(self, returns_compiled: bool = True) -> None:
        self.launches: list = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid):
        def run(*args, **options):
            self.launches.append(("triton", grid, args, options))
            return Compiled(self.launches) if self.returns_compiled else None
        return run


class Hooks:
    """Where Triton keeps its launch hooks (knobs.runtime); a chain of them from Triton 3.6."""

    def __init__(self) -> None:
        self.launch_enter_hook, self.launch_exit_hook = None, None


@pytest.fixture
def hooks(monkeypatch):
    owner = Hooks()
    monkeypatch.setattr(tk, "_hook_owner", lambda: owner)
    return owner


@pytest.fixture
def direct(monkeypatch, hooks):
    monkeypatch.setattr(tk, "_direct_launches", lambda: True)
    monkeypatch.setattr(tk, "_COMPILED", {})
    monkeypatch.setattr(tk, "_current_device", lambda: 0)
    monkeypatch.setattr(tk, "_current_stream", lambda device: 0)


def ways(kernel: Kernel) -> list[str]:
    return [launch[0] for launch in kernel.launches]


def test_a_repeated_launch_goes_direct_with_every_parameter_in_order(direct):
    kernel = Kernel()
    a, out = torch.zeros(64), torch.zeros(64)
    tk.launch(kernel, (3,), a, out, 1000, BLOCK=32, num_warps=4)
    tk.launch(kernel, (5,), a, out, 1000, BLOCK=32, num_warps=4)
    assert ways(kernel) == ["triton", "direct"]
    # the grid padded to three dimensions; the constant BLOCK passed by position, num_warps (an option) not
    assert kernel.launches[1][1:] == ((5, 1, 1), (a, out, 1000, 32))


@pytest.mark.parametrize("change", ["alignment", "dtype", "divisible by 16", "one", "int64", "constant", "option"])
def test_whatever_triton_specialises_on_goes_through_triton_again(direct, change):
    kernel = Kernel()
    storage = torch.zeros(128)
    first = dict(a=storage[:64], out=torch.zeros(64), rows=1000, BLOCK=32, num_warps=4)
    second = dict(first)
    if change == "alignment":
        second["a"] = storage[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        second["a"] = first["a"].half()
    elif change == "divisible by 16":
        second["rows"] = 1008
    elif change == "one":
        second["rows"] = 1
    elif change == "int64":
        second["rows"] = 2**31 + 3
    elif change == "constant":
        second["BLOCK"] = 64
    else:
        second["num_warps"] = 8
    for launch in (first, second, second):
        tk.launch(kernel, (1,), launch["a"], launch["out"], launch["rows"], BLOCK=launch["BLOCK"],
                  num_warps=launch["num_warps"])
    assert ways(kernel) == ["triton", "triton", "direct"]


def test_without_a_compiled_kernel_every_launch_goes_through_triton(direct):
    """The interpreter's launch returns no compiled kernel."""
    kernel = Kernel(returns_compiled=False)
    for _ in range(3):
        tk.launch(kernel, (1,), torch.zeros(4), torch.zeros(4), 7, BLOCK=32)
    assert ways(kernel) == ["triton"] * 3


def test_a_parameter_left_to_its_default_keeps_triton_launching(direct):
    """Direct launches need every parameter; one left to its default is not known here."""
    kernel = Kernel()
    for _ in range(2):
        tk.launch(kernel, (1,), torch.zeros(4), torch.zeros(4), 7)
    assert ways(kernel) == ["triton", "triton"]


def test_a_bound_launch_takes_its_operands_and_keeps_the_rest(direct):
    """A Bound launch runs the compiled kernel with the given tensors in their places, the fixed
    arguments and constants in theirs; an operand at another alignment or dtype goes through
    Triton again (another binary), and then direct as well."""
    kernel = Kernel()
    kernel.arg_names = ["a_ptr", "view_ptr", "rows", "out_ptr", "BLOCK"]
    view, storage = torch.zeros(8), torch.zeros(128)
    bound = tk.Bound(kernel, (2,), [None, view, 96, None], {"BLOCK": 32}, varying=(0, 3))
    aligned, out = storage[:64], torch.zeros(64)
    unaligned = storage[1:65]
    bound(aligned, out)
    bound(aligned, out)
    bound(unaligned, out)
    bound(unaligned, out)
    bound(aligned.half(), out)
    assert ways(kernel) == ["triton", "direct", "triton", "direct", "triton"]
    grid, args = kernel.launches[1][1:]
    assert grid == (2, 1, 1) and len(args) == 5
    assert args[0] is aligned and args[1] is view and args[2] == 96 and args[3] is out and args[4] == 32
    assert kernel.launches[3][2][0] is unaligned
    assert bound.args == [None, view, 96, None]  # a call leaves the bound arguments as they were


def test_a_new_bound_launch_finds_the_kernel_compiled_for_an_earlier_one(direct):
    """A new map's product (other views and grid, the same forms) launches the kernel compiled for
    the last map's directly, from its first call."""
    kernel = Kernel()
    kernel.arg_names = ["a_ptr", "view_ptr", "rows", "out_ptr", "BLOCK"]
    a, out = torch.zeros(64), torch.zeros(64)
    tk.Bound(kernel, (2,), [None, torch.zeros(8), 96, None], {"BLOCK": 32}, varying=(0, 3))(a, out)
    tk.Bound(kernel, (7,), [None, torch.zeros(12), 112, None], {"BLOCK": 32}, varying=(0, 3))(a, out)
    tk.Bound(kernel, (7,), [None, torch.zeros(12), 100, None], {"BLOCK": 32}, varying=(0, 3))(a, out)
    assert ways(kernel) == ["triton", "direct", "triton"]  # 100 is not divisible by 16: another binary
    assert kernel.launches[1][1] == (7, 1, 1) and kernel.launches[1][2][2] == 112


def test_a_template_bound_to_another_map_s_views_keeps_the_compiled_kernel(direct):
    """A product's launch for a new map (other views, sizes and grid) is the template of the first
    map's bound to them: it holds none of the first map's tensors, launches the kernel compiled for
    the first directly while the new arguments specialise alike, and goes through Triton otherwise."""
    kernel = Kernel()
    kernel.arg_names = ["a_ptr", "view_ptr", "rows", "out_ptr", "BLOCK"]
    a, out, first_view = torch.zeros(64), torch.zeros(64), torch.zeros(8)
    first = tk.Bound(kernel, (2,), [None, first_view, 96, None], {"BLOCK": 32}, varying=(0, 3))
    first(a, out)
    template = first.template((1,))
    assert template.args == [None, None, 96, None] and first.args[1] is first_view
    view = torch.zeros(12)
    bound = template.bind((7,), {1: view, 2: 112})
    bound(a, out)
    assert ways(kernel) == ["triton", "direct"]
    assert kernel.launches[1][1:] == ((7, 1, 1), (a, view, 112, out, 32))
    assert template.args == [None, None, 96, None] and bound.args == [None, view, 112, None]
    template.bind((7,), {1: view, 2: 100})(a, out)  # 100 is not divisible by 16: another binary
    template.bind((7,), {1: torch.zeros(12, dtype=torch.float64), 2: 112})(a, out)  # another dtype
    template.bind((3,), {1: torch.zeros(16)[1:], 2: 112})(a, out)  # unaligned
    template.bind((3,), {1: torch.zeros(16), 2: 128})(a, out)
    assert ways(kernel) == ["triton", "direct", "triton", "triton", "triton", "direct"]


class Chain:
    def __init__(self, calls: list) -> None:
        self.calls = calls


@pytest.mark.parametrize("hook", ["function", "chain", "empty chain"])
def test_a_launch_hook_sees_every_launch_through_triton_s_runner(direct, hooks, hook):
    """A profiler's hook (Proton's) is called by Triton's runner: while one is installed, the
    compiled kernel is launched through it; an empty chain (Triton 3.6's default) is no hook."""
    kernel = Kernel()
    a, out = torch.zeros(64), torch.zeros(64)
    tk.launch(kernel, (3,), a, out, 1000, BLOCK=32)
    hooks.launch_enter_hook = {"function": print, "chain": Chain([print]), "empty chain": Chain([])}[hook]
    tk.launch(kernel, (3,), a, out, 1000, BLOCK=32)
    assert ways(kernel) == ["triton", "direct" if hook == "empty chain" else "runner"]
    assert kernel.launches[1][1:] == ((3, 1, 1), (a, out, 1000, 32))


@pytest.mark.gpu
def test_a_real_launch_hook_sees_the_direct_launches():
    """Triton 3.6's hook chain (or an older Triton's hook) is called for a launch that went direct
    before the hook was installed, and not after it is removed."""
    pytest.importorskip("triton")
    from sparseconv.backends import mask_views, triton_kernels

    table = torch.arange(8, dtype=torch.int32, device="cuda").view(8, 1)
    counts = torch.ones(1, dtype=torch.int64, device="cuda")
    keys = torch.empty(8, dtype=torch.int16, device="cuda")
    args, options = mask_views._masks_launch(table, counts, keys, 8, 1, 8, [(0, 1)])
    kernel = triton_kernels.kernels().row_masks
    owner, seen = tk._hook_owner(), []
    previous = owner.launch_enter_hook
    hook = seen.append
    for installed in (False, False, True, False):  # the first launch through Triton, the next direct
        if installed:
            previous.add(hook) if hasattr(previous, "add") else setattr(owner, "launch_enter_hook", hook)
        try:
            tk.launch(kernel, (1, 1), *args, **options)
        finally:
            previous.remove(hook) if hasattr(previous, "remove") else setattr(owner, "launch_enter_hook", previous)
    torch.cuda.synchronize()
    assert len(seen) == 1


class Kernels:
    """A stand-in for a module's kernels: ``source = (kernels_of, "kernel")``."""

    kernel = Kernel()


def kernels_of():
    return Kernels


@pytest.fixture
def gate(monkeypatch, direct):
    """A compile gate that says "not compiled" to each kernel's first ask, then "compiled"; it records its asks."""
    asks = []

    def ask(tensor, key, hook, args):
        asks.append((key, hook, args))
        return sum(1 for k, _, _ in asks if k == key) > 1

    monkeypatch.setattr(compiling, "kernel_ready", ask)
    monkeypatch.setattr(tk, "_READY", set())
    Kernels.kernel = Kernel()
    return asks


def test_a_kernel_not_compiled_yet_launches_nothing_and_is_compiled_by_the_gate(gate):
    x = torch.zeros(8)
    assert not tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 8, BLOCK=4)
    assert Kernels.kernel.launches == [] and len(gate) == 1
    key, hook, args = gate[0]
    # What a worker runs: the kernel looked up by its module function and name, pointers given as their dtype.
    assert hook is tk.warm_kernel and args == ((kernels_of, "kernel"), -1, (torch.float32, torch.float32, 8), {"BLOCK": 4})
    assert tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 8, BLOCK=4)  # compiled now
    assert tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 8, BLOCK=4)
    assert ways(Kernels.kernel) == ["triton", "direct"] and len(gate) == 2, "a launched kernel asks no more"
    # Arguments that select another binary (another block size, an int that is 1) are another kernel to the gate.
    assert not tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 8, BLOCK=8)
    assert not tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 1, BLOCK=4)
    assert len(gate) == 4 and gate[2][0] != gate[3][0] != gate[0][0]


def test_where_the_gate_allows_every_kernel_launches(monkeypatch, direct):
    monkeypatch.setattr(compiling, "kernel_ready", lambda *args: True)
    Kernels.kernel = Kernel()
    x = torch.zeros(8)
    assert tk.launch_ready((kernels_of, "kernel"), (2,), x, x, 8, BLOCK=4)
    assert ways(Kernels.kernel) == ["triton"]


def test_the_view_gate_compiles_in_the_background_where_products_do(monkeypatch, view_gate):
    # On a GPU outside traces and captures, not in deterministic mode (whose first batches would round the fused
    # norm otherwise than later ones), and with background compiles on: elsewhere in the call.
    import sparseconv

    asked = []

    class Workers:  # the process's background workers, as the tuner's products share them
        def ready(self, *args):
            asked.append(args)
            return False

    monkeypatch.setattr(compiling, "background", functools.cache(Workers))  # as the real one, made once
    x = torch.zeros(4)
    assert view_gate(x, "k", tk.warm_kernel, ()) and not asked, "a CPU tensor"
    monkeypatch.setattr(compiling, "on_gpu_eagerly", lambda a: True)  # as a CUDA tensor would be
    monkeypatch.setenv("SPARSECONV_BACKGROUND_COMPILE", "0")
    assert view_gate(x, "k", tk.warm_kernel, ()) and not asked
    monkeypatch.setenv("SPARSECONV_BACKGROUND_COMPILE", "1")
    sparseconv.set_deterministic(True)
    try:
        assert view_gate(x, "k", tk.warm_kernel, ()) and not asked
    finally:
        sparseconv.set_deterministic(None)
    assert not view_gate(x, "k", tk.warm_kernel, ()) and len(asked) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_view_kernel_compiles_in_a_worker_while_torch_builds_the_view(monkeypatch, view_gate):
    # The real gate: the first ask queues the compile in a background worker and torch counts the pairs;
    # once it has compiled, the kernel counts them, the same.
    import sparseconv.tune as tune
    from sparseconv import SparseTensor
    from sparseconv.coords import KernelMapKey
    from sparseconv.backends import planned_views

    monkeypatch.setenv("SPARSECONV_BACKGROUND_COMPILE", "1")
    monkeypatch.setattr(compiling, "kernel_ready", view_gate)
    monkeypatch.setattr(tk, "_READY", set())
    monkeypatch.setattr(tk, "_COMPILED", {})
    coords = torch.randint(0, 30, (3000, 4), dtype=torch.int32)
    coords[:, 0] = 0
    coords = torch.unique(coords, dim=0).cuda()
    x = SparseTensor(coords, torch.zeros(len(coords), 1, device="cuda"))
    kernel_map = x.cache.kernel_map(KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]
    assert planned_views.pair_counts([kernel_map]) is None, "not compiled yet: the caller counts with torch"
    assert tune.wait_for_compiles(300)
    counts, starts = planned_views.pair_counts([kernel_map])
    assert starts == [0] and torch.equal(counts, (kernel_map.neighbors >= 0).sum(0))


def test_a_ready_launch_gates_its_first_call_then_launches_direct_with_its_fixed_arguments(gate):
    """ReadyLaunch: the gate's answer for each new form of the varying arguments (a tensor's dtype and alignment,
    a size's specialisation), then direct launches with the fixed arguments in their places."""
    Kernels.kernel.arg_names = ["a_ptr", "w_ptr", "out_ptr", "rows", "channels", "BLOCK"]
    w, storage, out = torch.zeros(16), torch.zeros(128), torch.zeros(64)
    ready = tk.ReadyLaunch((kernels_of, "kernel"), [None, w, None, None, 16], {"BLOCK": 4}, varying=(0, 2, 3))
    a = storage[:64]
    assert not ready((2,), a, out, 96), "not compiled yet: nothing launched"
    assert Kernels.kernel.launches == []
    assert ready((2,), a, out, 96) and ready((3,), a, out, 112)
    assert ways(Kernels.kernel) == ["triton", "direct"]
    grid, args = Kernels.kernel.launches[1][1:]
    assert grid == (3, 1, 1) and args[0] is a and args[1] is w and args[2] is out and args[3:] == (112, 16, 4)
    assert ready.args == [None, w, None, None, 16], "a call leaves the fixed arguments as they were"
    asks = len(gate)
    assert not ready((2,), a, out, 1), "a size of 1 is another binary: the gate asked again"
    assert not ready((2,), storage[1:65], out, 96), "another alignment: another binary"
    assert not ready((2,), a.half(), out, 96), "another dtype"
    assert len(gate) == asks + 3 and ways(Kernels.kernel) == ["triton", "direct"]
