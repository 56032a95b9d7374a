"""Kernel-map build and explicit conv times on the synthetic scenes, side by side with the anchors.

Columns, measured in one run: ours (warp-lang maps, explicit_gemm), spconv 2.x and spconv-triton
when importable (GPU only), and a naive torch implementation (sorted keys + searchsorted for
the map, one im2col gather + one matmul for the conv). Every conv row first checks our output
against the naive one (and against spconv where the weight layouts can be matched).

    python scripts/bench_core.py                 # best device, fp32, street + room
    python scripts/bench_core.py --device cpu --repeats 5
    python scripts/bench_core.py --stages        # a fresh map's host time, step by step (ours)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import sparseconv.tune
from sparseconv import SparseTensor, sparse_conv3d
from sparseconv.cli.bench import anchor_tensor, import_anchor, median_ms, timed
from sparseconv.data import make_scene
# Internal on purpose: our map build is timed through SparseTensor.cache.kernel_map (keyed by a KernelMapKey),
# and the naive torch map searches our packed coordinate keys (pack_coords) at our kernel offsets.
from sparseconv.coords import KernelMapKey, offset_deltas
from sparseconv.coords.keys import pack_coords
from sparseconv.ops.batch import kernel_map as map_request


def bench(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` (the shared timer, :func:`sparseconv.cli.bench.median_ms`), two warm-up calls."""
    return median_ms(fn, device, repeats, warmup=2)


# --- naive torch ---------------------------------------------------------------------------

def naive_neighbors(in_coords: torch.Tensor, out_coords: torch.Tensor, kernel_size: int, in_stride: int) -> torch.Tensor:
    """(N_out, K) int64 neighbour table by binary search over sorted packed keys."""
    keys, order = torch.sort(pack_coords(in_coords))
    offsets = offset_deltas((kernel_size,) * 3).to(in_coords.device) * in_stride
    table = []
    for off in offsets:
        query = out_coords.clone()
        query[:, 1:] += off
        q = pack_coords(query)
        pos = torch.searchsorted(keys, q).clamp_max(keys.numel() - 1)
        table.append(torch.where(keys[pos] == q, order[pos], -1))
    return torch.stack(table, dim=1)


def naive_conv(feats: torch.Tensor, weight: torch.Tensor, neighbors: torch.Tensor) -> torch.Tensor:
    """im2col: gather all K neighbours (zero row for -1) and one (N, K*C_in) x (K*C_in, C_out) matmul."""
    padded = torch.cat([feats, feats.new_zeros(1, feats.shape[1])])
    cols = padded[neighbors.where(neighbors >= 0, feats.shape[0])]
    return cols.reshape(len(neighbors), -1) @ weight.reshape(-1, weight.shape[2])


def time_anchor(spc, coords, feats, leaf_feats, channels, device, dtype, repeats) -> dict[str, str]:
    conv = spc.SubMConv3d(channels, channels, 3, bias=False, indice_key="bench").to(device, dtype)
    # The map: a fresh tensor per call minus a call that finds its indices cached.
    st, st_leaf = anchor_tensor(spc, coords, feats), anchor_tensor(spc, coords, leaf_feats)
    fresh_ms = bench(lambda: conv(anchor_tensor(spc, coords, feats)), device, repeats)
    fwd_ms = bench(lambda: conv(st), device, repeats)
    fwd_bwd_ms = bench(lambda: conv(st_leaf).features.sum().backward(), device, repeats)
    return {"map": f"{fresh_ms - fwd_ms:.2f}*", "fwd": f"{fwd_ms:.2f}", "fwd+bwd": f"{fwd_bwd_ms:.2f}"}


# --- rows ------------------------------------------------------------------------------------

