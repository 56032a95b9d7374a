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
  timing ms         ours: the tuner's timing of candidates inside those ten steps, per step (what
                    the settled step pays for keys still to time)
  settled GPU ms    the kernels' time in one such step (torch.profiler), ours' timing budget
                    closed for it: what the choices cost on the GPU, without the host's noise or
                    the candidates the tuner would time in that step

Configurations: ``ours`` (default: a decided layer runs the reference while its kernels compile
in the background), ``ours_blocking`` (SPARSECONV_BACKGROUND_COMPILE=0: compile in the call),
``ours_full`` (the fully tuned reference: every candidate of every pool timed, compiled in the
call, no shipped tunings), ``naive`` (every product pinned to explicit_gemm), and the peers in
--peers.

    python scripts/bench_cold_start.py --scene street1 --dtype float16 --peers spconv
    python scripts/bench_cold_start.py --device cpu --dtype float32 --scale 0.05 --seconds 5 --peers   # dry run

``--unseen N`` trains on a data set of N unseen clouds instead (new layouts and sizes, cycled, the same clouds in
every configuration's process), and the settled GPU ms is the mean over its first clouds' steps; beside
``ours_full`` it prints each configuration's settled GPU time over the fully tuned network's (how close the
default tuning gets within --steps steps), the tuner's progress at the end and the kernels of most GPU time in a
settled step. ``--full-on-eval`` has ours_full train on those first clouds alone (fully tuned on what is measured).

    python scripts/bench_cold_start.py --scene street1 --unseen 24 --steps 200 --seconds 0 --configs ours ours_full --peers

With ``--passes`` it runs instead a new user's first minutes, one fresh process per library (empty
tuning, Triton, Warp and CuPy caches unless --warm-compilers): import torch, import the library, the
first inference on one unseen cloud, the first training step on another, 20 inferences on further
unseen clouds (the largest against the steady pass: ours after its background compiles finished),
then a second scene's first inference and step (--second-scene). For ours, a second table says where
each of those passes spent its seconds (cli.probes.PHASES: Warp and Triton builds, tuning, ...), and a
line when its background compiles ended (seconds after the first inference began). ``--window S`` goes on
inferring on unseen clouds for S seconds after the 20 and prints their median per 2 s since the first
inference began: how soon the passes reach the steady one while the compiles run.

    python scripts/bench_cold_start.py --passes --scene street1 --second-scene street4 --dtype float16 --peers spconv
    python scripts/bench_cold_start.py --passes --window 16 --scene street1 --dtype float16 --peers spconv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

    from sparseconv.cli.bench import Runner, gpu_ms, scene_coords, sync, unseen_clouds

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = "ours" if args.config in OURS else args.config
    start = time.perf_counter()
    # --unseen: a data set of that many clouds, the same in every configuration's process (the same seeds)
    clouds = unseen_clouds(args.scene, args.unseen, dtype, device, args.scale) if args.unseen else []
    if args.config == "ours_full" and args.full_on_eval:
        clouds = clouds[:EVAL]  # what the settled GPU ms is measured on, each fully tuned
    coords = clouds[0].coords if clouds else scene_coords(args.scene, args.scale).to(device)
    runner = Runner(name, coords, dtype, device)
    setup, steps, pending = time.perf_counter() - start, [], None

    def step(index: int) -> None:
        if clouds:
            runner.use(clouds[index % len(clouds)])
        runner.step()

    while not steps or (time.perf_counter() - start < args.seconds or len(steps) < args.steps):
        begin = time.perf_counter()
        step(len(steps))
        sync(device)
        steps.append(time.perf_counter() - begin)
        if pending is None and name == "ours":
            import sparseconv.tune

            pending = sparseconv.tune.get_tuner().compiling()
    free_gb = torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else None
    if name == "ours":
        import sparseconv.tune

        sparseconv.tune.wait_for_compiles(args.timeout / 4)
    for index in range(3):  # choices whose kernels compiled meanwhile run from here
        step(len(steps) + index)
    settled, timed_before = [], timed_s(name)
    for index in range(10):
        begin = time.perf_counter()
        step(len(steps) + 3 + index)
        sync(device)
        settled.append(time.perf_counter() - begin)
    result = {"setup_s": setup, "steps": steps, "pending": pending, "free_gb": free_gb,
              "settled_ms": 1e3 * statistics.median(settled),
              "timing_ms": 1e3 * (timed_s(name) - timed_before) / len(settled)}
    if clouds and name == "ours":
        import sparseconv.tune

        result["progress"] = sparseconv.tune.progress()._asdict()
    with untimed(name) as closed:
        # The kernels' time of a step: on the first EVAL clouds of the data set with --unseen (every configuration
        # the same ones), their mean; what the choices cost, without the candidates the tuner would time inside
        # these steps (their runs, flushes and references; the timing's share of a step is timing_ms).
        gpu = [gpu_ms(functools.partial(step, index), device) for index in range(min(len(clouds), EVAL) or 1)]
        result["gpu_ms"] = gpu[0] if isinstance(gpu[0], str) else statistics.mean(gpu)
        if clouds and device.type == "cuda":  # where that GPU time goes
            from sparseconv.cli.probes import gpu_busy

            by_kernel = gpu_busy(functools.partial(step, 0), passes=1)["by kernel"]
            kernels = sorted(([name, *cost] for name, cost in by_kernel.items()), key=lambda kernel: -kernel[2])
            result["kernels"] = kernels[:KERNELS]
    result["timed_in_gpu_s"] = closed.spent_s if closed is not None else 0.0  # keys timed though it was closed
    print(json.dumps(result))


