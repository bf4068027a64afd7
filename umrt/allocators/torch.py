"""Route PyTorch's CUDA allocations to umrt's managed pool.

    import umrt.allocators.torch as ut
    ut.install(pool)            # before the first CUDA tensor

torch's pluggable-allocator API (``torch.cuda.memory.CUDAPluggableAllocator``)
takes two C functions::

    void* alloc(ssize_t size, int device, cudaStream_t stream);
    void  free(void* ptr, ssize_t size, int device, cudaStream_t stream);

umrt's allocator is Python, so :func:`install` wraps the pool in two ctypes
callbacks with these signatures. They are kept in a module-level list for
the life of the process: torch keeps calling them after any Python reference
would have died (freed callbacks crash, as other projects learned).

torch does not check the pointer ``alloc`` returns, and a ctypes callback
cannot raise, so by default torch is handed a small C++ shim instead
(``umrt/native/torch_alloc_shim.cpp``): its ``umrt_alloc`` / ``umrt_free``
forward to the callbacks, and when the pool is out of memory ``umrt_alloc``
throws ``c10::OutOfMemoryError``, which torch turns into
``torch.cuda.OutOfMemoryError`` in the Python code that asked for the
tensor (catch it, free memory, retry: the usual torch recipe works). The shim
is compiled on first use with ``torch.utils.cpp_extension.load`` (needs a
C++ compiler and ninja; 10-20 s once, then cached under torch's extension
directory, ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). If it
cannot be built, umrt warns once and hands torch the ctypes callbacks
directly; an out-of-memory then prints a clear message and stops the process
(``os.abort``) rather than give torch a NULL pointer that a kernel would
write through.

Other limits of the pluggable-allocator API (PyTorch 2.4-2.13), and what
umrt does about them:

* It must run before the first CUDA allocation; afterwards torch refuses
  ("Can't swap an already initialized allocator") and :func:`install` raises
  :class:`AllocatorError` saying so.
* torch's stats (``memory_allocated``...) raise "not supported": umrt
  answers them from its own counters (:func:`_patch_memory_stats`); more in
  :func:`umrt.memory_stats` / :func:`umrt.statistics`.
* ``torch.cuda.empty_cache()`` does nothing for a pluggable allocator: umrt
  patches it to also empty umrt's pool (:func:`empty_cache`).
* ``Tensor.record_stream`` reaches a pluggable allocator only through
  ``set_record_stream_fn``: umrt gives it ``umrt_record_stream`` (the shim),
  and the pool orders the block's next use and discard after that stream
  (:meth:`umrt.allocators.managed.ManagedPool.record_stream`).
* :func:`check_oom` builds ``torch.cuda.OutOfMemoryError`` for code that
  calls the pool directly.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umrt import stats
from umrt.errors import UmrtError
from umrt.native.build import native_source
from umrt.native.signatures import declare

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
RECORD_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)

_KEEP_ALIVE: list[Any] = []  # callbacks and allocator objects, never released
_state: dict[str, Any] = {"pool": None, "installed": False, "shim": None}
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
        shim = _state["shim"]
        if shim is not None:  # the shim raises torch.cuda.OutOfMemoryError with this reason
            shim.set_error(f"{type(exc).__name__}: {exc}")
            return 0
        _fatal(f"umrt: out of managed memory: allocating {size} bytes on cuda:{device} failed: {exc}")
        return 0  # not reached


def _free(ptr: int | None, size: int, device: int, stream: int | None) -> None:
    if not ptr:
        return
    try:
        _state["pool"].free(ptr)
    except Exception as exc:  # noqa: BLE001
        print(f"umrt: error freeing {ptr:#x} ({size} bytes): {exc}", file=sys.stderr)


def _record_stream(ptr: int | None, stream: int | None) -> None:
    if not ptr:
        return
    try:
        _state["pool"].record_stream(ptr, stream or 0)
    except Exception as exc:  # noqa: BLE001 - nothing may escape a C callback
        print(f"umrt: error recording stream {stream or 0:#x} for {ptr:#x}: {exc}", file=sys.stderr)


def record_stream_callback() -> int:
    """The address of a ctypes callback ``void (void* ptr, cudaStream_t stream)`` that
    passes torch's ``record_stream`` to the pool of :func:`make_callbacks` (kept alive)."""
    c_record = RECORD_FN(_record_stream)
    _KEEP_ALIVE.append(c_record)
    return int(ctypes.cast(c_record, ctypes.c_void_p).value)


def _fatal(message: str) -> None:
    print(message, file=sys.stderr)
    print(
        "umrt: the allocator shim that raises torch.cuda.OutOfMemoryError is not in use (see the "
        "warning at start-up), and a ctypes callback cannot raise; stopping here instead of "
        "returning a NULL pointer",
        file=sys.stderr,
    )
    sys.stderr.flush()
    os.abort()


def callback_pool() -> Any:
    """The pool umrt's callbacks (:func:`make_callbacks`) serve now; ``None`` before any."""
    return _state["pool"]


