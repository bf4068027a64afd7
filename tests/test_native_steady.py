"""The native steady state served live (umrt.native.server.SteadyServer over a ManagedPool
on the fake CUDA runtime): recording, arming, serving without Python, handing back."""
from __future__ import annotations

import ctypes
import itertools
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import plain

from bench.live_replay import LOGS, RUNS, ClosedLoop, read_live_log
from umrt import stats
from umrt.allocators.managed import ManagedPool
from umrt.backends.base import Advice, Range
from umrt.backends.cuda import CudaApi, CudaBackend
from umrt.drive.driver import Driver
from umrt.drive.live import LiveLayout, ManagedOnly
from umrt.hardware import load_profile
from umrt.native.binding import counting_table
from umrt.native.constants import EV_ALLOC
from umrt.native.server import MAX_SHORT_LIVED, SHORT_LIVED, BackendCalls, Phase, SteadyServer
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

SIZES = [3 << 20, 1 << 20, 512 << 10, 3 << 20, 1 << 20, 2 << 20]


class StubBridge:
    """The live bridge as the server sees it; ``act`` runs at every pool event (a policy)."""

    def __init__(self, pool, act=None):
        self.pool, self.iteration, self.stepped = pool, 0, True
        self.native = False
        self.mute = False
        self.stopped = None
        self.calls = Counter()
        self.act = act
        pool.listeners.append(self.on_pool_event)
        pool.before_malloc.append(self.before_malloc)

    def before_malloc(self, n):
        """As the live bridge: the first allocation after a step opens the next iteration."""
        if self.stepped:
            self.stepped = False
            self.iteration += 1
            self.pool.observe(IterationBoundary(self.iteration))

    def on_step(self, server):
        self.stepped = True
        server.on_step()

    def on_pool_event(self, what, ptr, n):
        self.calls[what] += 1
        if self.act is not None and not self.mute:
            self.act(what, ptr, n)

    def can_go_native(self):
        return self.stopped is None

    def go_native(self):
        self.native = True

    def leave_native(self):
        self.native = False

    def muted(self, on):
        self.mute = on

    def replayed_step(self):
        self.stepped = True

    def stop(self, exc):
        self.stopped = exc


class Program:
    """A training loop's allocations: each step frees the last step's survivors (the
    gradients, at zero_grad), allocates SIZES, frees the activations, keeps two."""

    def __init__(self, malloc, free):
        self.malloc, self.free = malloc, free
        self.live: dict[int, int] = {}
        self.survivors: list[int] = []

    def step(self, sizes=SIZES):
        for ptr in self.survivors:
            self.free(ptr)
            del self.live[ptr]
        got = []
        for n in sizes:
            ptr = self.malloc(n)
            assert ptr, f"no memory for {n} bytes"
            for other, m in self.live.items():  # nothing handed out twice
                assert ptr + n <= other or other + m <= ptr, "two live blocks overlap"
            self.live[ptr] = n
            got.append(ptr)
        for ptr in got[:-2]:
            self.free(ptr)
            del self.live[ptr]
        self.survivors = got[-2:]
        return got


def _server(cuda13, front=None, act=None):
    pool = ManagedPool(cuda13)
    server = SteadyServer(pool, front=front, calls=BackendCalls(cuda13), enabled=True)
    bridge = StubBridge(pool, act)
    server.attach(bridge)
    return pool, server, bridge


def _learn(server, program, max_steps=12):
    """Steps until the server serves natively; the addresses of the last Python step."""
    for _ in range(max_steps):
        got = program.step()
        server.bridge.on_step(server)
        if server.phase is Phase.NATIVE:
            return got
    raise AssertionError(f"not native after {max_steps} steps: {server.phase}")


def _run(server, program, steps, **kw):
    out = []
    for _ in range(steps):
        out.append(program.step(**kw))
        server.bridge.on_step(server)
    return out


@pytest.fixture
def fronted(cuda13):
    """The native front over a server (its fallback: umrt's callbacks into the server):
    ``(front, pool, server, bridge)``; skips without a compiler."""
    from umrt.allocators.torch import make_callbacks
    from umrt.native.front import load_front

    front = load_front()
    if front is None:
        pytest.skip("no compiler: the native front cannot be built")
    pool, server, bridge = _server(cuda13, front=front)
    _, _, alloc_ptr, free_ptr = make_callbacks(server)
    front.set_fallback(alloc_ptr, free_ptr)
    yield front, pool, server, bridge
    front.install(None)
    front.set_fallback(0, 0)


def test_python_schedule_serves_the_steady_state_at_the_addresses_python_chose(cuda13):
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    learned = _learn(server, program)
    assert bridge.native
    python_events = bridge.calls.copy()
    frame = stats.push_statistics()
    served = _run(server, program, 3)
    assert stats.pop_statistics() is frame
    assert (frame.total_count, frame.total_bytes) == (3 * len(SIZES), 3 * sum(SIZES))  # umrt.statistics() totals
    assert served == [learned] * 3  # the same addresses
    assert bridge.calls == python_events  # the pool (and so the bridge) saw nothing
    assert server.report.arms == 1 and server.report.steps_native == 3
    assert server.report.events_drained == 3 * (len(SIZES) * 2 + 1) - 1  # allocs, frees, boundaries


def test_a_deviation_hands_back_and_python_stands_where_it_would_have(cuda13):
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    _learn(server, program)
    # Half a window natively, then a size the schedule does not expect.
    other = list(SIZES)
    other[3] = 5 << 20
    syncs = cuda13.calls["cudaStreamSynchronize"]
    program.step(other)
    assert cuda13.calls["cudaStreamSynchronize"] > syncs  # the schedule's work waited for, once
    assert server.phase is Phase.FOLLOWING and not bridge.native and not bridge.mute
    assert server.report.catch_ups == 1 and "5242880 bytes" in server.report.last_deviation
    assert bridge.stopped is None and server.report.layouts_retired == 0
    assert pool.live_blocks() == program.live  # the pool's books are the program's
    _run(server, program, 3)  # Python serves on, nothing overlaps
    assert pool.live_blocks() == program.live


def test_python_view_off_retires_the_layout_and_stops_acting(cuda13):
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    _learn(server, program)
    program.step()

    def stray(n):  # at the catch-up's first replayed allocation: the pool's state is not what it was
        pool.before_malloc.remove(stray)
        ptr = pool.malloc(SIZES[0], 0)  # takes the planned block the replay expects
        program.live[ptr] = SIZES[0]

    pool.before_malloc.append(stray)
    other = list(SIZES)
    other[2] = 7 << 20
    program.step(other)
    assert server.report.layouts_retired == 1 and bridge.stopped is not None
    assert "did not match" in str(bridge.stopped) and server.phase is Phase.OFF
    live = pool.live_blocks()
    assert all(live.get(p) == n for p, n in program.live.items())
    _run(server, program, 3)  # new blocks never land on the schedule's
    assert all(pool.live_blocks().get(p) == n for p, n in program.live.items())


