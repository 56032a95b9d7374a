"""A child process of test_faults.py: ``python fault_worker.py ROLE CACHE_DIR [ARGS]``.

Roles: ``sweep MARKER`` tunes one key, then hangs in the second key's sweep after one candidate
(MARKER appears then) until a signal ends it; ``tune WORKER KEYS GO`` tunes KEYS keys of its own
once the file GO exists; ``scribble`` tunes with a Triton candidate that writes far out of
bounds on the GPU (the first run breaks the CUDA context, the second must skip it).
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import signal
import sys
import time


def main(role: str, cache_dir: str, *args: str) -> None:
    os.environ["SPARSECONV_CACHE_DIR"] = cache_dir
    # Candidates timed in the call that meets their key (where kernels compile in the background, a key's first
    # calls run a pick untimed: the scribbling candidate would be timed by a later call).
    os.environ["SPARSECONV_BACKGROUND_COMPILE"] = "0"
    # Python's own SIGINT handling, as in a terminal: a test run launched in the background by a
    # non-interactive shell inherits SIGINT ignored, and the SIGINT test's worker would never stop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO)  # the tuner's skip lines go to stderr, for a failing test to show
    import torch

    import sparseconv.tune
    from sparseconv import SparseTensor
    from sparseconv.ops import sparse_conv3d
    from sparseconv.backends import Backend, explicit, register
    from sparseconv.tune import budget, tuner

    # as tests/conftest.py's whole_sweeps: a key's sweep in the call that meets it
    tuner.TimingBudget = functools.partial(budget.TimingBudget, burst=1.0, per_call=None)

    device = "cuda" if role == "scribble" else "cpu"
    calls: list[str] = []

    def fake(name: str, before=None, heuristic: float = 0.0) -> Backend:
        def run(namespace, problem, params, a, b, kernel_map):
            calls.append(name)
            if before is not None:
                before(a)
            return explicit.run(namespace, problem, params, a, b, kernel_map)

        return Backend(name, frozenset({"AB_gather_scatter"}), run, heuristic=lambda problem: heuristic)

    def hang(a) -> None:
        pathlib.Path(args[0]).touch()
        time.sleep(120)

    register(fake("fake_quick", heuristic=1.0))  # first in every pool
    register(fake("fake_hang", hang))
    if role == "scribble":
        register(fake("fake_scribble", _scribble, heuristic=2.0))
    generator = torch.Generator().manual_seed(0)
    coords = torch.unique(torch.randint(0, 12, (200, 4), generator=generator), dim=0)
    coords[:, 0] = 0
    coords = torch.unique(coords, dim=0)
    x = SparseTensor(coords.to(device), torch.randn(len(coords), 4, generator=generator).to(device))

    def conv(c_out: int, algos: list[str]) -> str:
        record: dict[str, str] = {}
        sparse_conv3d(x, torch.randn(27, 4, c_out, device=device), fwd_algo=algos, record=record)
        return record["AB_gather_scatter"]

    if role == "sweep":
        conv(4, ["fake_quick", "explicit_gemm"])
        conv(8, ["fake_quick", "fake_hang"])
        raise AssertionError("the sweep was not interrupted")
    if role == "tune":
        worker, keys, go = int(args[0]), int(args[1]), pathlib.Path(args[2])
        pathlib.Path(f"{go}.ready-{worker}").touch()
        while not go.exists():  # all workers tune and exit together, after their imports
            time.sleep(0.005)
        # Every key timed and stored: on a loaded machine (three workers on two cores) the timing budget ran out
        # before a worker's last key, which then ran untimed and was never stored (CI, 2026-12-01).
        with sparseconv.tune.get_tuner().budget.waived():
            for i in range(keys):
                conv(2 + worker * keys + i, ["fake_quick", "explicit_gemm"])
        return
    if role == "scribble":
        print("choice", conv(4, ["fake_scribble", "explicit_gemm"]), "calls", calls.count("fake_scribble"), flush=True)
        return
    raise ValueError(f"unknown role {role!r}")


def _scribble(a) -> None:
    """Store one float ~4 TB past ``a``: an illegal address, which breaks the CUDA context."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_far(pointer, distance):
        tl.store(pointer + distance, 1.0)

    store_far[(1,)](a, 1 << 40)


if __name__ == "__main__":
    main(*sys.argv[1:])
