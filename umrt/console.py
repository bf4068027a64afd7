"""Where umrt's reports print: a rich ``Console`` whose width does not depend on who runs it.

On a terminal it is the terminal's width; into a file, a pipe or a test (anything that is not a
terminal) it is :data:`WIDTH` columns, whatever ``COLUMNS`` says, so that a report written to a log
reads the same on every machine.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from io import StringIO
from typing import TextIO

from rich.console import Console

__all__ = ["WIDTH", "console", "text_console", "TextConsole"]

#: Columns of a report that does not go to a terminal.
WIDTH = 120


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or a file-like object without a terminal
        return False


def console(file: TextIO | None = None, *, stderr: bool = False) -> Console:
    """A rich console on ``file`` (default stdout, or stderr): the terminal's width on a terminal, else
    :data:`WIDTH`; no highlighting of numbers (a report's colours are its own)."""
    file = file if file is not None else (sys.stderr if stderr else sys.stdout)
    return Console(file=file, width=None if _is_terminal(file) else WIDTH, highlight=False)


class TextConsole:
    """A console that prints to stdout, or collects text for a callable (a test, a log) and hands it
    over in one piece with :meth:`flush_to`."""

    def __init__(self, out: Callable[[str], None] | None) -> None:
        self._buffer = StringIO() if out is not None else None
        self._console = console(self._buffer)

    def print(self, *objects: object) -> None:
        """Print as rich does (text wraps at the console's width)."""
        self._console.print(*objects)

    def flush_to(self, out: Callable[[str], None] | None) -> None:
        """Hand what was collected to ``out`` (nothing when printing to stdout)."""
        if out is not None and self._buffer is not None:
            out(self._buffer.getvalue().rstrip("\n"))


def text_console(out: Callable[[str], None] | None) -> TextConsole:
    """:class:`TextConsole` for ``out`` (None: stdout)."""
    return TextConsole(out)