def test_decisions_replay_the_backends_exact_calls(cuda13, fake_gpu):
    """A policy advising and populating at every allocation: native windows make the
    same CUDA calls (same streams, same order) as the Python window they replay."""
    def act(what, ptr, n):
        if what == "alloc":
            cuda13.advise([(ptr, n)], Advice.SET_PREFERRED_LOCATION, 0)
            cuda13.populate([(ptr, n)])

    pool, server, bridge = _server(cuda13, act=act)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    start = len(fake_gpu.ops)
    _learn(server, program)
    python_ops = [(o.name, o.detail, o.stream) for o in fake_gpu.ops[start:]]
    assert server.report.schedule_calls > 0
    mark = len(fake_gpu.ops)
    before = dict(cuda13.calls)
    _run(server, program, 2)
    native_ops = [(o.name, o.detail, o.stream) for o in fake_gpu.ops[mark:]]
    window = len(native_ops) // 2
    assert window and native_ops[:window] == python_ops[-window:]
    assert native_ops[:window] == native_ops[window:]
    added = {k: cuda13.calls[k] - before.get(k, 0) for k in cuda13.calls}
    assert added["cudaMemAdvise"] == 2 * len(SIZES)  # counted as the backend's own calls


def test_the_native_front_serves_without_python(fronted):
    front, pool, server, bridge = fronted
    program = Program(lambda n: front.malloc(n, 0, 0), lambda p: front.free(p, 0, 0, 0))
    learned = _learn(server, program)
    assert server.schedule.native
    before = front.counters()
    served = _run(server, program, 3)
    after = front.counters()
    assert served == [learned] * 3
    assert after.fallback_allocs == before.fallback_allocs  # not one allocation entered Python
    assert after.native_allocs - before.native_allocs == 3 * len(SIZES)
    other = list(SIZES)
    other[4] = 9 << 20
    program.step(other)  # declined natively, caught up in the Python callback
    assert server.phase is Phase.FOLLOWING and front.installed is None
    assert pool.live_blocks() == program.live


def test_close_hands_back_with_the_books_right(cuda13):
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    _learn(server, program)
    program.step()
    server.close()
    assert server.phase is Phase.OFF and pool.live_blocks() == program.live


def test_disabled_server_only_forwards(cuda13):
    pool = ManagedPool(cuda13)
    server = SteadyServer(pool, calls=BackendCalls(cuda13), enabled=False)
    server.attach(StubBridge(pool))
    program = Program(lambda n: server.malloc(n, 0), server.free)
    _run(server, program, 6)
    assert server.phase is Phase.OFF and server.schedule is None


def test_front_counts_and_falls_back_without_a_schedule():
    from umrt.native.front import load_front

    front = load_front()
    if front is None:
        pytest.skip("no compiler: the native front cannot be built")
    got = []
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        lambda n, d, s: got.append(("alloc", n)) or 4096)
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        lambda p, n, d, s: got.append(("free", p)))
    front.set_fallback(ctypes.cast(alloc, ctypes.c_void_p).value, ctypes.cast(free, ctypes.c_void_p).value)
    try:
        before = front.counters()
        assert front.malloc(100) == 4096 and front.malloc(0) == 0
        front.free(4096)
        after = front.counters()
        assert got == [("alloc", 100), ("free", 4096)]
        assert (after.fallback_allocs - before.fallback_allocs, after.fallback_frees - before.fallback_frees) == (1, 1)
    finally:
        front.set_fallback(0, 0)


def test_cupy_native_allocator_serves_on_cupys_current_stream(fronted, fake_gpu, monkeypatch):
    """Finding 4 (CuPy): umrt's native CuPy allocator passes CuPy's current stream, read at
    each allocation, to the same entry points as torch's: the schedule serves the stream
    it was armed on, and a step on another stream deviates (before the fix every CuPy
    allocation was labelled with the armed stream and served natively, whatever stream
    CuPy ran on). Its blocks are freed through the front when CuPy drops them."""
    cupy = pytest.importorskip("cupy")
    from fake_cuda import STREAM_NON_BLOCKING

    from umrt.allocators import cupy as uc

    front, pool, server, bridge = fronted
    streams = [fake_gpu.create_stream("test", STREAM_NON_BLOCKING) for _ in range(2)]
    current = {"stream": streams[0]}

    class Stream:
        @property
        def ptr(self):
            return current["stream"]

    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Stream())
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setitem(uc._state, "pool", server)
    monkeypatch.setitem(uc._state, "front", front)
    allocate, held = uc.native_allocator(), {}

    def malloc(n):
        memory = allocate(n)
        held[memory.ptr] = memory
        return memory.ptr

    program = Program(malloc, lambda p: held.pop(p) and None)  # CuPy drops the array: freed
    learned = _learn(server, program)
    before = front.counters()
    assert _run(server, program, 2) == [learned] * 2
    after = front.counters()
    assert after.fallback_allocs == before.fallback_allocs
    assert after.native_frees - before.native_frees == 2 * len(SIZES)
    current["stream"] = streams[1]  # the program moves to another CuPy stream
    program.step()
    assert server.phase is not Phase.NATIVE and "stream" in server.report.last_deviation
    assert pool.live_blocks() == program.live and pool.stream == streams[1]
    server.close()
    monkeypatch.setitem(uc._state, "front", None)
    assert uc.native_allocator() is uc.allocator  # no front: the Python allocator


def test_torch_shim_calls_reach_the_schedule_through_the_front(fronted, fake_gpu, monkeypatch):
    """torch's pluggable allocator calls umrt_alloc through a C function pointer
    (the shim's ``_try_alloc`` calls it that way): the front serves the steady state
    natively; an out-of-memory in the fallback is still torch.cuda.OutOfMemoryError."""
    import shutil

    import torch

    from umrt.allocators import torch as ut

    front, pool, server, bridge = fronted
    if shutil.which("c++") is None:
        pytest.skip("no compiler: the shim cannot be built")
    shim = ut.load_shim()
    assert shim is not None
    monkeypatch.setitem(ut._state, "shim", shim)
    shim.set_callbacks(front.malloc_address, front.free_address)
    program = Program(lambda n: shim.module._try_alloc(n, 0), lambda p: shim.module._try_free(p, 0, 0))
    learned = _learn(server, program)
    before = front.counters()
    assert _run(server, program, 2) == [learned] * 2
    assert front.counters().fallback_allocs == before.fallback_allocs
    limit, fake_gpu.managed_limit = fake_gpu.managed_limit, 0
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of managed memory"):
        shim.module._try_alloc(1 << 40, 0)  # declined natively, the pool cannot serve it
    fake_gpu.managed_limit = limit
    assert server.phase is Phase.FOLLOWING and pool.live_blocks() == program.live


