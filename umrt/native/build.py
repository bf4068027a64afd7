"""Building umrt's C++ libraries, and where their sources are.

The sources are this package's own files (``umrt/native/*.cpp``), in a checkout and in an
installed wheel alike (package data): found by path beside this module, never by import.
:func:`build_native` compiles one of the plain libraries (no Python API) with torch's
``cpp_extension``, cached in torch's extension directory; :func:`warn_not_built` is the one
warning a library that could not be built gives.
"""
from __future__ import annotations

import hashlib
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent  # umrt/native: the C++ sources beside their Python


def native_source(name: str) -> Path:
    """The C++ source ``name`` (``steady_alloc.cpp``, ``steady_front.cpp``,
    ``torch_alloc_shim.cpp``). The path may not exist (a broken install); the builders say so."""
    return SOURCE_DIR / name


def build_native(source: Path, stem: str, what: str, ldflags: Sequence[str] = ()) -> str:
    """Compile one of umrt's plain C++ libraries (no Python API) with torch's
    ``cpp_extension`` (cached in torch's extension directory, once per source and
    torch version) and return its path; ``what`` names it in the one-time build message.
    Raises on any build failure."""
    import torch  # optional: the build uses torch's cpp_extension; the Python schedule needs no torch
    from torch.utils import cpp_extension  # optional: same

    if not source.exists():
        raise FileNotFoundError(f"{source} is missing from the umrt installation")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    # The source's hash in the name: worktrees with different sources never rebuild over each other.
    digest = hashlib.sha1(source.read_bytes()).hexdigest()[:10]
    name = stem + "_" + re.sub(r"\W", "_", torch.__version__) + "_" + digest
    started = time.monotonic()
    path = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O2", "-std=c++17"],
                              extra_ldflags=list(ldflags), with_cuda=False, is_python_module=False)
    if time.monotonic() - started > 2:
        print(f"umrt: compiled {what} in {time.monotonic() - started:.0f} s (cached for later runs)",
              file=sys.stderr)
    return str(path)


def warn_not_built(what: str, exc: BaseException, instead: str) -> None:
    """The one warning a native library that could not be built gives: ``what`` failed
    (the error's first line), what umrt does ``instead``, and what a build needs."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    warnings.warn(f"umrt: could not build {what} ({type(exc).__name__}: {first_line}); {instead}. It needs a "
                  "C++ compiler, ninja and torch.", RuntimeWarning, stacklevel=4)
