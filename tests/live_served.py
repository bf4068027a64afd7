"""A recorded live run served the way a live GPU run is: allocations through umrt's
:class:`~umrt.drive.steady.SteadyServer` over a ``ManagedPool`` on the fake CUDA runtime,
the events the live bridge would feed reaching umrt's runtime through a ``Driver``, the
stream closed-loop on the runtime's ``wants_launches`` (:class:`bench.live_replay.ClosedLoop`).
Used by ``tests/test_native_steady.py`` to hold the native path to the Python path on
the H100's own event streams."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from fake_cuda import FakeBindingsRuntime, FakeGpu

from bench.live_replay import LOGS, RUNS, ClosedLoop, read_live_log
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import BindingsApi, CudaBackend
from umrt.drive.driver import Driver
from umrt.drive.live import LiveLayout, ManagedOnly
from umrt.drive.steady import BackendCalls, SteadyServer
from umrt.hardware import load_profile
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit


@dataclass
class Served:
    """What a served replay did: per allocation of the stream, the address it got; the
    fake runtime's calls; the server's report and the runtime's mode per iteration."""

    addresses: list[int] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    phases: list[str] = field(default_factory=list)
    failed: BaseException | None = None
    violations: list = field(default_factory=list)


class ReplayBridge:
    """The live bridge's part in a served replay (:class:`umrt.drive.steady.SteadyBridge`)."""

    def __init__(self, session_backend: CudaBackend, pool: ManagedPool, budget: int, profile: str) -> None:
        self.pool = pool
        self.policy = Runtime(use_pool=False)
        self.backend = ManagedOnly(session_backend)
        self._born: dict[int, int] = {}
        self.layout = LiveLayout(self._born.pop, pool, learn=True)
        self.policy.attach(PolicyContext(self.backend, self.layout, budget, load_profile(profile)))
        self.driver = Driver(self.policy, self.layout, self.backend)
        self.native = False
        self.failed: BaseException | None = None
        self._ids = itertools.count(1)
        self.obj_at: dict[int, int] = {}
        self._step_ended = False
        self._next = 0
        pool.listeners.append(self.on_pool_event)
        pool.before_malloc.append(lambda n: self.open_if_stepped())

    def on_pool_event(self, what: str, ptr: int, n: int) -> None:
        if what == "alloc":
            self.open_if_stepped()
            obj = next(self._ids)
            self.obj_at[ptr] = obj
            self._born[obj] = ptr
            self.driver.feed(Alloc(obj, n, Kind.OTHER, 0))
        else:
            obj = self.obj_at.pop(ptr, None)
            if obj is not None:
                self.driver.feed(Free(obj))

    def open_if_stepped(self) -> None:
        if self._step_ended:
            self._step_ended = False
            self._next += 1
            self.driver.feed(IterationBoundary(self._next))

    def stepped(self) -> None:
        self._step_ended = True

    # SteadyBridge
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


def _plain(x):
    """A logged call as plain values (a cudaMemLocation as its type and fields)."""
    if isinstance(x, (int, str, float, type(None))):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(_plain(y) for y in x)
    return (type(x).__name__, *(_plain(v) for v in vars(x).values()))


def serve(run: str, budget: int, iterations: int, *, native: bool, front=None,
          profile: str = "h100-sxm5-80g") -> Served:
    """Replay live log ``run`` (a name of ``bench.live_replay.RUNS``) for ``iterations``
    iterations through a server (``native``: its steady state on) and say what it did."""
    gpu = FakeGpu(total=80 * 2**30, managed_limit=512 * 2**30)
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
    pool = ManagedPool(backend)
    server = SteadyServer(pool, front=front, calls=BackendCalls(backend), enabled=native)
    bridge = ReplayBridge(backend, pool, budget, profile)
    server.attach(bridge)
    if front is not None:
        from umrt.allocators.torch import make_callbacks

        _, _, alloc_ptr, free_ptr = make_callbacks(server)
        front.set_fallback(alloc_ptr, free_ptr)
        malloc, free = (lambda n: front.malloc(n, 0, 0)), (lambda p: front.free(p, 0, 0, 0))
    else:
        malloc, free = (lambda n: server.malloc(n, 0)), server.free
    out = Served()
    where: dict[int, int] = {}  # the log's object -> its block
    source = ClosedLoop(read_live_log(LOGS / RUNS[run]))
    started = False
    try:
        for ev, seen in source.stream(iterations, lambda: bridge.policy.wants_launches):
            t = type(ev)
            if t is Alloc:
                ptr = malloc(ev.nbytes)
                where[ev.obj] = ptr
                out.addresses.append(ptr)
            elif t is Free:
                ptr = where.pop(ev.obj, None)
                if ptr is not None:
                    free(ptr)
            elif t is IterationBoundary:
                if started:  # an optimizer step just ended
                    bridge.stepped()
                    server.on_step()
                    out.phases.append(server.phase.value)
                started = True
            elif bridge.native:
                continue  # the bridge feeds nothing while the schedule serves
            elif t is Launch:
                accesses = tuple(Access(bridge.obj_at[where[a.obj]], a.offset, a.length, a.write)
                                 for a in ev.accesses if where.get(a.obj) in bridge.obj_at)
                bridge.open_if_stepped()
                bridge.driver.feed(Launch(ev.seq, ev.exec_id, ev.op, accesses, ev.flops, ev.bytes, ev.module,
                                          ev.precision), shown=seen)
            elif t in (LayerEnter, LayerExit):
                bridge.open_if_stepped()
                bridge.driver.feed(ev)
        server.close()
    finally:
        if front is not None:
            front.install(None)
            front.set_fallback(0, 0)
    out.calls = [_plain(c) for c in gpu.calls if c[0] != "cudaStreamSynchronize"]  # (a hand-back's settle)
    out.report = server.report.__dict__.copy()
    out.failed = bridge.failed
    out.violations = list(gpu.violations)
    return out
