"""numba CUDA kernels for calibration probes (checked under ``NUMBA_ENABLE_CUDASIM=1``;
``umrt calibrate`` itself runs CuPy's).

* :func:`touch_pages` - one thread per page writes one element of each page
  of a (managed) array: the cheapest way to fault every page in, used to
  time fault batches and fault-driven bandwidth.
* :func:`triad` / :func:`copy` - STREAM kernels (McCalpin) with a grid-stride
  loop, for device bandwidth and prefetched-vs-faulted comparisons.

Kernels are compiled on first use (numba is imported lazily, so
``import kernels`` is cheap and works without a GPU). Before numba's CUDA
target is imported, :func:`numpy_compat` restores the one numpy name that
numba-cuda 0.30 still registers and numpy 2.5 removed.
"""
from __future__ import annotations

import functools
from typing import Any

THREADS = 256
MAX_BLOCKS = 65535


def numpy_compat() -> bool:
    """Let numba-cuda compile on numpy >= 2.5; returns whether numpy needed it.

    numba-cuda 0.30 registers an overload for ``np.row_stack`` when its CUDA
    target first compiles; numpy 2.5 removed that name (an alias of
    ``np.vstack`` since numpy 2.0), so every kernel then fails to compile with
    an AttributeError. Where the name is missing it is set to ``np.vstack``
    (what it was), and nothing else changes; with an older numpy this does
    nothing.
    """
    import numpy

    if hasattr(numpy, "row_stack"):
        return False
    numpy.row_stack = numpy.vstack
    return True


@functools.lru_cache(maxsize=1)
def _compiled() -> dict[str, Any]:
    numpy_compat()  # before numba.cuda is imported (by _jit) and compiles anything
    from kernels import _jit

    return {"touch": _jit.touch_kernel, "triad": _jit.triad_kernel, "copy": _jit.copy_kernel}


def _blocks(n: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-n // THREADS)))


def touch_pages(arr: Any, page_bytes: int = 4096, value: float = 1, stream: Any = 0) -> int:
    """Add ``value`` to the first element of every ``page_bytes`` page of ``arr``; returns pages touched."""
    if page_bytes <= 0 or page_bytes % arr.dtype.itemsize:
        raise ValueError(f"page_bytes={page_bytes} must be a positive multiple of the item size {arr.dtype.itemsize}")
    stride = page_bytes // arr.dtype.itemsize
    pages = -(-arr.shape[0] // stride)
    _compiled()["touch"][_blocks(pages), THREADS, stream](arr, stride, value)
    return pages


def triad(a: Any, b: Any, c: Any, scalar: float, stream: Any = 0) -> None:
    """STREAM triad ``a = b + scalar * c`` (equal 1-D arrays)."""
    if not a.shape == b.shape == c.shape:
        raise ValueError(f"triad needs equal shapes, got {a.shape}, {b.shape}, {c.shape}")
    _compiled()["triad"][_blocks(a.shape[0]), THREADS, stream](a, b, c, scalar)


def copy(dst: Any, src: Any, stream: Any = 0) -> None:
    """STREAM copy ``dst = src``."""
    if dst.shape != src.shape:
        raise ValueError(f"copy needs equal shapes, got {dst.shape}, {src.shape}")
    _compiled()["copy"][_blocks(dst.shape[0]), THREADS, stream](dst, src)


__all__ = ["touch_pages", "triad", "copy", "numpy_compat", "THREADS"]
