"""A trace replayed through a layout, addresses only: umrt's LifetimePool against peak
live bytes and PyTorch's caching allocator (``tests/test_bench_pool.py`` holds the pool
to its targets on a real model's trace), and the bump-allocator backend the CPU
benches serve managed segments from.

:func:`replay` drives a layout event by event over :class:`BumpBackend` (no simulator:
only addresses matter here). The pool is fed the event stream (``observe``), learns the
first iteration and plans from the second on. Figures are taken over the last
(steady-state) iteration:

* ``peak_live`` — the most bytes of live objects at once (requested sizes);
* ``footprint`` — the most managed bytes the layout held;
* ``stable`` — the fraction of the last iteration's allocations that got the
  same address as in the iteration before (1.0 = deterministic layout).

With ``live_feed``, the pool is fed as a live run feeds it (``LifetimePool(live_feed=True)``
under umrt's ``ManagedPool``): every allocation announced as ``Kind.OTHER``, no launches,
layer events and iteration boundaries fed, and during the first two iterations a
``hint_kind`` with the trace's kind right after each allocation (what the live bridge
forwards from the capture recorder and the optimizer's facts while the runtime learns).
"""
from __future__ import annotations

from umrt.errors import UmrtError
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch

TARGET_VS_LIVE = 1.03  # issue 4: the pool's footprint over peak live bytes
# The live bridge hints kinds while it learns only: the recorder's while the runtime records
# (Config.learn_iterations = 2), the optimizer's facts in its first steps (umrt.api._FACT_STEPS = 2).
LIVE_HINTED_ITERATIONS = 2


class BumpBackend:
    """Managed segments from a bump allocator, 2 MB-aligned like cudaMallocManaged's large allocations."""

    def __init__(self) -> None:
        self._next = 1 << 40

    def malloc(self, nbytes: int) -> int:
        ptr = self._next
        self._next += -(-nbytes // (2 << 20)) * (2 << 20)
        return ptr

    def free(self, ptr: int) -> None:
        pass


def replay(trace, layout, *, feed: bool, live_feed: bool = False) -> dict:
    """Drive ``layout`` through the trace as the simulator does (``live_feed``: as a live
    run's allocator and bridge do, see the module docstring); measure the last iteration."""
    spans = trace.iteration_spans()
    if len(spans) < 2:
        raise UmrtError("the pool bench needs a trace with at least 2 complete iterations")
    last_start, last_stop = spans[-1]
    prev_start = spans[-2][0]
    sizes: dict[int, int] = {}
    live = peak_live = peak_footprint = 0
    prev_addrs: list[int] = []
    last_addrs: list[int] = []
    observe = getattr(layout, "observe", None) if feed else None
    iteration = None
    for i, e in enumerate(trace.events):
        steady = last_start <= i < last_stop
        if isinstance(e, IterationBoundary):
            iteration = e.index
        if live_feed and isinstance(e, Launch):
            continue  # a live run's launches stop once the runtime stops recording
        if isinstance(e, Alloc):
            if live_feed:
                ptr = layout.alloc(e.obj, e.nbytes, Kind.OTHER)  # the allocator knows no kind
                if iteration is not None and iteration < LIVE_HINTED_ITERATIONS:
                    layout.hint_kind(e.obj, e.kind)
            else:
                ptr = layout.alloc(e.obj, e.nbytes, e.kind)
            sizes[e.obj] = e.nbytes
            live += e.nbytes
            if steady:
                last_addrs.append(ptr)
            elif prev_start <= i < last_start:
                prev_addrs.append(ptr)
        elif isinstance(e, Free):
            if observe:
                observe(e)
            layout.free(e.obj)
            live -= sizes.pop(e.obj)
        elif observe:
            observe(e)
        elif isinstance(e, IterationBoundary) and hasattr(layout, "on_iteration_boundary"):
            layout.on_iteration_boundary(e.index)
        if steady:
            peak_live = max(peak_live, live)
            peak_footprint = max(peak_footprint, layout.footprint())
    same = sum(a == b for a, b in zip(prev_addrs, last_addrs, strict=False))
    return {
        "peak_live": peak_live,
        "footprint": peak_footprint,
        "stable": same / len(last_addrs) if last_addrs and len(prev_addrs) == len(last_addrs) else None,
    }
