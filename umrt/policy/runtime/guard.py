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
from collections.abc import Mapping
from typing import TYPE_CHECKING

from umrt.policy.runtime.planner import Action, Plan
from umrt.trace.events import Launch

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.acting import Acting
    from umrt.policy.runtime.phases import LoopPhases

#: If FAILURES of the last WINDOW acted iterations of a loop phase deviate, the guard
#: trips for that phase for COOLDOWN of its iterations (see :class:`Guard`).
WINDOW, FAILURES, COOLDOWN = 4, 3, 2


class Guard:
    """The runtime's answer to mispredictions.

    It owns the misprediction guard (each phase's recent outcomes, its cooldowns)
    and changes the runtime's acting state (plan, next action, mode) through
    :class:`~umrt.policy.runtime.acting.Acting`.

    Parameters
    ----------
    acting:
        The runtime's acting state.
    plans, phases:
        The runtime's plans by signature, and its loop phases (which plans are the
        running phase's); read, never changed.

    If :data:`FAILURES` of the last :data:`WINDOW` acted iterations of a loop phase
    deviate after their first decision point held (a deviation at the very first
    one just means a new shape, learned at once), the guard trips for that phase:
    no acting there for :data:`COOLDOWN` of its iterations, then re-learning. The
    other phases' plans are kept.
    """

    def __init__(self, acting: Acting, plans: Mapping[int, Plan], phases: LoopPhases) -> None:
        self.acting = acting
        self.plans = plans
        self.phases = phases
        self.window = WINDOW
        self.failures = FAILURES
        self.cooldown = COOLDOWN
        self._outcomes: dict[str, deque[bool]] = {}  # phase -> acted iterations: held to the end or not
        self._predictions: dict[str, deque[bool]] = {}  # phase -> predicted iterations: the shape was right
        self._cooldown_left: dict[str, int] = {}
        self.left_launch_free = False  # this iteration left its plan while acting without launches
        self.left_early = False  # this iteration left its plan before half its decision points
        self.left_shape: int | None = None  # the signature of the plan this iteration left

    def new_iteration(self) -> None:
        """An iteration starts: it has left no plan yet."""
        self.left_launch_free = self.left_early = False
        self.left_shape = None

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

    def predicted(self, phase: str, right: bool) -> None:
        """An iteration of ``phase`` ran with a plan predicted for it (acted on, or not):
        whether it was of that plan's shape, all the way."""
        out = self._predictions.get(phase)
        if out is None:
            out = self._predictions[phase] = deque(maxlen=self.window)
        if right and self.unsure(phase):
            out.clear()  # the shapes repeat again: act from the next iteration
        out.append(right)

    def unsure(self, phase: str = "train") -> bool:
        """Whether :data:`FAILURES` of the last :data:`WINDOW` predictions in ``phase`` were
        wrong (acted on: the program missed one of the first half of the plan's decision
        points, the first one included; a plan that held most of the way paid as far as it
        went, as where another thread's frees arrive off their places late in a step; only
        checked: the iteration was of another shape). Steps whose shapes do not repeat
        (bucketed lengths in a varying order) run so: a plan acted on there moves data for a
        shape that then leaves. Until predictions hold again the runtime only checks them,
        acting on none, as plain Unified Memory runs."""
        out = self._predictions.get(phase)
        return out is not None and sum(1 for ok in out if not ok) >= self.failures

    def cooling(self, phase: str = "train") -> bool:
        """Whether this iteration of ``phase`` is one of a cooldown's (it counts it)."""
        left = self._cooldown_left.get(phase, 0)
        if left > 0:
            self._cooldown_left[phase] = left - 1
            return True
        return False

    # -- leaving a plan ------------------------------------------------------------

    def switch(self, ev: Launch, n_alloc: int, n_frees: int) -> Action | None:
        """Another learned shape of this phase may match where this one failed (a
        short last batch instead of a full one): continue with its plan from here.
        ``n_alloc``, ``n_frees``: the allocations and frees of the iteration so far."""
        acting = self.acting
        n = acting.n_launches - 1
        for sig in reversed(self.plans):
            plan = self.plans[sig]
            if plan is acting.plan or not self.phases.in_phase(sig) or plan.outlived(acting.keys.obj_of):
                continue
            idx = plan.index_at(n)
            if idx is None:
                continue
            a = plan.actions[idx]
            if (ev.exec_id == a.exec_id and n_alloc == a.n_alloc and n_frees == a.n_free
                    and plan.events_match(a, acting.n_events, acting.shape_hash if acting.after_rare
                                          else acting.events_hash, not acting.after_rare)):
                self.adopt(plan, idx)
                return a
        return None

    def adopt(self, plan: Plan, idx: int) -> None:
        """Continue with another shape's plan from its action ``idx``: everything
        keyed by that plan's keys and launches comes with it (acting without
        launches, the launch-free clock adopts its key map and events too:
        :meth:`LaunchFreeClock.adopt`)."""
        acting = self.acting
        acting.counters["switches"] += 1
        acting.unfreeze()  # the addresses seen so far were checked against another shape
        acting.restore_swapped()  # the other shape's plan does not bring back what this one swapped out
        acting.plan = plan
        acting.actions = plan.actions
        acting.next_action = idx
        acting.discard_keys = plan.discard
        acting.oversized = plan.remote_at

    def deviate(self, nothing_held: bool = False) -> None:
        """The program left the plan: stop acting. Early in the iteration the
        probe record is still running, so the runtime learns this iteration
        instead; later it waits for the next boundary. ``nothing_held``: the
        plan had no decision to hold (its prediction was wrong, not early)."""
        acting = self.acting
        acting.counters["deviations"] += 1
        acting.unfreeze()
        self.left_early = nothing_held or 2 * acting.next_action < len(acting.actions)
        if acting.next_action > 0:  # failed after it had started to hold: the guard counts that
            self.outcomes(self.phases.phase).append(False)
        self.left_launch_free = acting.acting_launch_free
        self.left_shape = acting.plan.signature if acting.plan is not None else None
        # the next iteration is learned
        acting.stop_acting("learn" if acting.record is not None else "off", wants_launches=True)
        acting.plan = None
        acting.event_tokens = None