def repoint_callbacks(pool: Any) -> None:
    """Serve umrt's callbacks (every one made so far) from ``pool`` from now on."""
    _state["pool"] = pool


def make_callbacks(pool: Any) -> tuple[Any, Any, int, int]:
    """The two ctypes callbacks over ``pool`` and their integer addresses (kept alive)."""
    _state["pool"] = pool
    c_alloc, c_free = ALLOC_FN(_alloc), FREE_FN(_free)
    _KEEP_ALIVE.extend((c_alloc, c_free))
    alloc_ptr = ctypes.cast(c_alloc, ctypes.c_void_p).value
    free_ptr = ctypes.cast(c_free, ctypes.c_void_p).value
    return c_alloc, c_free, int(alloc_ptr), int(free_ptr)


@dataclass(frozen=True)
class Shim:
    """The compiled allocator shim: its library path and entry points."""

    path: str
    module: Any  # the Python module (``_try_alloc`` / ``_try_free`` test hooks)
    lib: ctypes.CDLL

    def set_callbacks(self, alloc_ptr: int, free_ptr: int) -> None:
        """Point ``umrt_alloc`` / ``umrt_free`` at umrt's callbacks (C function addresses)."""
        self.lib.umrt_set_callbacks(ctypes.c_void_p(alloc_ptr), ctypes.c_void_p(free_ptr))

    def set_error(self, message: str) -> None:
        """Why this thread's allocation failed (goes into the OutOfMemoryError message)."""
        self.lib.umrt_set_error(message.encode("utf-8", "replace"))

    def set_record_stream(self, record_ptr: int) -> None:
        """Point ``umrt_record_stream`` at umrt's record-stream callback (a C function address)."""
        self.lib.umrt_set_record_stream(ctypes.c_void_p(record_ptr or None))

    @property
    def record_stream_address(self) -> int:
        """``umrt_record_stream``: what torch's allocator is given for ``record_stream``."""
        return int(ctypes.cast(self.lib.umrt_record_stream, ctypes.c_void_p).value)


def _shim_source() -> Path:
    """``umrt/native/torch_alloc_shim.cpp``."""
    return native_source("torch_alloc_shim.cpp")


@functools.lru_cache(maxsize=1)
def load_shim() -> Shim | None:
    """Compile (first time) and load the allocator shim; ``None``, with one warning, if that fails.

    The build is cached by torch (keyed on this torch version and the source),
    so later processes only load it.
    """
    try:
        import torch
        from torch.utils import cpp_extension

        source = _shim_source()
        name = "umrt_torch_alloc_shim_" + re.sub(r"\W", "_", torch.__version__)
        if not source.exists():
            raise FileNotFoundError(f"{source} is missing from the umrt installation")
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (pip install ninja)")
        from rich.console import Console

        started = time.monotonic()
        with Console(stderr=True).status("umrt: building the torch allocator shim (first use only)"):
            module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O2"], with_cuda=False)
        if time.monotonic() - started > 2:
            print(f"umrt: compiled the torch allocator shim in {time.monotonic() - started:.0f} s "
                  "(cached for later runs)", file=sys.stderr)
        lib = declare(ctypes.CDLL(module.__file__), "torch_alloc_shim.cpp")
        return Shim(path=module.__file__, module=module, lib=lib)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the ctypes path"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(
            f"umrt: could not build the torch allocator shim ({first_line}); torch allocates through "
            "umrt's ctypes callbacks instead, so running out of managed memory stops the process "
            "instead of raising torch.cuda.OutOfMemoryError. The shim needs a C++ compiler and ninja.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def install(pool: Any, *, shim: bool = True, front: Any = None) -> None:
    """Make ``pool`` torch's CUDA allocator (must precede the first CUDA allocation).

    Args:
        pool: anything with ``malloc(nbytes, stream) -> ptr`` and ``free(ptr)``
            (:class:`umrt.native.server.SteadyServer` over a
            :class:`umrt.allocators.managed.ManagedPool`).
        shim: hand torch the compiled shim (:func:`load_shim`) so an
            out-of-memory raises ``torch.cuda.OutOfMemoryError``; ``False``
            (or a failed build) hands it the ctypes callbacks directly.
        front: the native allocation front (:class:`umrt.native.front.Front`):
            torch's calls go to it first (a native steady schedule serves them
            without Python), and to the ctypes callbacks when it declines.

    Calling it again with a pool already installed just repoints the
    callbacks at the new pool (torch's allocator cannot be swapped twice).
    """
    with _lock:
        if _state["installed"]:
            _state["pool"] = pool
            return
        torch = _torch()
        _, _, alloc_ptr, free_ptr = make_callbacks(pool)
        record_ptr = record_stream_callback()
        if front is not None:  # the front first; the callbacks where it declines
            front.set_fallback(alloc_ptr, free_ptr, record_ptr)
            alloc_ptr, free_ptr, record_ptr = front.malloc_address, front.free_address, front.record_stream_address
        loaded = load_shim() if shim else None
        if loaded is not None:
            loaded.set_callbacks(alloc_ptr, free_ptr)
            loaded.set_record_stream(record_ptr)
            record_ptr = loaded.record_stream_address
            pluggable = torch.cuda.memory.CUDAPluggableAllocator(loaded.path, "umrt_alloc", "umrt_free")
            _KEEP_ALIVE.append(pluggable)
            allocator = pluggable.allocator()
        else:
            allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        _KEEP_ALIVE.append(allocator)
        _give_record_stream(torch, allocator, record_ptr)
        try:
            torch._C._cuda_changeCurrentAllocator(allocator)
        except RuntimeError as exc:
            raise AllocatorError(
                f"torch's CUDA allocator is already initialized ({exc}), so umrt cannot take over: "
                "call umrt.enable() (or set UMRT=1) before the first CUDA tensor is created"
            ) from exc
        _state["shim"] = loaded
        _state["installed"] = True
        _patch_empty_cache(torch)
        _patch_memory_stats(torch)


