"""The native allocation front: what torch and CuPy call for every allocation.

``steady_front.cpp`` exports ``umrt_front_malloc`` / ``umrt_front_free``
(the signatures torch's pluggable allocator calls, through umrt's shim; umrt's CuPy
allocator calls them too, with CuPy's current stream) and ``umrt_front_record_stream``
(torch's ``record_stream``).
Each asks the installed native steady schedule first
(:class:`umrt.native.binding.NativeSteadySchedule`); when none is installed or
it declines (disarmed), the call goes to the fallback, umrt's Python callbacks
(:func:`umrt.allocators.torch.make_callbacks`). So in steady state an allocation
and a free never enter Python.

:func:`load_front` builds the library at first use (torch's extension cache, as the
shim) and returns ``None``, after one warning, where it cannot: umrt then serves
the steady state from the Python schedule inside its Python callbacks.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umrt.native.build import build_native, native_source, warn_not_built
from umrt.native.signatures import declare

__all__ = ["Front", "FrontCounters", "load_front", "front_source"]


@dataclass(frozen=True)
class FrontCounters:
    """Allocations and frees the front served natively and those it sent to Python."""

    native_allocs: int
    native_frees: int
    fallback_allocs: int
    fallback_frees: int


def front_source() -> Path:
    """``umrt/native/steady_front.cpp``."""
    return native_source("steady_front.cpp")


class Front:
    """The loaded front library (one per process: its state is global, as torch's allocator is),
    its functions declared (:func:`umrt.native.signatures.declare`)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib, self.path = declare(lib, "steady_front.cpp"), path
        self._slots: list[Any] = []  # every slot and schedule ever installed: never freed
        self.installed: Any = None

    def _address(self, name: str) -> int:
        return int(ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value)

    @property
    def malloc_address(self) -> int:
        """``umrt_front_malloc``: ``void* (ssize_t size, int device, cudaStream_t stream)``."""
        return self._address("umrt_front_malloc")

    @property
    def free_address(self) -> int:
        """``umrt_front_free``: ``void (void* ptr, ssize_t size, int device, cudaStream_t stream)``."""
        return self._address("umrt_front_free")

    @property
    def record_stream_address(self) -> int:
        """``umrt_front_record_stream``: ``void (void* ptr, cudaStream_t stream)``."""
        return self._address("umrt_front_record_stream")

    def set_fallback(self, alloc_address: int, free_address: int, record_address: int = 0) -> None:
        """The Python callbacks (C function addresses) every declined call goes to, and
        every ``record_stream`` (0: none)."""
        self.lib.umrt_front_set_fallback(alloc_address, free_address, record_address or None)

    def install(self, schedule: Any) -> None:
        """Serve allocations from ``schedule`` (a :class:`~umrt.native.binding.NativeSteadySchedule`)
        first; ``None``: every call goes to the fallback. The schedule is kept alive for
        the life of the process (a call on another thread may still be using it)."""
        if schedule is None:
            self.lib.umrt_front_install(None, None, None, None, None)
            self.installed = None
            return
        slot = ctypes.create_string_buffer(int(self.lib.umrt_front_slot_size()))
        self._slots.append((slot, schedule))
        lib = schedule.lib
        malloc_fn = ctypes.cast(lib.umrt_steady_malloc, ctypes.c_void_p).value
        free_fn = ctypes.cast(lib.umrt_steady_free, ctypes.c_void_p).value
        record_fn = ctypes.cast(lib.umrt_steady_record_stream, ctypes.c_void_p).value
        self.lib.umrt_front_install(slot, schedule.handle, malloc_fn, free_fn, record_fn)
        self.installed = schedule

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """``umrt_front_malloc`` from Python (tests, benches)."""
        return self.lib.umrt_front_malloc(size, device, stream or None) or 0

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> None:
        """``umrt_front_free`` from Python (tests, benches, umrt's CuPy allocator)."""
        self.lib.umrt_front_free(ptr, size, device, stream or None)

    def record_stream(self, ptr: int, stream: int) -> None:
        """``umrt_front_record_stream`` from Python (tests)."""
        self.lib.umrt_front_record_stream(ptr, stream or None)

    def counters(self) -> FrontCounters:
        """What the front served natively and what it sent to Python, since the process started."""
        out = (ctypes.c_int64 * 4)()
        self.lib.umrt_front_counters(out)
        return FrontCounters(*out)


@functools.lru_cache(maxsize=1)
def load_front() -> Front | None:
    """The front, built at first use; ``None`` after one warning saying why."""
    try:
        path = build_native(front_source(), "umrt_steady_front", "the native allocation front")
        return Front(ctypes.CDLL(path), path)
    except Exception as exc:  # noqa: BLE001 - any build failure means "serve from Python"
        warn_not_built("the native allocation front", exc,
                       "every allocation goes through umrt's Python callbacks, and the steady state is served "
                       "by the pure-Python schedule (same behaviour, slower)")
        return None
