"""Whole-network benchmark: MinkUNet (or, with --model backbone, the detection backbone) as users run it,
ours beside spconv, spconv-triton and naive torch, in one run.

Every pass builds a new SparseTensor from the scene's coordinates ("new": the kernel maps are
built again, as when every batch brings new point clouds), or reuses one ("same": maps cached).
The model is the TorchSparse++ MinkUNet: a stem of two submanifold 3^3 convs to 32 channels,
four encoder stages [32, 64, 128, 256] of a k2 s2 conv and two residual blocks, four decoder
stages [256, 128, 96, 96] of a k2 s2 transposed conv, a skip concatenation and two residual
blocks, then a 1x1x1 head; weights in the benchmark dtype. The backbone (--model backbone) is
SparseResNetBackbone (OpenPCDet's VoxelResBackBone8x shape: a submanifold stem, stages [16, 32, 64,
128] of two residual blocks, the later three opened by a k3 s2 conv, a k3 s2 height conv, the dense
BEV map; its loss the map's mean square) with spconv's downsampling (``generative_down``: every coarse
voxel a window reaches, as spconv's SparseConv3d with padding 1 makes), against the same network
written with spconv's modules; the voxels of each stage are printed for both, to show equal networks. "naive torch" is our network with
every product pinned to explicit_gemm (gather, mm, scatter-add in torch). With --deterministic,
"ours_deterministic" is ours in deterministic mode (sparseconv.set_deterministic(True): only
atomics-free algorithms), the row after ours: what bitwise-repeatable runs cost. With --lazy-maps,
"ours_lazy_maps" is ours with SPARSECONV_PLAN_MAPS=0 (each kernel map built when a layer first asks
for it, instead of a new batch building the maps the last batches asked for at once), in the
alternating rounds too: what planning the maps saves. With --graphed, "ours_graphed" is ours' inference
through sparseconv.graphed (the pass replayed from a CUDA graph per capacity bucket; maps built eagerly
per batch); it has no training step. With --settle, every alternating round of ours prints where its pass spent its
time (the calling thread's CPU and phases, the other threads' CPU, the collector's pauses, what the tuner gained):
the rounds right after the warm-up against the settled ones.

Columns, per scene, dtype and library (milliseconds unless named; medians of --repeats):
  infer / step      inference (no_grad, eval) and one training step (forward, cross-entropy,
                    backward, SGD), new coordinates every pass
  infer= / step=    the same with the coordinates (and, for ours and spconv, the maps) reused
  host / gpu        inference, new coordinates: host time until the call returns, and the
                    kernels' summed device time (torch.profiler)
  peak GB           peak allocated memory of a training step, new coordinates
  first / 1st step  the first inference, and the first training step after the timed
                    inferences, in this process (ours: the tuner's sweeps and kernel compiles,
                    or the reference while decided layers compile in the background; empty
                    tuning cache unless SPARSECONV_CACHE_DIR points at a filled one; see
                    scripts/bench_cold_start.py for the steps after the first)
A peer whose training fails with its default algorithm trains with ConvAlgo.Native, marked.
  maps / syncs      kernel maps a pass queries (a transposed conv's map is the transpose of
  / warp            its strided conv's, not queried); host syncs torch reports in one new-coordinate
                    inference (torch.cuda.set_sync_debug_mode); Warp launches (hash-table inserts
                    and queries) in one; ours only
A second table times ours and each peer in alternating rounds, inference rounds then training
rounds, the order rotating; the ratio lines (medians of the per-round ratios) come from it, since
timing one library after the other let host drift between them move the ratios by tens of percent.
By default (--rounds unseen) every round feeds all libraries one point cloud none has seen (a new
scene layout: contents and voxel counts change every batch, as in training on a data set), and the
table adds per library the kernels' summed device time of a pass (gpu), wall minus that (host),
and the peak memory of a training step on an unseen cloud; --rounds same-coords builds a new tensor
from the scene's one set of coordinates every round instead. --rounds-only prints this table alone.
A last table times map building: for subm3, a 16-channel conv on a fresh tensor minus the
same conv with its map cached (both printed too); for down2 (k2 s2), the whole fresh conv, since
spconv cannot reuse a strided conv's map. ``--maps-only`` prints that table alone.

    python scripts/bench_network.py                                   # 3 scenes x fp16, bf16 (minutes)
    python scripts/bench_network.py --scenes street1 --dtypes float16 --peers spconv
    python scripts/bench_network.py --scenes street1 street4 room2 --dtypes float16 --peers spconv --rounds-only --repeats 15
    python scripts/bench_network.py --scenes street1 street4 room2 --dtypes float16 --peers --deterministic
    python scripts/bench_network.py --scenes street1 room2 --dtypes float16 --peers spconv --lazy-maps
    python scripts/bench_network.py --scenes street1 street4 room2 --dtypes float16 --peers spconv --rounds-only --graphed
    python scripts/bench_network.py --scenes street1 street4 --dtypes float16 --peers spconv --model backbone
    python scripts/bench_network.py --scenes street1 --dtypes float16 --peers spconv --rounds-only --repeats 16 --settle
    python scripts/bench_network.py --device cpu --scale 0.05 --repeats 2 --peers naive   # dry run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import tempfile

import torch

import sparseconv
from sparseconv.cli.bench import (MODELS, SCENES, Runner, anchor_tensor, gpu_ms, import_anchor, one_call_ms,
                                  scene_coords, subm_maps, sync, timed, unseen_clouds)
from sparseconv.cli.probes import (OpSites, count_syncs, gpu_busy, phase_seconds, probed_round, sync_sites,
                                   warp_launches)
from sparseconv.nn import SparseConv3d

PEERS = ("spconv", "spconv_triton", "naive")
PHASE_PASSES = 20
"""Unseen clouds per pass kind whose phases ``--profile`` sums (new keys, refits and timings come now and then)."""


def peak_gb(fn, device: torch.device, runner: Runner | None = None) -> float | str:
    """Peak memory of one call of ``fn``; a runner's same-coordinate input (kept by the ``infer=``
    column, with its maps and their views, or spconv's indice pairs) is dropped first: a training
    loop on new coordinates holds no other batch's maps. (Kept, it added ~0.5 GB to ours at street4
    and less to spconv's, H200, 2026-11-26.)"""
    if device.type != "cuda":
        return "-"
    if runner is not None:
        runner._same = None
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def train_columns(runner: Runner, device, repeats: int, row: dict) -> None:
    """The training columns, into ``row`` one by one (those measured before a failure stay)."""
    for column, measure in (("1st step", lambda: one_call_ms(runner.step, device)),
                            ("step", lambda: timed(runner.step, device, repeats)[0]),
                            ("peak GB", lambda: peak_gb(runner.step, device, runner)),
                            ("step=", lambda: timed(lambda: runner.step(same=True), device, repeats)[0])):
        if column not in row:
            row[column] = measure()