def run(device: torch.device, scenes: list[str], channels: int, repeats: int, dtype: torch.dtype) -> list[list[str]]:
    anchors = {name: import_anchor(name) for name in ("spconv", "spconv_triton")} if device.type == "cuda" else {
        "spconv": "n/a (cpu)", "spconv_triton": "n/a (cpu)"}
    rows = []
    for scene in scenes:
        coords, raw = make_scene(scene, batch_size=2)
        coords = coords.to(device)
        feats = torch.randn(len(coords), channels, device=device, dtype=dtype)
        n = len(coords)
        weight = torch.randn(27, channels, channels, device=device, dtype=dtype) / (27 * channels) ** 0.5

        def fresh():
            return SparseTensor(coords, feats, validate=False)

        def our_map():
            x = fresh()
            map_request(x.cache, KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0].pairs

        x = fresh()
        neighbors = naive_neighbors(coords, coords, 3, 1)
        ours_out = sparse_conv3d(x, weight, fwd_algo="explicit_gemm").feats
        reference = naive_conv(feats.double(), weight.double(), neighbors)
        err = float((ours_out.double() - reference).norm() / reference.norm())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"ours vs naive: relative error {err:.2e}"

        def ours_fwd():
            sparse_conv3d(x, weight)

        leaf_feats = feats.clone().requires_grad_()
        leaf_weight = weight.clone().requires_grad_()

        def ours_fwd_bwd():
            sparse_conv3d(x.replace(leaf_feats), leaf_weight).feats.sum().backward()

        def naive_fwd():
            naive_conv(feats, weight, neighbors)

        def naive_fwd_bwd():
            naive_conv(leaf_feats, leaf_weight, neighbors).sum().backward()

        # Tune, then let the chosen kernels compile (the reference runs while they compile in the background)
        ours_fwd_bwd()
        sparseconv.tune.wait_for_compiles()
        results = {
            "map": (bench(our_map, device, repeats), bench(lambda: naive_neighbors(coords, coords, 3, 1), device, repeats)),
            "fwd": (bench(ours_fwd, device, repeats), bench(naive_fwd, device, repeats)),
            "fwd+bwd": (bench(ours_fwd_bwd, device, repeats), bench(naive_fwd_bwd, device, repeats)),
        }
        anchor_ms = {}
        for name, spc in anchors.items():
            if isinstance(spc, str):
                anchor_ms[name] = {k: spc for k in results}
                continue
            try:
                anchor_ms[name] = time_anchor(spc, coords, feats, leaf_feats, channels, device, dtype, repeats)
            except Exception as error:  # noqa: BLE001 - e.g. spconv has no bf16 kernels: report, go on
                anchor_ms[name] = {k: f"n/a ({type(error).__name__})" for k in results}
        for what, (ours_ms, naive_ms) in results.items():
            rows.append([scene, f"{n}", what, f"{ours_ms:.2f}", anchor_ms["spconv"][what],
                         anchor_ms["spconv_triton"][what], f"{naive_ms:.2f}"])
    return rows


def stage_rows(device: torch.device, scenes: list[str], channels: int, repeats: int, dtype: torch.dtype) -> list[list[str]]:
    """Where a new map's host time goes: each step of a fresh subm3 map (cumulative, as a pass
    builds it), a fresh conv and the same conv with its map kept; host ms until the call returns
    and wall ms after a sync (the tuner's choice is made before timing)."""
    rows = []
    for scene in scenes:
        coords, _ = make_scene(scene, batch_size=2)
        coords = coords.to(device)
        feats = torch.randn(len(coords), channels, device=device, dtype=dtype)
        weight = torch.randn(27, channels, channels, device=device, dtype=dtype) / (27 * channels) ** 0.5

        def fresh(validate: bool = False) -> SparseTensor:
            return SparseTensor(coords, feats, validate=validate)

        def subm(x: SparseTensor):
            return map_request(x.cache, KernelMapKey(x.coord_id, (3, 3, 3), (1, 1, 1), (1, 1, 1), False, False))[0]

        kept = fresh(True)
        sparse_conv3d(kept, weight)  # tunes, compiles
        steps = {
            "SparseTensor (validated)": lambda: fresh(True),
            "+ packed keys": lambda: (x := fresh()).cache.keys(x.coord_id),
            "+ hash table": lambda: (x := fresh()).cache.table(x.coord_id),
            "+ neighbour query": lambda: subm(fresh()),
            "+ pair counts (sync)": lambda: subm(fresh()).pair_counts,
            "fresh conv": lambda: sparse_conv3d(fresh(), weight),
            "conv, map kept": lambda: sparse_conv3d(kept, weight),
        }
        for what, fn in steps.items():
            fn(), fn()  # with timed's own, three warm-up calls
            wall_ms, host_ms = timed(fn, device, repeats)
            rows.append([scene, f"{len(coords)}", what, f"{host_ms:.3f}", f"{wall_ms:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scenes", nargs="+", default=["street", "room"])
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=None, help="default: 20 on GPU, 5 on CPU")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--stages", action="store_true",
                        help="instead: a fresh map's host time step by step (ours only), and a conv with it kept")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; submanifold k=3, C={args.channels}->{args.channels}, {args.dtype}, batch of 2 scenes, "
          f"median of {repeats} (ms)")
    if args.stages:
        header = ["scene", "N", "step (ours)", "host ms", "wall ms"]
        rows = stage_rows(device, args.scenes, args.channels, repeats, getattr(torch, args.dtype))
    else:
        header = ["scene", "N", "what", "ours", "spconv", "spconv-triton", "naive torch"]
        rows = run(device, args.scenes, args.channels, repeats, getattr(torch, args.dtype))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if not args.stages:
        print("* anchors' map = a forward on a fresh tensor minus a forward with its indices cached")


if __name__ == "__main__":
    main()
