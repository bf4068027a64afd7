"""Building umrt's C++ libraries, and where their sources are.

The sources are this package's own files (``umrt/native/*.cpp``), in a checkout and in an
installed wheel alike (package data): found by path beside this module, never by import.
:func:`build_native` compiles one of the plain libraries (no Python API) with torch's
``cpp_extension``, cached in torch's extension directory, with the headers generated for it
(the steady schedule's: :func:`umrt.native.constants.cpp_header` and
:func:`umrt.native.tables.c_table_header`); :func:`warn_not_built` is the one warning a library
that could not be built gives.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent  # umrt/native: the C++ sources beside their Python


def native_source(name: str) -> Path:
    """The C++ source ``name`` (``steady_alloc.cpp``, ``steady_front.cpp``,
    ``torch_alloc_shim.cpp``). The path may not exist (a broken install); the builders say so."""
    return SOURCE_DIR / name


def build_native(source: Path, stem: str, what: str, ldflags: Sequence[str] = (),
                 headers: Mapping[str, str] | None = None) -> str:
    """Compile one of umrt's plain C++ libraries (no Python API) with torch's
    ``cpp_extension`` (cached in torch's extension directory, once per source, generated
    headers and torch version) and return its path; ``what`` names it in the one-time build
    message. ``headers`` (file name -> text) are generated headers the source includes:
    written into an include directory of the build's own. Raises on any build failure."""
    import torch  # optional: the build uses torch's cpp_extension; the Python schedule needs no torch
    from torch.utils import cpp_extension  # optional: same

    if not source.exists():
        raise FileNotFoundError(f"{source} is missing from the umrt installation")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    headers = dict(headers or {})
    # The hash of the source and its generated headers in the name: worktrees with different
    # sources, or different constants, never rebuild over each other.
    sha = hashlib.sha1(source.read_bytes())
    for name in sorted(headers):
        sha.update(f"\0{name}\0{headers[name]}".encode())
    name = stem + "_" + re.sub(r"\W", "_", torch.__version__) + "_" + sha.hexdigest()[:10]
    # Beside the build's own directory, under the root torch builds in (as cpp_extension picks it).
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    include = Path(root) / (name + "_include")
    for header, text in headers.items():
        _write_once(include / header, text)
    started = time.monotonic()
    path = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O2", "-std=c++17"],
                              extra_ldflags=list(ldflags), extra_include_paths=[str(include)] if headers else None,
                              with_cuda=False, is_python_module=False)
    if time.monotonic() - started > 2:
        print(f"umrt: compiled {what} in {time.monotonic() - started:.0f} s (cached for later runs)",
              file=sys.stderr)
    return str(path)


def _write_once(path: Path, text: str) -> None:
    """``text`` at ``path``, unless it is there already; written to a private file and renamed
    into place, so a process building at the same time never reads half of it."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def warn_not_built(what: str, exc: BaseException, instead: str) -> None:
    """The one warning a native library that could not be built gives: ``what`` failed
    (the error's first line), what umrt does ``instead``, and what a build needs."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    warnings.warn(f"umrt: could not build {what} ({type(exc).__name__}: {first_line}); {instead}. It needs a "
                  "C++ compiler, ninja and torch.", RuntimeWarning, stacklevel=4)
