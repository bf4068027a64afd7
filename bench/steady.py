"""The native steady schedule against the Python path: ``python -m bench.steady``.

The allocation stream of a steady gpt2 (batch 8 x 1024) iteration, from the H100's
live log (``tests/data/gpu-evidence/live-gpt2-b8s1024-budget40GiB.log.gz``): its
recorded variant (1,101 allocations) repeated with fresh objects until umrt's pool
(``LifetimePool(live_feed=True)`` over a bump allocator) gives every allocation the
same address in two iterations running. Then, side by side in one run, CPU time of:

* ``python``: :class:`umrt.allocators.managed.ManagedPool` ``malloc`` / ``free`` over
  that pool in steady state (the path torch's allocator callback takes today, less
  the callback and the live bridge);
* ``python_callback``: the same through the two ctypes callbacks torch calls
  (:func:`umrt.allocators.torch.make_callbacks`), called from Python through ctypes
  (the forward call's own cost is the empty C functions' figure below);
* ``twin``: :class:`umrt.native.twin.PythonSteadySchedule` (the fallback);
* ``native``: the compiled schedule's ``umrt_steady_malloc`` / ``umrt_steady_free``
  called from Python through ctypes, one ``drain`` per iteration; beside it an empty
  C function of the same signatures called the same way (the ctypes call's own cost),
  and the same stream run by a loop in C through the function pointers
  (``umrt_steady_run``: no ctypes at all).

A *pair* is one malloc and one free: an iteration's time over its allocations (it
frees as many as it allocates). Figures are medians over ``--iterations`` steady
iterations (the minimum beside). CPU figures on this machine, no GPU, no decisions
(the ``um`` policy's steady state: nothing to prefetch). The schedule alone:
``tests/test_native_steady.py`` serves recorded runs through the live path
(:class:`umrt.native.server.SteadyServer`, which arms such a schedule in the native front).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Sequence

from bench.live_replay import LOGS, RUNS, read_live_log
from umrt.allocators.managed import ManagedPool
from umrt.memory.pool import LifetimePool
from umrt.native.binding import load_steady
from umrt.native.recorder import AllocAt, FreeAt, Recorded
from umrt.native.schedule import compile_schedule
from umrt.testing.fake_backend import BumpBackend
from umrt.trace.events import Alloc, Event, Free, IterationBoundary, Kind

Op = tuple  # ("A", obj, size) | ("F", obj)


def log_iterations(events: Sequence[Event]) -> list[list[Op]]:
    """The allocations and frees of each iteration of a live log."""
    out: list[list[Op]] = []
    for ev in events:
        t = type(ev)
        if t is IterationBoundary:
            out.append([])
        elif out and t is Alloc:
            out[-1].append(("A", ev.obj, ev.nbytes))
        elif out and t is Free:
            out[-1].append(("F", ev.obj))
    return out


def steady_stream(iterations: Sequence[list[Op]], template: int, repeats: int) -> list[list[Op]]:
    """The log's iterations before ``template``, then ``template`` repeated ``repeats``
    times with fresh objects: an object born in the template keeps its role (its
    allocation ordinal); one born in the iteration before it is the previous
    repetition's object of the same ordinal (the two iterations must have the same shape)."""
    born: dict[int, tuple[int, int]] = {}
    for i, it in enumerate(iterations):
        n = 0
        for op in it:
            if op[0] == "A":
                born[op[1]] = (i, n)
                n += 1
    out = [list(it) for it in iterations[:template]]
    base = 1 + max(born, default=0)
    for r in range(repeats):
        def obj(o: int, r: int = r) -> int:
            it, ordinal = born[o]
            if it == template:
                return base + r * 100_000 + ordinal
            if it == template - 1 and r > 0:
                return base + (r - 1) * 100_000 + ordinal
            return o
        out.append([("A", obj(op[1]), op[2]) if op[0] == "A" else ("F", obj(op[1])) for op in iterations[template]])
    return out


def place(stream: Sequence[list[Op]]) -> list[list[Recorded]]:
    """Each iteration as umrt's pool places it (``LifetimePool(live_feed=True)`` over a
    bump allocator, boundaries observed): allocations with their addresses, frees."""
    pool = LifetimePool(BumpBackend(), live_feed=True)
    where: dict[int, int] = {}
    out: list[list[Recorded]] = []
    for i, it in enumerate(stream):
        pool.observe(IterationBoundary(i))
        rec: list[Recorded] = []
        for op in it:
            if op[0] == "A":
                where[op[1]] = ptr = pool.alloc(op[1], op[2], Kind.OTHER)
                rec.append(AllocAt(op[2], ptr))
            else:
                pool.free(op[1])
                rec.append(FreeAt(where.pop(op[1])))
        out.append(rec)
    return out


