import functools
import importlib.util
import os
import secrets
from pathlib import Path

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

if not torch.cuda.is_available():
    # Triton's interpreter runs the GPU kernels on the CPU, so CI catches their logic errors.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_tuner(tmp_path, monkeypatch):
    """Each test tunes into its own cache file and starts with no in-process choices."""
    import sparseconv.tune

    for variable in ("SPARSECONV_FWD_ALGO_MODE", "SPARSECONV_DGRAD_ALGO_MODE", "SPARSECONV_WGRAD_ALGO_MODE",
                     "SPARSECONV_AUTOTUNE_EFFORT", "SPARSECONV_AUTOTUNE_LOG", "SPARSECONV_DETERMINISTIC"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tmp_path / "sparseconv-cache"))
    # Tests see what they tune, not the package's shipped GPU tunings (tests/tune/test_shipped.py turns them on).
    monkeypatch.setenv("SPARSECONV_SHIPPED_TUNINGS", "0")
    sparseconv.tune.reset()
    yield
    sparseconv.tune.reset()


@pytest.fixture(autouse=True)
def whole_sweeps(monkeypatch):
    """The tuner of a test times a key's sweep in the call that meets it, with a second of timing at once (as before
    sweeps were spread over calls): the tests of what it decides see the decision in one call. tests/tune/
    test_spread.py checks the process's defaults (a few candidates a call); a test that builds a TimingBudget
    itself gets those defaults."""
    from sparseconv.tune import budget, tuner

    monkeypatch.setattr(tuner, "TimingBudget", functools.partial(budget.TimingBudget, burst=1.0, per_call=None))


@pytest.fixture
def clock(monkeypatch):
    """The tuner's timer on a virtual clock (tests/tune/fakes.py: VirtualClock), which the fakes of the tuner's tests
    advance: their costs are exact. (Real sleeps 4 ms apart were not: on a busy 2-core CI machine a slower level
    was now and then timed the faster.)"""
    from fakes import VirtualClock

    from sparseconv.tune import timing

    virtual = VirtualClock()
    monkeypatch.setattr(timing, "clock", virtual)
    return virtual


@pytest.fixture(autouse=True)
def fresh_map_plans(monkeypatch):
    """Each test starts with no planned kernel maps (coords/plan.py remembers a device's last batches:
    a test's maps must not depend on which tests ran before it); its own batches still plan."""
    from sparseconv.coords import plan

    monkeypatch.delenv("SPARSECONV_PLAN_MAPS", raising=False)
    monkeypatch.setattr(plan, "_history", {})
    monkeypatch.setattr(plan, "_failed", set())
    monkeypatch.setattr(plan, "_trained", {})


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs on every run; the seed is printed with a failure to reproduce it."""
    seed = secrets.randbits(31)
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    return seed


@pytest.fixture(autouse=True)
def view_gate(monkeypatch):
    """Tests launch the view kernels (pair counts and lists, the fused norm) in the call, as without
    background compiles: a test calling a view builder gets its kernel's result, not None while it
    compiles in a worker. Returns the real gate (compiling.kernel_ready, which triton_launch.launch_ready
    asks), for the tests of that gate."""
    from sparseconv.backends import compiling

    gate = compiling.kernel_ready
    monkeypatch.setattr(compiling, "kernel_ready", lambda *args: True)
    return gate


@pytest.fixture(params=[False, True], ids=["one_launch", "cpu_parts"])
def cpu_query_parts(request, monkeypatch):
    """Run twice: as is, then with every CPU hash-table query split into row ranges on three threads at once
    (sparseconv.coords.hashing._cpu_chunks, whose size floor keeps the small sets of tests in one launch)."""
    if not request.param:
        yield False
        return
    from sparseconv.coords import hashing

    monkeypatch.setattr(hashing, "CPU_CHUNK_LOOKUPS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        yield True
    finally:
        torch.set_num_threads(threads)
