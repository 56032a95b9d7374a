"""Faults in a sweep: failing, out-of-memory and far too slow candidates, compiler output, signals,
processes sharing a cache, and a candidate that breaks the CUDA context."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import ROOT
from conv_cases import MODES, make_input
from fakes import Calls, fast, registered
from test_cache import python, read_file

import sparseconv.tune
from sparseconv.ops import sparse_conv3d
from sparseconv.backends import Backend, explicit
from sparseconv.tune import faults
from sparseconv.tune.cache import TuneCache
from sparseconv.tune.timing import Timer, TimingPlan, TooSlow

FWD = "AB_gather_scatter"
WORKER = Path(__file__).with_name("fault_worker.py")
# Children import this checkout's sparseconv, whatever is installed.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
DUMP = "=== PTX reproducer: please share the reproducer above ==="


_INPUT_SEED = int(torch.randint(0, 2**31 - 1, ()))
"""New each run, the same for every call of a run: a test that expects a second call to find the
first one's timings needs the same tune key (row counts and density of one random input)."""


def conv(c_out: int = 5, **pins) -> dict[str, str]:
    """Runs a forward conv under ``pins``, checks it against explicit_gemm, returns what ran."""
    with torch.random.fork_rng():
        torch.manual_seed(_INPUT_SEED)
        x = make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=200)
    weight = torch.randn(27, 4, c_out)
    record: dict[str, str] = {}
    out = sparse_conv3d(x, weight, record=record, **pins)
    torch.testing.assert_close(out.feats, sparse_conv3d(x, weight, fwd_algo="explicit_gemm").feats)
    return record


def raising(calls: Calls, name: str, error: Exception, noisy: bool = False) -> Backend:
    """Raises ``error`` on every call; ``noisy``: first writes a compiler-like dump to both descriptors."""

    def run(namespace, problem, params, a, b, kernel_map):
        calls.add(name, namespace)
        if noisy:
            print(DUMP)
            os.write(2, f"{DUMP} (fd 2)\n".encode())
            subprocess.run([sys.executable, "-c", f"print({DUMP!r})"], check=True)  # a child compiler
        raise error

    return Backend(name, frozenset({FWD}), run, params_space=({"tile": 64},))


def skip_lines(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sparseconv.tune" and name in r.getMessage()]


def stored(name: str) -> dict:
    """The timing records of candidate ``name`` in the cache file, read back by a fresh cache."""
    sparseconv.tune.reset()
    path = sparseconv.tune.get_tuner().cache.path
    records = [t for _, _, entry in TuneCache(path).items(FWD) for cid, t in entry["timings"].items() if name in cid]
    assert records, f"no timing of {name} in {path}"
    return records[-1]


def test_a_failing_candidate_is_one_log_line_and_its_compiler_output_never_reaches_the_terminal(caplog, capfd):
    calls = Calls()
    error = RuntimeError("PTXAS error: Internal Triton PTX codegen error\n`ptxas` stderr:\nptxas fatal: bad\n" + DUMP)
    with registered(raising(calls, "fake_broken", error, noisy=True), fast(calls)):
        with caplog.at_level(logging.INFO, logger="sparseconv"):
            first = conv(5, fwd_algo=["fake_broken", "fake_fast"])
            second = conv(6, fwd_algo=["fake_broken", "fake_fast"])  # another key: the same candidate fails again
    assert first[FWD] == second[FWD] == "fake_fast" and calls.of("fake_broken") == 2
    lines = skip_lines(caplog, "fake_broken")
    assert [r.levelno for r in lines] == [logging.WARNING, logging.INFO]  # one warning a process, then quiet
    message = lines[0].getMessage()
    assert "fake_broken[tile=64]" in message and "RuntimeError: PTXAS error: Internal Triton PTX codegen error" in message
    assert "\n" not in message and "ptxas fatal" not in message
    terminal = capfd.readouterr()
    assert DUMP not in terminal.out + terminal.err
    assert stored("fake_broken")["verdict"] == "failed"


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nOf the allocated memory ..."),
    RuntimeError("CUDA error: out of memory"),
], ids=["OutOfMemoryError", "RuntimeError"])
def test_a_candidate_out_of_memory_is_skipped_and_the_run_goes_on(error, caplog):
    calls = Calls()
    assert faults.is_out_of_memory(error) and not faults.is_out_of_memory(RuntimeError("shape mismatch"))
    with registered(raising(calls, "fake_hungry", error), fast(calls)):
        with caplog.at_level(logging.INFO, logger="sparseconv"):
            record = conv(fwd_algo=["fake_hungry", "fake_fast"])
    assert record[FWD] == "fake_fast"
    [line] = skip_lines(caplog, "fake_hungry")
    assert "out of memory" in line.getMessage() and "\n" not in line.getMessage()


