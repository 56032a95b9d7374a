"""Merge bench_layers.py outputs into one grid: summary lines and a markdown table.

A grid that does not fit one device call is measured in several; each log holds the rows
`bench_layers.py` printed. Rows are keyed by (scene, dtype, C, layer); a later log's row
replaces an earlier one's. Prints, for forward and forward+backward, the geometric-mean
speed-up over spconv and over the faster peer per cell, the cells that lose to a peer, the
best fraction of bf16 peak, and per family (Triton, CUTLASS) the cells it wins.

    python scripts/summarize_bench.py run1.log run2.log [--markdown]
"""

from __future__ import annotations

import argparse
import math
import statistics

COLUMNS = ["scene", "dtype", "C", "layer", "N", "ours", "spconv", "sp-triton", "naive", "ours+bwd", "spconv+bwd",
           "sp-triton+bwd", "naive+bwd", "%peak", "%bw", "chose", "triton", "cutlass", "triton+bwd", "cutlass+bwd"]


def read_rows(paths: list[str]) -> dict[tuple, dict]:
    grid: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as log:
            for line in log:
                fields = [f.strip() for f in line.split(" | ")]
                if len(fields) != len(COLUMNS) or fields[0] == "scene":
                    continue
                row = dict(zip(COLUMNS, fields))
                grid[(row["scene"], row["dtype"], int(row["C"]), row["layer"])] = row
    return grid


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def geo_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def summarize(grid: dict[tuple, dict]) -> list[str]:
    lines = [f"{len(grid)} cells"]
    for mode, suffix in (("forward", ""), ("forward+backward", "+bwd")):
        over_spconv, over_peer, losing = [], [], []
        for key, row in grid.items():
            ours = number(row["ours" + suffix])
            peers = [v for v in (number(row["spconv" + suffix]), number(row["sp-triton" + suffix])) if v]
            if ours is None or not peers:
                continue
            if number(row["spconv" + suffix]):
                over_spconv.append(number(row["spconv" + suffix]) / ours)
            over_peer.append(min(peers) / ours)
            if min(peers) < ours:
                losing.append(f"{' '.join(map(str, key))} {min(peers) / ours:.2f}x")
        lines.append(f"{mode}: {geo_mean(over_spconv):.2f}x over spconv ({len(over_spconv)} cells), "
                     f"{geo_mean(over_peer):.2f}x over the faster peer, worst {min(over_peer):.2f}x; "
                     f"{len(losing)} losing: {', '.join(losing) or 'none'}")
        wins = {"triton": 0, "cutlass": 0}
        for row in grid.values():
            triton, cutlass = number(row["triton" + suffix]), number(row["cutlass" + suffix])
            if triton and cutlass:
                wins["triton" if triton <= cutlass else "cutlass"] += 1
        if any(wins.values()):
            lines.append(f"{mode} family best: Triton {wins['triton']}, CUTLASS {wins['cutlass']} cells")
    best = max(grid.items(), key=lambda item: int(item[1]["%peak"].rstrip("%")))
    lines.append(f"best fraction of bf16 peak: {best[1]['%peak']} ({' '.join(map(str, best[0]))})")
    return lines


def markdown(grid: dict[tuple, dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in grid.values()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="bench_layers.py outputs, oldest first")
    parser.add_argument("--markdown", action="store_true", help="also print the merged grid as a markdown table")
    args = parser.parse_args()
    grid = read_rows(args.logs)
    if not grid:
        raise SystemExit(f"no bench_layers rows in {args.logs}")
    print("\n".join(summarize(grid)))
    if args.markdown:
        print("\n".join(markdown(grid)))


if __name__ == "__main__":
    main()