def run_network(name: str, coords, dtype, device, repeats: int, model: str = "minkunet") -> dict:
    if name == "ours_deterministic":
        previous = sparseconv.set_deterministic(True)
        try:
            return run_network("ours", coords, dtype, device, repeats, model)
        finally:
            sparseconv.set_deterministic(previous)
    try:
        runner = Runner(name, coords, dtype, device, model=model)
        row = {"first": one_call_ms(runner.infer, device)}
        row["infer"], row["host"] = timed(runner.infer, device, repeats)
        row["infer="], _ = timed(lambda: runner.infer(same=True), device, repeats)
        row["gpu"] = gpu_ms(runner.infer, device)
        if name == "ours_graphed":  # inference only
            return row
        try:
            train_columns(runner, device, repeats, row)
        except Exception as error:  # noqa: BLE001
            if name not in ("spconv", "spconv_triton"):
                raise
            # spconv's default (mask implicit GEMM) fails in backward on some passes (seen on an
            # H100 with spconv-cu126 2.3.8, in the maps-kept passes, whose maps this script hands
            # back to it); a user would then train with its Native algorithm. The columns measured
            # before the failure keep the default algorithm's numbers.
            print(f"{name}: training failed ({type(error).__name__}: {str(error)[:300]}); "
                  "the remaining training columns with ConvAlgo.Native", flush=True)
            row["native"] = [k for k in ("step", "peak GB", "step=") if k not in row]
            train_columns(Runner(name, coords, dtype, device, native=True, model=model), device, repeats, row)
            row["note"] = "Native: " + ", ".join(row["native"])
        if model == "backbone" and name in ("ours", "spconv", "spconv_triton"):
            row["voxels"] = runner.voxels()
        if name in ("ours", "ours_lazy_maps"):
            x = runner.make_input(False)
            with torch.no_grad():
                runner.net.eval()(x)
            # The tensor's map cache (SparseTensor.cache) is what this column measures: maps a pass queried.
            row["maps"] = sum(m.transpose_of is None for m in x.cache.kernel_maps())
            row["syncs"] = count_syncs(runner.infer, device)
            row["warp"] = warp_launches(runner.infer)
        return row
    except Exception as error:  # noqa: BLE001 - a peer that cannot run a case is reported as n/a
        return {"error": f"n/a ({type(error).__name__}: {str(error)[:80]})"}