def test_the_live_bridge_goes_native_and_hands_back(fake_gpu):
    """The real bridge and the `um` policy: the server arms at an optimizer step, the
    bridge stops recording (ops and module hooks off), and a deviation brings it back."""
    import torch
    from fake_cuda import FakeCupyRuntime

    from umrt import api
    from umrt.backends.cuda import CudaBackend, CupyApi
    from umrt.config import Config
    from umrt.drive.live import LiveBridge

    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    pool = ManagedPool(backend)
    server = SteadyServer(pool, calls=BackendCalls(backend), enabled=True)
    session = api.Session(Config(enabled=True, policy="um"), active=True, backend=backend, pool=pool,
                          budget_bytes=1 << 30, steady=server)
    bridge = LiveBridge(session, device="cpu", from_allocator=True)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bridge.start()
    try:
        def step(sizes=SIZES):
            got = program.step(sizes)
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return got

        for _ in range(12):
            step()
            if server.phase is Phase.NATIVE:
                break
        assert server.phase is Phase.NATIVE and bridge.native
        assert bridge.recorder.ops_suspended and bridge.recorder._hooks._handles[0] is None
        events = bridge.events
        step()
        assert bridge.events == events  # nothing fed to Python in a native step
        other = list(SIZES)
        other[1] = 6 << 20
        step(other)
        assert not bridge.native and server.phase is Phase.FOLLOWING and bridge.failed is None
        assert bridge.events > events  # the window replayed into the policy
        assert pool.live_blocks() == program.live
        assert bridge.recorder._hooks._handles[0] is not None  # module hooks back at the step
    finally:
        bridge.close()


def test_a_front_that_cannot_be_built_warns_once_and_python_serves(monkeypatch, cuda13):
    from umrt.native import front as front_module

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: c++: command not found")

    monkeypatch.setattr(front_module, "build_native", no_compiler)
    front_module.load_front.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not build the native allocation front .*c\\+\\+: command "
                                                "not found.*pure-Python schedule"):
            assert front_module.load_front() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: a second warning would raise here
            assert front_module.load_front() is None
    finally:
        front_module.load_front.cache_clear()
    pool, server, bridge = _server(cuda13, front=None)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    learned = _learn(server, program)
    assert not server.schedule.native and _run(server, program, 2) == [learned] * 2


def test_a_two_step_cycle_is_served_and_handed_back_from_its_second_step(cuda13):
    """Steps that alternate (two shapes) repeat with a period of two: one schedule serves
    both in turn, and a deviation in the cycle's second step replays the whole cycle so far."""
    other = [1 << 20, 3 << 20, 2 << 20, 3 << 20, 512 << 10, 1 << 20]  # the same sizes, another order
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    shapes = [SIZES, other]
    k = 0
    for k in range(16):
        program.step(shapes[k % 2])
        server.bridge.on_step(server)
        if server.phase is Phase.NATIVE:
            break
    assert server.phase is Phase.NATIVE and server.report.schedule_allocations == len(SIZES) + len(other)
    calls = bridge.calls.copy()
    for j in range(k + 1, k + 5):
        program.step(shapes[j % 2])
        server.bridge.on_step(server)
    assert server.phase is Phase.NATIVE and bridge.calls == calls  # four native steps, no Python
    program.step(shapes[(k + 5) % 2])  # the cycle's first step, native
    server.bridge.on_step(server)
    replayed = []
    replay = server._replay
    server._replay = lambda events, live: (replayed.extend(events), replay(events, live))
    wrong = list(shapes[(k + 6) % 2])
    wrong[2] += 1 << 20
    program.step(wrong)  # its second step deviates at its third allocation
    assert server.phase is Phase.FOLLOWING and server.report.layouts_retired == 0 and bridge.stopped is None
    assert sum(e[0] == EV_ALLOC for e in replayed) == 6 + 2  # the cycle from its start: both steps
    assert pool.live_blocks() == program.live


def test_a_replay_that_fails_never_fails_the_allocation(cuda13, monkeypatch):
    """A hand-back whose replay raises is handled as a view that is off: the layout is
    retired, the schedule's blocks are the pool's, umrt stops acting, the program goes on."""
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    _learn(server, program)
    program.step()
    server.bridge.on_step(server)
    original = pool.malloc
    failing = {"left": 2}  # the replay's third allocation fails; the program's own go through

    def malloc(n, stream=0):
        if server.phase is Phase.NATIVE or failing["left"] < 0:
            return original(n, stream)
        failing["left"] -= 1
        if failing["left"] < 0:
            raise RuntimeError("layout broke")
        return original(n, stream)

    monkeypatch.setattr(pool, "malloc", malloc)
    other = list(SIZES)
    other[4] = 9 << 20
    program.step(other)
    assert bridge.stopped is not None and "the replay failed: RuntimeError: layout broke" in str(bridge.stopped)
    assert server.phase is Phase.OFF and server.report.layouts_retired == 1
    live = pool.live_blocks()
    assert all(live.get(p) == n for p, n in program.live.items())
    _run(server, program, 2)


# ---------------------------------------------------------------------------
# A recorded live run served as a live run is
# ---------------------------------------------------------------------------
# The H100's GPT-2 event streams (bench.live_replay's logs, closed loop on umrt's runtime:
# bench.live_replay.ClosedLoop) drive what a live GPU run runs on the CPU: every allocation
# and free through umrt's allocator (SteadyServer over a ManagedPool on a CudaBackend), and
# the events the live bridge would feed (allocations, frees, module boundaries, launches
# while the runtime wants them) reaching umrt's runtime through a Driver, on the Python path
# or with the native steady state (through the native front's C entry points where it
# builds). NullCuda, a runtime that does nothing, is the default; the tests below run it on
# the fake CUDA runtime too, and hold the two paths to the same addresses and calls.


class NullCuda(CudaApi):
    """A CUDA 13 runtime that does nothing: managed memory from a bump pointer, handles
    from a counter. What umrt's own CPU costs, without a driver's."""

    version = 13000
    has_batch = True

    def __init__(self) -> None:
        self._next = 0x7F00_0000_0000
        self._handles = itertools.count(0x1000)

    def device_count(self) -> int:
        return 1

    def set_device(self, device: int) -> None:
        pass

    def concurrent_managed_access(self, device: int) -> bool:
        return True

    def mem_get_info(self) -> tuple[int, int]:
        return 80 << 30, 80 << 30

    def malloc_managed(self, nbytes: int) -> int:
        ptr, self._next = self._next, self._next + -(-nbytes // (2 << 20)) * (2 << 20)
        return ptr

    def free(self, ptr: int) -> None:
        pass

    def create_stream(self, blocking: bool = False) -> int:
        return next(self._handles)

    def create_event(self) -> int:
        return next(self._handles)

    def record_event(self, event: Any, stream: Any) -> None:
        pass

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: Any) -> None:
        pass

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        pass

    def discard_batch(self, ranges: Sequence[Range], stream: Any) -> None:
        pass

    def discard_and_prefetch_batch(self, ranges: Sequence[Range], device: int, stream: Any) -> None:
        pass


