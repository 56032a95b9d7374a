"""Deterministic mode: its switches, the backends' marks, pools of deterministic candidates only,
pins refused, keys apart from normal mode, and bitwise-repeatable convs and MinkUNet steps."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from conv_cases import MODES, make_conv, make_input
from sparse_reference import random_coords

import sparseconv
import sparseconv.tune
from sparseconv import SparseTensor, config
from sparseconv.models import MinkUNet14
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import explicit, registry
from sparseconv.backends.algos import LEVELS, AlgoMode, parse_mode
from sparseconv.backends.problem import NAMESPACES, PIN_ARGUMENT, ConvProblem
from sparseconv.tune.pools import candidate_pool

FORWARD, DGRAD, WGRAD = NAMESPACES

# The audit of every backend (backends/): which (namespace, params) are deterministic. A new
# backend fails test_every_backend_is_audited until it is listed here with its reason.
EXPECTED = {
    "explicit_gemm": lambda ns, p: True,  # per offset, index_add_ meets each row once
    "explicit_gemm_grouped": lambda ns, p: ns == WGRAD,  # a group's offsets meet in one index_add_
    "explicit_gemm_csr": lambda ns, p: False,
    "explicit_gemm_table": lambda ns, p: True,  # one GEMM per chunk of output rows, chunks summed in order  # MKL's sparse product: its summation order is not documented
    "implicit_gemm": lambda ns, p: False,  # fp32 atomics across offsets
    "splitk_wgrad": lambda ns, p: p["split"] == 1,  # split-K chunks meet through atomics
    "mask_implicit_gemm": lambda ns, p: True,  # output-stationary, groups add in launch order
    "cutlass_grouped": lambda ns, p: True,
    "cutlass_implicit_gemm": lambda ns, p: True,
    "cutlass_splitk_wgrad": lambda ns, p: True,  # chunks summed in a fixed order
    "cutlass_sm90": lambda ns, p: True,  # the tile counter's atomics only schedule
}
SUBMANIFOLD = next(m for m in MODES if m.name == "submanifold_k3")


@pytest.fixture(autouse=True)
def settings_restored():
    previous = sparseconv.set_deterministic(None)
    torch_mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    sparseconv.set_deterministic(previous)
    torch.use_deterministic_algorithms(torch_mode[0], warn_only=torch_mode[1])


# ---------------------------------------------------------------- switches ----------------------

def test_the_variable_the_setter_and_torchs_switch_turn_it_on_explicit_settings_first(monkeypatch):
    assert "SPARSECONV_DETERMINISTIC" in config.VARIABLES
    assert not sparseconv.is_deterministic()
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "1")
    assert sparseconv.is_deterministic()
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "")
    torch.use_deterministic_algorithms(True)
    assert sparseconv.is_deterministic()
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "0")  # an explicit no wins over torch's switch
    assert not sparseconv.is_deterministic()
    assert sparseconv.set_deterministic(True) is None
    assert sparseconv.is_deterministic()
    assert sparseconv.set_deterministic(False) is True
    assert not sparseconv.is_deterministic()
    sparseconv.set_deterministic(None)
    monkeypatch.delenv("SPARSECONV_DETERMINISTIC")
    assert sparseconv.is_deterministic()
    torch.use_deterministic_algorithms(False)
    assert not sparseconv.is_deterministic()


def test_a_bad_setting_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "sometimes")
    with pytest.raises(ValueError, match="SPARSECONV_DETERMINISTIC must be one of"):
        sparseconv.is_deterministic()
    with pytest.raises(TypeError, match="set_deterministic: mode must be True, False or None, got 'yes'"):
        sparseconv.set_deterministic("yes")


# ---------------------------------------------------------------- marks and pools ---------------

def test_every_backend_is_audited_and_marked_as_the_audit_says():
    assert sorted(registry.names()) == sorted(EXPECTED), "audit a new backend and list it in EXPECTED"
    for name in registry.names():
        backend = registry.get(name)
        for namespace in sorted(backend.ops):
            for params in backend.params_space:
                assert backend.deterministic(namespace, params) == EXPECTED[name](namespace, params), (name, params)
    # The fallback runs everywhere, so every namespace has a deterministic candidate on every device.
    assert all(registry.get("explicit_gemm").deterministic(ns, {}) for ns in NAMESPACES)
    assert not registry.Backend("unmarked", frozenset(NAMESPACES), lambda *a: None).deterministic(FORWARD, {})


def _problem(device: str, channels: int = 32, dtype=torch.float16) -> ConvProblem:
    return ConvProblem(20000, 20000, channels, channels, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False, dtype,
                       torch.device(device))


def _marked(namespace, candidate) -> bool:
    return registry.get(candidate.backend).deterministic(namespace, candidate.params_dict)


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu", "cuda_pools_built_on_the_cpu"])
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_deterministic_pool_holds_deterministic_candidates_only(namespace, device):
    # A cuda problem's pools are built here without a GPU: the Triton backends' supports() passes
    # under TRITON_INTERPRET=1 (conftest), so their GPU pools are what is filtered.
    for channels in (32, 256):
        problem = _problem(device, channels)
        for level in LEVELS:
            for effort in ("quick", "full"):
                mode = AlgoMode(level, (), "test")
                normal = candidate_pool(namespace, problem, mode, effort, False)
                pool = candidate_pool(namespace, problem, mode, effort, True)
                assert pool and all(_marked(namespace, c) for c in pool), (level, effort, pool)
                assert {c.id for c in normal if _marked(namespace, c)} <= {c.id for c in pool}
                if device == "cuda":  # the filter had something to take out
                    assert any(not _marked(namespace, c) for c in normal)
                    expected = "splitk_wgrad" if namespace == WGRAD else "mask_implicit_gemm"
                    assert expected in {c.backend for c in pool}, (level, pool)
    # The process's setting is the default.
    sparseconv.set_deterministic(True)
    assert all(_marked(namespace, c) for c in candidate_pool(namespace, _problem(device), AlgoMode("all", (), "t"), "full"))


def test_splitk_wgrad_keeps_its_tiles_at_one_split():
    problem = _problem("cuda", 256)
    normal = [c.params_dict for c in candidate_pool(WGRAD, problem, AlgoMode("auto", (), "t"), "quick", False)
              if c.backend == "splitk_wgrad"]
    pool = [c.params_dict for c in candidate_pool(WGRAD, problem, AlgoMode("auto", (), "t"), "quick", True)
            if c.backend == "splitk_wgrad"]
    tiles = lambda sets: {(p["block_m"], p["block_n"], p["block_p"]) for p in sets}  # noqa: E731
    assert all(p["split"] == 1 for p in pool) and tiles(pool) == tiles(normal) and min(p["split"] for p in normal) > 1


@pytest.mark.parametrize("namespace, pin", [(FORWARD, "implicit_gemm"), (DGRAD, "implicit_gemm"),
                                            (FORWARD, "explicit_gemm_grouped"), (FORWARD, "[implicit_gemm]"),
                                            (DGRAD, ["explicit_gemm", "explicit_gemm_grouped"])])
def test_a_pinned_nondeterministic_algorithm_is_an_error_naming_the_argument(namespace, pin, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backends may run CPU problems (also on a GPU machine)
    argument = PIN_ARGUMENT[namespace]
    mode = parse_mode(pin, namespace, argument)
    for problem in (_problem("cpu"), _problem("cuda")):
        with pytest.raises(ValueError, match=rf"^{argument}: algorithm '\w+' is not deterministic for {namespace}"
                                             r".*deterministic mode is on.*deterministic algorithms: \[.*'explicit_gemm'"):
            candidate_pool(namespace, problem, mode, "quick", True)
        assert candidate_pool(namespace, problem, mode, "quick", False)


def test_a_pin_from_the_environment_is_refused_in_a_conv_call_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=200)
    weight = torch.randn(27, 4, 5)
    monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", "implicit_gemm")
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "1")
    with pytest.raises(ValueError, match="^SPARSECONV_FWD_ALGO_MODE: algorithm 'implicit_gemm' is not deterministic"):
        sparse_conv3d(x, weight)
    monkeypatch.delenv("SPARSECONV_FWD_ALGO_MODE")
    with pytest.raises(ValueError, match="^fwd_algo: algorithm 'implicit_gemm' is not deterministic"):
        sparse_conv3d(x, weight, fwd_algo="implicit_gemm")
    # A deterministic pin runs; splitk_wgrad's default set is one split.
    assert candidate_pool(WGRAD, _problem("cpu"), parse_mode("splitk_wgrad", WGRAD, "wgrad_algo"), "quick", True)


def test_torchs_warn_only_switch_warns_for_a_pin_and_runs_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.use_deterministic_algorithms(True, warn_only=True)
    mode = parse_mode("implicit_gemm", FORWARD, "fwd_algo")
    with pytest.warns(UserWarning, match="fwd_algo: algorithm 'implicit_gemm' is not deterministic.*warn_only"):
        pool = candidate_pool(FORWARD, _problem("cpu"), mode, "quick")
    assert [c.backend for c in pool] == ["implicit_gemm"]
    # The auto pool is filtered all the same.
    auto = candidate_pool(FORWARD, _problem("cuda"), AlgoMode("auto", (), "t"), "quick")
    assert all(_marked(FORWARD, c) for c in auto)


# ---------------------------------------------------------------- the tuner ---------------------

def _conv(x: SparseTensor, weight: torch.Tensor, record: dict) -> None:
    feats = x.feats.clone().requires_grad_()
    out = sparse_conv3d(x.replace(feats), weight, record=record)
    out.feats.backward(torch.ones_like(out.feats))


@contextlib.contextmanager
def fast_fake(name: str, **fields):
    """A backend that is right and nearly free (it replays explicit_gemm's result): it wins
    wherever it may run."""
    memo: dict[tuple, torch.Tensor] = {}

    def run(namespace, problem, params, a, b, kernel_map):
        key = (namespace, a.data_ptr(), b.data_ptr(), id(kernel_map))
        if key not in memo:
            memo[key] = explicit.run(namespace, problem, params, a, b, kernel_map)
        return memo[key].clone()

    registry.register(registry.Backend(name, frozenset(NAMESPACES), run, **fields))
    try:
        yield
    finally:
        registry.unregister(name)


def test_a_normal_winner_is_never_the_deterministic_choice_and_their_keys_are_apart():
    x = make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300)
    weight = torch.randn(27, 4, 5, requires_grad=True)
    with fast_fake("fake_fast"):  # unmarked, so not deterministic
        normal = {}
        _conv(x, weight, normal)
        assert normal == dict.fromkeys(NAMESPACES, "fake_fast")
        sparseconv.set_deterministic(True)
        chosen = {}
        _conv(x, weight, chosen)  # same process, same map: the memo must not answer
        assert "fake_fast" not in chosen.values()
        sparseconv.tune.reset()  # a new process: only the cache file remembers
        again = {}
        _conv(x, weight, again)
        assert again == chosen
        # On the CPU deterministic mode's forward and dgrad pools are explicit_gemm alone (nothing
        # to time); wgrad's times explicit_gemm and explicit_gemm_grouped under a key of its own.
        keys = [key for _, key, _ in sparseconv.tune.get_tuner().cache.items(WGRAD)]
        assert len(keys) == 2 and sum(key.endswith("|det") for key in keys) == 1
        sparseconv.set_deterministic(False)
        back = {}
        _conv(x, weight, back)
        assert back == normal
    sparseconv.tune.reset()  # a new backend is timed by a new process (the memo keeps its choices)
    with fast_fake("fake_marked", deterministic=registry.always_deterministic):
        sparseconv.set_deterministic(True)
        marked = {}
        _conv(make_input(SUBMANIFOLD, 4, "cpu", dtype=torch.float32, n=300), weight, marked)
        assert set(marked.values()) == {"fake_marked"}


# ---------------------------------------------------------------- bitwise repeatable ------------

@contextlib.contextmanager
def chosen_algorithms():
    """Every (namespace, candidate id) the tuner runs inside the block."""
    chosen: list[tuple[str, str]] = []

    run = sparseconv.tune.run

    def spy(namespace, problem, pin, a, b, kernel_map, record=None, use=None):
        record = {} if record is None else record
        out = run(namespace, problem, pin, a, b, kernel_map, record, use)
        chosen.append((namespace, record[namespace]))
        return out

    sparseconv.tune.run = spy  # what ops.dispatch calls for every product
    try:
        yield chosen
    finally:
        sparseconv.tune.run = run


def _all_marked(chosen: list[tuple[str, str]]) -> bool:
    for namespace, candidate_id in chosen:
        name = candidate_id.split("[", 1)[0]
        backend = registry.get(name)
        params = next(p for p in backend.params_space
                      if sparseconv.tune.Candidate.of(name, p).id == candidate_id) if "[" in candidate_id else {}
        if not backend.deterministic(namespace, params):
            return False
    return True


def _conv_run(mode, coords, feats, weight_seed: int):
    torch.manual_seed(weight_seed)
    conv = make_conv(mode, feats.shape[1], 6, "cpu", dtype=feats.dtype)
    x = SparseTensor(coords, feats.clone().requires_grad_(), mode.input_stride)
    out = conv(x)
    (out.feats * torch.linspace(-1, 1, out.feats.numel()).view_as(out.feats)).sum().backward()
    return out.feats.detach(), x.feats.grad, conv.weight.grad, conv.bias.grad


@pytest.mark.parametrize("mode", [m for m in MODES if not m.transposed], ids=str)
def test_each_conv_mode_is_bitwise_repeatable_on_cpu(mode, monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")  # heuristic picks: no timing sweeps in CI
    sparseconv.set_deterministic(True)
    s = mode.input_stride
    coords = random_coords(300, 9, stride=(s, s, s), low=-5 * s)
    feats = torch.randn(len(coords), 5)
    with chosen_algorithms() as chosen:
        first = _conv_run(mode, coords, feats, 7)
        sparseconv.tune.reset()  # the second run decides again
        second = _conv_run(mode, coords, feats, 7)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert _all_marked(chosen)


@pytest.mark.parametrize("mode", [m for m in MODES if m.transposed], ids=str)
def test_each_transposed_conv_mode_is_bitwise_repeatable_on_cpu(mode, monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    sparseconv.set_deterministic(True)
    with chosen_algorithms() as chosen:
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            x = make_input(mode, 5, "cpu", dtype=torch.float32, n=300)
            x = x.replace(x.feats.clone().requires_grad_())
            conv = make_conv(mode, 5, 6, "cpu", dtype=torch.float32)
            out = conv(x)
            out.feats.square().sum().backward()
            runs.append((out.feats.detach(), x.feats.grad, conv.weight.grad))
            sparseconv.tune.reset()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert _all_marked(chosen)


def test_per_offset_pairs_meet_each_row_once_which_explicit_gemm_relies_on():
    for mode in MODES:
        x = make_input(mode, 3, "cpu", dtype=torch.float32, n=300)
        make_conv(mode, 3, 3, "cpu", dtype=torch.float32)(x)
        for kernel_map in x.cache.kernel_maps():
            for in_idx, out_idx in kernel_map.per_offset:
                assert in_idx.unique().numel() == in_idx.numel() and out_idx.unique().numel() == out_idx.numel(), mode


def minkunet_steps(device: str, dtype: torch.dtype, steps: int, n: int, seed: int = 0) -> tuple[list, list]:
    """(losses, final parameters) of ``steps`` SGD steps of a small MinkUNet from a seeded start."""
    torch.manual_seed(seed)
    coords = random_coords(n, 40, device=device)
    feats = torch.randn(len(coords), 4, device=device, dtype=dtype)
    labels = torch.randint(0, 5, (len(coords),), device=device)
    model = MinkUNet14(4, 5, width=0.25, stem_kernel_size=3).to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(SparseTensor(coords, feats))  # a new tensor: maps built again, as in training
        loss = torch.nn.functional.cross_entropy(out.feats.float(), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_minkunet_training_step_is_bitwise_repeatable_on_cpu(monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    sparseconv.set_deterministic(True)
    with chosen_algorithms() as chosen:
        first = minkunet_steps("cpu", torch.float32, 1, 500)
        sparseconv.tune.reset()
        second = minkunet_steps("cpu", torch.float32, 1, 500)
    assert chosen and _all_marked(chosen)
    assert all(torch.equal(a, b) for a, b in zip(first[0] + first[1], second[0] + second[1]))


# ---------------------------------------------------------------- on the GPU --------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_minkunet_training_steps_are_bitwise_repeatable_on_cuda(dtype):
    sparseconv.set_deterministic(True)
    with chosen_algorithms() as chosen:
        first = minkunet_steps("cuda", dtype, 2, 20000)
        sparseconv.tune.reset()  # the second run decides again, from the cache file
        second = minkunet_steps("cuda", dtype, 2, 20000)
    assert chosen and _all_marked(chosen), sorted(set(chosen))
    assert all(bool(torch.isfinite(loss)) for loss in first[0]), first[0]
    assert [float(x) for x in first[0]] == [float(x) for x in second[0]]
    assert all(torch.equal(a, b) for a, b in zip(first[0] + first[1], second[0] + second[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_every_deterministic_candidate_repeats_bitwise_on_cuda(dtype):
    """Each candidate of deterministic mode's auto pools, run three times on a dense map, gives
    the same bits (a race in a candidate marked deterministic shows here; explicit_gemm included)."""
    products = []

    def capture(namespace, problem, pin, a, b, kernel_map, record=None, use=None):
        products.append((namespace, problem, a, b, kernel_map))
        return registry.get("explicit_gemm").run(namespace, problem, {}, a, b, kernel_map)

    coords = random_coords(30000, 40, device="cuda")
    feats = torch.randn(len(coords), 64, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(27, 64, 64, device="cuda", dtype=dtype, requires_grad=True)
    run, sparseconv.tune.run = sparseconv.tune.run, capture  # what ops.dispatch calls for every product
    try:
        sparse_conv3d(SparseTensor(coords, feats), weight).feats.sum().backward()
    finally:
        sparseconv.tune.run = run
    assert sorted(p[0] for p in products) == sorted(NAMESPACES)
    for namespace, problem, a, b, kernel_map in products:
        for candidate in candidate_pool(namespace, problem, AlgoMode("auto", (), "test"), "quick", True):
            backend = registry.get(candidate.backend)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs = [backend.run(namespace, problem, candidate.params_dict, a, b, kernel_map) for _ in range(3)]
            assert all(torch.equal(runs[0], r) for r in runs[1:]), candidate.id
