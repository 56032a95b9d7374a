"""Command line: ``python -m sparseconv demo ...``, ``python -m sparseconv cache show|clear|export|merge|populate``,
``python -m sparseconv tune populate|export`` and ``python -m sparseconv cutlass status|build``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparseconv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small MinkUNet to segment synthetic scenes; print loss, mIoU and the tuned algorithms")
    demo.add_argument("--scene", choices=("street", "room"), default="street")
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument("--scale", type=float, default=None, help="multiplies the points per scene (default 1)")
    demo.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    demo.add_argument("--width", type=int, default=None, help="channels of the stem (default 8)")
    demo.add_argument("--steps", "--iterations", dest="steps", type=int, default=None, help="training steps (default 200)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default=None, metavar="FILE.png", help="save a bird's-eye picture (needs matplotlib)")
    from .cli import cache as cache_cli
    from .cli import populate as tune_cli

    from .cli import cutlass as cutlass_cli

    cache_cli.add_parser(commands)
    tune_cli.add_parser(commands)
    cutlass_cli.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "cache":
        return cache_cli.run(args)
    if args.command == "tune":
        return tune_cli.run(args)
    if args.command == "cutlass":
        return cutlass_cli.run(args)

    from .cli.demo import format_report, run_demo

    report = run_demo(args.scene, args.batch_size, args.scale, args.device, args.width, args.steps,
                      seed=args.seed, plot=args.plot)
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