def test_a_far_too_slow_candidate_is_stopped_after_two_timed_calls(monkeypatch, caplog):
    calls = Calls()

    def crawl(namespace, problem, params, a, b, kernel_map):
        calls.add("fake_crawl", namespace)
        time.sleep(0.05)
        return explicit.run(namespace, problem, params, a, b, kernel_map)

    # The limit comes from the reference's time, which a loaded machine moves: fix it here.
    monkeypatch.setattr(faults, "time_limit_ms", lambda reference_ms: 20.0)
    with registered(Backend("fake_crawl", frozenset({FWD}), crawl), fast(calls)):
        with caplog.at_level(logging.INFO, logger="sparseconv"):
            conv(fwd_algo=["fake_crawl", "fake_fast"])  # right result: the run went on
    assert calls.of("fake_crawl") == 3  # the guard's call and two timed calls, not the plan's 1 + 5
    [line] = skip_lines(caplog, "fake_crawl")
    assert line.levelno == logging.INFO and "over the limit of 20.0 ms" in line.getMessage()
    assert stored("fake_crawl")["verdict"] == "slow"


def test_timer_stops_at_the_limit_and_times_fully_without_one():
    runs = []

    def nap():
        runs.append(1)
        time.sleep(0.03)

    timer = Timer(torch.device("cpu"), TimingPlan(warmup=1, repeats=3, flush_l2=False, min_repeats=3))
    with pytest.raises(TooSlow) as raised:
        timer.measure(nap, limit_ms=10.0)
    assert len(runs) == 2 and raised.value.args[0] >= 30.0 and raised.value.args[1] == 10.0
    assert timer.measure(nap)[1] == 3 and len(runs) == 2 + 1 + 3
    assert timer.measure(nap, limit_ms=1e6)[1] == 3 and len(runs) == 6 + 1 + 3  # the check's call is the warm-up
    assert faults.time_limit_ms(2.0) == faults.SLOW_FACTOR * 2.0 + faults.SLOW_FLOOR_MS


def test_captured_output_holds_what_python_c_and_children_write(capfd):
    with faults.captured_output() as captured:
        print("from python")
        print("to stderr", file=sys.stderr)
        os.write(1, b"from fd 1\n")
        os.write(2, b"from fd 2\n")
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('from a child')"], check=True)
    print("after")
    for text in ("from python", "to stderr", "from fd 1", "from fd 2", "from a child"):
        assert text in captured.text
    terminal = capfd.readouterr()
    assert terminal.out == "after\n" and terminal.err == ""


ILLEGAL = "CUDA error: an illegal memory access was encountered"


def test_a_candidate_that_breaks_the_cuda_context_stops_the_run_with_what_to_do(monkeypatch):
    calls = Calls()
    broken: list[bool] = []

    def scribble(namespace, problem, params, a, b, kernel_map):
        calls.add("fake_scribble", namespace)
        broken.append(True)
        raise RuntimeError(f"{ILLEGAL}\nCUDA kernel errors might be asynchronously reported")

    # On the GPU the probe's own CUDA call fails after an illegal address; here a fake says so.
    monkeypatch.setattr(faults, "probe", lambda device: RuntimeError(ILLEGAL) if broken else None)
    backend = Backend("fake_scribble", frozenset({FWD}), scribble, heuristic=lambda problem: 1.0)
    with registered(backend, fast(calls)):
        with pytest.raises(faults.CudaContextPoisoned) as raised:
            conv(fwd_algo=["fake_scribble", "fake_fast"])
        message = str(raised.value)
        for part in ("fake_scribble", FWD, ILLEGAL, "Restart the process", "fwd_algo='explicit_gemm'",
                     "SPARSECONV_FWD_ALGO_MODE=explicit_gemm", "recorded as failed"):
            assert part in message, (part, message)
        assert "broke the CUDA context" in stored("fake_scribble")["reason"]

        # The next process (a fresh tuner on the same file) skips it; the context is fine there.
        broken.clear()
        assert conv(fwd_algo=["fake_scribble", "fake_fast"])[FWD] == "fake_fast"
        assert calls.of("fake_scribble") == 1

        # A chosen candidate that breaks the context later says so too, instead of falling back.
        broken.append(True)
        with pytest.raises(faults.CudaContextPoisoned, match="Restart the process"):
            conv(fwd_algo="fake_scribble")


