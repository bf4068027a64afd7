"""Acting on a trusted plan without launches: the launch-free clock.

A trusted plan's decisions are placed on the clock of the events other than
launches (allocations, frees, module boundaries), which a live driver gets
from the allocator and module hooks without capturing ops (the costly part of
capture). The iteration is checked against its plan by a running hash of
every allocation's size, every freed size and every module boundary, at each
decision and at the iteration's end. A decision no event precedes (inside an
optimizer step) or an oversized launch makes the runtime count launches from
the event before it to the next event (``Plan.launch_free_resume``):
``Policy.wants_launches`` is True for that stretch.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from umrt.policy.runtime.planner import rebase

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.policy import Runtime


class LaunchFreeClock:
    """The runtime's decisions on the launch-free clock.

    It changes the runtime's acting state in place: it is part of the runtime,
    split out by job. The runtime's hot path counts the events
    (``Runtime._n_events``), keeps their running hash (``Runtime._events_hash``)
    and calls :meth:`on_due_event` only when ``Runtime._due_event`` comes.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.next_event = -1  # the next decision's event, when this clock decides it
        # Events a launch count starts at -> (launches before it, running hash there), and those events in order.
        self.resume: dict[int, tuple[int, int]] = {}
        self.resume_events: list[int] = []
        self.confirmed: set[int] = set()  # signatures whose launch-free clock ran a whole iteration
        self.rebases: dict[int, int] = {}  # signature -> times its launch-free clock was re-based
        self.failed = False  # this iteration left its plan while acting without launches

    def follow(self, resume: dict[int, tuple[int, int]]) -> None:
        """Count launches from the events of ``resume`` (a plan's ``launch_free_resume``)."""
        self.resume = resume
        self.resume_events = sorted(resume)

    def forget_plans(self) -> None:
        """The plans are dropped: what was confirmed or re-based of them goes too."""
        self.confirmed.clear()
        self.rebases.clear()

    def on_due_event(self, event: int) -> None:
        """Non-launch event ``event`` of an iteration acted on without launches,
        when something is due at it (:meth:`set_due`): decisions among the launches
        counted since the last event that were not taken, the decision placed
        on this event (``Action.launch_free_at``), counting launches from it or not."""
        rt = self.rt
        if rt._launch_mapped:
            rt._host.unmap_launch()  # the oversized launch it was made for has been queued
        if rt._counting_launches:
            # The launches counted since an earlier event are all queued by now:
            # a decision among them not yet taken (a launch not delivered) is taken now.
            actions = rt._actions
            while (rt._next_action < len(actions) and actions[rt._next_action].launch_free_at < 0
                   and actions[rt._next_action].launch_free_from < event):
                a = actions[rt._next_action]
                rt._next_action += 1
                rt.counters["late_decisions"] += 1
                # not yet checked against this event: nothing that destroys data (a swap out,
                # a drop) is done out of place; what stays on the GPU only costs room
                rt._act(a, destructive=False)
            rt._arm()
        if event == self.next_event:
            self.decide(event)
        # Launches are counted from an event the plan names to the next event.
        r = self.resume.get(event)
        if r is None:
            if rt._counting_launches:
                rt._counting_launches = rt.wants_launches = False
        elif rt._acting_launch_free:  # not if the decision above deviated
            if r[1] != rt._events_hash:
                if not rt._guard.switch_launch_free(event):
                    rt._guard.launch_free_mismatch()
                    return
                r = self.resume.get(event)  # the shape switched to counts from here, or not
            if r is not None:
                rt._n_launches = r[0]  # launches before this event, as recorded
                rt._counting_launches = rt.wants_launches = True
            elif rt._counting_launches:
                rt._counting_launches = rt.wants_launches = False
        self.set_due(event)

    def set_due(self, event: int) -> None:
        """The next launch-free event after ``event`` that something is due at: a
        decision, a count to start, or (counting, or a launch host-mapped)
        the very next one; -1 when nothing is (the hot path compares one int)."""
        rt = self.rt
        if not rt._acting_launch_free:
            rt._due_event = -1
        elif rt._counting_launches or rt._launch_mapped:
            rt._due_event = event + 1
        else:
            nxt = self.next_event if self.next_event > event else -1
            i = bisect.bisect_right(self.resume_events, event)
            if i < len(self.resume_events) and (nxt < 0 or self.resume_events[i] < nxt):
                nxt = self.resume_events[i]
            rt._due_event = nxt

    def decide(self, event: int) -> None:
        """The decision at event ``event`` (one at most: launch_free_points places each
        launch's action on its own event), if the iteration has matched its
        plan so far: the running hash of every allocation's size, every freed
        size and every module boundary must be the recorded one."""
        rt = self.rt
        a = rt._actions[rt._next_action]
        if rt._events_hash != a.launch_free_hash:
            if not rt._guard.switch_launch_free(event):
                rt._guard.launch_free_mismatch()
                return
            a = rt._actions[rt._next_action] if rt._next_action < len(rt._actions) else None
            if a is None or a.launch_free_at != event:  # the other shape decides nothing here
                rt._arm()
                return
        rt._next_action += 1
        rt._arm()
        rt._act(a)

    def finish_iteration(self) -> None:
        """The iteration ends: if it matched its plan to the last event, the
        decisions counted from that event whose launches were not delivered
        run now, late (they prepare the next iteration)."""
        rt = self.rt
        end = (rt._n_events, rt._events_hash)
        if end != rt._plan.launch_free_end:
            other = next((p for p in (q.launch_free_variant or q for sig, q in rt.plans.items() if rt.phases.in_phase(sig))
                          if p is not rt._plan and p.launch_free_end == end), None)
            if other is None:
                rt._guard.launch_free_mismatch()
                return
            rt._guard.adopt(other, len(other.actions))  # it was that shape, to its last event
        if rt._pending_discards:
            rt._flush()
        while rt._next_action < len(rt._actions):
            rt.counters["late_decisions"] += 1
            rt._act(rt._actions[rt._next_action])
            rt._next_action += 1

    def rebase(self, entry: dict) -> None:
        """An iteration acted on without launches left its plan's launch-free clock and
        ran on without acting: its events are the clock of iterations that run the way
        acting ones do (a capture can change what a program allocates). The plan's
        decisions are placed on them (:func:`~umrt.policy.runtime.planner.rebase`) for
        the next iteration of its shape, and the survivors born in it take the keys the
        plan knows them by."""
        rt = self.rt
        sig = rt._plan.signature
        base = rt.plans.get(sig)
        if base is not None and base.migration_only is not None and not rt._plan.swap:
            base = base.migration_only  # the twin ran (see PathTrial)
        variant = rebase(base, rt._event_tokens) if base is not None else None
        entry["signature"] = sig
        if variant is None:  # not the same shape after all: as a deviation
            rt.counters["deviations"] += 1
            rt.variants.last = None
            rt._learner.seek(rt._phase)
            return
        base.launch_free_variant = variant
        self.rebases[sig] = self.rebases.get(sig, 0) + 1
        rt.counters["light_rebases"] += 1
        rt.variants.observe(sig)
        keys = rt.keys
        for ordinal, obj in enumerate(rt._token_objects):
            old = keys.key_of.get(obj)
            if old is None or old < 0 or keys.obj_of.get(old) != obj:
                continue  # dead, or carried over from an earlier iteration
            new = variant.keymap[ordinal]
            del keys.obj_of[old]
            keys.obj_of[new] = obj
            keys.key_of[obj] = new