ROUND_KINDS = ("infer", "step")


def interleaved(scene: str, coords, dtype, device, libraries: list[str], rows: dict, args) -> dict[str, dict]:
    """{library: {"infer": [ms per round], "step": [...]}}: inference and training step timed in rounds
    that alternate the libraries (the order rotating every round), inference rounds first.

    With ``--rounds unseen`` (the default) every round feeds every library the same point cloud, one no
    pass has seen (:func:`unseen_clouds`: contents and voxel counts change as in training on a data set),
    and each library's entry gains "infer gpu" / "step gpu" (the kernels' summed device time of one pass
    on a further unseen cloud) and "peak GB" (a training step on another); with ``--rounds same-coords``
    every round builds a new tensor from the scene's one set of coordinates.

    The per-library rows time each library's columns one after the other; on a shared host the same
    pass drifted by up to 2x between such runs (H100, 2026-11-25), which moved the ratios more than most
    changes do. Alternating puts that drift on every library alike.
    """
    unseen = args.rounds == "unseen"
    pool = unseen_clouds(scene, 2 * args.repeats + 6, dtype, device, args.scale) if unseen else []
    clouds = iter(pool)
    # the backbone's fixed grid (a detector's point-cloud range) covers every cloud of the run
    grid = torch.cat([coords, *(cloud.coords for cloud in pool)]) if args.model == "backbone" else coords
    runners = {}
    for library in libraries:
        if library == "ours_deterministic" or "error" in rows.get(library, {}):
            continue
        # As its row trained: Native only if its default algorithm failed there.
        runners[library] = Runner(library, grid, dtype, device, native="step" in rows.get(library, {}).get("native", ()),
                                  model=args.model)

    def feed() -> None:
        """The next round's cloud, the same for every library (unseen mode; else the runners keep theirs)."""
        if unseen:
            cloud = next(clouds)
            for runner in runners.values():
                runner.use(cloud)

    kinds = {library: list(ROUND_KINDS) for library in runners}  # what each library can run
    budget = sparseconv.tune.get_tuner().budget
    # Warm-up passes on three clouds, each followed by our background compiles: tuned ahead, as
    # sparseconv.warmup tunes (every key met timed at once, whatever the timing budget holds), so that the rounds
    # time the steady state, their own new keys timed within the budget as in any training.
    with budget.waived():
        for _ in range(3):
            feed()
            for library, runner in list(runners.items()):
                for kind in list(kinds[library]):
                    try:
                        getattr(runner, kind)()
                    except Exception as error:  # noqa: BLE001 - a peer that cannot run a kind is reported, not timed
                        # (spconv's CPU build infers but cannot train with a CPU-only torch: its backward asks for
                        # a CUDA stream)
                        print(f"{library}: no {kind} rounds ({type(error).__name__}: {str(error)[:200]})")
                        kinds[library].remove(kind)
                if not kinds[library]:
                    del runners[library]
            sparseconv.tune.wait_for_compiles()
    times = {library: {kind: [] for kind in kinds[library]} for library in runners}
    for kind in ROUND_KINDS:
        names = [library for library in runners if kind in kinds[library]]
        timed_before = budget.spent_s
        for round_ in range(args.repeats if names else 0):
            feed()
            for library in names[round_ % len(names):] + names[: round_ % len(names)]:
                if args.settle and library == "ours":
                    sync(device)
                    before = sparseconv.tune.progress()
                    probed = probed_round(lambda: (getattr(runners[library], kind)(), sync(device)))
                    times[library][kind].append(1e3 * probed["wall"])
                    print_probed(scene, kind, round_, probed, before, sparseconv.tune.progress())
                    continue
                times[library][kind].append(one_call_ms(getattr(runners[library], kind), device))
        if args.verbose and names:
            print(f"{scene} {kind} rounds (ms): " + "; ".join(
                f"{library} " + " ".join(f"{ms:.1f}" for ms in times[library][kind]) for library in names)
                + f"; ours timed candidates for {budget.spent_s - timed_before:.2f} s of them", flush=True)
    if unseen:
        for kind in ROUND_KINDS:
            feed()
            for library, runner in runners.items():
                times[library][kind + " gpu"] = gpu_ms(getattr(runner, kind), device) if kind in kinds[library] else "-"
        feed()
        for library, runner in runners.items():
            times[library]["peak GB"] = peak_gb(runner.step, device, runner) if "step" in kinds[library] else "-"
        times["voxels"] = [len(cloud.coords) for cloud in pool]
    graphed = getattr(runners.get("ours_graphed"), "graphed", None)
    if args.verbose and graphed is not None:
        print(f"{scene} ours_graphed: {graphed.captures} graph(s) captured over all its passes; " + "; ".join(
            f"capacities {b.capacities}: captured in {b.seconds:.2f} s, {b.memory_bytes / 2**30:.2f} GB reserved"
            for b in graphed.buckets), flush=True)
    return times


