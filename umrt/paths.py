"""Checking output paths before long work: a path that cannot be written fails in one line
at the start (``umrt trace -o``, ``umrt run --plot``, ``python -m bench --out/--json/--md/--plots``),
not with a traceback after minutes of recording or simulating."""
from __future__ import annotations

import tempfile
from pathlib import Path

from umrt.errors import ConfigError

__all__ = ["check_writable", "check_writable_dir"]


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_writable_dir(path: str | Path, shown: str | None = None) -> None:
    """Files can be written into the directory ``path``: it is made if missing (as the command
    that writes there would), and a file is created in it and removed. Else a
    :class:`ConfigError` that says why, naming ``shown`` (default ``path``)."""
    shown = str(path) if shown is None else shown
    p = Path(path).absolute()
    existing = _first_existing(p)
    if not existing.is_dir():
        raise ConfigError(f"cannot write {shown!r}: {str(existing)!r} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write {shown!r}: cannot make the directory {str(p)!r} ({_why(exc)})") from None
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write {shown!r}: cannot create a file in {str(p)!r} ({_why(exc)})") from None


def check_writable(path: str | Path, *, make_dirs: bool = False) -> None:
    """A file can be written at ``path``: its directory exists (or, with ``make_dirs``, can be
    made) and can be written into (:func:`check_writable_dir`), and ``path`` is neither a
    directory nor a file we may not write. Else a :class:`ConfigError` that says why. An
    existing file is left as it is."""
    p = Path(path).absolute()
    if p.is_dir():
        raise ConfigError(f"cannot write {str(path)!r}: it is a directory")
    existing = _first_existing(p.parent)
    if not existing.is_dir():
        raise ConfigError(f"cannot write {str(path)!r}: {str(existing)!r} is a file, not a directory")
    if not make_dirs and existing != p.parent:
        raise ConfigError(f"cannot write {str(path)!r}: directory {str(p.parent)!r} does not exist")
    check_writable_dir(p.parent, str(path))
    if p.exists():
        try:
            with p.open("ab"):
                pass
        except OSError as exc:
            raise ConfigError(f"cannot write {str(path)!r}: {_why(exc)}") from None