class ReplayBridge:
    """The live bridge's part (:class:`umrt.drive.live.LiveBridge`) in a served replay:
    the pool's blocks as the runtime's objects, boundaries opened by the first allocation
    after a step, and :class:`umrt.native.server.SteadyBridge` for the server."""

    def __init__(self, backend: CudaBackend, pool: ManagedPool, budget: int, profile: str) -> None:
        self.policy = Runtime(use_pool=False)  # as the live bridge makes it (umrt.drive.live._live_policy)
        self.backend = ManagedOnly(backend)
        self._born: dict[int, int] = {}
        self.layout = LiveLayout(self._born.pop, pool, learn=True)
        self.policy.attach(PolicyContext(self.backend, self.layout, budget, load_profile(profile)))
        self.driver = Driver(self.policy, self.layout, self.backend)
        self.native = False
        self.failed: BaseException | None = None
        self.obj_at: dict[int, int] = {}  # block -> the runtime's object living there
        self._ids = itertools.count(1)
        self._step_ended = False
        self._next = 0
        pool.listeners.append(self.on_pool_event)
        pool.before_malloc.append(lambda nbytes: self.open_if_stepped())

    def on_pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        """The pool's listener, as the live bridge's."""
        if what == "alloc":
            self.open_if_stepped()
            obj = next(self._ids)
            self.obj_at[ptr] = obj
            self._born[obj] = ptr
            self.driver.feed(Alloc(obj, nbytes, Kind.OTHER, 0))
        else:
            obj = self.obj_at.pop(ptr, None)
            if obj is not None:
                self.driver.feed(Free(obj))

    def open_if_stepped(self) -> None:
        """The first allocation, layer event or launch after a step opens the next iteration."""
        if self._step_ended:
            self._step_ended = False
            self._next += 1
            self.driver.feed(IterationBoundary(self._next))

    def stepped(self) -> None:
        """An optimizer step ended."""
        self._step_ended = True

    def can_go_native(self) -> bool:
        return self.failed is None and not self.policy.wants_launches

    def go_native(self) -> None:
        self.native = True

    def leave_native(self) -> None:
        self.native = False

    def muted(self, on: bool) -> None:
        self.backend.muted = on

    def replayed_step(self) -> None:
        self._step_ended = True

    def stop(self, exc: BaseException) -> None:
        self.failed = exc


@dataclass
class Served:
    """What a served replay did: per allocation the address it got; the server's report
    and phase after each step."""

    addresses: list[int] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    failed: BaseException | None = None


def serve(run: str, budget: int, iterations: int, *, native: bool, api: CudaApi | None = None, front: Any = None,
          profile: str = "h100-sxm5-80g", odd_steps: Sequence[int] = (), kernels: Any = None) -> Served:
    """Replay live log ``run`` (a name of ``bench.live_replay.RUNS``) for ``iterations``
    iterations through umrt's allocator on ``api`` (default :class:`NullCuda`), with its
    native steady state on (``native``) or off; ``front``: the native front, whose C
    entry points then take every allocation and free, as torch's shim calls them.
    ``odd_steps``: steps (counted from 0) that also allocate one 3 MiB block first and
    free it at their end (an evaluation pass, a logging tensor: a step that deviates).
    ``kernels``: the fake GPU behind ``api``, on which each launch of the log then runs as the
    program's kernel, on the compute stream, after the runtime has seen it (Python path only)."""
    backend = CudaBackend(0, api=api or NullCuda())
    pool = ManagedPool(backend)
    # On NullCuda a native schedule's calls go to the C table that only counts them, as they
    # would go to libcudart's on a GPU (no Python); on another runtime, to that runtime.
    calls = BackendCalls(backend, c_table=counting_table if api is None else None)
    server = SteadyServer(pool, front=front, calls=calls, enabled=native)
    bridge = ReplayBridge(backend, pool, budget, profile)
    server.attach(bridge)
    malloc: Callable[[int], int] = lambda n: server.malloc(n, 0)  # noqa: E731
    free: Callable[[int], None] = server.free
    if front is not None:
        from umrt.allocators.torch import make_callbacks  # optional: the callbacks need ctypes only

        _, _, alloc_ptr, free_ptr = make_callbacks(server)
        front.set_fallback(alloc_ptr, free_ptr)
        front_malloc, front_free = front.lib.umrt_front_malloc, front.lib.umrt_front_free
        malloc, free = (lambda n: front_malloc(n, 0, None)), (lambda p: front_free(p, 0, 0, None))
    out = Served()
    where: dict[int, int] = {}  # the log's object -> its block
    source = ClosedLoop(read_live_log(LOGS / RUNS[run] if run in RUNS else Path(run)))
    stepping, odd = False, None  # (stepping: the first boundary is behind)
    try:
        for ev, seen in source.stream(iterations, lambda: bridge.policy.wants_launches):
            t = type(ev)
            if t is Alloc:
                where[ev.obj] = ptr = malloc(ev.nbytes)
                out.addresses.append(ptr)
            elif t is Free:
                ptr = where.pop(ev.obj, None)
                if ptr is not None:
                    free(ptr)
            elif t is IterationBoundary:
                if odd is not None:
                    free(odd)
                    odd = None
                if stepping:  # an optimizer step just ended
                    bridge.stepped()
                    server.on_step()
                    out.phases.append(server.phase.value)
                stepping = True
                if len(out.phases) in odd_steps:
                    odd = malloc(3 << 20)
                    out.addresses.append(odd)
            elif bridge.native:
                continue  # nothing is fed while the schedule serves (no hooks, no recorder)
            elif t is Launch:
                obj_at = bridge.obj_at
                accesses = tuple(Access(obj_at[where[a.obj]], a.offset, a.length, a.write)
                                 for a in ev.accesses if where.get(a.obj) in obj_at)
                bridge.open_if_stepped()
                bridge.driver.feed(Launch(ev.seq, ev.exec_id, ev.op, accesses, ev.flops, ev.bytes, ev.module,
                                          ev.precision), shown=seen)
                if kernels is not None:
                    spans = [(where[a.obj] + a.offset, a.length, a.write) for a in ev.accesses
                             if where.get(a.obj) is not None and a.length > 0]
                    kernels.kernel(backend.compute_stream, reads=[(p, n) for p, n, w in spans if not w],
                                   writes=[(p, n) for p, n, w in spans if w], name=ev.op)
            elif t is LayerEnter or t is LayerExit:
                bridge.open_if_stepped()
                server.mark()  # as the live bridge: kernels ran since the last pool event
                bridge.driver.feed(ev)
        server.close()
    finally:
        if front is not None:
            front.install(None)
            front.set_fallback(0, 0)
    out.report = dict(server.report.__dict__)
    out.failed = bridge.failed
    return out


@pytest.mark.slow
def test_both_paths_serve_the_h100_run_at_the_same_addresses():
    """On the default runtime (NullCuda, the native schedule's calls going to the C table
    that only counts them): the H100 live run served on both paths gives every allocation
    the same address, and the native path arms and serves steps."""
    from umrt.native.front import load_front

    python = serve("40GiB", 40 << 30, 12, native=False)
    native = serve("40GiB", 40 << 30, 12, native=True, front=load_front())
    assert python.failed is None and native.failed is None
    assert native.addresses == python.addresses
    assert python.report["phase"] == "off" and python.report["arms"] == 0
    assert native.report["arms"] == 1 and native.report["steps_native"] >= 2, native.report
    assert "native" in native.phases and "native" not in python.phases


def _events_masked(calls):
    """Runtime calls with the event handle of each event record and wait left out."""
    return [(c[0], c[2]) if c[0] == "cudaEventRecord" else (c[0], c[1]) if c[0] == "cudaStreamWaitEvent" else c
            for c in calls]