def print_probed(scene: str, kind: str, round_: int, probed: dict, before, after) -> None:
    """One line of ``--settle``: where ours' pass of this round spent its time (:func:`probed_round`), and what
    the tuner's progress (before, after) gained in it."""
    ms = {name: 1e3 * seconds for name, seconds in probed["phases"].items() if seconds > 3e-4}
    threads = sorted(probed["threads"].items(), key=lambda kv: -kv[1])[:4]
    pauses = probed["gc"]
    print(f"  settle {scene} {kind} round {round_}: wall {1e3 * probed['wall']:.1f} ms, calling thread's CPU "
          f"{1e3 * probed['caller']:.1f}; gc {1e3 * pauses.get('seconds', 0.0):.1f} ms "
          f"({', '.join(f'{g} {n}' for g, n in sorted(pauses.items()) if g != 'seconds') or 'none'}); phases: "
          + ", ".join(f"{label.strip()} {value:.1f}" for label, value in sorted(ms.items(), key=lambda kv: -kv[1])[:6])
          + "; other threads' CPU ms: " + (", ".join(f"{name} {1e3 * s:.1f}" for name, s in threads) or "none")
          + "; tuner: " + ", ".join(f"{field} {getattr(after, field) - getattr(before, field):+g}"
                                    for field in after._fields),
          flush=True)


def print_rounds(alternated: dict, args) -> None:
    """The alternating-rounds table and the ratio lines over spconv (medians of per-round ratios)."""
    unseen = args.rounds == "unseen"
    what = ("a point cloud no library has seen every round (host = wall - gpu)" if unseen
            else "same coordinates, a new tensor every round")
    print(f"\nalternating rounds, {what}: median ms of {args.repeats} rounds")
    extra = ["infer gpu", "infer host", "step gpu", "step host", "peak GB"] if unseen else []
    columns = ["infer", "step", *extra]
    print("| scene | voxels | dtype | library | " + " | ".join(columns) + " |\n" + "|---" * (4 + len(columns)) + "|")
    ratios = []
    for (scene, dtype_name, n), times in alternated.items():
        sizes = times.pop("voxels", None)
        voxels = f"{min(sizes)}-{max(sizes)}" if sizes else str(n)
        for library, kinds in times.items():
            cells = {kind: statistics.median(kinds[kind]) if kinds.get(kind) else "-" for kind in ROUND_KINDS}
            for kind in ROUND_KINDS if unseen else ():
                cells[kind + " gpu"] = kinds[kind + " gpu"]
                gpu = kinds[kind + " gpu"]
                cells[kind + " host"] = cells[kind] - gpu if isinstance(gpu, float) and cells[kind] != "-" else "-"
            if unseen:
                cells["peak GB"] = kinds["peak GB"]
            print(f"| {scene} | {voxels} | {dtype_name} | {library} | " + " | ".join(fmt(cells[c]) for c in columns)
                  + " |")
        anchor = times.get("spconv")
        for name in ("ours", "ours_graphed"):
            ours = times.get(name)
            if anchor is None or ours is None:
                continue
            per_round = [f"{statistics.median(a / b for a, b in zip(anchor[kind], ours[kind])):.2f}x"
                         if anchor.get(kind) and ours.get(kind) else "-" for kind in ROUND_KINDS]
            memory = (f"; step peak memory {fmt(ours['peak GB'])} vs {fmt(anchor['peak GB'])} GB"
                      if unseen and name == "ours" else "")
            gpu = ours.get("infer gpu")
            if unseen and name == "ours_graphed" and isinstance(gpu, float) and gpu > 0 and ours.get("infer"):
                memory = f"; its inference {statistics.median(ours['infer']) / gpu:.2f}x its own GPU time"
            ratios.append(f"{scene} {dtype_name} {args.model}: {name} over spconv ({args.rounds} rounds, median of "
                          f"per-round ratios): inference {per_round[0]}, training step {per_round[1]}" + memory)
    print("\n".join(ratios))


