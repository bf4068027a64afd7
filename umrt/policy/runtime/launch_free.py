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
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from umrt.policy.runtime.planner import ALLOC_TOKEN, SPARE_KEY, Action, Plan, ordered_union, running_hashes

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.acting import Acting
    from umrt.policy.runtime.guard import Guard
    from umrt.policy.runtime.host_map import HostMapper
    from umrt.policy.runtime.learning import Learner
    from umrt.policy.runtime.phases import LoopPhases
    from umrt.predict.tables import ObjectKeys, VariantTable

#: Times a plan's launch-free clock is re-based before a mismatch counts as a deviation.
MAX_REBASES = 2


class LaunchFreeClock:
    """The runtime's decisions on the launch-free clock.

    It owns when its decisions come (the next decision's event, the events launches
    are counted from) and what it learned of each plan's clock (confirmed, re-based),
    and changes the runtime's acting state through
    :class:`~umrt.policy.runtime.acting.Acting`. The runtime's hot path counts the
    events (``Acting.n_events``), keeps their running hash (``Acting.events_hash``)
    and calls :meth:`on_due_event` only when ``Acting.due_event`` comes.

    Parameters
    ----------
    acting:
        The runtime's acting state.
    guard:
        The runtime's guard (switching to another shape's plan, deviating).
    host:
        The runtime's host mapper (a launch host-mapped for its oversized ranges).
    plans, phases, keys, variants, learner:
        The runtime's plans, loop phases, object keys, variant table and learner
        (a re-based clock re-keys the objects born in its iteration and tells the
        variant table; a shape that turns out unknown is sought again).
    """

    def __init__(self, acting: Acting, guard: Guard, host: HostMapper, plans: Mapping[int, Plan],
                 phases: LoopPhases, keys: ObjectKeys, variants: VariantTable, learner: Learner) -> None:
        self.acting = acting
        self.guard = guard
        self.host = host
        self.plans = plans
        self.phases = phases
        self.keys = keys
        self.variants = variants
        self.learner = learner
        self.next_event = -1  # the next decision's event, when this clock decides it
        # Events a launch count starts at -> (launches before it, running hash there), and those events in order.
        self.resume: dict[int, tuple[int, int]] = {}
        self.resume_events: list[int] = []
        self.confirmed: set[int] = set()  # signatures whose launch-free clock ran a whole iteration
        self.rebases: dict[int, int] = {}  # signature -> times its launch-free clock was re-based

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
        acting = self.acting
        if self.host.launch_mapped:
            self.host.unmap_launch()  # the oversized launch it was made for has been queued
        if acting.counting_launches:
            # The launches counted since an earlier event are all queued by now:
            # a decision among them not yet taken (a launch not delivered) is taken now.
            actions = acting.actions
            while (acting.next_action < len(actions) and actions[acting.next_action].launch_free_at < 0
                   and actions[acting.next_action].launch_free_from < event):
                a = actions[acting.next_action]
                acting.next_action += 1
                acting.counters["late_decisions"] += 1
                # not yet checked against this event: nothing that destroys data (a swap out,
                # a drop) is done out of place; what stays on the GPU only costs room
                acting.act(a, destructive=False)
            acting.arm()
        if event == self.next_event:
            self.decide(event)
        # Launches are counted from an event the plan names to the next event.
        r = self.resume.get(event)
        if r is None:
            if acting.counting_launches:
                acting.counting_launches = acting.wants_launches = False
        elif acting.acting_launch_free:  # not if the decision above deviated
            if r[1] != acting.events_hash:
                if not self.switch(event):
                    self.mismatch()
                    return
                r = self.resume.get(event)  # the shape switched to counts from here, or not
            if r is not None:
                acting.n_launches = r[0]  # launches before this event, as recorded
                acting.counting_launches = acting.wants_launches = True
            elif acting.counting_launches:
                acting.counting_launches = acting.wants_launches = False
        self.set_due(event)

    def set_due(self, event: int) -> None:
        """The next launch-free event after ``event`` that something is due at: a
        decision, a count to start, or (counting, or a launch host-mapped)
        the very next one; -1 when nothing is (the hot path compares one int)."""
        acting = self.acting
        if not acting.acting_launch_free:
            acting.due_event = -1
        elif acting.counting_launches or self.host.launch_mapped:
            acting.due_event = event + 1
        else:
            nxt = self.next_event if self.next_event > event else -1
            i = bisect.bisect_right(self.resume_events, event)
            if i < len(self.resume_events) and (nxt < 0 or self.resume_events[i] < nxt):
                nxt = self.resume_events[i]
            acting.due_event = nxt

    def decide(self, event: int) -> None:
        """The decision at event ``event`` (one at most: launch_free_points places each
        launch's action on its own event), if the iteration has matched its
        plan so far: the running hash of every allocation's size, every freed
        size and every module boundary must be the recorded one."""
        acting = self.acting
        a = acting.actions[acting.next_action]
        if acting.events_hash != a.launch_free_hash:
            if not self.switch(event):
                self.mismatch()
                return
            a = acting.actions[acting.next_action] if acting.next_action < len(acting.actions) else None
            if a is None or a.launch_free_at != event:  # the other shape decides nothing here
                acting.arm()
                return
        acting.next_action += 1
        acting.arm()
        acting.act(a)

    def finish_iteration(self) -> None:
        """The iteration ends: if it matched its plan to the last event, the
        decisions counted from that event whose launches were not delivered
        run now, late (they prepare the next iteration). The runtime has
        discarded its pending dead ranges already."""
        acting = self.acting
        end = (acting.n_events, acting.events_hash)
        if end != acting.plan.launch_free_end:
            other = next((p for p in (q.launch_free_variant or q for sig, q in self.plans.items() if self.phases.in_phase(sig))
                          if p is not acting.plan and p.launch_free_end == end), None)
            if other is None:
                self.mismatch()
                return
            self.adopt(other, len(other.actions))  # it was that shape, to its last event
        while acting.next_action < len(acting.actions):
            acting.counters["late_decisions"] += 1
            acting.act(acting.actions[acting.next_action])
            acting.next_action += 1

    # -- leaving a plan's launch-free clock -------------------------------------------

    def switch(self, event: int) -> bool:
        """Another learned shape of this phase whose events so far are this iteration's
        (its running hash after launch-free event ``event`` is ours: a short last batch
        instead of a full one, say): continue with its plan from its next decision (as
        :meth:`Guard.switch`)."""
        acting = self.acting
        for sig in reversed(self.plans):
            plan = self.plans[sig]
            plan = plan.launch_free_variant or plan
            if plan is acting.plan or not self.phases.in_phase(sig) or plan.launch_free_end is None \
                    or plan.hash_after(event) != acting.events_hash:
                continue
            idx = plan.index_at_launch_free(event)
            self.adopt(plan, idx if idx is not None else plan.index_after_launch_free(event))
            return True
        return False

    def adopt(self, plan: Plan, idx: int) -> None:
        """Continue with another shape's plan from its action ``idx`` (:meth:`Guard.adopt`),
        and with its key map (allocations from here on; those before keep their keys) and
        the events it counts launches from."""
        self.guard.adopt(plan, idx)
        self.acting.keymap = plan.keymap
        self.follow(plan.launch_free_resume)

    def mismatch(self) -> None:
        """Acting without launches, the iteration's running hash is not the plan's.
        While the plan's launch-free clock is unconfirmed (the iteration's events are
        being recorded) that is what a capture changes in a program (the recorded
        iteration ran with the capture on; this one without it): stop acting, but let
        the iteration run on without launches, as acting ones do, and re-base the
        plan on it at its end (:meth:`rebase`). Otherwise it is a deviation."""
        acting = self.acting
        if acting.event_tokens is None or self.rebases.get(acting.plan.signature, 0) >= MAX_REBASES:
            self.guard.deviate()
            return
        acting.unfreeze()
        if self.host.launch_mapped:
            self.host.unmap_launch()
        acting.stop_acting("rebase", wants_launches=False)

    def rebase(self, entry: dict) -> None:
        """An iteration acted on without launches left its plan's launch-free clock and
        ran on without acting: its events are the clock of iterations that run the way
        acting ones do (a capture can change what a program allocates). The plan's
        decisions are placed on them (:func:`rebase`) for
        the next iteration of its shape, and the survivors born in it take the keys the
        plan knows them by."""
        acting = self.acting
        sig = acting.plan.signature
        base = self.plans.get(sig)
        if base is not None and base.migration_only is not None and not acting.plan.swap:
            base = base.migration_only  # the twin ran (see PathTrial)
        variant = rebase(base, acting.event_tokens) if base is not None else None
        entry["signature"] = sig
        if variant is None:  # not the same shape after all: as a deviation
            acting.counters["deviations"] += 1
            self.variants.forget_last()
            self.learner.seek(self.phases.phase)
            return
        base.launch_free_variant = variant
        self.rebases[sig] = self.rebases.get(sig, 0) + 1
        acting.counters["light_rebases"] += 1
        self.variants.observe(sig)
        keys = self.keys
        for ordinal, obj in enumerate(acting.token_objects):
            old = keys.key_of.get(obj)
            if old is None or old < 0 or keys.obj_of.get(old) != obj:
                continue  # dead, or carried over from an earlier iteration
            new = variant.keymap[ordinal]
            del keys.obj_of[old]
            keys.obj_of[new] = obj
            keys.key_of[obj] = new


