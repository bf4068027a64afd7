"""``umrt bench ...``: the same as ``python -m bench ...`` (see bench/cli.py)."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from bench.cli import DESCRIPTION, EPILOG, add_arguments

    parser = subparsers.add_parser(
        "bench",
        help="simulate a grid of models x budgets x GPU profiles x policies",
        description=DESCRIPTION,
        epilog=EPILOG.replace("python -m bench", "umrt bench"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
