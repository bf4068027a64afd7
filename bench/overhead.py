"""Steady-state CPU overhead of the umrt runtime: ``python -m bench.overhead``.

Feeds a training trace (default GPT-2 XL, batch 8, seq 1024, traced on meta)
event by event through the :class:`umrt.drive.Driver` to :class:`umrt.policy.runtime.Runtime`,
as the simulator's replay does, and times every ``Driver.feed`` and, inside it,
``Runtime.on_event`` call of the steady iterations with ``time.perf_counter_ns``
(less the cost of timing an empty call). An iteration is timed from its opening boundary to the next, so it
holds exactly one boundary's work. The machine is shared, so ``--repeats``
steady iterations are timed and the minimum (the least disturbed) is the
figure, with the median beside it.

The backend is a no-op stand-in: what is measured is the runtime's own Python
work (tables, plan following, range resolution), the pool's and the driver's. The number of backend calls it made
is reported beside it, with what they cost on the profile
(``prefetch_call_overhead_s`` each, the simulator's model of the driver's
time). The pool's ``alloc``/``free`` (umrt's allocator, standing in for
PyTorch's caching allocator) are timed the same way and reported beside it.

Launches are held back while the runtime does not want them
(``Runtime.wants_launches``: a trusted plan runs on allocations, frees and
module boundaries), as the live bridge does by suspending capture; the
launches it was handed per iteration are reported (the pool, which keys
its layout by launch in the simulator, is told of every launch). ``--all-launches`` feeds
every launch instead (and acts on launches: ``launch_free=False``).

The figure is compared with the simulated ideal (unlimited-memory) iteration
time on the hardware profile (default h100-pcie5-80g); the target is <= 1%.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.pool import BumpBackend
from umrt.backends.base import Backend
from umrt.drive.driver import Driver
from umrt.hardware import load_profile
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.sim.budget import resolve_budget
from umrt.sim.replay import iteration_stream
from umrt.trace.events import IterationBoundary, Launch


class NullBackend(BumpBackend, Backend):
    """Counts calls and does nothing (addresses from the pool bench's bump allocator)."""

    name = "null"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def prefetch(self, ranges, device) -> None:
        self.calls += 1

    def discard(self, ranges) -> None:
        self.calls += 1

    def advise(self, ranges, advice, device) -> None:
        self.calls += 1

    def launch(self, reads, writes, flops, nbytes, precision="") -> None:
        pass

    def synchronize(self) -> None:
        pass


def measure(trace, profile_name: str, budget: str, iterations: int, op_level: bool,
            repeats: int = 1, all_launches: bool = False) -> dict:
    """Feed ``iterations + repeats - 1`` iterations; time each of the last ``repeats``.

    Events reach the runtime through the :class:`~umrt.drive.Driver`, closed
    loop as live (launches only while the runtime wants them, unless
    ``all_launches``). An iteration is timed from its opening
    :class:`IterationBoundary` (included: the boundary's work belongs to the
    iteration it opens) to the next one (excluded), so each timed iteration
    holds exactly one boundary. Inside ``Driver.feed``, ``Runtime.on_event``
    (``runtime_cpu_s_per_iteration``) and the pool's ``alloc``/``free`` and
    learning (``pool_cpu_s_per_iteration``: the allocator umrt replaces
    PyTorch's with) are timed call by call, less the cost of timing a call.
    A second, untimed-inside run feeds each iteration to a fresh driver as one
    batch (``Driver.feed_all``) and times the batch
    (``driver_cpu_s_per_iteration``: everything umrt does per iteration).
    """
    profile = load_profile(profile_name)
    spans = trace.iteration_spans()
    budget_bytes = resolve_budget(budget, trace).bytes  # a percentage: of the footprint the run needs
    backend = NullBackend()
    rt = Runtime(op_level=op_level, launch_free=not all_launches)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, budget_bytes, profile))
    driver = Driver(rt, layout, backend, profile=profile, launches_on_demand=not all_launches)
    clock = time.perf_counter_ns

    def nop(_e) -> None:
        return None

    per_call_floor = _floor(clock, nop)
    total = iterations + repeats - 1
    spent = {"runtime": 0, "pool": 0}
    calls = {"runtime": 0, "pool": 0}

    def timed(part: str, fn):
        def call(*args):
            a = clock()
            try:
                return fn(*args)
            finally:
                spent[part] += clock() - a
                calls[part] += 1
        return call

    # Instance attributes shadow the methods the driver looks up on each call.
    rt.on_event = timed("runtime", rt.on_event)
    for name in ("alloc", "free", "observe", "observe_launch"):
        setattr(layout, name, timed("pool", getattr(layout, name)))
    feed = driver.feed

    boundary = 0
    events = launches = held0 = 0
    calls0 = 0
    samples: list[dict] = []

    def close() -> None:
        samples.append({
            "runtime_s": max(0.0, spent["runtime"] - calls["runtime"] * per_call_floor) / 1e9,
            "pool_s": max(0.0, spent["pool"] - calls["pool"] * per_call_floor) / 1e9,
            "events": calls["runtime"], "fed": events, "ideal_s": driver.ideal_s[-1],
            "calls": backend.calls - calls0,
            "launches": launches, "delivered": launches - (driver.launches_held_back - held0),
        })

    for ev in iteration_stream(trace, spans, total):
        t = type(ev)
        if t is IterationBoundary:
            boundary += 1
            if boundary > iterations:
                close()
            if boundary >= iterations:  # a measured iteration starts
                events = launches = 0
                spent.update(runtime=0, pool=0)
                calls.update(runtime=0, pool=0)
                calls0, held0 = backend.calls, driver.launches_held_back
        launches += t is Launch
        feed(ev)
        events += 1
    # (the closing boundary of the stream opens no iteration; it is not timed)
    first = samples[0]
    runtime_s = [s["runtime_s"] for s in samples]
    pool_s = [s["pool_s"] for s in samples]
    driver_s = _batches(trace, profile, budget_bytes, iterations, op_level, repeats, all_launches)
    best = min(runtime_s)
    ideal = first["ideal_s"]
    calls = first["calls"]
    return {
        "model": trace.header.model,
        "dtype": trace.header.meta.get("dtype", "float32"),
        "profile": profile.name,
        "budget_bytes": budget_bytes,
        "op_level": op_level,
        "events_per_iteration": first["events"],
        "events_fed_per_iteration": first["fed"],
        "launches_per_iteration": first["launches"],
        "launches_delivered_per_iteration": first["delivered"],
        "measured_iterations": len(samples),
        "runtime_cpu_s_per_iteration": best,
        "runtime_cpu_s_first": runtime_s[0],
        "runtime_cpu_s_median": statistics.median(runtime_s),
        "runtime_cpu_s_all": runtime_s,
        "pool_cpu_s_per_iteration": min(pool_s),
        "pool_cpu_s_median": statistics.median(pool_s),
        "driver_cpu_s_per_iteration": min(driver_s),
        "driver_cpu_s_median": statistics.median(driver_s),
        "timer_floor_ns_per_call": per_call_floor,
        "ideal_iteration_s": ideal,
        "overhead_fraction": best / ideal if ideal else float("nan"),
        "overhead_fraction_median": statistics.median(runtime_s) / ideal if ideal else float("nan"),
        "overhead_fraction_with_pool": (best + min(pool_s)) / ideal if ideal else float("nan"),
        "overhead_fraction_driver": min(driver_s) / ideal if ideal else float("nan"),
        "backend_calls_per_iteration": calls,
        "backend_call_time_s": calls * profile.prefetch_call_overhead_s,
        "runtime_report": {k: v for k, v in rt.report().items() if not isinstance(v, dict)},
    }


