"""Running a user's training script as ``__main__``: ``umrt run``, shadow mode
(:mod:`umrt.shadow`) and ``umrt trace -- script.py``."""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def as_main(argv: list[str], path: str | None) -> Iterator[None]:
    """A script's view for the block: ``sys.argv = argv`` and ``path`` (its directory) first on
    ``sys.path``; both restored afterwards."""
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = list(argv)
    if path is not None:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run_script(script: str, argv: list[str]) -> int:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *argv]``; return its exit status
    (a non-integer ``SystemExit`` message is printed to stderr and counts as 1). Its directory
    goes on ``sys.path`` with symlinks resolved, as ``python script.py`` does."""
    with as_main([script, *argv], os.path.dirname(os.path.realpath(script))):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
            if code is None:
                return 0
            if isinstance(code, int):
                return code
            print(code, file=sys.stderr)
            return 1
    return 0
