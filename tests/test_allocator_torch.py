"""The torch allocator shim: C callbacks over umrt's pool, install rules, stats.

The compiled shim (umrt/native/torch_alloc_shim.cpp) builds here against the CPU
torch headers; its OutOfMemoryError is checked through torch's own error
translation (the ``_try_alloc`` hook), since no CUDA tensor can be made here.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import textwrap

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
    monkeypatch.setitem(ut._state, "shim", None)
    monkeypatch.setattr(torch.cuda, "empty_cache", torch.cuda.empty_cache)
    monkeypatch.setattr(torch.cuda.memory, "empty_cache", torch.cuda.memory.empty_cache)
    for name in ("memory_stats_as_nested_dict", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
        monkeypatch.setattr(torch.cuda.memory, name, getattr(torch.cuda.memory, name))
    calls = {}

    class Allocator:  # torch._C._CUDAPluggableAllocator's setter torch's recordStream calls through
        def set_record_stream_fn(self, address):
            calls["record_stream"] = address

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch._C, "_cuda_customAllocator",
                        lambda a, f: calls.setdefault("custom", (a, f)) and Allocator(), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_changeCurrentAllocator",
                        lambda alloc: calls.setdefault("swap", alloc), raising=False)
    return calls


def test_cpu_only_torch_gets_a_clear_message(monkeypatch, pool):
    monkeypatch.setitem(ut._state, "installed", False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ut.AllocatorError, match="CPU-only build"):
        ut.install(pool)


@pytest.fixture(scope="module")
def shim():
    """The compiled shim (the first run compiles it, ~10-20 s; then torch's cache)."""
    from torch.utils import cpp_extension

    if shutil.which("c++") is None or not cpp_extension.is_ninja_available():
        pytest.skip("building the shim needs a C++ compiler and ninja")
    loaded = ut.load_shim()
    assert loaded is not None, "the shim did not build (see the warning)"
    return loaded


@pytest.fixture
def via_shim(shim, pool, monkeypatch):
    """The shim forwarding to umrt's ctypes callbacks over ``pool``, as install() sets it up."""
    monkeypatch.setitem(ut._state, "shim", shim)
    _, _, alloc_ptr, free_ptr = ut.make_callbacks(pool)
    shim.set_callbacks(alloc_ptr, free_ptr)
    return shim


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def test_install_hands_torch_working_c_function_pointers(fresh, pool, fake_gpu):
    ut.install(pool, shim=False)
    alloc_ptr, free_ptr = fresh["custom"]
    assert ut._state["shim"] is None
    _check_c_allocator(alloc_ptr, free_ptr, fake_gpu)


@pytest.mark.slow
def test_install_hands_torch_the_shim(shim, fresh, pool, fake_gpu):
    ut.install(pool)
    alloc_ptr, free_ptr = fresh["custom"]  # via torch.cuda.memory.CUDAPluggableAllocator
    assert (alloc_ptr, free_ptr) == (_address(shim.lib.umrt_alloc), _address(shim.lib.umrt_free))
    assert fresh["record_stream"] == _address(shim.lib.umrt_record_stream)  # torch's record_stream: to umrt
    assert ut._state["shim"] is shim
    _check_c_allocator(alloc_ptr, free_ptr, fake_gpu)
    ptr = ut.ALLOC_FN(alloc_ptr)(MiB, 0, None)
    shim.module._try_record_stream(ptr, 0x5000)  # reaches the pool (an unknown stream: nothing to order yet)
    ut.FREE_FN(free_ptr)(ptr, MiB, 0, None)


def test_a_torch_without_record_stream_for_pluggable_allocators_is_warned_about(fresh, pool, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_customAllocator", lambda a, f: "an allocator without the setter")
    with pytest.warns(RuntimeWarning, match="does not pass Tensor.record_stream"):
        ut.install(pool, shim=False)


def _check_c_allocator(alloc_ptr, free_ptr, fake_gpu):
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
    ut.install(pool, shim=False)
    assert sum(isinstance(x, (ut.ALLOC_FN, ut.FREE_FN)) for x in ut._KEEP_ALIVE) >= 2


def test_too_late_is_a_clear_error(fresh, pool, monkeypatch):
    def refuse(alloc):
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch._C, "_cuda_changeCurrentAllocator", refuse, raising=False)
    with pytest.raises(ut.AllocatorError, match="before the first CUDA tensor"):
        ut.install(pool, shim=False)
    assert not ut.installed()


def test_empty_cache_hook(fresh, pool, monkeypatch):
    released = []
    monkeypatch.setattr(pool, "empty_cache", lambda: released.append(True))
    ut.install(pool, shim=False)
    torch.cuda.empty_cache()
    assert released == [True]


def test_torchs_memory_statistics_are_umrts(fresh, pool, fake_gpu, monkeypatch):
    """A pluggable allocator has no statistics of torch's (torch raises), so a script that
    logs ``torch.cuda.max_memory_allocated()`` stopped at its first log line: they are
    umrt's, read through torch's own functions (``memory_stats`` flattens them)."""
    ut.install(pool, shim=False)
    monkeypatch.setitem(stats._sources, "pool", pool)  # (umrt.enable attaches it)
    c_alloc, c_free = ut.ALLOC_FN(fresh["custom"][0]), ut.FREE_FN(fresh["custom"][1])
    torch.cuda.reset_peak_memory_stats()
    base = stats.memory_stats()["allocated_bytes"]
    a, b = c_alloc(3 * MiB, 0, None), c_alloc(MiB, 0, None)
    c_free(a, 3 * MiB, 0, None)
    assert torch.cuda.memory_allocated() == base + MiB == stats.memory_stats()["allocated_bytes"]
    assert torch.cuda.max_memory_allocated() == base + 4 * MiB
    assert torch.cuda.memory_reserved() == stats.memory_stats()["reserved_bytes"] >= 4 * MiB
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    flat = torch.cuda.memory_stats()
    assert flat["allocation.all.current"] == stats.memory_stats()["allocation_count"]
    assert flat["allocated_bytes.all.freed"] == flat["allocated_bytes.all.allocated"] - (base + MiB)
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base + MiB
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.memory_stats()["allocated_bytes.all.freed"] == 0
    c_free(b, MiB, 0, None)
    assert torch.cuda.memory_stats()["allocated_bytes.all.freed"] == MiB


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


# The two tests that throw the shim's C++ OutOfMemoryError through torch's error
# translation run in a child process (over the shim the fixture built): the shim's
# callbacks are process-wide, and on a CUDA build of torch with a real driver a
# failure there must fail the test with its output, never take the pytest worker down.
ISOLATED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from fake_cuda import FakeCupyRuntime, FakeGpu
    from umrt.allocators import torch as ut
    from umrt.allocators.managed import ManagedPool
    from umrt.backends.cuda import CudaBackend, CupyApi
    MiB = 2**20
    fake_gpu = FakeGpu()
    pool = ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))))
    shim = ut.load_shim()
    assert shim is not None, "the shim did not load"
    ut._state["shim"] = shim
