"""``umrt bench ...``: the same as ``python -m bench ...`` (see bench/cli.py)."""
from __future__ import annotations

import argparse

from umrt.errors import UmrtError


def register(subparsers) -> None:
    try:
        from bench.cli import DESCRIPTION, EPILOG, add_arguments
    except ImportError:  # an installed umrt: the benchmarks live in the repository only
        _register_missing(subparsers)
        return

    parser = subparsers.add_parser(
        "bench",
        help="simulate a grid of models x budgets x GPU profiles x policies",
        description=DESCRIPTION,
        epilog=EPILOG.replace("python -m bench", "umrt bench"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)


def _register_missing(subparsers) -> None:
    """``umrt bench`` where the ``bench`` package is not importable: one clear line."""
    parser = subparsers.add_parser("bench", help="simulate a grid of models x budgets x GPU profiles x policies "
                                                 "(needs a checkout of umrt's repository)",
                                   prefix_chars="\0", add_help=False)  # whatever follows: the one message
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_missing)


def _missing(args: argparse.Namespace) -> int:
    raise UmrtError("`umrt bench` runs the benchmarks of a checkout of umrt's repository (bench/ is not "
                    "installed with umrt): run it from the checkout, as `python -m bench ...`")
