"""The plan layer's interface.

A policy consumes the event stream one event at a time, in program order, and
acts on a :class:`~umrt.backends.base.Backend` (prefetch, pre-evict, discard,
advise). It sees an event only when the program issues it — never the
future — unless it is explicitly an oracle that was handed the trace.

The driver (:class:`umrt.drive.Driver`, the one loop that feeds events) calls
:meth:`Policy.on_event` *before* the backend executes a
:class:`~umrt.trace.events.Launch`, and *after* a
:class:`~umrt.trace.events.Alloc` has been given an address (so
``layout.address(obj)`` works inside the call), and *before* a
:class:`~umrt.trace.events.Free` releases it. A layout that learns from the
stream (umrt's pool) sees each other event just before the policy does.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from umrt.backends.base import Backend
    from umrt.memory.base import Layout
    from umrt.sim.result import SimResult
    from umrt.trace.events import Event, Kind


@dataclass
class PolicyContext:
    """What a runtime legitimately knows about its environment."""

    backend: Backend
    layout: Layout
    budget_bytes: int  # GPU memory the policy may plan to use
    profile: object | None = None  # umrt.hardware.HardwareProfile, for time-based windows
    #: The simulator (``umrt.sim.replay.simulate``), in a simulated run: a policy that
    #: plans by scoring candidates on it (the oracle, SwapAdvisor) calls it; None live.
    simulate: Callable[..., SimResult] | None = None


class Policy(ABC):
    """Decides what to move, and when."""

    name: str = "policy"
    #: Iterations before the policy's steady state (a runtime that learns):
    #: a bench reports the iteration after them at the earliest.
    warmup_iterations: int = 0
    #: Whether the policy needs :class:`~umrt.trace.events.Launch` events now. A
    #: live driver captures launches with a dispatch mode that costs CPU on every
    #: op and changes what the program allocates; it suspends that capture while
    #: this is False. A policy that acts on allocations alone says False.
    wants_launches: bool = True
    #: Whether the policy is simulated with unbounded GPU memory (the ``ideal`` baseline).
    unlimited_memory: bool = False

    def steady_iterations(self, at_least: int = 3) -> int:
        """Iterations to simulate so that the last one (the one reported) is
        this policy's steady state: at least ``at_least``."""
        return max(at_least, self.warmup_iterations + 1)

    def attach(self, ctx: PolicyContext) -> None:
        """Called once before the first event."""
        self.ctx = ctx

    @abstractmethod
    def on_event(self, event: Event) -> None:
        """Observe one event and issue backend calls if needed."""

    def set_budget(self, budget_bytes: int) -> None:
        """Plan for ``budget_bytes`` of GPU memory from now on (a live job's share of its
        GPU moved; shadow mode sizes the GPU once the footprint is known). By default
        the new figure is only recorded: a policy that plans with it replans."""
        self.ctx.budget_bytes = int(budget_bytes)

    def make_layout(self, backend: Backend, *, live_feed: bool = False) -> Layout:
        """The address layout this policy runs with: by default a model of
        PyTorch's caching allocator (umrt's own runtime uses its pool);
        ``live_feed``: allocations arrive as a live allocator announces them
        (kinds guessed, see :class:`~umrt.memory.pool.LifetimePool`)."""
        # optional: the layouts need numpy; `umrt --help` imports this module (the policy names)
        from umrt.memory.caching import CachingAllocatorLayout

        return CachingAllocatorLayout(backend)

    def hint_kind(self, obj: int, kind: Kind) -> None:
        """What live ``obj`` holds, once known (live, after its allocation);
        a policy that plans by kind keeps it; by default it is not needed."""
        return None

    def detach(self) -> None:
        """The source stops feeding events for good (a live run's failure): put back what only
        this policy would have brought back (umrt's runtime copies back what it swapped out).
        Default: nothing."""
        return None

    def iteration_time(self, index: int, seconds: float) -> None:
        """How long iteration ``index`` took, once known: simulated (the driver, at the
        boundary that ends it) or measured live with CUDA events (the live bridge, an
        iteration or two later). A policy that checks whether its acting pays keeps
        it; by default it is not needed."""
        return None

    def report(self) -> dict:
        """Policy-specific counters for reports (prefetches issued, ...)."""
        return {}