def _batches(trace, profile, budget_bytes: int, iterations: int, op_level: bool, repeats: int,
             all_launches: bool) -> list[float]:
    """Seconds ``Driver.feed_all`` takes for each of the ``repeats`` iterations from
    ``iterations`` on, each fed as one batch (boundary first) to a runtime as :func:`measure`'s."""
    backend = NullBackend()
    rt = Runtime(op_level=op_level, launch_free=not all_launches)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, budget_bytes, profile))
    driver = Driver(rt, layout, backend, profile=profile, launches_on_demand=not all_launches)
    out: list[float] = []
    batch: list = []
    boundary = 0
    for ev in iteration_stream(trace, trace.iteration_spans(), iterations + repeats - 1):
        if type(ev) is IterationBoundary:
            boundary += 1
            if batch:
                a = time.perf_counter()
                driver.feed_all(batch)
                if boundary > iterations:
                    out.append(time.perf_counter() - a)
                batch = []
        batch.append(ev)
    driver.feed_all(batch)
    return out


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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's training precision (float32: as the zoo traces by default)")
    parser.add_argument("--budget", default="20%")
    parser.add_argument("--iterations", type=int, default=6,
                        help="the first measured iteration (the runtime trusts a plan from its third run)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="steady iterations measured from --iterations on; the minimum is reported "
                             "(the machine is shared: the minimum is the least disturbed), the median beside it")
    parser.add_argument("--op-level", action="store_true", help="act before every launch")
    parser.add_argument("--all-launches", action="store_true",
                        help="deliver every launch (the runtime acts on launches), as before capture could be "
                             "suspended")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    from bench.grid import trace_for

    t = time.perf_counter()
    trace = trace_for(args.model, args.batch, args.seq, dtype=args.dtype)
    print(f"trace {args.model} b{args.batch} s{args.seq}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    res = measure(trace, args.profile, args.budget, args.iterations, args.op_level, args.repeats,
                  args.all_launches)
    ideal = res["ideal_iteration_s"]
    print(f"{res['model']} ({res['dtype']}) on {res['profile']} (simulated ideal iteration {ideal * 1e3:.1f} ms): "
          f"runtime CPU {res['runtime_cpu_s_per_iteration'] * 1e3:.2f} ms per steady iteration "
          f"(min of {res['measured_iterations']}; median {res['runtime_cpu_s_median'] * 1e3:.2f} ms) over "
          f"{res['events_per_iteration']} events ({res['launches_delivered_per_iteration']} of "
          f"{res['launches_per_iteration']} launches) = {res['overhead_fraction'] * 100:.2f}% "
          f"(median {res['overhead_fraction_median'] * 100:.2f}%; target <= 1%); "
          f"{res['backend_calls_per_iteration']} backend calls "
          f"({res['backend_call_time_s'] * 1e3:.2f} ms of driver time on the profile)")
    print(f"  + the pool's alloc/free {res['pool_cpu_s_per_iteration'] * 1e3:.2f} ms "
          f"(median {res['pool_cpu_s_median'] * 1e3:.2f} ms) = {res['overhead_fraction_with_pool'] * 100:.2f}% "
          f"with the allocator")
    print(f"  everything umrt does per iteration (Driver.feed_all: the runtime, the pool, the driver) "
          f"{res['driver_cpu_s_per_iteration'] * 1e3:.2f} ms (median {res['driver_cpu_s_median'] * 1e3:.2f} ms) "
          f"= {res['overhead_fraction_driver'] * 100:.2f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