@pytest.mark.slow
@pytest.mark.parametrize(("run", "budget", "iterations"), [("40GiB", 40 << 30, 14), ("50pct", 8 << 30, 16)])
def test_the_h100_live_runs_served_natively_make_the_same_calls_at_the_same_addresses(run, budget, iterations,
                                                                                   monkeypatch):
    """The H100's GPT-2 event streams, served as a live run is (:func:`serve`: closed
    loop on umrt's runtime, allocations through the server and the pool on the fake CUDA
    runtime), with a step that deviates (an extra block: an evaluation pass): the native
    path arms (above the footprint with no CUDA call per step; at 8 GiB with the
    runtime's ~1,700 prefetches, discards and event calls per step), hands back at the
    odd step, and every allocation gets the address the Python path gives it and the
    fake runtime the very calls the Python path makes, before and after the hand-back,
    with no ordering violation. Page migration only: a window that swaps is not repeated
    natively (its copies have no schedule call), so with the copy engines the 8 GiB run would
    never arm (``test_the_h100_run_at_8_gib_swaps_live_and_loses_nothing`` runs it so)."""
    from fake_cuda import FakeBindingsRuntime, FakeGpu

    from umrt.backends.cuda import BindingsApi
    from umrt.native.front import load_front

    monkeypatch.setattr("umrt.policy.runtime.policy.SWAP", False)
    odd = iterations - 3  # (at 8 GiB, two more steps: its calls repeat once newborns are populated ahead)
    runs = {}
    for native in (False, True):
        gpu = FakeGpu(total=80 << 30, managed_limit=512 << 30)
        served = serve(run, budget, iterations, native=native, api=BindingsApi(FakeBindingsRuntime(gpu)),
                       front=load_front() if native else None, odd_steps=(odd,))
        calls = [plain(c) for c in gpu.calls if c[0] != "cudaStreamSynchronize"]  # (a hand-back's settle)
        runs[native] = served, calls, list(gpu.violations)
    (python, python_calls, python_violations), (native, native_calls, native_violations) = runs[False], runs[True]
    assert native.report["arms"] >= 1 and native.report["steps_native"] >= 2, native.report
    assert native.phases[odd - 1] == "native" and native.phases[odd] != "native", native.phases  # the odd step
    assert native.report["layouts_retired"] == 0 and native.failed is None and python.failed is None
    assert native.addresses == python.addresses
    # Event handles are the same until the hand-back, whose synchronization gives every
    # event back (which one is spare next then differs); the calls are the same throughout,
    # but for waits: after that synchronization the native run's backend knows every copy
    # done and skips a wait the Python run still makes (redundant there, never missing here:
    # the fake runtime checks the ordering of both).
    masked_native, masked_python = _events_masked(native_calls), _events_masked(python_calls)
    waits = [[c for c in m if c[0] == "cudaStreamWaitEvent"] for m in (masked_native, masked_python)]
    assert [c for c in masked_native if c[0] != "cudaStreamWaitEvent"] == \
        [c for c in masked_python if c[0] != "cudaStreamWaitEvent"]
    assert len(waits[0]) <= len(waits[1]) <= len(waits[0]) + 2
    first = next(i for i, (a, b) in enumerate(zip(native_calls, python_calls, strict=False)) if a != b) \
        if native_calls != python_calls else len(native_calls)
    assert first > len(native_calls) * 0.5  # (the hand-back comes in the second half of the run)
    assert not native_violations and not python_violations
    if budget < 40 << 30:
        assert native.report["schedule_calls"] > 1000  # the steps it served made the runtime's calls


@pytest.mark.slow
@pytest.mark.parametrize("swap_copy", ["sm", "engines"])
def test_the_h100_run_at_8_gib_swaps_live_and_loses_nothing(monkeypatch, swap_copy):
    """The H100's GPT-2 event stream at 8 GiB, served on the Python path on the fake CUDA
    runtime with its kernels run there too: the live runtime's plans copy to pinned memory
    (SM copies, or the copy engines; its view of the backend passes the swap path on), and
    the fake runtime's page state sees no copy out of bytes nothing wrote, no kernel before
    its copy back, no discard before its copy out, no slot reused early."""
    from fake_cuda import FakeBindingsRuntime, FakeGpu

    from umrt.backends.cuda import BindingsApi

    monkeypatch.setenv("UMRT_SWAP_COPY", swap_copy)
    gpu = FakeGpu(total=80 << 30, managed_limit=512 << 30)
    rt = FakeBindingsRuntime(gpu)
    served = serve("50pct", 8 << 30, 10, native=False, api=BindingsApi(rt, sm_copy=rt.sm_copy_kernel), kernels=gpu)
    assert served.failed is None
    copies = [c for c in gpu.calls if c[0] == {"sm": "umrt_sm_copy", "engines": "cudaMemcpyAsync"}[swap_copy]]
    assert copies, f"the live runtime planned no copy ({swap_copy})"
    assert not gpu.violations, gpu.violations[:3]


def test_an_allocation_from_another_thread_while_the_server_arms_waits_and_is_served_safely(cuda13):
    """An allocation on another thread (torch's backward thread, a data loader's copy)
    arriving while the server arms waits for it, then deviates and is served by Python:
    never at an address the schedule hands out."""
    import threading
    import time

    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    arm, got = server._arm_locked, []

    def arm_with_a_visitor(window, arrays):
        server._arm_locked = arm  # one visitor, at the first arming
        visitor = threading.Thread(target=lambda: got.append(server.malloc(64 << 10, 0)))
        visitor.start()
        time.sleep(0.05)  # the visitor is at the server's door, the schedule not armed yet
        assert not got
        arm(window, arrays)
        server._visitor = visitor

    server._arm_locked = arm_with_a_visitor
    _learn(server, program)
    server._visitor.join()
    assert got and server.phase is Phase.FOLLOWING and server.report.catch_ups == 1  # it deviated at once
    program.live[got[0]] = 64 << 10
    _run(server, program, 8)  # no overlap (Program checks), Python, then native again
    assert server.report.arms == 2
    assert pool.live_blocks() == program.live


@pytest.mark.parametrize(("native_steps", "gives_up"), [(0, True), (SHORT_LIVED, False)])
def test_schedules_that_keep_deviating_at_once_are_given_up(cuda13, native_steps, gives_up):
    """A schedule handed back within a few steps, again and again, is not tried again;
    one that served a while before its hand-back (an evaluation pass every N steps) is."""
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    odd = list(SIZES)
    odd[0] = 5 << 20
    for _ in range(MAX_SHORT_LIVED):
        _learn(server, program)
        _run(server, program, native_steps)
        program.step(odd)  # deviates at its first allocation
        server.bridge.on_step(server)
    assert (server.phase is Phase.OFF) == gives_up, server.report
    assert server.report.catch_ups == MAX_SHORT_LIVED and pool.live_blocks() == program.live


