"""What the runtime does when the program leaves its plan.

A mismatch at a decision first looks for another learned shape of the same
loop phase that matches there (a short last batch instead of a full one) and
continues with its plan
(:meth:`Guard.switch`); otherwise it is a deviation and the runtime stops
acting (:meth:`Guard.deviate`). If plans keep failing part-way, predictions
are not paying: the guard trips, the runtime drops its plans, does nothing for
a while and re-learns (:meth:`Guard.tripped`).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from umrt.policy.runtime.planner import Action, Plan
from umrt.trace.events import Launch

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.policy import Runtime

#: Times a plan's launch-free clock is re-based before a mismatch counts as a deviation.
MAX_REBASES = 2


class Guard:
    """The runtime's answer to mispredictions.

    It changes the runtime's acting state (plan, next action, mode, freezing)
    in place: it is part of the runtime, split out by job.

    Parameters
    ----------
    runtime:
        The runtime it guards.
    window, failures, cooldown:
        If ``failures`` of the last ``window`` acted iterations of a loop phase
        deviate after their first decision point held (a deviation at the very
        first one just means a new shape, learned at once), the guard trips for
        that phase: no acting there for ``cooldown`` of its iterations, then
        re-learning. The other phases' plans are kept.
    """

    def __init__(self, runtime: Runtime, window: int, failures: int, cooldown: int) -> None:
        self.rt = runtime
        self.window = window
        self.failures = failures
        self.cooldown = cooldown
        self._outcomes: dict[str, deque[bool]] = {}  # phase -> acted iterations: held to the end or not
        self._cooldown_left: dict[str, int] = {}

    # -- the misprediction guard -------------------------------------------------

    def outcomes(self, phase: str = "train") -> deque[bool]:
        """The last ``window`` acted iterations of ``phase``: whether each held to its end."""
        out = self._outcomes.get(phase)
        if out is None:
            out = self._outcomes[phase] = deque(maxlen=self.window)
        return out

    def tripped(self, phase: str = "train") -> bool:
        """Too many recent deviations in ``phase``: start a cooldown there (the caller
        drops that phase's plans)."""
        outcomes = self.outcomes(phase)
        if sum(1 for ok in outcomes if not ok) < self.failures:
            return False
        outcomes.clear()
        self._cooldown_left[phase] = self.cooldown
        return True

    def cooling(self, phase: str = "train") -> bool:
        """Whether this iteration of ``phase`` is one of a cooldown's (it counts it)."""
        left = self._cooldown_left.get(phase, 0)
        if left > 0:
            self._cooldown_left[phase] = left - 1
            return True
        return False

    # -- leaving a plan ------------------------------------------------------------

    def unfreeze(self) -> None:
        """Addresses can no longer be trusted this iteration: decisions resolve
        every key again, and this iteration is no reference for the next."""
        rt = self.rt
        if rt._frozen:
            rt.counters["unfreezes"] += 1
        rt._frozen = False
        rt._addresses = None

    def switch(self, ev: Launch) -> Action | None:
        """Another learned shape of this phase may match where this one failed (a
        short last batch instead of a full one): continue with its plan from here."""
        rt = self.rt
        n = rt._n_launches - 1
        for sig in reversed(rt.plans):
            plan = rt.plans[sig]
            if plan is rt._plan or not rt.phases.in_phase(sig):
                continue
            idx = plan.index_at(n)
            if idx is None:
                continue
            a = plan.actions[idx]
            if ev.exec_id == a.exec_id and rt.keys.ordinal == a.n_alloc and rt._n_frees == a.n_free:
                self.adopt(plan, idx)
                return a
        return None

    def switch_launch_free(self, event: int) -> bool:
        """Another learned shape of this phase whose events so far are this iteration's
        (its running hash after launch-free event ``event`` is ours: a short last batch
        instead of a full one, say): continue with its plan from its next decision (as
        :meth:`switch`)."""
        rt = self.rt
        for sig in reversed(rt.plans):
            plan = rt.plans[sig]
            plan = plan.launch_free_variant or plan
            if plan is rt._plan or not rt.phases.in_phase(sig) or plan.launch_free_end is None or plan.hash_after(event) != rt._events_hash:
                continue
            idx = plan.index_at_launch_free(event)
            self.adopt(plan, idx if idx is not None else plan.index_after_launch_free(event))
            return True
        return False

    def adopt(self, plan: Plan, idx: int) -> None:
        """Continue with another shape's plan from its action ``idx``: everything
        keyed by that plan's keys and launches comes with it."""
        rt = self.rt
        rt.counters["switches"] += 1
        self.unfreeze()  # the addresses seen so far were checked against another shape
        rt.restore_swapped()  # the other shape's plan does not bring back what this one swapped out
        rt._plan = plan
        rt._actions = plan.actions
        rt._next_action = idx
        rt._discard_keys = plan.discard
        rt._oversized = plan.remote_at
        if rt._acting_launch_free:
            rt._keymap = plan.keymap  # allocations from here on (those before keep their keys)
            rt._clock.follow(plan.launch_free_resume)

    def launch_free_mismatch(self) -> None:
        """Acting without launches, the iteration's running hash is not the plan's.
        While the plan's launch-free clock is unconfirmed (the iteration's events are
        being recorded) that is what a capture changes in a program (the recorded
        iteration ran with the capture on; this one without it): stop acting, but let
        the iteration run on without launches, as acting ones do, and re-base the
        plan on it at its end (:meth:`LaunchFreeClock.rebase`). Otherwise it is a
        deviation."""
        rt = self.rt
        if rt._event_tokens is None or rt._clock.rebases.get(rt._plan.signature, 0) >= MAX_REBASES:
            self.deviate()
            return
        self.unfreeze()
        if rt._launch_mapped:
            rt._host.unmap_launch()
        rt.stop_acting("rebase", wants_launches=False)

    def deviate(self) -> None:
        """The program left the plan: stop acting. Early in the iteration the
        probe record is still running, so the runtime learns this iteration
        instead; later it waits for the next boundary."""
        rt = self.rt
        rt.counters["deviations"] += 1
        self.unfreeze()
        if rt._next_action > 0:  # failed after it had started to hold: the guard counts that
            self.outcomes(rt._phase).append(False)
        rt._clock.failed = rt._acting_launch_free
        rt._mode = "learn" if rt._record is not None else "off"
        rt._acting_launch_free = rt._counting_launches = False
        rt._due_event = -1
        rt.wants_launches = True  # the next iteration is learned
        rt._plan = None
        rt._event_tokens = None
        rt._discard_keys = frozenset()
        rt._oversized = {}
        rt.restore_swapped()  # no plan brings them back now
