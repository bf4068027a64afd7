"""A recorded live run served as a live run is: ``python -m bench.served``.

The H100's GPT-2 event streams (``bench.live_replay``'s logs, closed loop on umrt's
runtime: :class:`bench.live_replay.ClosedLoop`) drive what a live GPU run runs on the
CPU: every allocation and free through umrt's allocator (:class:`umrt.native.server.SteadyServer`
over a :class:`umrt.allocators.managed.ManagedPool` on a :class:`umrt.backends.cuda.CudaBackend`),
and the events the live bridge would feed (allocations, frees, module boundaries,
launches while the runtime wants them) reaching umrt's runtime through a
:class:`umrt.drive.Driver`. Run once on the Python path (``UMRT_NATIVE=0``) and once
with the native steady state (through the native front's C entry points where it
builds), it reports umrt's CPU per step side by side: everything between two
optimizer steps but the program's own work, torch's calls into the allocator (a
ctypes callback each on the Python path: ``bench.overhead`` measures them) and the
module hooks (``bench.overhead``). The CUDA runtime is a stand-in that does nothing
(:class:`NullCuda`): CPU figures, no GPU. ``tests/test_native_steady.py`` runs the same
replay on the fake CUDA runtime and holds the two paths to the same addresses and calls.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.live_replay import LOGS, RUNS, ClosedLoop, read_live_log
from umrt.allocators.managed import ManagedPool
from umrt.backends.base import Advice, Range
from umrt.backends.cuda import CudaApi, CudaBackend
from umrt.cli import Renamed
from umrt.config import parse_amount
from umrt.drive.driver import Driver
from umrt.drive.live import LiveLayout, ManagedOnly
from umrt.errors import ConfigError
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
    """What a served replay did: per allocation the address it got; umrt's CPU per step
    (from one step's end to the next); the server's report and phase after each step."""

    addresses: list[int] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)
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
    clock, mark, odd = time.perf_counter, None, None
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
                if mark is not None:  # an optimizer step just ended
                    bridge.stepped()
                    server.on_step()
                    now = clock()
                    out.step_cpu_s.append(now - mark)
                    out.phases.append(server.phase.value)
                mark = clock()
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


def harness_cpu_s(run: str, iterations: int, *, through_ctypes: bool) -> list[float]:
    """The replay's own CPU per step: the closed-loop source and this loop with every
    allocation and free a call that does nothing (Python functions, or with
    ``through_ctypes`` empty C functions called through ctypes, as the native path's
    replay calls the front), launches unwanted; taken off the served figures."""
    if through_ctypes:
        from umrt.native.binding import native_library  # optional: the empty C functions it holds

        lib = native_library()
        noop_malloc, noop_free = lib.umrt_steady_noop_malloc, lib.umrt_steady_noop_free
        malloc, free = (lambda n: noop_malloc(1, n, 0, None)), (lambda p: noop_free(1, p, 0, 0, None))
    else:
        blocks = itertools.count(1)
        malloc, free = (lambda n: next(blocks)), (lambda p: None)
    where: dict[int, int] = {}
    source = ClosedLoop(read_live_log(LOGS / RUNS[run] if run in RUNS else Path(run)))
    out, mark = [], None
    for ev, _ in source.stream(iterations, lambda: False):
        t = type(ev)
        if t is Alloc:
            where[ev.obj] = malloc(ev.nbytes)
        elif t is Free:
            ptr = where.pop(ev.obj, None)
            if ptr is not None:
                free(ptr)
        elif t is IterationBoundary:
            now = time.perf_counter()
            if mark is not None:
                out.append(now - mark)
            mark = now
    return out


def compare(run: str, budget: int, iterations: int, steady_from: int) -> dict:
    """The Python path and the native path on ``run``; per-step CPU from ``steady_from``
    (the native path's steps served natively), medians and minimums."""
    from umrt.native.front import load_front  # optional: the native path's front, if it builds

    front = load_front()
    python = serve(run, budget, iterations, native=False)
    native = serve(run, budget, iterations, native=True, front=front)
    steps = [k for k in range(steady_from, len(native.phases)) if native.phases[k - 1] == "native"]

    def summary(s: Served, through_ctypes: bool) -> dict:
        harness = statistics.median(harness_cpu_s(run, iterations, through_ctypes=through_ctypes)[steady_from:])
        times = [s.step_cpu_s[k] for k in steps] or s.step_cpu_s[steady_from:]
        return {"cpu_s": max(0.0, statistics.median(times) - harness),
                "cpu_s_min": max(0.0, min(times) - harness), "harness_cpu_s": harness, "report": s.report}

    return {"run": run, "budget": budget, "iterations": iterations, "front": front is not None,
            "same_addresses": python.addresses == native.addresses, "native_steps": len(steps),
            "python": summary(python, False), "native": summary(native, front is not None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.splitlines()[0])
    p.add_argument("--run", default="40GiB", help=f"a live log: {', '.join(RUNS)} or a path (default 40GiB)")
    p.add_argument("--gpu-memory", dest="budget", default="40GiB", metavar="SIZE",
                   help="GPU memory the runtime plans for, a size (default 40GiB)")
    p.add_argument("--budget", dest="budget", action=Renamed, new="--gpu-memory", prefix="bench.served")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    args = p.parse_args(argv)
    try:
        budget = parse_amount(args.budget, "--gpu-memory", allow_percent=False).bytes
    except ConfigError as exc:
        p.error(str(exc))
    if args.iterations < 12:
        p.error("--iterations must be at least 12 (the native path arms around the eighth)")
    r = compare(args.run, budget, args.iterations, steady_from=args.iterations // 2)
    print(f"{args.run} served at {budget / 2**30:.1f} GiB, {args.iterations} iterations (CPU on this machine, "
          "no GPU; torch's allocator callbacks and the module hooks not included: see bench.overhead)")
    for name in ("python", "native"):
        s = r[name]
        print(f"  {name:>6}: umrt's CPU per steady step {s['cpu_s'] * 1e3:8.3f} ms (min {s['cpu_s_min'] * 1e3:.3f}; "
              f"the replay's own {s['harness_cpu_s'] * 1e3:.2f} ms taken off)  {s['report']['steps_native']} steps "
              "served natively")
    print(f"  same addresses on both paths: {'yes' if r['same_addresses'] else 'NO'}; {r['native_steps']} steps "
          f"compared{'' if r['front'] else ' (no native front: the Python schedule served)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
