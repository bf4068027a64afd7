"""The one place where events meet the policy, its layout and the backend.

Every source of events (the simulator's replay, shadow mode, the live bridge,
the benchmarks) hands its events to a :class:`Driver`, one at a time or in
batches, and the driver keeps the event contract of :mod:`umrt.policy.base`:

* ``Alloc``  -> ``layout.alloc``, then ``policy.on_event`` (the object has an address);
* ``Launch`` -> the learning layout, ``policy.on_event``, then ``backend.launch``
  on the ranges the launch touches;
* ``Free``   -> ``policy.on_event``, then the backend is told the range died, then ``layout.free``;
* an iteration boundary -> the per-iteration bookkeeping below, the learning
  layout, ``policy.on_event``, then (a simulated backend) ``policy.iteration_time``
  with the simulated time of the iteration it ended;
* layer events -> the learning layout, then ``policy.on_event``; anything else -> ``policy.on_event``.

A layout that learns from the stream (:class:`~umrt.memory.base.LearningLayout`,
umrt's pool) is fed here and nowhere else. A backend that models memory
contents (:class:`~umrt.backends.base.SimulatedContents`, the simulator) is
told which objects were written on the host and which died, and its counters
are read at every boundary (:attr:`Driver.marks`).
"""
from __future__ import annotations

from collections.abc import Iterable

from umrt.backends.base import Backend, SimulatedContents
from umrt.errors import DataIntegrityError, TraceFormatError
from umrt.hardware import HardwareProfile
from umrt.memory.base import Layout, LearningLayout
from umrt.policy.base import Policy
from umrt.trace.events import Alloc, Event, Free, IterationBoundary, Launch, LayerEnter, LayerExit

__all__ = ["Driver"]