def first_steady(placed: Sequence[list[Recorded]]) -> int:
    """The first iteration the next one repeats exactly (addresses included)."""
    for i in range(len(placed) - 1):
        if placed[i] == placed[i + 1] and placed[i]:
            return i
    raise ValueError("the pool never reached a steady state on this stream")


def gpt2_steady(run: str = "40GiB", repeats: int = 6) -> tuple[list[list[Op]], list[list[Recorded]], int]:
    """gpt2's steady stream from a live log: (ops, placed iterations, first steady one)."""
    its = log_iterations(read_live_log(LOGS / RUNS[run]))
    template = 2  # the recorded variant, after one of the same shape (tests/data/gpu-evidence/README.md)
    stream = steady_stream(its, template, repeats)
    placed = place(stream)
    return stream, placed, first_steady(placed)


def _median_min(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), min(xs)


def schedule_plan(ops: Sequence[Op]) -> list[tuple[int, int]]:
    """An iteration's operations as a schedule sees them: ``(0, size)`` an allocation,
    ``(1, k)`` the free of this iteration's allocation ``k``, ``(2, k)`` the free of the
    previous iteration's allocation ``k`` (the object of the same role: ``steady_stream``)."""
    ordinal_of: dict[int, int] = {}
    plan: list[tuple[int, int]] = []
    for op in ops:
        if op[0] == "A":
            ordinal_of[op[1]] = len(ordinal_of)
            plan.append((0, op[2]))
        elif op[1] in ordinal_of:
            plan.append((1, ordinal_of[op[1]]))
        else:
            plan.append((2, -1))
    return plan


def _with_previous(plan: list[tuple[int, int]], ops: Sequence[Op], prev_ops: Sequence[Op]) -> list[tuple[int, int]]:
    """``plan`` with each ``(2, -1)`` given the previous iteration's allocation ordinal."""
    prev = {}
    for op in prev_ops:
        if op[0] == "A":
            prev[op[1]] = len(prev)
    return [(2, prev[op[1]]) if step == (2, -1) else step for step, op in zip(plan, ops, strict=True)]


def run_plan(malloc, free, plan: list[tuple[int, int]], n_alloc: int, last: list[int]) -> list[int]:
    """One iteration of ``plan`` through ``malloc(size)`` / ``free(ptr)``; returns its blocks."""
    cur = [0] * n_alloc
    k = 0
    for o, a in plan:
        if o == 0:
            cur[k] = malloc(a)
            k += 1
        elif o == 1:
            free(cur[a])
        else:
            free(last[a])
    return cur


def _time_loop(malloc, free, drain, plan, n_alloc: int, iterations: int) -> list[float]:
    """Per-pair ns of ``iterations`` timed iterations (after one untimed)."""
    last = [0] * n_alloc
    times = []
    for r in range(iterations + 1):
        t0 = time.perf_counter_ns()
        last = run_plan(malloc, free, plan, n_alloc, last)
        drain()
        if r:
            times.append((time.perf_counter_ns() - t0) / n_alloc)
    return times


def callback_pair_times(stream: Sequence[list[Op]], steady: int, n_alloc: int) -> list[float]:
    """Per-pair ns of ``stream``'s iterations after ``steady + 1``, served by a
    :class:`ManagedPool` over ``LifetimePool`` through the two ctypes callbacks torch
    calls (:func:`umrt.allocators.torch.make_callbacks`), called here through ctypes (the
    forward call's own cost is ``ctypes_empty_pair_ns``). Restores the torch allocator's pool."""
    from umrt.allocators import torch as torch_alloc

    previous = torch_alloc.callback_pool()  # make_callbacks repoints the module's callbacks at our pool
    pool = ManagedPool(BumpBackend())
    c_alloc, c_free, _, _ = torch_alloc.make_callbacks(pool)
    try:
        ptr_of: dict[int, tuple[int, int]] = {}
        times = []
        for i, it in enumerate(stream):
            pool.observe(IterationBoundary(i))
            t0 = time.perf_counter_ns()
            for op in it:
                if op[0] == "A":
                    ptr_of[op[1]] = (c_alloc(op[2], 0, None), op[2])
                else:
                    ptr, size = ptr_of.pop(op[1])
                    c_free(ptr, size, 0, None)
            if i > steady + 1:
                times.append((time.perf_counter_ns() - t0) / n_alloc)
        return times
    finally:
        torch_alloc.repoint_callbacks(previous)