def map_build_ms(name: str, coords, device, repeats: int, layer: str) -> dict[str, float] | str:
    """subm3: {"build": one conv (16 -> 16 channels) on a fresh tensor minus the same conv with its map cached,
    "fresh" and "kept": the two}; down2: {"build": the whole fresh conv} (spconv cannot reuse a strided map)."""
    feats = torch.randn(len(coords), 16, device=device)
    try:
        if name == "ours":
            conv = SparseConv3d(16, 16, 3 if layer == "subm3" else 2, 1 if layer == "subm3" else 2).to(device)

            def fresh():
                conv(sparseconv.SparseTensor(coords, feats))

            cached_x = sparseconv.SparseTensor(coords, feats)
            conv(cached_x)

            def cached():
                conv(cached_x)
        else:
            spc = import_anchor(name)
            if isinstance(spc, str):
                return spc
            native = {"algo": spc.ConvAlgo.Native} if device.type == "cpu" else {}  # its only CPU algorithm
            if layer == "subm3":
                conv = spc.SubMConv3d(16, 16, 3, bias=False, indice_key="k", **native).to(device)
            else:
                conv = spc.SparseConv3d(16, 16, 2, 2, bias=False, indice_key="k", **native).to(device)
            template = anchor_tensor(spc, coords, feats)

            def fresh():
                conv(spc.SparseConvTensor(feats, template.indices, template.spatial_shape, template.batch_size))

            keep = conv(template)
            cached_x = spc.SparseConvTensor(feats, template.indices, template.spatial_shape, template.batch_size)
            cached_x.indice_dict = subm_maps(keep)

            def cached():
                conv(cached_x)
        with torch.no_grad():
            if layer != "subm3":  # spconv cannot reuse a strided conv's map: time the whole fresh conv
                return {"build": timed(fresh, device, repeats)[0]}
            made, kept = timed(fresh, device, repeats)[0], timed(cached, device, repeats)[0]
            return {"build": max(0.0, made - kept), "fresh": made, "kept": kept}
    except Exception as error:  # noqa: BLE001
        return f"n/a ({type(error).__name__})"