""")


def _isolated(body: str) -> None:
    """Run ``body`` after ISOLATED's set-up in a fresh interpreter; fail with its output."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = ISOLATED.format(tests=tests) + textwrap.dedent(body) + "\nprint('ISOLATED OK')\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ISOLATED OK" in out.stdout, (
        f"exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


@pytest.mark.slow
def test_shim_out_of_memory_is_torch_out_of_memory_error(shim):
    _isolated("""
        _, _, alloc_ptr, free_ptr = ut.make_callbacks(pool)
        shim.set_callbacks(alloc_ptr, free_ptr)
        limit, fake_gpu.managed_limit = fake_gpu.managed_limit, 0
        try:
            shim.module._try_alloc(64 * MiB, 1)
        except torch.cuda.OutOfMemoryError as exc:
            err = exc
        else:
            raise AssertionError("no OutOfMemoryError")
        assert isinstance(err, torch.OutOfMemoryError)
        assert "out of managed memory" in str(err) and "67108864 bytes on cuda:1" in str(err), str(err)
        assert "ManagedOutOfMemoryError" in str(err)  # the pool's reason is carried over
        fake_gpu.managed_limit = limit
        assert shim.module._try_alloc(MiB) != 0  # the next allocation works again
    """)


@pytest.mark.slow
def test_shim_null_without_a_reason_still_raises(shim):
    _isolated("""
        keep = (ut.ALLOC_FN(lambda size, device, stream: 0), ut.FREE_FN(lambda *args: None))
        shim.set_callbacks(ut.ctypes.cast(keep[0], ut.ctypes.c_void_p).value,
                           ut.ctypes.cast(keep[1], ut.ctypes.c_void_p).value)
        try:
            shim.module._try_alloc(4096)
        except torch.OutOfMemoryError as exc:
            assert "returned no memory" in str(exc), str(exc)
        else:
            raise AssertionError("no OutOfMemoryError")
        assert shim.module._try_alloc(0) == 0  # zero bytes: NULL, no error
    """)