class Driver:
    """Feeds events to ``policy``, ``layout`` and ``backend`` in the contract's order.

    Args:
        policy: the attached policy (its context holds the same layout and backend).
        layout: where objects are placed (``policy.make_layout`` in a simulation,
            the live program's allocator live).
        backend: what launches run on (simulated or real managed memory).
        profile: with a hardware profile the driver adds up each iteration's ideal
            (roofline) compute time in :attr:`ideal_s`.
        strict: a launch that touches an object the driver never placed is a
            :class:`~umrt.errors.TraceFormatError` (a trace being simulated); otherwise
            that access is skipped (live programs touch memory umrt did not allocate).
        launches_on_demand: closed loop, as live: a launch is shown to the policy only
            while ``policy.wants_launches`` (the live bridge stops capturing launches
            otherwise); it runs on the backend and the learning layout is told of it all the same.

    Attributes:
        addresses: ``obj -> (ptr, nbytes)`` of every live object.
        marks: the backend's counters at each iteration boundary (a simulated backend only).
        phases: the loop phase (``IterationBoundary.phase``) of each iteration a boundary opened.
        peaks: the backend's resident peak of each completed iteration (likewise).
        ideal_s: ideal compute time of each iteration so far, the last one running.
        launches_held_back: launches not shown to the policy (``launches_on_demand``).
        events: events fed so far.
    """

    def __init__(self, policy: Policy, layout: Layout, backend: Backend, *,
                 profile: HardwareProfile | None = None, strict: bool = False,
                 launches_on_demand: bool = False) -> None:
        self.policy, self.layout, self.backend = policy, layout, backend
        self.learner: LearningLayout | None = layout if isinstance(layout, LearningLayout) else None
        self.contents: SimulatedContents | None = backend if isinstance(backend, SimulatedContents) else None
        self.profile = profile
        self.strict = strict
        self.launches_on_demand = launches_on_demand
        self.launches_held_back = 0  # launches the policy did not want (launches_on_demand)
        self.addresses: dict[int, tuple[int, int]] = {}
        self.marks: list[dict] = []
        self.phases: list[str] = []
        self._opened: int | None = None  # the index of the iteration the last boundary opened
        self.peaks: list[int] = []
        self.ideal_s: list[float] = [0.0]
        self.events = 0

    def feed(self, event: Event, *, shown: bool | None = None) -> None:
        """One event; ``shown=False``: a launch the program ran that its policy is not
        shown (capture was off; a closed-loop source decides, see ``launches_on_demand``)."""
        self.feed_all((event,), shown=shown)

    def feed_all(self, events: Iterable[Event], *, shown: bool | None = None) -> None:
        """Events in program order (a batch, a generator, a whole trace); ``shown`` as in :meth:`feed`."""
        policy = self.policy
        on_event = policy.on_event
        on_demand = self.launches_on_demand
        layout, backend, learner, contents = self.layout, self.backend, self.learner, self.contents
        addresses = self.addresses
        compute_time = self.profile.compute_time if self.profile is not None else None
        n = 0
        try:
            for ev in events:
                n += 1
                t = type(ev)
                if t is Launch:
                    if learner is not None:
                        learner.observe_launch(ev.exec_id)
                    if shown if shown is not None else (not on_demand or policy.wants_launches):
                        on_event(ev)
                    else:
                        self.launches_held_back += 1
                    reads: list[tuple[int, int]] = []
                    writes: list[tuple[int, int]] = []
                    for a in ev.accesses:
                        where = addresses.get(a.obj)
                        if where is None:
                            if self.strict:
                                raise TraceFormatError(f"launch #{ev.seq} {ev.op} touches object {a.obj}, "
                                                       "which is not live (no Alloc before it)")
                            continue
                        (writes if a.write else reads).append((where[0] + a.offset, a.length))
                    try:
                        if contents is not None and writes and ev.updates_in_place:  # it reads them first
                            contents.check_defined(writes)
                        backend.launch(reads, writes, ev.flops, ev.bytes, ev.precision)
                    except DataIntegrityError as exc:
                        raise self._explain(exc, ev) from None
                    if compute_time is not None:
                        self.ideal_s[-1] += compute_time(ev.flops, ev.bytes, ev.precision)
                elif t is Alloc:
                    if ev.obj in addresses:  # an id allocated again without a Free: the old one is gone
                        del addresses[ev.obj]
                        layout.free(ev.obj)
                    ptr = layout.alloc(ev.obj, ev.nbytes, ev.kind)
                    if ptr:
                        addresses[ev.obj] = (ptr, ev.nbytes)
                        if contents is not None and ev.launch == -1:
                            contents.mark_host_written([(ptr, ev.nbytes)])
                    on_event(ev)
                elif t is Free:
                    where = addresses.pop(ev.obj, None)
                    if where is not None:
                        on_event(ev)
                        if contents is not None:
                            contents.mark_dead([where])
                        layout.free(ev.obj)
                elif t is IterationBoundary:
                    if contents is not None:
                        if self.marks:
                            self.peaks.append(contents.peak_resident_bytes)
                        self.marks.append(contents.counters())
                        contents.reset_peak()
                    self.phases.append(ev.phase)
                    self.ideal_s.append(0.0)
                    if learner is not None:
                        learner.observe(ev)
                    on_event(ev)
                    ended, self._opened = self._opened, ev.index
                    if contents is not None and ended is not None and len(self.marks) >= 2:
                        policy.iteration_time(ended, self.marks[-1]["time_s"] - self.marks[-2]["time_s"])
                elif t is LayerEnter or t is LayerExit:
                    if learner is not None:
                        learner.observe(ev)
                    on_event(ev)
                else:
                    on_event(ev)
        finally:
            self.events += n

    def steady(self) -> dict:
        """The backend's counters over the last complete iteration, and its ideal
        compute time (``ideal_time_s``); empty before two boundaries."""
        if len(self.marks) < 2:
            return {}
        a, b = self.marks[-2], self.marks[-1]
        out = {k: b[k] - a[k] for k in b if isinstance(b[k], (int, float))}
        out["ideal_time_s"] = self.ideal_s[-2]
        return out

    def iteration_times(self) -> list[float]:
        """Simulated time of each completed iteration."""
        return [b["time_s"] - a["time_s"] for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def iteration_phases(self) -> list[str]:
        """The loop phase of each completed iteration (as :meth:`iteration_times`)."""
        return self.phases[: max(0, len(self.marks) - 1)]

    def _explain(self, exc: DataIntegrityError, ev: Launch) -> DataIntegrityError:
        objs = ", ".join(str(a.obj) for a in ev.accesses if not a.write or ev.updates_in_place)
        return DataIntegrityError(f"{exc}; launch #{ev.seq} {ev.op} in {ev.module or 'top level'} reading "
                                  f"object(s) {objs}, under policy {self.policy.name!r}")