def _give_record_stream(torch: Any, allocator: Any, record_ptr: int) -> None:
    """Hand torch's ``Tensor.record_stream`` to umrt: ``CUDAPluggableAllocator::recordStream``
    calls the function given to ``set_record_stream_fn`` (``torch/csrc/cuda/Module.cpp`` binds
    it on ``torch._C._CUDAPluggableAllocator``); without it the call does nothing, and a
    tensor used on a second stream must be ordered by the program (``wait_stream``)."""
    setter = getattr(allocator, "set_record_stream_fn", None)
    if setter is None:
        warnings.warn(f"umrt: torch {torch.__version__} does not pass Tensor.record_stream to a pluggable "
                      "allocator: a tensor used on a second stream must be kept alive, or its stream "
                      "synchronized (wait_stream), until that stream's work is done", RuntimeWarning,
                      stacklevel=3)
        return
    setter(record_ptr)


def _patch_empty_cache(torch: Any) -> None:
    """``torch.cuda.empty_cache()`` also empties umrt's pool (torch's own call is a no-op here)."""
    original = torch.cuda.empty_cache

    def empty_cache_with_umrt() -> None:
        empty_cache()
        original()

    empty_cache_with_umrt.__doc__ = original.__doc__
    torch.cuda.empty_cache = empty_cache_with_umrt
    torch.cuda.memory.empty_cache = empty_cache_with_umrt


def _patch_memory_stats(torch: Any) -> None:
    """torch's memory statistics answered from umrt's: a pluggable allocator has none
    (torch raises "CUDAPluggableAllocator does not yet support getDeviceStats"), so a
    script that logs ``torch.cuda.max_memory_allocated()`` stopped at its first log.
    ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
    ``max_memory_reserved``, ``memory_stats`` and ``memory_summary`` read
    :func:`umrt.memory_stats`'s counters (allocated: live tensors' requested bytes; reserved:
    the managed memory umrt's pool holds, its peak the most these calls have seen), for the
    whole process; ``reset_peak_memory_stats`` and ``reset_accumulated_memory_stats`` reset
    umrt's peak and totals."""
    mem, seen = torch.cuda.memory, {"reserved_peak": 0}

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        totals, reserved = stats.process_statistics(), stats.reserved_bytes()  # cheap: a script may log every step
        seen["reserved_peak"] = max(seen["reserved_peak"], reserved)

        def metric(current: int, peak: int, allocated: int = 0, freed: int = 0) -> dict[str, dict[str, int]]:
            whole = {"current": current, "peak": peak, "allocated": allocated, "freed": freed}
            return {"all": whole, "large_pool": dict(whole), "small_pool": dict.fromkeys(whole, 0)}

        live = metric(totals.current_bytes, totals.peak_bytes, totals.total_bytes,
                      totals.total_bytes - totals.current_bytes)
        count = metric(totals.current_count, totals.peak_count, totals.total_count,
                       totals.total_count - totals.current_count)
        return {"allocated_bytes": live, "active_bytes": live, "requested_bytes": live,
                "reserved_bytes": metric(reserved, seen["reserved_peak"]), "inactive_split_bytes": metric(0, 0),
                "allocation": count, "active": count, "segment": metric(0, 0), "inactive_split": metric(0, 0),
                "oversize_allocations": metric(0, 0)["all"], "oversize_segments": metric(0, 0)["all"],
                "num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
                "num_device_free": 0, "max_split_size": -1}

    def reset_peak_memory_stats(device: Any = None) -> None:
        stats.reset_peak_memory_stats()
        seen["reserved_peak"] = 0

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        stats.reset_accumulated_memory_stats()

    for name, fn in (("memory_stats_as_nested_dict", memory_stats_as_nested_dict),
                     ("reset_peak_memory_stats", reset_peak_memory_stats),
                     ("reset_accumulated_memory_stats", reset_accumulated_memory_stats)):
        fn.__doc__ = getattr(mem, name).__doc__
        setattr(mem, name, fn)
        setattr(torch.cuda, name, fn)


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