@pytest.mark.slow
def test_shim_forwards_alloc_and_free(via_shim, fake_gpu):
    before = stats.memory_stats()["allocated_bytes"]
    ptr = via_shim.module._try_alloc(3 * MiB)
    assert any(b <= ptr < b + s for b, s in fake_gpu.allocs.items())
    assert stats.memory_stats()["allocated_bytes"] == before + 3 * MiB
    via_shim.module._try_free(ptr, 3 * MiB)
    assert stats.memory_stats()["allocated_bytes"] == before


def test_failed_shim_build_falls_back_to_callbacks_with_one_warning(fresh, pool, monkeypatch):
    from torch.utils import cpp_extension

    def broken_build(**kwargs):
        raise RuntimeError("Error building extension 'umrt_torch_alloc_shim'\nc++: not found")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(ut, "load_shim", functools.lru_cache(maxsize=1)(ut.load_shim.__wrapped__))
    with pytest.warns(RuntimeWarning, match=r"could not build the torch allocator shim \(Error building"):
        ut.install(pool)
    alloc_ptr, free_ptr = fresh["custom"]
    callbacks = [x for x in ut._KEEP_ALIVE if isinstance(x, (ut.ALLOC_FN, ut.FREE_FN))]
    assert (alloc_ptr, free_ptr) == (_address(callbacks[-2]), _address(callbacks[-1]))
    assert ut._state["shim"] is None
    assert ut.load_shim() is None  # cached: no second build, no second warning


def test_without_the_shim_out_of_memory_stops_the_process(pool, fake_gpu, monkeypatch):
    monkeypatch.setitem(ut._state, "shim", None)
    monkeypatch.setitem(ut._state, "pool", pool)
    stopped = []
    monkeypatch.setattr(ut, "_fatal", stopped.append)
    fake_gpu.managed_limit = 0
    assert ut._alloc(64 * MiB, 0, None) == 0
    assert len(stopped) == 1 and "out of managed memory" in stopped[0]


def test_events_and_kind_hints_reach_the_stream_layouts(fake_gpu):
    """What the live bridge feeds the pool (boundaries, layer events, kind hints by block
    start) reaches each stream's layout: umrt's pool plans, so an activation gets one address."""
    from umrt.memory.caching import CachingAllocatorLayout
    from umrt.memory.pool import LifetimePool
    from umrt.trace.events import IterationBoundary, Kind, LayerEnter, LayerExit

    made = []

    def factory(backend):
        made.append(LifetimePool(backend, live_feed=True))
        return made[-1]

    pool = ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))), factory)
    pool.malloc(2 * MiB)  # a parameter, before the first boundary
    side, late = pool.backend.api.create_stream(), pool.backend.api.create_stream()  # torch's side streams
    pool.malloc(MiB, stream=side)  # a second stream: its own layout, fed the same events
    addrs = []
    for it in range(4):
        pool.observe(IterationBoundary(it))
        pool.observe(LayerEnter("layer"))
        act = pool.malloc(3 * MiB)
        tmp = pool.malloc(MiB)
        pool.free(tmp)
        pool.observe(LayerExit("layer"))
        if it == 0:  # the first step's lazily made state, as big as the temporary
            assert pool.hint_kind(pool.malloc(MiB), Kind.OPTIMIZER_STATE)
        pool.free(act)
        addrs.append((act, tmp))
    assert made[0].planned and made[0].plans_made == 1
    assert addrs[2] == addrs[3]  # planned once the second step repeated the first's shape
    assert made[1]._iteration == 3 and not made[1].planned  # saw the boundaries, nothing to plan
    pool.observe(IterationBoundary(4))
    pool.observe(LayerEnter("layer"))
    pool.malloc(MiB, stream=late)  # a stream's first block, mid-iteration: its new layout is told where
    assert made[2]._iteration == 4 and made[2]._depth == 1
    assert not pool.hint_kind(12345, Kind.PARAMETER)  # not a block of this pool: ignored
    with pytest.raises(UmrtError, match="unknown kind"):
        pool.hint_kind(addrs[0][0], 99)
    caching = ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))), CachingAllocatorLayout)
    ptr = caching.malloc(MiB)
    caching.observe(IterationBoundary(0))  # a layout that reads no events: nothing to do
    assert not caching.hint_kind(ptr, Kind.PARAMETER)


