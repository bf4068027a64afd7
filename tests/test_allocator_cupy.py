"""The CuPy allocator and memory hook, over the fake runtime."""
from __future__ import annotations

import pytest
from fake_cuda import FakeCupyRuntime

from umrt.allocators import cupy as uc
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import CudaBackend, CupyApi
from umrt.errors import UmrtError

cupy = pytest.importorskip("cupy")


class _Stream:
    ptr = 0


@pytest.fixture
def pool(fake_gpu, monkeypatch):
    pool = ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))))
    monkeypatch.setitem(uc._state, "pool", pool)
    # Without a driver CuPy cannot name the current stream or device.
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: _Stream())
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    return pool


def test_allocator_returns_pool_memory_freed_on_drop(pool, fake_gpu):
    events = []
    pool.listeners.append(lambda kind, ptr, n: events.append((kind, n)))
    mp = uc.allocator(5000)
    assert isinstance(mp, cupy.cuda.MemoryPointer) and mp.mem.size == 5000
    assert any(b <= mp.ptr < b + s for b, s in fake_gpu.allocs.items())
    del mp
    assert events == [("alloc", 5000), ("free", 5000)]


def test_allocator_needs_enable(monkeypatch):
    monkeypatch.setitem(uc._state, "pool", None)
    with pytest.raises(UmrtError, match="umrt.enable"):
        uc.allocator(16)


def test_out_of_memory_is_cupys_error(pool, fake_gpu):
    fake_gpu.managed_limit = 0
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        uc.allocator(1 << 20)


def test_hook_feeds_registry():
    seen = []
    hook = uc.make_hook(lambda kind, ptr, n: seen.append((kind, ptr, n)))
    assert isinstance(hook, cupy.cuda.MemoryHook)
    hook.malloc_postprocess(device_id=0, size=100, mem_size=512, mem_ptr=4096, pmem_id=1)
    hook.malloc_postprocess(device_id=0, size=100, mem_size=512, mem_ptr=0, pmem_id=0)  # failed malloc
    hook.free_postprocess(device_id=0, mem_size=512, mem_ptr=4096, pmem_id=1)
    assert seen == [("alloc", 4096, 512), ("free", 4096, 512)]