def timed_s(name: str) -> float:
    """Seconds ours' tuner has spent timing candidates inside calls so far (0 for the others)."""
    if name != "ours":
        return 0.0
    import sparseconv.tune

    return sparseconv.tune.progress().timed_s


@contextlib.contextmanager
def untimed(name: str):
    """Ours' tuner times nothing inside the block: its timing budget is closed (a key met there runs its pick or
    stand-in untimed, as when the budget is spent), so a step's GPU time is its choices' alone. Yields that closed
    budget (its ``spent_s``: what was timed inside anyway), None for the others."""
    if name != "ours":
        yield None
        return
    import sparseconv.tune
    from sparseconv.tune.budget import TimingBudget

    tuner = sparseconv.tune.get_tuner()
    budget, tuner.budget = tuner.budget, TimingBudget(share=0.0, burst=0.0)
    try:
        yield tuner.budget
    finally:
        tuner.budget = budget


KERNELS = 10
"""--unseen: the kernels of most GPU time in a settled step on the first cloud, printed per configuration."""


EVAL = 6
"""--unseen: the clouds whose steps' GPU time is the settled GPU ms."""


def passes_child(args) -> None:
    """``--passes`` in this fresh process: print the passes' times (and ours' phases) as one JSON line."""
    start = time.perf_counter()
    import torch
    imported_torch = time.perf_counter() - start
    start = time.perf_counter()
    name = "ours" if args.config in OURS else args.config
    if name in ("ours", "naive"):
        import sparseconv  # noqa: F401
    from sparseconv.cli.anchors import import_anchor
    from sparseconv.cli.bench import Runner, sync, unseen_clouds
    from sparseconv.cli.probes import phase_seconds
    if name not in ("ours", "naive"):
        import_anchor(name)
    imported = time.perf_counter() - start
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    clouds = unseen_clouds(args.scene, 22, dtype, device, args.scale)
    second = unseen_clouds(args.second_scene, 2, dtype, device, args.scale, first_seed=2000)
    start = time.perf_counter()
    runner = Runner(name, clouds[0].coords, dtype, device)
    sync(device)
    built = time.perf_counter() - start
    passes, phases = {}, {}

    def measured(label: str, cloud, kind: str) -> None:
        runner.use(cloud)
        passes[label], phases[label] = phase_seconds(lambda: (getattr(runner, kind)(), sync(device)))

    began, compiles_done = time.perf_counter(), None
    measured("first inference", clouds[0], "infer")
    measured("first step", clouds[1], "step")
    after, after_phases = [], []
    for cloud in clouds[2:]:
        runner.use(cloud)
        wall, seconds = phase_seconds(lambda: (runner.infer(), sync(device)))
        after.append(wall)
        after_phases.append(seconds)
    worst = max(range(len(after)), key=after.__getitem__)
    tuning = sparseconv.tune.progress()._asdict() if name == "ours" else None  # after the 20 passes
    passes[f"worst of next 20 (#{worst + 1})"], phases[f"worst of next 20 (#{worst + 1})"] = after[worst], after_phases[worst]

    def inference(cloud) -> tuple[float, float]:
        """(when it began, seconds after the first inference began; its seconds)"""
        runner.use(cloud)
        begin = time.perf_counter()
        runner.infer()
        sync(device)
        return begin - began, time.perf_counter() - begin

    running = name == "ours" and not sparseconv.tune.wait_for_compiles(0)  # after the 20 passes
    window = []  # --window's inferences
    started = time.perf_counter()
    while time.perf_counter() - started < args.window:
        window.append(inference(clouds[2 + len(window) % (len(clouds) - 2)]))
    if name == "ours":
        compiled = sparseconv.tune.wait_for_compiles(args.timeout / 4)
        compiles_done = (time.perf_counter() - began, running) if compiled else None
    steady = [inference(cloud)[1] for cloud in clouds[2:12]]
    measured("new scene inference", second[0], "infer")
    measured("new scene step", second[1], "step")
    print(json.dumps({"import torch": imported_torch, "import": imported, "model": built, "passes": passes,
                      "tuning": tuning, "compiles done": compiles_done,
                      "phases": phases, "after": after, "steady": statistics.median(steady), "window": window}))


