"""Command line: ``python -m sparseconv demo ...`` and ``python -m sparseconv cache show|clear|export|merge|populate``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparseconv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a small encoder-decoder on a synthetic scene and print timings")
    demo.add_argument("--scene", choices=("street", "room"), default="street")
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument("--scale", type=float, default=1.0, help="multiplies the number of points of the scene")
    demo.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    demo.add_argument("--width", type=int, default=32, help="channels of the first stage")
    demo.add_argument("--iterations", type=int, default=3)
    from .tune import cli as cache_cli

    cache_cli.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "cache":
        return cache_cli.run(args)

    from .demo import format_report, run_demo

    report = run_demo(args.scene, args.batch_size, args.scale, args.device, args.width, args.iterations)
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
