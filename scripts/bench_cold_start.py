"""Cold start of a whole network: the first training steps of a fresh process, ours beside the peers.

Each configuration runs in a process of its own with empty tuning and Triton caches (a temporary
SPARSECONV_CACHE_DIR and TRITON_CACHE_DIR; the shipped tunings stay unless --no-shipped), and
trains the benchmark MinkUNet (scripts/bench_network.py) on new coordinates every step for
--seconds, at least --steps steps. Printed per configuration, one table:

  first step        wall time of the first training step (Warp start-up, tuning, compiling)
  steady after      when the steps settle: the end of the first step after which every step
                    is within 25% of the steady step
  steps in Ns       training steps done within the first --seconds
  steady step       median of the last five steps, milliseconds
  compiles left     ours: products (and map views) whose kernels were queued for a background
                    compile and that have not run them yet, after the first step
  free GB           the GPU's free memory after the last step (background compile workers
                    must not hold GPU memory)
  settled step ms   after those steps, once the background compiles are done (ours) and three
                    more steps ran: median of ten steps, milliseconds
  settled GPU ms    the kernels' time in one such step (torch.profiler): what the choices cost
                    on the GPU, without the host's noise

Configurations: ``ours`` (default: a decided layer runs the reference while its kernels compile
in the background), ``ours_blocking`` (SPARSECONV_BACKGROUND_COMPILE=0: compile in the call),
``ours_full`` (the fully tuned reference: every candidate of every pool timed, compiled in the
call, no shipped tunings), ``naive`` (every product pinned to explicit_gemm), and the peers in
--peers.

    python scripts/bench_cold_start.py --scene street1 --dtype float16 --peers spconv
    python scripts/bench_cold_start.py --device cpu --dtype float32 --scale 0.05 --seconds 5 --peers   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OURS = {"ours": {}, "ours_blocking": {"SPARSECONV_BACKGROUND_COMPILE": "0"},
        "ours_full": {"SPARSECONV_AUTOTUNE_EFFORT": "full", "SPARSECONV_BACKGROUND_COMPILE": "0",
                      "SPARSECONV_SHIPPED_TUNINGS": "0"}}


def child(args) -> None:
    """One configuration in this (fresh) process: print the step times as one JSON line."""
    import torch

    from sparseconv.cli.bench import Runner, gpu_ms, scene_coords, sync

    device = torch.device(args.device)
    name = "ours" if args.config in OURS else args.config
    start = time.perf_counter()
    coords = scene_coords(args.scene, args.scale).to(device)
    runner = Runner(name, coords, getattr(torch, args.dtype), device)
    setup, steps, pending = time.perf_counter() - start, [], None
    while not steps or (time.perf_counter() - start < args.seconds or len(steps) < args.steps):
        begin = time.perf_counter()
        runner.step()
        sync(device)
        steps.append(time.perf_counter() - begin)
        if pending is None and name == "ours":
            import sparseconv.tune

            pending = sparseconv.tune.get_tuner().compiling()
    free_gb = torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else None
    if name == "ours":
        import sparseconv.tune

        sparseconv.tune.wait_for_compiles(args.timeout / 4)
    for _ in range(3):  # choices whose kernels compiled meanwhile run from here
        runner.step()
    settled = []
    for _ in range(10):
        begin = time.perf_counter()
        runner.step()
        sync(device)
        settled.append(time.perf_counter() - begin)
    print(json.dumps({"setup_s": setup, "steps": steps, "pending": pending, "free_gb": free_gb,
                      "settled_ms": 1e3 * statistics.median(settled), "gpu_ms": gpu_ms(runner.step, device)}))


def run_config(config: str, args) -> dict:
    env = dict(os.environ, **OURS.get(config, {}))
    with tempfile.TemporaryDirectory() as tmp:
        env.update(SPARSECONV_CACHE_DIR=os.path.join(tmp, "sc"), TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        if not args.shipped:
            env["SPARSECONV_SHIPPED_TUNINGS"] = "0"
        command = [sys.executable, os.path.abspath(__file__), "--child", config, "--scene", args.scene,
                   "--dtype", args.dtype, "--device", args.device, "--scale", str(args.scale),
                   "--seconds", str(args.seconds), "--steps", str(args.steps)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within --timeout {args.timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[:200]}
    result = json.loads(lines[-1])
    if done.returncode:  # the steps ran, the process did not end cleanly: say so beside them
        result["exit"] = f"exit code {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:80]}"
    return result


def summary(result: dict, seconds: float) -> list[str]:
    if "error" in result:
        return ["failed: " + result["error"], "", "", "", "", "", "", ""]
    steps = result["steps"]
    steady = statistics.median(steps[-5:])
    settled = next(i for i in range(len(steps)) if all(s <= 1.25 * steady for s in steps[i + 1:]))
    ends = [sum(steps[: i + 1]) for i in range(len(steps))]
    within = sum(1 for end in ends if end <= seconds)
    pending = result.get("pending")
    return [f"{steps[0]:.2f} s", f"{ends[settled]:.1f} s (step {settled + 1})", str(within), f"{1e3 * steady:.1f}",
            ("-" if pending is None else str(pending)) + (f" ({result['exit']})" if "exit" in result else ""),
            "-" if result.get("free_gb") is None else f"{result['free_gb']:.1f}", f"{result['settled_ms']:.1f}",
            result["gpu_ms"] if isinstance(result["gpu_ms"], str) else f"{result['gpu_ms']:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scene", default="street1")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="train at least this long per configuration")
    parser.add_argument("--steps", type=int, default=10, help="and at least this many steps")
    parser.add_argument("--configs", nargs="+", default=["ours", "ours_blocking", "naive"])
    parser.add_argument("--peers", nargs="*", default=["spconv"])
    parser.add_argument("--no-shipped", dest="shipped", action="store_false", help="SPARSECONV_SHIPPED_TUNINGS=0")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per configuration")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.config = args.child
        return child(args)
    rows = [(config, summary(run_config(config, args), args.seconds)) for config in [*args.configs, *args.peers]]
    print(f"\nCold start, {args.scene} x{args.scale:g}, {args.dtype}, {args.device}, shipped tunings "
          f"{'on' if args.shipped else 'off'}, empty tuning and Triton caches, new coordinates every step")
    header = ["library", "first step", "steady after", f"steps in {args.seconds:g} s", "steady step ms",
              "compiles left", "free GB", "settled step ms", "settled GPU ms"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for config, cells in rows:
        print("| " + " | ".join([config, *cells]) + " |")


if __name__ == "__main__":
    main()