def _two_stream_pool(fake_gpu) -> tuple[ManagedPool, list, object]:
    """A pool behind torch whose default stream's lifetime pool has planned three steps, and a
    side stream's layout; the layouts it made, in order; the side stream."""
    from umrt.memory.pool import LifetimePool
    from umrt.trace.events import IterationBoundary, LayerEnter, LayerExit

    made: list = []

    def factory(backend):
        made.append(LifetimePool(backend, live_feed=True))
        return made[-1]

    pool = ManagedPool(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu))), factory)
    pool.malloc(2 * MiB)  # a parameter: the default stream's layout first
    side = pool.backend.api.create_stream()
    pool.malloc(MiB, stream=side)
    for it in range(3):
        pool.observe(IterationBoundary(it))
        pool.observe(LayerEnter("layer"))
        act = pool.malloc(3 * MiB)
        pool.observe(LayerExit("layer"))
        pool.free(act)
    return pool, made, side


def test_stop_planning_reaches_every_stream_layout_and_the_ones_made_later(fake_gpu):
    """When umrt stops acting in training steps, the live bridge's layout tells the pool behind
    torch: every stream's lifetime pool places best-fit from then on, a layout made later too,
    and the blocks already live stay where they are."""
    from umrt.drive.live import LiveLayout
    from umrt.trace.events import IterationBoundary

    pool, made, side = _two_stream_pool(fake_gpu)
    live = pool.malloc(2 * MiB)
    assert made[0].planned and made[0].planning
    before = pool.live_blocks()
    LiveLayout(lambda obj: 0, pool, learn=True).stop_planning("umrt stopped acting in training steps")
    assert [m.stopped_planning for m in made] == ["umrt stopped acting in training steps"] * 2
    assert pool.stopped_planning == "umrt stopped acting in training steps" and pool.live_blocks() == before
    pool.retire_layout(pool.stream)  # a fresh layout for the stream: it never plans either
    pool.malloc(MiB)
    assert len(made) == 3 and not made[2].planning
    pool.free(live)
    LiveLayout(lambda obj: 0, pool, learn=True).resume_planning()  # acting won over a held step
    assert pool.stopped_planning is None
    pool.retire_layout(pool.stream)
    pool.malloc(MiB)
    assert len(made) == 4 and made[3].planning  # a layout made later plans
    pool.observe(IterationBoundary(3))  # the side stream's layout plans again from its next step
    act = pool.malloc(3 * MiB, stream=side)
    pool.free(act)
    pool.observe(IterationBoundary(4))
    assert made[1].planning and made[1].stopped_planning is None
    LiveLayout(lambda obj: 0, None, learn=False).stop_planning("no pool")  # a recorder-only bridge: nothing
    LiveLayout(lambda obj: 0, None, learn=False).resume_planning()


def test_a_step_served_unplanned_reaches_every_stream_layout_and_the_ones_made_later(fake_gpu):
    """A training step umrt moves nothing in, served best-fit by the pool behind torch: the live
    bridge's layout tells every stream's lifetime pool, and a layout made during that step; the
    next step's word undoes it."""
    from umrt.drive.live import LiveLayout

    pool, made, _ = _two_stream_pool(fake_gpu)
    assert made[0].planned
    bridge = LiveLayout(lambda obj: 0, pool, learn=True)
    bridge.serve_unplanned(True)
    assert [m._unplanned_now for m in made] == [True, True]
    pool.retire_layout(pool.stream)
    pool.malloc(MiB)
    assert len(made) == 3 and made[2]._unplanned_now
    bridge.serve_unplanned(False)
    assert not made[1]._unplanned_now and not made[2]._unplanned_now  # (made[0] is retired: it places nothing)
    LiveLayout(lambda obj: 0, None, learn=False).serve_unplanned(True)  # a recorder-only bridge: nothing


def test_before_malloc_hooks_run_before_the_block_is_placed(pool):
    seen = []
    pool.before_malloc.append(lambda n: seen.append((n, pool.reserved_bytes())))
    pool.malloc(0)  # nothing to place, nothing to tell
    pool.free(pool.malloc(5 * MiB))
    assert seen == [(5 * MiB, 0)]