def cache_entries(cache_dir: Path) -> dict:
    doc = msgpack.unpackb((cache_dir / "autotune.msgpack").read_bytes(), raw=False)
    return doc["entries"]


def timed(entry: dict) -> set[str]:
    return {cid.split("[", 1)[0] for cid, t in entry["timings"].items() if t["verdict"] == "ok"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_sweep_keeps_every_timing_measured_and_a_valid_file(tmp_path, signum):
    marker, cache_dir = tmp_path / "hanging", tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, str(WORKER), "sweep", str(cache_dir), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the worker never reached the hanging candidate"
            time.sleep(0.02)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signum, stderr  # it still dies by the signal, as it would without us
    entries = cache_entries(cache_dir)[FWD]
    # The finished key, and the interrupted sweep's finished candidate; not the one cut off.
    assert sorted(sorted(timed(e)) for e in entries.values()) == [["explicit_gemm", "fake_quick"], ["fake_quick"]], stderr
    assert not any("fake_hang" in cid for e in entries.values() for cid in e["timings"])
    assert not list(cache_dir.glob(".*.tmp"))


def test_processes_tuning_into_one_cache_dir_lose_no_entry(tmp_path):
    cache_dir, go, workers, keys = tmp_path / "cache", tmp_path / "go", 3, 4
    procs = [subprocess.Popen([sys.executable, str(WORKER), "tune", str(cache_dir), str(w), str(keys), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV) for w in range(workers)]
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{go}.ready-{w}").exists() for w in range(workers)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.02)
        go.touch()
        for p in procs:
            _, stderr = p.communicate(timeout=90)
            assert p.returncode == 0, stderr
    finally:
        for p in procs:
            p.kill()
    entries = cache_entries(cache_dir)[FWD]
    assert len(entries) == workers * keys  # every key of every process (they differ in C_out)
    assert all(timed(e) == {"explicit_gemm", "fake_quick"} for e in entries.values()), entries


SIGNAL_MID_WRITE = """
    import os, signal, sys, time
    cache = TuneCache(sys.argv[1], flush_interval_s=3600)
    cache.install_exit_hooks()
    for i in range(5):
        cache.put("ns", f"k{i}", {"evidence": 1, "updated": time.time()})  # the first put writes k0
    assert cache.wait_for_writes(30)  # (on the writer thread: done before the patch below)
    write = module.write_entries

    def interrupted(path, entries):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, before the new file is in place
        write(path, entries)

    module.write_entries = interrupted
    cache.flush(force=True)
    raise AssertionError("SIGTERM did not end the process")
"""


def test_sigterm_in_the_middle_of_a_write_lets_it_finish_then_dies(tmp_path):
    path = tmp_path / "cache.msgpack"
    result = subprocess.run(python(SIGNAL_MID_WRITE, str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert set(read_file(path)["ns"]) == {f"k{i}" for i in range(5)}


@pytest.mark.gpu
def test_an_illegal_address_in_a_candidate_gives_the_clear_error_then_is_skipped_on_restart(tmp_path):
    pytest.importorskip("triton")
    argv = [sys.executable, str(WORKER), "scribble", str(tmp_path / "cache")]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=CHILD_ENV)
    assert first.returncode != 0, first.stdout
    for part in ("CudaContextPoisoned", "fake_scribble", "illegal memory access", "Restart the process",
                 "SPARSECONV_FWD_ALGO_MODE"):
        assert part in first.stderr, (part, first.stderr[-3000:])
    [entry] = cache_entries(tmp_path / "cache")[FWD].values()
    assert "broke the CUDA context" in entry["timings"]["fake_scribble"]["reason"]
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=CHILD_ENV)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "choice explicit_gemm calls 0" in second.stdout.splitlines(), second.stdout  # Warp prints to stdout too
