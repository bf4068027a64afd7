"""A recorded live run served as a live run is: the harness of the native steady state's
end-to-end test (``tests/test_native_steady.py``).

The H100's GPT-2 event streams (``bench.live_replay``'s logs, closed loop on umrt's
runtime: :class:`bench.live_replay.ClosedLoop`) drive what a live GPU run runs on the
CPU: every allocation and free through umrt's allocator (:class:`umrt.native.server.SteadyServer`
over a :class:`umrt.allocators.managed.ManagedPool` on a :class:`umrt.backends.cuda.CudaBackend`),
and the events the live bridge would feed (allocations, frees, module boundaries,
launches while the runtime wants them) reaching umrt's runtime through a
:class:`umrt.drive.Driver`, on the Python path or with the native steady state (through
the native front's C entry points where it builds). The test runs it on the fake CUDA
runtime and holds the two paths to the same addresses and calls; :class:`NullCuda`, a
runtime that does nothing, is the default.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.live_replay import LOGS, RUNS, ClosedLoop, read_live_log
from umrt.allocators.managed import ManagedPool
from umrt.backends.base import Advice, Range
from umrt.backends.cuda import CudaApi, CudaBackend
from umrt.drive.driver import Driver
from umrt.drive.live import LiveLayout, ManagedOnly
from umrt.hardware import load_profile
from umrt.native.binding import counting_table
from umrt.native.server import BackendCalls, SteadyServer
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit


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
          profile: str = "h100-sxm5-80g", odd_steps: Sequence[int] = ()) -> Served:
    """Replay live log ``run`` (a name of ``bench.live_replay.RUNS``) for ``iterations``
    iterations through umrt's allocator on ``api`` (default :class:`NullCuda`), with its
    native steady state on (``native``) or off; ``front``: the native front, whose C
    entry points then take every allocation and free, as torch's shim calls them.
    ``odd_steps``: steps (counted from 0) that also allocate one 3 MiB block first and
    free it at their end (an evaluation pass, a logging tensor: a step that deviates)."""
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