def test_steps_of_two_shapes_taking_turns_keep_their_segments_and_go_native(cuda13):
    """A step whose shape the plan misses every other time (different sizes): the pool
    keeps its overflow segment instead of a cudaMallocManaged and a cudaFree each step,
    so the steps repeat in a cycle of two and the schedule serves them."""
    other = [2 << 20, 1 << 20, 3 << 20, 512 << 10, 4 << 20]
    pool, server, bridge = _server(cuda13)
    program = Program(lambda n: server.malloc(n, 0), server.free)
    for k in range(16):
        program.step([SIZES, other][k % 2])
        server.bridge.on_step(server)
        if server.phase is Phase.NATIVE:
            break
    assert server.phase is Phase.NATIVE and server.report.schedule_allocations == len(SIZES) + len(other)
    made = (cuda13.calls["cudaMallocManaged"], cuda13.calls["cudaFree"])
    for j in range(k + 1, k + 5):
        program.step([SIZES, other][j % 2])
        server.bridge.on_step(server)
    assert server.phase is Phase.NATIVE and (cuda13.calls["cudaMallocManaged"], cuda13.calls["cudaFree"]) == made


def test_a_native_schedule_calls_libcudart_only_on_the_process_runtime(cuda13, monkeypatch):
    """The C table over the process's libcudart is for the process's own CUDA runtime;
    a stand-in runtime (the fake one) gets its calls through its own adapter, whatever
    libcudart some other code loaded."""
    from umrt.native import server as steady_module
    from umrt.native.binding import counting_table, load_steady
    from umrt.native.schedule import ScheduleArrays

    built = []
    monkeypatch.setattr(steady_module, "loaded_libcudart", lambda: ("/x/libcudart.so.13", ""))
    monkeypatch.setattr(steady_module, "cudart_table", lambda path: built.append(path) or counting_table())
    schedule = load_steady(ScheduleArrays([64], [1 << 30], [0, 0], [0, 0]))
    if not schedule.native:
        pytest.skip("the native schedule did not build here")
    calls = BackendCalls(cuda13)
    calls.attach(schedule)
    assert calls.table_kind == "python" and not built  # the fake runtime: its own adapter
    monkeypatch.setattr(cuda13.api, "process_runtime", True)
    calls = BackendCalls(cuda13)
    calls.attach(schedule)
    assert calls.table_kind == "libcudart" and built == ["/x/libcudart.so.13"]


# -- findings of the native path's review: each test fails without its fix -------------------
class DiscardingPolicy:
    """A policy as umrt's runtime acts in a live run: at each allocation or free, the
    blocks freed before it are discarded, and each new block is populated on the GPU
    before its first kernel (no refault). It follows a replayed window with its calls
    muted, as the runtime does (``bridge.mute``), and once the bridge stopped (a quarantine)
    it is fed nothing more, as the runtime is not (``LiveBridge.on_event`` after a failure)."""

    def __init__(self, backend, pool):
        self.backend, self.dead, self.bridge = backend, [], None
        pool.listeners.append(self.on_pool_event)

    def on_pool_event(self, what, ptr, n):
        if self.bridge is not None and self.bridge.stopped is not None:
            return
        calls = self.bridge is None or not self.bridge.mute
        dead = [(p, m) for p, m in self.dead if self.backend.allocation_of(p) is not None]  # (as ManagedOnly)
        if dead and calls:
            self.backend.discard(dead)
        self.dead = [(ptr, n)] if what == "free" else []
        if what == "alloc" and calls:
            self.backend.populate([(ptr, n)])


class KernelProgram:
    """A step whose blocks hold data: each block is written by a kernel on the compute
    stream when it is made and read by one before it is freed (the fake GPU reports a
    read of discarded bytes, or a touch of memory no longer managed). ``late``: block
    ``a`` is freed after block ``b``, later than in the recorded step."""

    def __init__(self, malloc, free, gpu, stream=0):
        self.malloc, self.free, self.gpu, self.stream = malloc, free, gpu, stream
        self.live: dict[int, int] = {}
        self.survivors: list[int] = []

    def _new(self, n):
        ptr = self.malloc(n)
        assert ptr, f"no memory for {n} bytes"
        self.live[ptr] = n
        self.gpu.kernel(self.stream, writes=[(ptr, n)], name=f"write {n}")
        return ptr

    def _done(self, ptr):
        self.gpu.kernel(self.stream, reads=[(ptr, self.live[ptr])], name=f"read {self.live[ptr]}")
        self.free(ptr)
        del self.live[ptr]

    def step(self, late=False, extra=0, use_c=None):
        for ptr in self.survivors:
            self._done(ptr)
        if extra:  # a temporary of another size (every other step: two shapes taking turns)
            self._done(self._new(extra))
        a = self._new(1 << 20)
        b = self._new(512 << 10)
        for ptr in ((b, a) if late else (a, b)):  # recorded: a's discard runs at b's free
            self._done(ptr)
        c = self._new(3 << 20)
        if use_c is not None:  # c is used elsewhere too (another stream)
            use_c(c, self.live[c])
        d = self._new(2 << 20)
        self._done(c)
        self.survivors = [d]


def _kernel_server(backend, front=None):
    pool, server, bridge = _server(backend, front=front)
    DiscardingPolicy(backend, pool).bridge = bridge
    if front is not None:
        from umrt.allocators.torch import make_callbacks

        _, _, alloc_ptr, free_ptr = make_callbacks(server)
        front.set_fallback(alloc_ptr, free_ptr)
        return pool, server, bridge, (lambda n: front.malloc(n, 0, 0)), (lambda p: front.free(p, 0, 0, 0))
    return pool, server, bridge, (lambda n: server.malloc(n, 0)), server.free


@pytest.fixture(params=["python", "native"])
def twin(request):
    """Which schedule serves: the Python twin (no front) or the native one (the front)."""
    if request.param == "python":
        yield None
        return
    from umrt.native.front import load_front

    front = load_front()
    if front is None:
        pytest.skip("no compiler: the native front cannot be built")
    yield front
    front.install(None)
    front.set_fallback(0, 0)


def test_a_free_later_than_recorded_hands_back_before_the_discard_of_its_block(cuda13, fake_gpu, twin):
    """Finding 1: the recorded window discards block a at the free of block b (a died just
    before). A step that frees a after b must hand back before that discard runs: a's
    data is read afterwards (the fake GPU raises on a read of discarded bytes)."""
    pool, server, bridge, malloc, free = _kernel_server(cuda13, twin)
    program = KernelProgram(malloc, free, fake_gpu)
    _learn(server, program)
    assert server.report.schedule_calls > 0
    _run(server, program, 2)
    assert server.phase is Phase.NATIVE
    discards = cuda13.calls["cudaMemDiscardBatchAsync"]
    program.step(late=True)  # raised PageStateError (discarded-read) before the fix
    server.bridge.on_step(server)
    assert not fake_gpu.violations
    assert server.report.catch_ups == 1 and "live" in server.report.last_deviation, server.report
    assert server.report.layouts_retired == 0 and bridge.stopped is None
    assert pool.live_blocks() == program.live
    assert cuda13.calls["cudaMemDiscardBatchAsync"] > discards  # Python discarded a once it died
    _run(server, program, 8)  # Python, then native again, nothing lost
    assert server.report.arms == 2 and not fake_gpu.violations


