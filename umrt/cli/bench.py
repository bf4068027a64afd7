"""``umrt bench ...``: runs ``python -m bench ...`` of a checkout of umrt's repository.

umrt does not import the benchmarks (``bench/`` builds on umrt, not the other way): this
subcommand hands its command line to the ``bench`` program where one is importable.
"""
from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys

from umrt.errors import UmrtError

#: ``sys.argv[0]`` while bench runs under ``umrt bench`` (its help then names this command).
PROG = "umrt bench"


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="simulate a grid of models x budgets x GPU profiles x policies "
                                                 "(python -m bench of a checkout of umrt's repository)",
                                   prefix_chars="\0", add_help=False)  # everything that follows is bench's
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_run)


def _bench_found() -> bool:
    try:
        return importlib.util.find_spec("bench.cli") is not None
    except (ImportError, ValueError, AttributeError):  # a parent that is not a package, or a blocked module
        return False


def _run(args: argparse.Namespace) -> int:
    if not _bench_found():
        raise UmrtError("`umrt bench` runs the benchmarks of a checkout of umrt's repository (bench/ is not "
                        "installed with umrt): run it from the checkout, as `python -m bench ...`")
    argv = sys.argv
    sys.argv = [PROG, *args.args]
    try:  # bench exits with its own status
        runpy.run_module("bench", run_name="__main__")  # (sys.argv[0] stays PROG: bench's help names it)
    finally:
        sys.argv = argv
    return 0
