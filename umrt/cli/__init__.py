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

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")  # :func:`umrt.x`, :py:class:`~a.B`
_LITERAL = re.compile(r"``([^`]+)``")
_LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)  # "Example::" introducing a literal block


def plain_text(text: str) -> str:
    """reST inline markup as plain text: ``x`` and :role:`x` become x (:role:`~a.x`:
    x), a trailing "::" becomes ":". Single back-quotes (command names) stay."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    text = _LITERAL.sub(r"\1", text)
    return _LITERAL_BLOCK.sub(r"\1:", text)


#: What argparse takes for a value rather than an option: negative numbers, as it does, and negative
#: amounts ("-20%"), so that ``--gpu-memory -20%`` gets umrt's message about the amount.
_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*\.?\d*%")


class Renamed(argparse.Action):
    """An old spelling of a flag, kept for one version: it stores into the new flag's ``dest`` and
    prints one note saying what to write now (hidden from ``--help``). ``note`` replaces the
    default note (``--old is now --new``) where the meaning changed too."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", note: str = "",
                 prefix: str = "umrt", append: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.new, self.note, self.prefix, self.append = new, note, prefix, append

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        note = self.note or f"{option_string} is now {self.new} (the same meaning)"
        print(f"{self.prefix}: note: {note}", file=sys.stderr)
        if self.append:  # as action="append": each use adds one
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


class PlainHelpParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help and usage print as plain text (:func:`plain_text`) and
    that reads ``-20%`` as a value (:data:`_NEGATIVE`); its subcommand parsers are of the same class."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._negative_number_matcher = _NEGATIVE  # argparse's own test for "a value, not an option"

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())


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