def test_empty_cache_while_native_hands_back_first(cuda13, fake_gpu, twin):
    """Finding 2: torch.cuda.empty_cache() while the schedule serves. Steps of two shapes
    take turns, so the pool keeps an overflow segment that is empty at every step's end
    and used inside every other step. The pool must not give it back while the schedule
    serves blocks in it: the next step's kernels would touch memory that is no longer
    managed (an illegal address on a GPU, or a second owner after a later cudaMallocManaged)."""
    pool, server, bridge, malloc, free = _kernel_server(cuda13, twin)
    program = KernelProgram(malloc, free, fake_gpu)
    extra = [0, 5 << 20]
    k = 0
    for k in range(16):
        program.step(extra=extra[k % 2])
        bridge.on_step(server)
        if server.phase is Phase.NATIVE:
            break
    assert server.phase is Phase.NATIVE
    server.empty_cache()  # between two steps, as a training loop calls it
    for j in range(k + 1, k + 9):
        program.step(extra=extra[j % 2])  # an illegal-address before the fix
        bridge.on_step(server)
    assert not fake_gpu.violations and pool.live_blocks() == program.live
    assert server.report.catch_ups == 1 and "empty_cache" in server.report.last_deviation
    assert server.report.arms == 2  # Python, then native again


def _streams(fake_gpu):
    """Two created non-blocking streams on the fake runtime: the compute stream and a side one."""
    from fake_cuda import STREAM_NON_BLOCKING

    return fake_gpu.create_stream("test", STREAM_NON_BLOCKING), fake_gpu.create_stream("test", STREAM_NON_BLOCKING)


def _side_stream_reads(fake_gpu, ptr, n, main, side):
    """What a program does to use a block on a side stream: the side stream waits for the
    block's producer (``side.wait_stream(main)``), then a kernel there reads it."""
    event = fake_gpu.handle()
    fake_gpu.events[event] = None
    fake_gpu._event_device[event] = 0
    fake_gpu.record("test", event, main)
    fake_gpu.wait("test", side, event, 0)
    fake_gpu.kernel(side, reads=[(ptr, n)], name="side-stream consumer")


def test_a_block_used_on_a_side_stream_is_reused_and_discarded_only_after_that_streams_work(cuda13, fake_gpu):
    """Finding 4: torch's record_stream, as its caching allocator honours it (an event on
    each recorded stream at the free, the block's next use after it). A block written on
    the main stream, read on a side stream, recorded there and freed: its reuse on the
    main stream (a kernel writing it) and its discard come after the side stream's read.
    Before the fix the pool ignored the stream (a stream-race, a discard of pages in use)."""
    main, side = _streams(fake_gpu)
    pool = ManagedPool(cuda13)
    DiscardingPolicy(cuda13, pool)
    n = 1 << 20
    x = pool.malloc(n, main)
    fake_gpu.kernel(main, writes=[(x, n)], name="producer")
    _side_stream_reads(fake_gpu, x, n, main, side)
    getattr(pool, "record_stream", lambda *a: None)(x, side)  # (before the fix torch's call went nowhere)
    pool.free(x)
    y = pool.malloc(n, main)  # the dead block's discard runs here, then y is populated
    assert y == x  # reused in place, on its stream
    fake_gpu.kernel(main, writes=[(y, n)], name="next owner")
    assert not fake_gpu.violations


def test_a_discard_at_a_free_goes_to_the_stream_the_block_was_used_on(cuda13, fake_gpu):
    """Finding 4: the backend's compute stream follows the latest allocation's stream; a
    block of another stream, read there after that switch and then freed, must not be
    discarded on the compute stream before that read (pages discarded while in use)."""
    main, other = _streams(fake_gpu)
    pool = ManagedPool(cuda13)
    freed = []
    pool.listeners.append(lambda what, ptr, n: what == "free" and cuda13.discard([(ptr, n)]) or freed.append(ptr))
    n = 1 << 20
    y = pool.malloc(n, other)
    fake_gpu.kernel(other, writes=[(y, n)], name="producer on its stream")
    z = pool.malloc(n, main)  # the compute stream is main from here
    fake_gpu.kernel(other, reads=[(y, n)], name="last user on its stream")
    pool.free(y)  # discarded at its free: after its last user
    fake_gpu.kernel(main, writes=[(z, n)])
    assert not fake_gpu.violations


def test_record_stream_on_a_block_the_schedule_serves_hands_back_and_orders_its_reuse(cuda13, fake_gpu, twin):
    """Finding 4, the native path: torch's record_stream on a block the schedule served
    (through the front's entry point, as the shim forwards it; the server's for the Python
    twin). The schedule serves one stream: it deviates, Python hands back, and the pool
    orders the block's reuse and discard after the side stream's read."""
    from fake_cuda import STREAM_NON_BLOCKING

    side = fake_gpu.create_stream("test", STREAM_NON_BLOCKING)
    pool, server, bridge, malloc, free = _kernel_server(cuda13, twin)
    if twin is not None:
        from umrt.allocators.torch import make_callbacks, record_stream_callback

        _, _, alloc_ptr, free_ptr = make_callbacks(server)
        twin.set_fallback(alloc_ptr, free_ptr, record_stream_callback())  # (as umrt.enable sets it)
    # (before the fix torch's record_stream reached nothing of umrt's)
    record = getattr(twin if twin is not None else server, "record_stream", lambda *a: None)
    program = KernelProgram(malloc, free, fake_gpu)
    _learn(server, program)
    _run(server, program, 1)
    assert server.phase is Phase.NATIVE

    def on_the_side(ptr, n):
        _side_stream_reads(fake_gpu, ptr, n, 0, side)
        record(ptr, side)

    program.step(use_c=on_the_side)  # before the fix: c's discard and reuse raced the side stream's read
    bridge.on_step(server)
    assert server.report.catch_ups == 1 and "record_stream" in server.report.last_deviation, server.report
    _run(server, program, 6)
    assert not fake_gpu.violations and pool.live_blocks() == program.live


def test_the_shim_passes_torchs_record_stream_to_umrt(monkeypatch):
    """torch's CUDAPluggableAllocator::recordStream calls the function given to
    set_record_stream_fn with the block and the stream: the shim's umrt_record_stream
    (called here as torch holds it, a std::function) reaches the pool's record_stream."""
    import shutil

    from umrt.allocators import torch as ut

    if shutil.which("c++") is None:
        pytest.skip("no compiler: the shim cannot be built")
    shim = ut.load_shim()
    assert shim is not None
    seen = []

    class Pool:
        def record_stream(self, ptr, stream):
            seen.append((ptr, stream))

    monkeypatch.setitem(ut._state, "pool", Pool())
    shim.set_record_stream(ut.record_stream_callback())
    try:
        shim.module._try_record_stream(0x7F00_0000_0000, 0x5000)
        shim.module._try_record_stream(0, 0x5000)  # no block: nothing
    finally:
        shim.set_record_stream(0)
    assert seen == [(0x7F00_0000_0000, 0x5000)]


