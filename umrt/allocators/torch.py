"""Route PyTorch's CUDA allocations to umrt's managed pool.

    import umrt.allocators.torch as ut
    ut.install(pool)            # before the first CUDA tensor

:func:`install` builds two ctypes callbacks with the C signatures of
``torch.cuda.memory.CUDAPluggableAllocator``::

    void* alloc(ssize_t size, int device, cudaStream_t stream);
    void  free(void* ptr, ssize_t size, int device, cudaStream_t stream);

hands their addresses to ``torch._C._cuda_customAllocator`` and swaps the
result in with ``torch.cuda.memory.change_current_allocator``. The callback
objects are kept in a module-level list for the life of the process: torch
keeps calling them after any Python reference would have died (freed
callbacks crash, as other projects learned).

Limits of torch's pluggable-allocator API (PyTorch 2.4-2.13), and what umrt
does about them:

* It must run before the first CUDA allocation; afterwards torch refuses
  ("Can't swap an already initialized allocator") and :func:`install` raises
  :class:`AllocatorError` saying so.
* torch's stats (``memory_allocated``...) raise "not supported": use
  :func:`umrt.memory_stats` / :func:`umrt.statistics`.
* ``torch.cuda.empty_cache()`` does nothing for a pluggable allocator:
  call :func:`empty_cache` (umrt's pool) instead.
* Out of memory: ``CUDAPluggableAllocator::malloc`` does not check the
  pointer it gets back, so an exception cannot cross the C callback and
  torch cannot raise ``torch.cuda.OutOfMemoryError`` from it. Managed memory
  only runs out when host memory does; umrt then prints a clear message and
  stops the process (``os.abort``) rather than hand torch a NULL pointer that
  a kernel would write through. :func:`check_oom` raises
  ``torch.cuda.OutOfMemoryError`` for code that calls the pool directly.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

from umrt.errors import UmrtError

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

_KEEP_ALIVE: list[Any] = []  # callbacks and allocator objects, never released
_state: dict[str, Any] = {"pool": None, "installed": False}
_lock = threading.Lock()


class AllocatorError(UmrtError):
    """The torch allocator cannot be installed (CPU build, too late, ...)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise AllocatorError("umrt's torch allocator needs PyTorch; install a CUDA build of torch") from None
    if not hasattr(torch._C, "_cuda_customAllocator") or torch.version.cuda is None:
        raise AllocatorError(
            f"this PyTorch ({torch.__version__}) is a CPU-only build: umrt's allocator needs a CUDA "
            "build of torch (https://pytorch.org/get-started/locally/)"
        )
    return torch


def _alloc(size: int, device: int, stream: int | None) -> int:
    pool = _state["pool"]
    try:
        return pool.malloc(int(size), stream or 0) if size > 0 else 0
    except Exception as exc:  # noqa: BLE001 - nothing may escape a C callback
        _fatal(f"umrt: out of managed memory: allocating {size} bytes on cuda:{device} failed: {exc}")
        return 0  # not reached


def _free(ptr: int | None, size: int, device: int, stream: int | None) -> None:
    if not ptr:
        return
    try:
        _state["pool"].free(ptr)
    except Exception as exc:  # noqa: BLE001
        print(f"umrt: error freeing {ptr:#x} ({size} bytes): {exc}", file=sys.stderr)


def _fatal(message: str) -> None:
    print(message, file=sys.stderr)
    print(
        "umrt: torch's pluggable-allocator API cannot raise torch.cuda.OutOfMemoryError from the "
        "allocation callback; stopping here instead of returning a NULL pointer",
        file=sys.stderr,
    )
    sys.stderr.flush()
    os.abort()


def make_callbacks(pool: Any) -> tuple[Any, Any, int, int]:
    """The two ctypes callbacks over ``pool`` and their integer addresses (kept alive)."""
    _state["pool"] = pool
    c_alloc, c_free = ALLOC_FN(_alloc), FREE_FN(_free)
    _KEEP_ALIVE.extend((c_alloc, c_free))
    alloc_ptr = ctypes.cast(c_alloc, ctypes.c_void_p).value
    free_ptr = ctypes.cast(c_free, ctypes.c_void_p).value
    return c_alloc, c_free, int(alloc_ptr), int(free_ptr)


def install(pool: Any) -> None:
    """Make ``pool`` torch's CUDA allocator (must precede the first CUDA allocation).

    Calling it again with a pool already installed just repoints the
    callbacks at the new pool (torch's allocator cannot be swapped twice).
    """
    with _lock:
        if _state["installed"]:
            _state["pool"] = pool
            return
        torch = _torch()
        _, _, alloc_ptr, free_ptr = make_callbacks(pool)
        allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        _KEEP_ALIVE.append(allocator)
        try:
            torch._C._cuda_changeCurrentAllocator(allocator)
        except RuntimeError as exc:
            raise AllocatorError(
                f"torch's CUDA allocator is already initialized ({exc}), so umrt cannot take over: "
                "call umrt.enable() (or set UMRT=1) before the first CUDA tensor is created"
            ) from exc
        _state["installed"] = True
        _patch_empty_cache(torch)


def _patch_empty_cache(torch: Any) -> None:
    """``torch.cuda.empty_cache()`` also empties umrt's pool (torch's own call is a no-op here)."""
    original = torch.cuda.empty_cache

    def empty_cache_with_umrt() -> None:
        empty_cache()
        original()

    empty_cache_with_umrt.__doc__ = original.__doc__
    torch.cuda.empty_cache = empty_cache_with_umrt
    torch.cuda.memory.empty_cache = empty_cache_with_umrt


def installed() -> bool:
    """True once torch allocates through umrt."""
    return bool(_state["installed"])


def empty_cache() -> None:
    """Release umrt's cached, unused managed memory where the pool supports it."""
    pool = _state["pool"]
    if pool is not None:
        pool.empty_cache()


def check_oom(exc: BaseException, nbytes: int) -> BaseException:
    """``torch.cuda.OutOfMemoryError`` for a pool error (for callers outside the C callback)."""
    try:
        import torch

        return torch.cuda.OutOfMemoryError(f"umrt: out of managed memory allocating {nbytes} bytes: {exc}")
    except (ImportError, AttributeError):
        return MemoryError(str(exc))