def profile_ours(scene: str, dtype, device, args) -> None:
    """Where ours spends host time: per pass kind (inference and training step, on unseen clouds and on
    kept coordinates), the torch ops each line of sparseconv issues (count, host ms), then the host
    syncs by line, the GPU's busy share of a pass (:func:`~sparseconv.cli.probes.gpu_busy`), a cProfile
    (by own time and by cumulative time) of one inference and one training step on unseen clouds, and the
    calling thread's time in each of :data:`~sparseconv.cli.probes.PHASES` (the tuner's decisions and sweeps,
    cost-model fits, map builds, ...) summed over PHASE_PASSES unseen clouds of each kind."""
    clouds = iter(unseen_clouds(scene, 24 + 2 * PHASE_PASSES, dtype, device, args.scale))
    first = next(clouds)
    runner = Runner("ours", first.coords, dtype, device, model=args.model)

    def unseen(kind):
        def run():
            runner.use(next(clouds))
            getattr(runner, kind)()
        return run

    passes = {"infer unseen": unseen("infer"), "infer same": lambda: runner.infer(same=True),
              "step same": lambda: runner.step(same=True), "step unseen": unseen("step")}
    for fn in passes.values():
        for _ in range(3):
            fn()
    sparseconv.tune.wait_for_compiles()  # else layers whose kernels compile in the background profile the reference
    for fn in passes.values():
        fn()
    sync(device)
    for label, fn in passes.items():
        with OpSites() as sites:
            fn()
            sync(device)
        print(f"\n{label}: {sum(c for c, _ in sites.counts.values())} torch ops; top sites by host ms (ops, ms)")
        for site, (count, ms) in sorted(sites.counts.items(), key=lambda kv: -kv[1][1])[:40]:
            print(f"  {count:5d} {ms:8.2f}  {site}")
    if device.type == "cuda":
        print("host syncs of one unseen-cloud inference, by the line that caused them:")
        for site, count in sync_sites(passes["infer unseen"]).most_common():
            print(f"  {count:4d}  {site}")
        print("the GPU's share of a pass on unseen clouds (torch.profiler, per pass of three: busy is the time some"
              " kernel ran; far under the span, the pass waits on the host)")
        for label in ("infer unseen", "step unseen"):
            seen = gpu_busy(passes[label])
            print(f"  {label}: span {seen['span']:.1f} ms, GPU busy {seen['busy']:.1f} ms "
                  f"({100 * seen['busy'] / max(seen['span'], 1e-9):.0f}%), {seen['kernels']:.0f} kernels, "
                  f"{seen['launches']:.0f} launch calls, {seen['sync ms']:.2f} ms in CUDA calls that may wait")
            print("    idle ms a pass by gap: " + ", ".join(f"{band} {ms:.2f}" for band, ms in seen["idle"].items()))
            print("    longest gaps (ms, kernel before, kernel after): " + "; ".join(
                f"{ms:.2f} {before[:40]} -> {after[:40]}" for ms, before, after in seen["gaps"][:6]))
            print("    kernels by GPU ms a pass (launches, ms, name):")
            for name, (count, ms) in sorted(seen["by kernel"].items(), key=lambda kv: -kv[1][1])[:18]:
                print(f"      {count:5.0f} {ms:7.3f}  {name[:100]}")
    for label in ("infer unseen", "step unseen"):
        profiler = cProfile.Profile()
        profiler.enable()
        passes[label]()
        sync(device)
        profiler.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats(order).print_stats(45)
            print(f"cProfile of one {label} pass ({stats.total_calls} Python calls), by {order}\n" + text.getvalue())
    for label in ("infer unseen", "step unseen"):
        walls, phases = [], collections.Counter()
        for _ in range(PHASE_PASSES):
            wall, seconds = phase_seconds(lambda: (passes[label](), sync(device)))
            walls.append(wall)
            phases.update(seconds)
        print(f"\n{label}: the calling thread's ms a pass in each phase, over {PHASE_PASSES} unseen clouds (median pass "
              f"{1e3 * statistics.median(walls):.1f} ms, mean {1e3 * statistics.mean(walls):.1f}; phases nest)")
        for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
            if seconds > 0:
                print(f"  {1e3 * seconds / PHASE_PASSES:8.2f}  {phase}")


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", nargs="+", default=list(SCENES), choices=list(SCENES))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="minkunet", choices=MODELS,
                        help="the MinkUNet, or the detection backbone (SparseResNetBackbone with spconv's downsampling)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=1.0, help="scene size multiplier")
    parser.add_argument("--profile", action="store_true",
                        help="profile ours first (torch ops by line, host syncs, cProfile, phases over unseen clouds), "
                             "first scene and dtype")
    parser.add_argument("--no-maps", dest="maps", action="store_false", help="skip the map-build table")
    parser.add_argument("--maps-only", action="store_true", help="the map-build table alone (no network)")
    parser.add_argument("--no-interleave", dest="interleave", action="store_false",
                        help="skip the alternating-rounds table (and the ratios it gives)")
    parser.add_argument("--rounds", default="unseen", choices=("unseen", "same-coords"),
                        help="the alternating rounds: a point cloud no library has seen every round (with device "
                             "and host time and step memory), or a new tensor on the scene's coordinates")
    parser.add_argument("--verbose", action="store_true",
                        help="print every round's times, and how long ours spent timing candidates in them")
    parser.add_argument("--rounds-only", action="store_true",
                        help="the alternating rounds alone (no per-library table, no map table)")
    parser.add_argument("--lazy-maps", action="store_true",
                        help="also run ours with SPARSECONV_PLAN_MAPS=0 (the row ours_lazy_maps, alternating rounds too)")
    parser.add_argument("--graphed", action="store_true",
                        help="also run ours' inference in graph mode (sparseconv.graphed: the row ours_graphed)")
    parser.add_argument("--settle", action="store_true",
                        help="probe ours' pass of every alternating round (one line each: the calling thread's CPU "
                             "time and phases, the other threads' CPU time, the collector's pauses): where the rounds "
                             "right after the warm-up spend what settled ones do not; the probe adds its own host time")
    parser.add_argument("--deterministic", action="store_true",
                        help="also run ours in deterministic mode (the row ours_deterministic)")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("SPARSECONV_CACHE_DIR", tempfile.mkdtemp(prefix="sparseconv-bench-"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model: {args.model}; device: {name}; torch {torch.__version__}; median of {args.repeats} passes (ms); "
          f"tuning cache {os.environ['SPARSECONV_CACHE_DIR']}")
    libraries = ["ours", *(["ours_deterministic"] if args.deterministic else []),
                 *(["ours_lazy_maps"] if args.lazy_maps else []), *(["ours_graphed"] if args.graphed else []),
                 *args.peers]
    scenes = {scene: scene_coords(scene, args.scale).to(device) for scene in args.scenes}
    if args.profile:
        profile_ours(args.scenes[0], getattr(torch, args.dtypes[0]), device, args)
    if args.maps_only:
        map_table(scenes, device, args)
        return
    columns = ["infer", "step", "infer=", "step=", "host", "gpu", "peak GB", "first", "1st step", "maps", "syncs",
               "warp"]
    if not args.rounds_only:
        print("\nper library, one after the other, same coordinates (a new tensor every pass: maps built again):")
        print("| scene | N | dtype | library | " + " | ".join(columns) + " |")
        print("|---" * (4 + len(columns)) + "|")
    alternated, voxels = {}, {}
    for scene, coords in scenes.items():
        for dtype_name in args.dtypes:
            rows = {}
            for library in libraries if not args.rounds_only else ():
                rows[library] = row = run_network(library, coords, getattr(torch, dtype_name), device, args.repeats,
                                                  args.model)
                cells = [row["error"]] if "error" in row else [fmt(row.get(c)) for c in columns]
                if "voxels" in row:
                    voxels[(scene, dtype_name, library)] = row["voxels"]
                label = library + (f" ({row['note']})" if "note" in row else "")
                print(f"| {scene} | {len(coords)} | {dtype_name} | {label} | " + " | ".join(cells) + " |", flush=True)
            if args.interleave and len(libraries) > 1:
                alternated[(scene, dtype_name, len(coords))] = interleaved(
                    scene, coords, getattr(torch, dtype_name), device, libraries, rows, args)
    if alternated:
        print_rounds(alternated, args)
    if voxels:
        print("\nvoxels of each stage's output and of the height conv (the same network on both sides when equal):")
        for (scene, dtype_name, library), counts in voxels.items():
            print(f"  {scene} {dtype_name} {library}: {counts}")
    if args.maps and not args.rounds_only:
        map_table(scenes, device, args)


def map_table(scenes: dict, device: torch.device, args) -> None:
    """The map-build table (:func:`map_build_ms`), ours and each peer but naive torch, every scene."""
    print("\nkernel-map build (ms): subm3, one 16-channel conv on a fresh tensor minus the same conv with its map "
          "cached (and the two convs); down2, the whole 16-channel k2 s2 conv on a fresh tensor (spconv cannot "
          "reuse its map)")
    libraries = ["ours", *(p for p in args.peers if p != "naive")]
    print("| scene | N | map | " + " | ".join(libraries) + " |")
    print("|---" * (3 + len(libraries)) + "|")
    for scene, coords in scenes.items():
        for layer in ("subm3", "down2"):
            times = [map_build_ms(library, coords, device, args.repeats, layer) for library in libraries]
            for part, label in (("build", layer), ("fresh", "subm3 conv, fresh"), ("kept", "subm3 conv, map kept")):
                if part == "build" or any(isinstance(t, dict) and part in t for t in times):
                    cells = [fmt(t.get(part)) if isinstance(t, dict) else t for t in times]
                    print(f"| {scene} | {len(coords)} | {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
