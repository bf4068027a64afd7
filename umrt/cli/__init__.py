"""The ``umrt`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds a parser whose ``func`` default takes the
parsed arguments and returns an exit status.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from umrt import __version__
from umrt.errors import UmrtError

SUBCOMMANDS = ("trace", "simulate", "run", "bench", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="umrt",
        description="CUDA Unified Memory prefetching runtime for deep learning.",
    )
    parser.add_argument("--version", action="version", version=f"umrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"umrt.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UmrtError as exc:
        print(f"umrt: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("umrt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
