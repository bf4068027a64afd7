"""The ``umrt`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds a parser whose ``func`` default takes the
parsed arguments and returns an exit status. Every parser is a
:class:`PlainHelpParser`, so help text may be written as reST (module
docstrings are) and still prints as plain text.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any

from umrt import __version__
from umrt.errors import UmrtError

SUBCOMMANDS = ("trace", "simulate", "run", "bench", "calibrate", "doctor")
REPORT_WIDTH = 120  # columns of a report written to a file or a pipe (the same on every machine)

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")  # :func:`umrt.x`, :py:class:`~a.B`
_LITERAL = re.compile(r"``([^`]+)``")
_LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)  # "Example::" introducing a literal block


def plain_text(text: str) -> str:
    """reST inline markup as plain text: ``x`` and :role:`x` become x (:role:`~a.x`:
    x), a trailing "::" becomes ":". Single back-quotes (command names) stay."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    text = _LITERAL.sub(r"\1", text)
    return _LITERAL_BLOCK.sub(r"\1:", text)


class PlainHelpParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help and usage print as plain text (:func:`plain_text`);
    its subcommand parsers are of the same class."""

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())


def make_console(*, stderr: bool = False) -> Any:
    """A ``rich`` console for a command's report: as wide as the terminal on a terminal,
    :data:`REPORT_WIDTH` columns otherwise (a log, a pipe, a test's captured output), so
    that what a command writes does not depend on the machine, ``COLUMNS`` or the load."""
    # optional: rich is imported by the commands that print tables only
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else REPORT_WIDTH)


def build_parser() -> argparse.ArgumentParser:
    parser = PlainHelpParser(
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
