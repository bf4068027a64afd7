"""Steady-state CPU overhead of the umrt runtime: ``python -m bench.overhead``.

Feeds a training trace (default GPT-2 XL, batch 8, seq 1024, traced on meta)
event by event to :class:`umrt.runtime.Runtime`, exactly as the simulator's
replay does, for several iterations, and times every ``Runtime.on_event``
call of the last (steady) iteration with ``time.perf_counter_ns``. The
backend is a no-op stand-in: what is measured is the runtime's own Python
work (tables, plan following, range resolution, the pool's bookkeeping it
feeds), not the driver's. The number of backend calls it made is reported
beside it, with what they cost on the profile (``prefetch_call_overhead_s``
each, the simulator's model of the driver's time).

The figure is compared with the simulated ideal (unlimited-memory) iteration
time on the hardware profile (default h100-pcie5-80g); the target is <= 1%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from umrt.backends.base import Backend
from umrt.hardware import load_profile
from umrt.policy.base import PolicyContext
from umrt.runtime import Runtime
from umrt.trace.events import Alloc, Free, IterationBoundary, Launch


class NullBackend(Backend):
    """Counts calls and does nothing (addresses from a bump allocator)."""

    name = "null"

    def __init__(self) -> None:
        self.top = 1 << 40
        self.calls = 0

    def malloc(self, nbytes: int) -> int:
        ptr = self.top
        self.top += -(-nbytes // (2 << 20)) * (2 << 20)
        return ptr

    def free(self, ptr: int) -> None:
        pass

    def prefetch(self, ranges, device) -> None:
        self.calls += 1

    def discard(self, ranges) -> None:
        self.calls += 1

    def advise(self, ranges, advice, device) -> None:
        self.calls += 1

    def launch(self, reads, writes, flops, nbytes) -> None:
        pass

    def synchronize(self) -> None:
        pass


def measure(trace, profile_name: str, budget: str, iterations: int, op_level: bool) -> dict:
    from umrt.sim.replay import _stream, parse_budget, peak_live_bytes

    profile = load_profile(profile_name)
    spans = trace.iteration_spans()
    budget_bytes = parse_budget(budget, peak_live_bytes(trace))
    backend = NullBackend()
    rt = Runtime(op_level=op_level)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, budget_bytes, profile))
    clock = time.perf_counter_ns
    on_event = rt.on_event

    def nop(_e) -> None:
        return None

    per_call_floor = _floor(clock, nop)

    boundary = 0
    spent = 0
    events = 0
    calls0 = 0
    ideal = 0.0
    for ev in _stream(trace, spans, iterations):
        t = type(ev)
        if t is IterationBoundary:
            boundary += 1
            if boundary == iterations:  # the last iteration starts: measure it
                spent, events, ideal, calls0 = 0, 0, 0.0, backend.calls
        if t is Alloc:
            layout.alloc(ev.obj, ev.nbytes, ev.kind)
        a = clock()
        on_event(ev)
        spent += clock() - a
        events += 1
        if t is Free:
            layout.free(ev.obj)
        elif t is Launch:
            ideal += profile.compute_time(ev.flops, ev.bytes)
    spent_s = max(0.0, spent - events * per_call_floor) / 1e9
    calls = backend.calls - calls0
    return {
        "model": trace.header.model,
        "profile": profile.name,
        "budget_bytes": budget_bytes,
        "op_level": op_level,
        "events_per_iteration": events,
        "runtime_cpu_s_per_iteration": spent_s,
        "timer_floor_ns_per_call": per_call_floor,
        "ideal_iteration_s": ideal,
        "overhead_fraction": spent_s / ideal if ideal else float("nan"),
        "backend_calls_per_iteration": calls,
        "backend_call_time_s": calls * profile.prefetch_call_overhead_s,
        "runtime_report": {k: v for k, v in rt.report().items() if not isinstance(v, dict)},
    }


def _floor(clock, fn) -> float:
    """Nanoseconds a timed call of an empty function costs (timer + call)."""
    best = float("inf")
    for _ in range(5):
        n = 50_000
        total = 0
        for _ in range(n):
            a = clock()
            fn(None)
            total += clock() - a
        best = min(best, total / n)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--profile", default="h100-pcie5-80g")
    parser.add_argument("--budget", default="20%")
    parser.add_argument("--iterations", type=int, default=6,
                        help="iterations fed; the last is measured (the runtime trusts a plan from its third run)")
    parser.add_argument("--op-level", action="store_true", help="act before every launch")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    from bench.grid import trace_for

    t = time.perf_counter()
    trace = trace_for(args.model, args.batch, args.seq)
    print(f"trace {args.model} b{args.batch} s{args.seq}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    res = measure(trace, args.profile, args.budget, args.iterations, args.op_level)
    print(f"{res['model']} on {res['profile']} (simulated ideal iteration {res['ideal_iteration_s'] * 1e3:.1f} ms): "
          f"runtime CPU {res['runtime_cpu_s_per_iteration'] * 1e3:.2f} ms per steady iteration over "
          f"{res['events_per_iteration']} events = {res['overhead_fraction'] * 100:.2f}% "
          f"(target <= 1%); {res['backend_calls_per_iteration']} backend calls "
          f"({res['backend_call_time_s'] * 1e3:.2f} ms of driver time on the profile)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
