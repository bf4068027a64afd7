"""Put CuPy arrays in umrt's managed pool.

    import cupy, umrt
    umrt.enable()
    cupy.cuda.set_allocator(umrt.allocators.cupy.native_allocator())

:func:`allocator` has the shape ``cupy.cuda.set_allocator`` expects
(``nbytes -> cupy.cuda.MemoryPointer``); memory comes from the pool of the
active umrt session (:func:`umrt.enable`) and returns to it when CuPy drops
the array, and every block is reported to the pool's ``listeners`` (the
runtime's object registry). :func:`native_allocator` is the same through
umrt's native front (no Python per allocation in the steady state). CuPy runs ``MemoryHook`` callbacks only inside its
own ``MemoryPool``, so :func:`make_hook` (a ``cupy.cuda.MemoryHook`` feeding
the same registry) is for code that keeps CuPy's pool.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from umrt.errors import UmrtError

_state: dict[str, Any] = {"pool": None, "front": None}


def set_pool(pool: Any, front: Any = None) -> None:
    """Use ``pool`` (``malloc(nbytes, stream)`` / ``free(ptr)``) for :func:`allocator`, and
    ``front`` (:class:`umrt.native.front.Front`, its fallback already pointing at
    ``pool``) for :func:`native_allocator`."""
    _state["pool"], _state["front"] = pool, front


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise UmrtError("umrt's CuPy allocator needs CuPy: pip install umrt[cuda12] (or [cuda13])") from None
    return cupy


class _PoolMemory:
    """A ``cupy.cuda.memory.BaseMemory``-like owner that frees into the pool when dropped."""

    def __init__(self, pool: Any, ptr: int, size: int, device_id: int) -> None:
        self.pool, self.ptr, self.size, self.device_id = pool, ptr, size, device_id

    def __del__(self) -> None:
        if self.ptr:
            self.pool.free(self.ptr)
            self.ptr = 0


def allocator(nbytes: int) -> Any:
    """``cupy.cuda.set_allocator`` target: a MemoryPointer into umrt's managed pool."""
    cupy = _cupy()
    pool = _state["pool"]
    if pool is None:
        raise UmrtError("umrt is not enabled: call umrt.enable() before using umrt's CuPy allocator")
    stream = cupy.cuda.get_current_stream().ptr
    try:
        ptr = pool.malloc(nbytes, stream)
    except UmrtError as exc:
        raise cupy.cuda.memory.OutOfMemoryError(nbytes, pool.reserved_bytes(), 0) from exc
    device = cupy.cuda.runtime.getDevice()
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, _PoolMemory(pool, ptr, nbytes, device), device)
    return cupy.cuda.MemoryPointer(mem, 0)


class _FrontMemory:
    """The owner of a block from the native front: freed through the front, on the stream
    it was allocated on (as torch's allocator frees), when CuPy drops the array."""

    def __init__(self, front: Any, ptr: int, size: int, device_id: int, stream: int) -> None:
        self.front, self.ptr, self.size, self.device_id, self.stream = front, ptr, size, device_id, stream

    def __del__(self) -> None:
        if self.ptr:
            self.front.free(self.ptr, self.size, self.device_id, self.stream)
            self.ptr = 0


def native_allocator() -> Any:
    """A ``cupy.cuda.set_allocator`` target that allocates through umrt's native front
    (``umrt_front_malloc`` / ``umrt_front_free``, with CuPy's current stream, read at
    each allocation as :func:`allocator` reads it): in the native steady state a CuPy
    allocation on the schedule's stream is served without entering umrt's Python
    pool (one ctypes call); otherwise it reaches the pool through umrt's callbacks.
    Without the front (no compiler) it is :func:`allocator`. Running out of managed
    memory there is not CuPy's ``OutOfMemoryError``: with torch's shim loaded CuPy
    gets a NULL block, without it the process stops with a message (a C allocator
    cannot raise); use :func:`allocator` where a program must catch it.

        cupy.cuda.set_allocator(umrt.allocators.cupy.native_allocator())
    """
    cupy = _cupy()
    front = _state["front"]
    if _state["pool"] is None:
        raise UmrtError("umrt is not enabled: call umrt.enable() before using umrt's CuPy allocator")
    if front is None:
        return allocator

    def native(nbytes: int) -> Any:
        stream = int(cupy.cuda.get_current_stream().ptr)
        device = cupy.cuda.runtime.getDevice()
        ptr = front.malloc(nbytes, device, stream) if nbytes else 0
        if nbytes and not ptr:
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, _state["pool"].reserved_bytes(), 0)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, _FrontMemory(front, ptr, nbytes, device, stream), device)
        return cupy.cuda.MemoryPointer(mem, 0)

    return native


def make_hook(on_event: Callable[[str, int, int], None]) -> Any:
    """A ``cupy.cuda.MemoryHook`` that calls ``on_event(kind, ptr, nbytes)`` after malloc/free.

    Use it as a context manager (hooks are per thread in CuPy)::

        with umrt.allocators.cupy.make_hook(registry.on_memory):
            ...
    """
    cupy = _cupy()

    class RegistryHook(cupy.cuda.MemoryHook):
        name = "UmrtRegistryHook"

        # CuPy calls hooks with keyword arguments only.
        def malloc_postprocess(self, **kw: Any) -> None:
            if kw["mem_ptr"]:  # 0 when malloc failed
                on_event("alloc", int(kw["mem_ptr"]), int(kw["mem_size"]))

        def free_postprocess(self, **kw: Any) -> None:
            on_event("free", int(kw["mem_ptr"]), int(kw["mem_size"]))

    return RegistryHook()