def test_a_call_made_at_a_module_boundary_replays_after_the_kernels_before_it(cuda13, fake_gpu, twin):
    """Finding 5: the policy evicts block a at a module boundary, after the kernel that
    writes it. The schedule cannot see module boundaries: the eviction must replay after
    that kernel (at the next allocation), never before it (at a's allocation, where the
    kernel then refaults a's pages from the host). Each native step's ops: the eviction
    comes after the write, as on the Python path."""
    from umrt.backends.base import HOST

    pool, server, bridge, malloc, free = _kernel_server(cuda13, twin)
    n, live = 1 << 20, {}

    class Program:  # one step: a written, a module boundary (a evicted), b, a read back
        survivors: list = []

        def step(self):
            a = malloc(n)
            fake_gpu.kernel(0, writes=[(a, n)], name="write a")
            getattr(server, "mark", lambda: None)()  # (a module hook; before the fix nothing marked it)
            if not bridge.native:
                cuda13.prefetch([(a, n)], HOST)  # the policy, at the boundary: a is not needed for a while
            b = malloc(2 * n)
            fake_gpu.kernel(0, writes=[(b, 2 * n)], name="write b")
            free(b)
            fake_gpu.kernel(0, reads=[(a, n)], name="read a")
            free(a)
            live.clear()

    program = Program()
    program.live = live
    _learn(server, program)
    assert server.report.schedule_calls > 0
    for _ in range(2):
        mark = len(fake_gpu.ops)
        program.step()
        bridge.on_step(server)
        names = [op.name + (" -> host" if op.detail.endswith("host") else "") for op in fake_gpu.ops[mark:]]
        assert server.phase is Phase.NATIVE
        assert names.index("cudaMemPrefetchAsync -> host") > names.index("write a"), names
    assert not fake_gpu.violations


DEADLOCK = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from fake_cuda import FakeBindingsRuntime, FakeGpu
import test_native_steady as t
from umrt.allocators import torch as ut
from umrt.native.tables import ApiTable
from umrt.native.front import load_front
from umrt.backends.cuda import BindingsApi, CudaBackend

gpu = FakeGpu()
backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
front, shim = load_front(), ut.load_shim()
pool, server, bridge = t._server(backend, front=front)
t.DiscardingPolicy(backend, pool).bridge = bridge  # decisions at every allocation: Python table calls
_, _, alloc_ptr, free_ptr = ut.make_callbacks(server)
front.set_fallback(alloc_ptr, free_ptr)
ut._state["shim"] = shim
shim.set_callbacks(front.malloc_address, front.free_address)
program = t.Program(lambda n: shim.module._try_alloc(n, 0), lambda p: shim.module._try_free(p, 0, 0))
t._learn(server, program)
entered, run = threading.Event(), ApiTable._run

def slow(self, *args):  # a decision's Python call, on the other thread: it lets the GIL go a while
    if threading.current_thread().name == "autograd":
        entered.set()
        time.sleep(0.5)
    return run(self, *args)

ApiTable._run = slow
for ptr in program.survivors:  # the next step starts as recorded
    shim.module._try_free(ptr, 0, 0)
# torch's autograd thread (no GIL) allocates through the front; its decision runs slowly...
other = threading.Thread(target=lambda: front.lib.umrt_front_malloc(t.SIZES[0], 0, None), daemon=True,
                         name="autograd")
other.start()
entered.wait(10)
# ...while this thread, holding the GIL (a torch op called from Python), allocates too.
shim.module._try_alloc(t.SIZES[1], 0)
other.join(10)
print("RESULT done", entered.is_set(), server.phase.value, front.installed is None, server.report.last_deviation)
"""


def test_a_decision_calling_python_never_runs_under_a_lock_a_gil_holder_waits_for(tmp_path):
    """Finding 6: a native schedule whose CUDA calls go through Python (no libcudart found)
    ran those calls under its mutex; a thread allocating from a torch op holds the GIL and
    waits for that mutex, while the decision's callback waits for the GIL: a deadlock.
    Such a schedule is now served from umrt's callbacks (ctypes lets the GIL go before
    taking the lock), never from the front torch's threads call directly."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from umrt.native.front import load_front

    if load_front() is None or shutil.which("c++") is None:
        pytest.skip("no compiler: the native front and the shim cannot be built")
    script = tmp_path / "deadlock.py"
    script.write_text(DEADLOCK.format(tests=str(Path(__file__).parent)))
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's umrt
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked: a GIL holder waited for the schedule's lock while a decision waited for the GIL")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT done True native True" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_prefetch_of_part_of_a_range_swapped_out_brings_the_whole_range_back():
    """The runtime swaps coalesced ranges out (several objects in one copy) and may then move
    one object of such a range alone: the backend brings the whole range back by its copy, so
    the object's bytes are the data it held (with only a population of the discarded pages,
    a kernel would read nothing)."""
    from fake_cuda import FakeBindingsRuntime, FakeGpu

    from umrt.backends.cuda import BindingsApi, CudaBackend

    gpu = FakeGpu()
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
    size = 4 << 20
    ptr = backend.malloc(size)
    gpu.kernel(backend.compute_stream, reads=(), writes=((ptr, size),), name="writer")
    backend.swap.reserve(size)
    backend.swap.out([(ptr, size)])
    second = (ptr + size // 2, size // 2)  # the second object of the range, moved alone
    backend.prefetch([second], backend.device)
    backend.launch([second], [], 0, 0)
    gpu.kernel(backend.compute_stream, reads=(second,), writes=(), name="reader")
    assert [c for c in gpu.calls if c[0] == "cudaMemcpyAsync"][-1][1] == ptr  # the whole range, copied back
    assert not gpu.violations


def test_a_window_that_swapped_is_not_repeated_natively():
    """The swap path's calls go through the backend's adapter as a window records it: its copies
    (which a schedule has no call for) make the window unschedulable; a drop's discard is recorded
    as the backend's own calls are."""
    from fake_cuda import FakeBindingsRuntime, FakeGpu

    from umrt.backends.cuda import BindingsApi, CudaBackend
    from umrt.native.constants import DecisionKind
    from umrt.native.recorder import CallAt, Unschedulable

    gpu = FakeGpu()
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
    assert backend.swap.pinned_copies
    size = 1 << 20
    live, dead = backend.malloc(size), backend.malloc(size)
    gpu.kernel(backend.compute_stream, reads=(), writes=((live, size), (dead, size)), name="writer")
    calls = BackendCalls(backend)
    log: list = []
    calls.record(log)
    assert backend.swap.pinned_copies  # (the recording adapter keeps the swap path on)
    backend.swap.reserve(size)
    backend.swap.out([(live, size)])
    backend.drop([(dead, size)])
    backend.swap.back([(live, size)])
    backend.swap.wait([(live, size)])
    calls.record(None)
    assert Unschedulable("memcpy") in log and Unschedulable("host_alloc") in log
    assert any(isinstance(e, CallAt) and e.kind is DecisionKind.DISCARD and e.ranges == ((dead, size),)
               for e in log), log
    assert not gpu.violations