def passes_table(results: dict[str, dict], args) -> None:
    """The ``--passes`` tables: per library the passes, then ours' phases per pass."""
    print(f"\nA new user's first passes, {args.scene} then {args.second_scene} x{args.scale:g}, {args.dtype}, "
          f"{args.device}, one fresh process each, compiler caches {'warm' if args.warm_compilers else 'empty'}, "
          f"shipped tunings {'on' if args.shipped else 'off'}; seconds unless said")
    header = ["library", "import torch", "import", "first inference", "first step", "next 20 inferences: worst / steady ms",
              "new scene inference", "new scene step"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, result in results.items():
        if "error" in result:
            print(f"| {name} | failed: {result['error']} |")
            continue
        passes = result["passes"]
        worst, steady = 1e3 * max(result["after"]), 1e3 * result["steady"]
        cells = [f"{result['import torch']:.2f}", f"{result['import']:.2f}", f"{passes['first inference']:.2f}",
                 f"{passes['first step']:.2f}", f"{worst:.0f} / {steady:.1f} ({worst / steady:.1f}x)",
                 f"{passes['new scene inference']:.2f}", f"{passes['new scene step']:.2f}"]
        print("| " + " | ".join([name, *cells]) + " |")
    for name, result in results.items():
        if name not in OURS or "error" in result:
            continue
        labels = list(result["passes"])
        print(f"\n{name}: where each pass's seconds went (time inside the phase's functions; phases nest; "
              "background workers not seen)")
        print("| phase | " + " | ".join(labels) + " |\n|" + "---|" * (len(labels) + 1))
        print("| wall | " + " | ".join(f"{result['passes'][label]:.2f}" for label in labels) + " |")
        for phase in result["phases"][labels[0]]:
            print(f"| {phase} | " + " | ".join(f"{result['phases'][label][phase]:.2f}" for label in labels) + " |")
        tuning = result["tuning"]
        print(f"\n{name}: the next 20 inferences, ms: " + " ".join(f"{1e3 * s:.0f}" for s in result["after"])
              + f"; after them the tuner had {tuning['settled']} products tuned, {tuning['untimed']} running a pick "
              f"untimed, {tuning['compiling']} waiting for background compiles, {tuning['timed_s']:.2f} s timed in calls")
        if result["window"]:
            print(f"{name}: {window_line(result['window'])}")
        done = result["compiles done"]
        if done is None:
            print(f"{name}: the background compiles had not ended by the wait's timeout")
        elif done[1]:
            print(f"{name}: the background compiles ended {done[0]:.1f} s after the first inference began")
        else:
            print(f"{name}: no background compile was left after the 20 inferences ({done[0]:.1f} s after the first "
                  "inference began)")


def window_line(window: list) -> str:
    """``--window``'s passes: how many, and their median ms per 2 s of the time since the first inference began."""
    buckets: dict[int, list[float]] = {}
    for at, seconds in window:
        buckets.setdefault(int(at // 2), []).append(1e3 * seconds)
    spans = " ".join(f"{2 * k}-{2 * k + 2} s: {statistics.median(v):.0f}" for k, v in sorted(buckets.items()))
    return (f"{len(window)} inferences on unseen clouds after those 20 ({window[-1][0] + window[-1][1] - window[0][0]:.1f}"
            f" s), median ms by the time since the first inference began: {spans}")


def run_config(config: str, args) -> dict:
    env = dict(os.environ, **OURS.get(config, {}))
    with tempfile.TemporaryDirectory() as tmp:
        env["SPARSECONV_CACHE_DIR"] = os.path.join(tmp, "sc")
        if not (args.passes and args.warm_compilers):
            env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        if args.passes and not args.warm_compilers:  # a fresh machine: Warp's kernel cache and CuPy's too
            env.update(WARP_CACHE_PATH=os.path.join(tmp, "warp"), CUPY_CACHE_DIR=os.path.join(tmp, "cupy"))
        if not args.shipped:
            env["SPARSECONV_SHIPPED_TUNINGS"] = "0"
        command = [sys.executable, os.path.abspath(__file__), "--child", config, "--scene", args.scene,
                   "--dtype", args.dtype, "--device", args.device, "--scale", str(args.scale),
                   "--seconds", str(args.seconds), "--steps", str(args.steps), "--second-scene", args.second_scene,
                   "--timeout", str(args.timeout), "--window", str(args.window), "--unseen", str(args.unseen)]
        command += ["--passes"] if args.passes else []
        command += ["--full-on-eval"] if args.full_on_eval else []
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
        return ["failed: " + result["error"], "", "", "", "", "", "", "", ""]
    steps = result["steps"]
    steady = statistics.median(steps[-5:])
    settled = next(i for i in range(len(steps)) if all(s <= 1.25 * steady for s in steps[i + 1:]))
    ends = [sum(steps[: i + 1]) for i in range(len(steps))]
    within = sum(1 for end in ends if end <= seconds)
    pending = result.get("pending")
    return [f"{steps[0]:.2f} s", f"{ends[settled]:.1f} s (step {settled + 1})", str(within), f"{1e3 * steady:.1f}",
            ("-" if pending is None else str(pending)) + (f" ({result['exit']})" if "exit" in result else ""),
            "-" if result.get("free_gb") is None else f"{result['free_gb']:.1f}", f"{result['settled_ms']:.1f}",
            f"{result['timing_ms']:.2f}" if result.get("timing_ms") else "-",
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
    parser.add_argument("--passes", action="store_true", help="a new user's first passes and where ours spends them")
    parser.add_argument("--second-scene", default="street4", help="--passes: the scene met after --scene")
    parser.add_argument("--window", type=float, default=0.0,
                        help="--passes: after the 20 inferences, go on inferring on unseen clouds this many seconds "
                             "(the background compiles' window: how soon the passes reach the steady one)")
    parser.add_argument("--warm-compilers", action="store_true",
                        help="--passes: keep Warp's, Triton's and CuPy's caches (a second process on the machine)")
    parser.add_argument("--unseen", type=int, default=0,
                        help="train on a data set of this many unseen clouds of --scene, cycled (new layouts and "
                             "sizes, the same in every configuration), instead of one cloud's coordinates")
    parser.add_argument("--full-on-eval", action="store_true",
                        help="--unseen: ours_full trains on the clouds its settled GPU ms is measured on alone (each "
                             "fully tuned, which is all that figure needs; every cloud of the data set met in full "
                             "tuning took more than 300 s on some hosts)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.config = args.child
        return (passes_child if args.passes else child)(args)
    if args.passes:
        configs = [c for c in args.configs if c in OURS or c == "naive"] or ["ours"]
        return passes_table({config: run_config(config, args) for config in [*configs, *args.peers]}, args)
    results = {config: run_config(config, args) for config in [*args.configs, *args.peers]}
    rows = [(config, summary(result, args.seconds)) for config, result in results.items()]
    data = (f"a data set of {args.unseen} unseen clouds, cycled (settled GPU ms: the mean of its first "
            f"{min(EVAL, args.unseen)} clouds' steps{'; ours_full trained on those alone' if args.full_on_eval else ''})"
            if args.unseen else "new coordinates every step")
    print(f"\nCold start, {args.scene} x{args.scale:g}, {args.dtype}, {args.device}, shipped tunings "
          f"{'on' if args.shipped else 'off'}, empty tuning and Triton caches, {data}")
    header = ["library", "first step", "steady after", f"steps in {args.seconds:g} s", "steady step ms",
              "compiles left", "free GB", "settled step ms", "timing ms", "settled GPU ms"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for config, cells in rows:
        print("| " + " | ".join([config, *cells]) + " |")
    for config, result in results.items():
        if "progress" in result:
            print(f"{config}'s tuning at the end: {result['progress']}")
        if result.get("timed_in_gpu_s"):
            print(f"  ({config} timed {1e3 * result['timed_in_gpu_s']:.1f} ms inside the settled GPU steps: keys with "
                  "no pick to run untimed)")
        for name, launches, ms in result.get("kernels", []):
            print(f"  {config} {ms:7.3f} ms {launches:5.0f} launches  {name[:90]}")
    full = results.get("ours_full", {}).get("gpu_ms")
    for config, result in results.items():
        if config != "ours_full" and isinstance(full, float) and isinstance(result.get("gpu_ms"), float):
            print(f"{config}'s settled GPU time over ours_full's (every candidate timed): "
                  f"{result['gpu_ms'] / full:.3f}x after {len(result['steps'])} steps")


if __name__ == "__main__":
    main()