def rebase(plan: Plan, tokens: Sequence[int], min_match: float = 0.8) -> Plan | None:
    """``plan`` moved onto an iteration that ran without launches, whose non-launch
    events were ``tokens``: the same decisions, placed on that iteration's events,
    with its running hashes and a ``keymap`` from its allocation ordinals to the
    plan's keys. None where the two iterations are not the same shape (less than
    ``min_match`` of their events align) or the decisions cannot keep their order.

    The two are aligned as sequences (difflib, no junk heuristic): an event the
    recorded iteration had and this one lacks (a temporary the capture caused)
    moves its decision to the last aligned event before it, so decisions come
    early, never late.
    """
    rec = plan.tokens
    if not rec or not tokens or plan.launch_free_end is None:
        return None
    sm = difflib.SequenceMatcher(None, rec, tokens, autojunk=False)
    to_launch_free = [-1] * len(rec)  # recorded event -> this iteration's event (or the last aligned before)
    matched = 0
    for a, b, n in sm.get_matching_blocks():
        for k in range(n):
            to_launch_free[a + k] = b + k
        matched += n
    if matched < min_match * max(len(rec), len(tokens)):
        return None
    last = -1
    for i, j in enumerate(to_launch_free):
        if j < 0:
            to_launch_free[i] = last
        else:
            last = j
    # Allocation ordinals: this iteration's -> the recorded key (an unmatched one a spare key).
    rec_ordinal = _alloc_ordinals(rec)
    launch_free_ordinal = _alloc_ordinals(tokens)
    keymap = [SPARE_KEY + o for o in range(len(launch_free_ordinal))]
    for a, b, n in sm.get_matching_blocks():
        for k in range(n):
            if (rec[a + k] & 3) == ALLOC_TOKEN:
                keymap[launch_free_ordinal[b + k]] = rec_ordinal[a + k]
    hashes = running_hashes(tokens)

    def moved(e: int) -> int:
        return to_launch_free[e] if e >= 0 else -1

    actions: list[Action] = []
    for a in plan.actions:
        if a.launch_free_at >= 0:
            e = moved(a.launch_free_at)
            if e < 0:
                return None  # a decision before this iteration's first event: keep the old clock
            prev = actions[-1] if actions else None
            if prev is not None and prev.launch_free_at == e:  # two decisions now on one event: one
                merged = ("evict", "prefetch", "swap_out", "swap_in", "ready", "drop", "populate")
                actions[-1] = replace(prev, **{f: ordered_union(getattr(prev, f), getattr(a, f)) for f in merged})
                continue
            if prev is not None and prev.launch_free_at > e:
                return None
            actions.append(replace(a, launch_free_at=e, launch_free_hash=hashes[e]))
        else:
            actions.append(replace(a, launch_free_from=moved(a.launch_free_from)))
    resume = {}
    for e, (launches, _) in plan.launch_free_resume.items():
        f = moved(e)
        resume[f] = (launches, hashes[f]) if f >= 0 else (0, 0)
    return plan.on_events(actions, resume, tokens, keymap, hashes)


def _alloc_ordinals(tokens: Sequence[int]) -> dict[int, int]:
    """Event index -> allocation ordinal, for the allocation tokens."""
    out: dict[int, int] = {}
    for i, tok in enumerate(tokens):
        if (tok & 3) == ALLOC_TOKEN:
            out[i] = len(out)
    return out
