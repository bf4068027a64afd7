"""What a GPU memory budget means when a run is simulated (``umrt simulate``, the bench, shadow mode).

A budget is a size (``"8GiB"``, ``"512MB"``, a number of bytes) or a
percentage of one named thing (:data:`umrt.config.PERCENT_BASES`): ``"20%"``
is 20% of **the footprint the run needs** (:class:`Needs`), so that ``100%``
holds everything and nothing has to be evicted (:data:`FOOTPRINT_DEFINITION`):

    the most managed memory the trace's allocations obtain when every
    Alloc/Free is placed, in order, by the layouts the simulator runs
    policies with — umrt's :class:`~umrt.memory.pool.LifetimePool` (fed the
    launches, layer events and boundaries, as the runtime feeds it, and laying
    out no plan, as the runtime has it where nothing has to move) and the
    model of PyTorch's caching allocator
    (:class:`~umrt.memory.caching.CachingAllocatorLayout`, under ``ideal``,
    ``um`` and most peers) — whichever needs more.

``"20%peak"`` is 20% of the trace's peak live bytes (the sum of live object
sizes, which no layout reaches: rounding, 2 MB blocks, fragmentation). A
percentage of the GPU's memory (``"90%device"``, a live run's) is an error
here: a simulated GPU's memory is its budget.

One pass per layout over the trace, placing objects and simulating no page:
:func:`needs` is cheap (0.7 s for GPT-2 XL's 38k events) and cached per
trace object.

:func:`parse_budget` is the one parser of simulated budgets; :func:`resolve_budget`
turns a budget into a :class:`Budget` that says what it is in every report
(:meth:`Budget.describe`).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

from umrt.backends.base import (
    BLOCK,  # the smallest budget: one 2 MB block of GPU memory (the driver's VA block)
)
from umrt.config import (
    FOOTPRINT_DEFINITION,
    PEAK_LIVE_DEFINITION,
    SIMULATED_FORMS,
    read_amount,
    simulated_amount,
)
from umrt.drive.driver import Driver
from umrt.errors import ConfigError
from umrt.policy.baselines import UMPolicy
from umrt.sim.needs import BASE_NAMES, BASES, Budget, Needs, check_base
from umrt.trace.events import Alloc, Event, Free, Trace

__all__ = ["BASES", "Needs", "Budget", "needs", "needs_of_events", "parse_budget", "resolve_budget",
           "budget_base", "peak_live_bytes", "FOOTPRINT_DEFINITION", "PEAK_LIVE_DEFINITION"]

FORMS = SIMULATED_FORMS


# ---------------------------------------------------------------- parsing


def parse_budget(budget: int | str, base_bytes: int, base: str = "footprint") -> int:
    """GPU memory budget in bytes: a percentage of ``base_bytes``, a size (``8GiB``, ``512MB``) or an int.

    The text is read by :func:`umrt.config.read_amount`, as every memory amount
    umrt takes; a percentage may exceed 100% here. ``base`` names what
    ``base_bytes`` is (:data:`BASES`); a percentage that names another base
    (``20%peak`` when ``base`` is ``footprint``) is a :class:`~umrt.errors.ConfigError`
    (:func:`resolve_budget` reads every base). Raises it too for anything that is
    not a budget, or for one below one 2 MB block (the unit of GPU memory).
    """
    value: float
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ConfigError(f"invalid budget {budget!r}: use {FORMS}")
    if isinstance(budget, (int, float)):
        value = budget
    else:
        amount = read_amount(budget)
        if amount is None:
            raise ConfigError(f"invalid budget {budget!r}: use {FORMS}")
        if amount.fraction is not None:
            simulated_amount(amount)  # %device and %budget: a clear error
            if not 0 < amount.fraction < math.inf:
                raise ConfigError(f"budget {budget!r} must be above 0%")
            if amount.base != base and not amount.implied:
                raise ConfigError(f"budget {budget!r} is of {BASE_NAMES[amount.base or base]}, not of "
                                  f"{BASE_NAMES.get(base, base)}")
            value = base_bytes * amount.fraction
        else:
            value = amount.bytes or 0
    if not math.isfinite(value) or value < BLOCK:
        raise ConfigError(f"budget {budget!r} = {value:.0f} bytes is below one 2 MB block of GPU memory")
    return int(value)


def budget_base(budget: int | str, base: str = "footprint") -> str:
    """What a percentage ``budget`` is of: the base it names (``20%peak``), else ``base``."""
    check_base(base)
    amount = read_amount(budget) if isinstance(budget, str) else None
    if amount is None or amount.fraction is None or amount.implied:
        return base
    return simulated_amount(amount).base or base


def resolve_budget(budget: int | str, source: Trace | Needs, base: str = "footprint") -> Budget:
    """``budget`` for the run of ``source`` (a trace, or its :class:`Needs`): a :class:`Budget`.

    A percentage is of the base it names (``20%``: the footprint; ``20%peak``: peak live
    bytes), a bare one of ``base`` (the older ``--budget-base`` flag's value)."""
    base = budget_base(budget, base)
    n = source if isinstance(source, Needs) else needs(source)
    return Budget(parse_budget(budget, max(n.base_bytes(base), 1), base), str(budget), base, n)


# ---------------------------------------------------------------- the footprint


def peak_live_bytes(events: Iterable[Event] | Trace) -> int:
    """Largest sum of live object sizes at any point of the trace (or of an event list)."""
    live: dict[int, int] = {}
    total = peak = 0
    for ev in events.events if isinstance(events, Trace) else events:
        if isinstance(ev, Alloc):
            total += ev.nbytes - live.get(ev.obj, 0)  # an id allocated again replaces its object
            live[ev.obj] = ev.nbytes
            peak = max(peak, total)
        elif isinstance(ev, Free):
            total -= live.pop(ev.obj, 0)
    return peak


class _Segments:
    """A backend that only hands out addresses and counts what is obtained (no pages)."""

    name = "footprint"
    device = 0

    def __init__(self) -> None:
        self._next = 1 << 40
        self._sizes: dict[int, int] = {}
        self.current = self.peak = 0

    def malloc(self, nbytes: int) -> int:
        ptr = self._next
        self._next += -(-nbytes // BLOCK) * BLOCK  # 2 MB aligned, like cudaMallocManaged
        self._sizes[ptr] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        return ptr

    def free(self, ptr: int) -> None:
        self.current -= self._sizes.pop(ptr)

    def launch(self, reads, writes, flops: int = 0, nbytes: int = 0, precision: str = "") -> None:
        """Nothing runs: only addresses are handed out."""


def _layout_peak(events: list[Event], make_layout) -> int:
    """Most managed memory ``make_layout(backend)`` obtains while placing ``events``' objects
    (fed by the driver as in a run: a pool that learns from the stream learns here too)."""
    backend = _Segments()
    layout = make_layout(backend)
    Driver(UMPolicy(), layout, backend).feed_all(events)
    return -(-backend.peak // BLOCK) * BLOCK


def needs_of_events(events: Iterable[Event]) -> Needs:
    """:class:`Needs` of an event list (shadow mode sizes its GPU from the first iteration's)."""
    # optional: the layouts need numpy; `umrt --help` imports this module (BASES)
    from umrt.memory.caching import CachingAllocatorLayout

    # optional: the layouts need numpy; `umrt --help` imports this module (BASES)
    from umrt.memory.pool import LifetimePool

    # With nothing evicted the runtime lets its pool plan no layout (a plan's region would only
    # add to what the pool holds: ``needs_plan`` says no while that fits the GPU), so the pool
    # the footprint is taken with is the one such a run has: its learning layout, best fit.
    def unplanned(backend: _Segments) -> LifetimePool:
        return LifetimePool(backend, needs_plan=lambda held: False)  # what it holds fits: no plan

    events = list(events)
    return Needs(peak_live_bytes=peak_live_bytes(events),
                 pool_bytes=_layout_peak(events, unplanned),
                 caching_bytes=_layout_peak(events, CachingAllocatorLayout))


_CACHE: dict[int, tuple[weakref.ref, int, Needs]] = {}


def needs(trace: Trace) -> Needs:
    """:class:`Needs` of ``trace``, computed once per trace object (and event count)."""
    key = id(trace)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is trace and hit[1] == len(trace.events):
        return hit[2]
    value = needs_of_events(trace.events)
    _CACHE[key] = (weakref.ref(trace, lambda _ref, key=key: _CACHE.pop(key, None)), len(trace.events), value)
    return value