def measure(iterations: int = 30) -> dict:
    """The figures (see the module docstring): ``*_ns`` are (median, min) per pair."""
    stream, placed, steady = gpt2_steady()
    ops = stream[steady + 1]
    plan = _with_previous(schedule_plan(ops), ops, stream[steady])
    n_alloc = sum(1 for o, _ in plan if o == 0)
    out: dict = {"allocations_per_iteration": n_alloc}
    # (a) the Python path: ManagedPool over LifetimePool(live_feed=True), steady state.
    long_stream = steady_stream(log_iterations(read_live_log(LOGS / RUNS["40GiB"])), 2, steady + iterations + 2)
    pool = ManagedPool(BumpBackend())
    ptr_of: dict[int, int] = {}
    py_times = []
    for i, it in enumerate(long_stream):
        pool.observe(IterationBoundary(i))
        t0 = time.perf_counter_ns()
        for op in it:
            if op[0] == "A":
                ptr_of[op[1]] = pool.malloc(op[2], 0)
            else:
                pool.free(ptr_of.pop(op[1]))
        if i > steady + 1:
            py_times.append((time.perf_counter_ns() - t0) / n_alloc)
    out["python_pair_ns"] = _median_min(py_times)
    out["python_callback_pair_ns"] = _median_min(callback_pair_times(long_stream, steady, n_alloc))
    arrays = compile_schedule(placed[steady])
    # (b) the native schedule through ctypes, the empty call beside it, and the C loop.
    sched = load_steady(arrays)
    out["native_built"] = bool(sched.native)
    if sched.native:
        lib, h = sched.lib, sched.handle
        m, f = lib.umrt_steady_malloc, lib.umrt_steady_free
        sched.arm()
        native = _time_loop(lambda size: m(h, size, 0, None), lambda p: f(h, p, 0, 0, None), sched.drain,
                            plan, n_alloc, iterations)
        if sched.deviation()[0]:
            raise RuntimeError(f"the native schedule deviated: {sched.deviation()[2]}")
        nm, nf = lib.umrt_steady_noop_malloc, lib.umrt_steady_noop_free
        empty = _time_loop(lambda size: nm(h, size, 0, None), lambda p: nf(h, p, 0, 0, None), lambda: None,
                           plan, n_alloc, iterations)
        out["native_pair_ns"] = _median_min(native)
        out["ctypes_empty_pair_ns"] = _median_min(empty)
        n_ops = len(plan)
        op_arr, arg_arr = (ctypes.c_int32 * n_ops)(), (ctypes.c_uint64 * n_ops)()
        alloc_index = [i for i, (o, _) in enumerate(plan) if o == 0]
        for i, (o, a) in enumerate(plan):
            op_arr[i], arg_arr[i] = (0, a) if o == 0 else (1, alloc_index[a])
        fresh = load_steady(arrays)  # nothing live from the loops above
        fresh.arm()
        got = (ctypes.c_uint64 * n_ops)()
        c_times = []
        for _ in range(iterations + 1):
            ns = lib.umrt_steady_run(fresh.handle, n_ops, op_arr, arg_arr, got, 1, 0, None)
            if ns < 0:
                raise RuntimeError(f"the native schedule deviated in the C loop: {fresh.deviation()[2]}")
            c_times.append(ns / n_alloc)
        out["native_c_loop_pair_ns"] = _median_min(c_times[1:])
    # (c) the Python twin (the fallback when the native build fails).
    twin = load_steady(arrays, native=False)
    twin.arm()
    twin_times = _time_loop(twin.malloc, twin.free, twin.drain, plan, n_alloc, iterations)
    if twin.deviation()[0]:
        raise RuntimeError(f"the Python schedule deviated: {twin.deviation()[2]}")
    out["twin_pair_ns"] = _median_min(twin_times)
    return out


def report(r: dict) -> str:
    """The figures as text."""
    n = r["allocations_per_iteration"]

    def row(name: str, key: str) -> str:
        med, lo = r[key]
        return f"  {name:<44} {med:8.0f} ns/pair (min {lo:6.0f})   {med * n / 1e6:7.3f} ms/iteration"

    lines = [f"gpt2 8x1024 steady iteration: {n} allocations and as many frees (CPU, this machine, no GPU)",
             row("python: ManagedPool over LifetimePool", "python_pair_ns"),
             row("python via torch's ctypes callbacks", "python_callback_pair_ns"),
             row("twin: PythonSteadySchedule", "twin_pair_ns")]
    if r["native_built"]:
        med_n, med_e = r["native_pair_ns"][0], r["ctypes_empty_pair_ns"][0]
        lines += [row("native via ctypes (incl. drain)", "native_pair_ns"),
                  row("  empty C functions via ctypes (call cost)", "ctypes_empty_pair_ns"),
                  f"  {'  native net of the ctypes call':<44} {med_n - med_e:8.0f} ns/pair",
                  row("native in a C loop (function pointers)", "native_c_loop_pair_ns"),
                  f"  python / native (C loop): {r['python_pair_ns'][0] / r['native_c_loop_pair_ns'][0]:.0f}x"]
    else:
        lines.append("  native: not built (see the warning above)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.steady", description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=30, help="steady iterations timed (default 30)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    r = measure(args.iterations)
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