def test_a_free_from_inside_the_pool_waits_until_the_pool_is_done(fake_gpu):
    """Python's garbage collector can release a tensor while this thread is inside
    a layout call: that free must not re-enter the layout half-way; it runs
    (and is announced) once the pool is done."""
    from umrt.memory.pool import LifetimePool

    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    order = []

    class Layout(LifetimePool):
        inside = False

        def alloc(self, obj, nbytes, kind):
            self.inside = True
            if victim:  # "the collector" frees a tensor in the middle of this call
                pool.free(victim.pop())
            ptr = super().alloc(obj, nbytes, kind)
            self.inside = False
            return ptr

        def free(self, obj):
            assert not self.inside, "a layout re-entered half-way"
            super().free(obj)

    pool = ManagedPool(backend, lambda b: Layout(b, live_feed=True))
    pool.listeners.append(lambda what, ptr, n: order.append((what, ptr)))
    victim = []
    a = pool.malloc(1 << 20)
    victim.append(a)
    b = pool.malloc(1 << 20)
    assert order == [("alloc", a), ("alloc", b), ("free", a)]
    with pytest.raises(KeyError):
        pool.size_of(a)  # freed once the pool was done
    pool.free(b)


def test_the_backend_follows_the_stream_the_program_allocates_on(fake_gpu):
    """Under ``with torch.cuda.stream(s):`` torch allocates (and launches) on s: a
    discard of a dead range the next block may reuse must be ordered there, so the
    backend's compute stream follows the stream of each allocation."""
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    pool = ManagedPool(backend)
    side = backend.api.create_stream()
    pool.free(pool.malloc(1 << 20))
    assert backend.compute_stream == 0
    a = pool.malloc(1 << 20, side)
    assert backend.compute_stream == side
    pool.free(pool.malloc(1 << 20))
    assert backend.compute_stream == 0
    pool.free(a)


def test_new_segments_are_populated_on_the_gpu_within_the_budget(fake_gpu):
    """A fresh managed range written first by a kernel populates at 3.4-8 GB/s on the
    H100, by one prefetch in ~11 ms per 2 GiB: the pool prefetches each segment it
    makes, in one call, while what it populated fits its limit (the budget)."""
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    pool = ManagedPool(backend, populate_limit=96 * MiB)
    a = pool.malloc(64 * MiB)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert len(calls) == 1 and calls[0][1] <= a < calls[0][1] + calls[0][2] and calls[0][3] == 0
    pool.malloc(64 * MiB)  # a second segment would pass the limit: left to the runtime
    assert len([c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]) == 1
    unlimited = ManagedPool(backend)  # the default: nothing populated (no budget known)
    unlimited.malloc(MiB)
    assert len([c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]) == 1


def test_the_pools_layouts_plan_only_once_what_it_holds_passes_the_budget(fake_gpu):
    """While all the pool has held fits its limit (the budget) nothing has to move, and a
    plan's region would only add to what it holds: its layouts serve as they learned, as a
    caching allocator does. Past the limit they plan, as before."""
    from umrt.memory.pool import LifetimePool
    from umrt.trace.events import IterationBoundary, LayerEnter, LayerExit

    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    for limit, plans in ((1 << 30, False), (8 * MiB, True), (0, True)):
        made: list[LifetimePool] = []
        pool = ManagedPool(backend, lambda b, made=made: made.append(LifetimePool(b, live_feed=True)) or made[-1],
                           populate_limit=limit)
        for step in range(5):
            pool.observe(IterationBoundary(step))
            pool.observe(LayerEnter("block", "forward"))
            blocks = [pool.malloc(4 * MiB) for _ in range(4)]
            pool.observe(LayerExit("block", "forward"))
            for b in blocks:
                pool.free(b)
        assert pool.peak_reserved_bytes() >= 16 * MiB
        assert [layout.planned for layout in made] == [plans], (limit, pool.peak_reserved_bytes())
        pool.empty_cache()


def test_the_pools_layouts_plan_once_the_steps_grow_past_the_budget(fake_gpu):
    """Steps that fit are served as learned; when later steps make the pool hold more than
    its limit, its layout plans at the next training boundary where it can: the end of the
    first step that repeats the one before it (the fifth step, the first of 8 blocks, repeats
    none before it: planned from, it would miss every step of another shape)."""
    from umrt.memory.pool import LifetimePool
    from umrt.trace.events import IterationBoundary, LayerEnter, LayerExit

    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    made: list[LifetimePool] = []
    pool = ManagedPool(backend, lambda b: made.append(LifetimePool(b, live_feed=True)) or made[-1],
                       populate_limit=24 * MiB)
    planned = []
    for step in range(8):
        pool.observe(IterationBoundary(step))
        pool.observe(LayerEnter("block", "forward"))
        blocks = [pool.malloc(4 * MiB) for _ in range(4 if step < 4 else 8)]
        pool.observe(LayerExit("block", "forward"))
        for b in blocks:
            pool.free(b)
        planned.append(made[0].planned)
    assert planned == [False] * 6 + [True] * 2 and pool.peak_reserved_bytes() > 24 * MiB
