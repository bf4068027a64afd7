"""Running a user's training script as ``__main__``: ``umrt run``, shadow mode
(:mod:`umrt.shadow`) and ``umrt trace -- script.py``.

A script that raises shows what ``python script.py`` would show: its own
traceback, without the frames of umrt and runpy that ran it (:func:`report_script_error`),
and the exit status 1.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from types import TracebackType


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


def exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``exc`` (a non-integer message is printed to stderr: 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_UMRT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _runs_scripts(filename: str) -> bool:
    """A frame of what ran the script: umrt's own code or runpy (frozen from Python 3.11)."""
    return filename.startswith(_UMRT_DIR) or filename in (runpy.__file__, "<frozen runpy>")


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its leading frames of umrt and runpy, which ran the script: from the
    script's first frame on. None when no frame is left (a SyntaxError in the script: its
    location is in the exception itself)."""
    while tb is not None and _runs_scripts(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def report_script_error(exc: BaseException) -> int:
    """Print ``exc``, raised by a script, as Python prints an uncaught exception (through
    ``sys.excepthook``, so a script's own hook is used) from the script's first frame on;
    return the status ``python`` exits with (1)."""
    tb = user_traceback(exc.__traceback__)
    sys.stdout.flush()
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    return 1


def run_script(script: str, argv: list[str], *, passthrough: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *argv]``; return its exit status.

    Its directory goes on ``sys.path`` with symlinks resolved, as ``python script.py`` does.
    An exception it raises is printed as Python prints it (:func:`report_script_error`)
    and the status is 1; ``KeyboardInterrupt`` and the ``passthrough`` exceptions (a
    recorder's stop signal) propagate.
    """
    with as_main([script, *argv], os.path.dirname(os.path.realpath(script))):
        try:
            runpy.run_path(os.path.abspath(script), run_name="__main__")  # as python: __file__ absolute
        except SystemExit as exc:
            return exit_status(exc)
        except (KeyboardInterrupt, *passthrough):
            raise
        except BaseException as exc:  # noqa: BLE001 - the script's own error, shown as python shows it
            return report_script_error(exc)
    return 0


def run_module(module: str, argv: list[str], *, passthrough: tuple[type[BaseException], ...] = ()) -> int:
    """:func:`run_script` for ``python -m module [argv...]``: ``sys.argv = [module, *argv]``."""
    with as_main([module, *argv], os.getcwd()):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            return exit_status(exc)
        except (KeyboardInterrupt, *passthrough):
            raise
        except BaseException as exc:  # noqa: BLE001 - the module's own error, shown as python shows it
            return report_script_error(exc)
    return 0
