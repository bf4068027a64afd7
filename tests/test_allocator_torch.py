"""The torch allocator shim: C callbacks over umrt's pool, install rules, stats."""
from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCupyRuntime

from umrt import stats
from umrt.allocators import torch as ut
from umrt.allocators.managed import ManagedOutOfMemoryError, ManagedPool
from umrt.backends.cuda import CudaBackend, CupyApi
from umrt.errors import UmrtError

MiB = 2**20


@pytest.fixture
def pool(fake_gpu):
    return ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))))


@pytest.fixture
def fresh(monkeypatch):
    """Reset the module's once-per-process state and fake a CUDA build of torch."""
    monkeypatch.setitem(ut._state, "installed", False)
    monkeypatch.setitem(ut._state, "pool", None)
    monkeypatch.setattr(torch.cuda, "empty_cache", torch.cuda.empty_cache)
    monkeypatch.setattr(torch.cuda.memory, "empty_cache", torch.cuda.memory.empty_cache)
    calls = {}
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch._C, "_cuda_customAllocator",
                        lambda a, f: calls.setdefault("custom", (a, f)) and "ALLOC", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_changeCurrentAllocator",
                        lambda alloc: calls.setdefault("swap", alloc), raising=False)
    return calls


def test_cpu_only_torch_gets_a_clear_message(monkeypatch, pool):
    monkeypatch.setitem(ut._state, "installed", False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ut.AllocatorError, match="CPU-only build"):
        ut.install(pool)


def test_install_hands_torch_working_c_function_pointers(fresh, pool, fake_gpu):
    ut.install(pool)
    alloc_ptr, free_ptr = fresh["custom"]
    assert isinstance(alloc_ptr, int) and isinstance(free_ptr, int) and fresh["swap"] == "ALLOC"
    assert ut.installed()
    # Call them through C, exactly as torch will: void* alloc(ssize_t, int, cudaStream_t).
    c_alloc, c_free = ut.ALLOC_FN(alloc_ptr), ut.FREE_FN(free_ptr)
    ptr = c_alloc(3 * MiB, 0, None)
    assert ptr and any(b <= ptr < b + s for b, s in fake_gpu.allocs.items())
    assert stats.memory_stats()["allocated_bytes"] >= 3 * MiB
    before = stats.memory_stats()["allocated_bytes"]
    c_free(ptr, 3 * MiB, 0, None)
    assert stats.memory_stats()["allocated_bytes"] == before - 3 * MiB
    assert c_alloc(0, 0, None) is None  # zero bytes: NULL, as torch expects


def test_callbacks_stay_alive(fresh, pool):
    ut.install(pool)
    assert sum(isinstance(x, (ut.ALLOC_FN, ut.FREE_FN)) for x in ut._KEEP_ALIVE) >= 2


def test_too_late_is_a_clear_error(fresh, pool, monkeypatch):
    def refuse(alloc):
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch._C, "_cuda_changeCurrentAllocator", refuse, raising=False)
    with pytest.raises(ut.AllocatorError, match="before the first CUDA tensor"):
        ut.install(pool)
    assert not ut.installed()


def test_empty_cache_hook(fresh, pool, monkeypatch):
    released = []
    monkeypatch.setattr(pool, "empty_cache", lambda: released.append(True))
    ut.install(pool)
    torch.cuda.empty_cache()
    assert released == [True]


def test_pool_errors_and_stream_segregation(pool, fake_gpu):
    a = pool.malloc(4096, stream=1)
    pool.free(a)
    b = pool.malloc(4096, stream=2)  # another stream never reuses a's block
    assert b != a
    assert pool.malloc(4096, stream=1) == a  # the same stream does, in place
    with pytest.raises(UmrtError, match="did not allocate"):
        pool.free(0x1234)
    fake_gpu.managed_limit = 0
    with pytest.raises(ManagedOutOfMemoryError, match="out of managed memory"):
        pool.malloc(64 * MiB)


def test_statistics_context_counts_the_block(pool):
    keep = pool.malloc(MiB)
    with stats.statistics() as outer:
        x = pool.malloc(2 * MiB)
        with stats.statistics() as inner:
            y = pool.malloc(MiB)
            pool.free(y)
        pool.free(x)
    assert (inner.total_bytes, inner.peak_bytes, inner.current_bytes) == (MiB, MiB, 0)
    assert (outer.total_bytes, outer.peak_bytes, outer.total_count) == (3 * MiB, 3 * MiB, 2)
    pool.free(keep)
