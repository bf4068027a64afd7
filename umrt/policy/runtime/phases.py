"""The loop's phases in the runtime: a training step and an evaluation batch are
learned, planned and predicted apart (``IterationBoundary.phase``).

:class:`LoopPhases` keeps, per phase, the shape its last iteration had and the
one its last run opened with (what the runtime predicts when a run of the
phase starts, or when the variant table has lost track), switches the running
phase (leaving an evaluation, the pages its dead left free are discarded: the
driver would otherwise copy dead bytes out to make room for the training
step), holds an iteration back where acting loses, and reports each phase.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from umrt.policy.runtime.ranges import DeadPages

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.planner import Plan
    from umrt.policy.runtime.policy import Runtime

__all__ = ["LoopPhases"]

_NO_PAYOFF = {"baseline_ms": None, "acting_ms": None, "acting_vs_baseline": None, "acting": True,
              "stopped_because": None}


class LoopPhases:
    """The runtime's loop phases.

    It changes the runtime's state in place (its running phase, the dead pages an
    evaluation tracks, its acting state when an iteration is held back): it is
    part of the runtime, split out by job.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.last: dict[str, int] = {}  # phase -> the shape of its last iteration
        self.opening: dict[str, int] = {}  # phase -> the shape its last run opened with
        self.opens_run = True  # the running iteration is the first of a run of its phase

    def in_phase(self, signature: int) -> bool:
        """Whether the plan of ``signature`` is one of the running iteration's phase."""
        return self.rt._learner.phase_of.get(signature, "train") == self.rt._phase

    def boundary(self, phase: str) -> None:
        """The next iteration is of ``phase``: on a change of phase, leaving an
        evaluation discards the pages its dead left free; entering one tracks them."""
        rt = self.rt
        self.opens_run = phase != rt._phase
        if not self.opens_run:
            return
        dead, rt._phase_dead = rt._phase_dead, (DeadPages() if phase == "eval" else None)
        rt._phase = phase
        if dead:
            rt._pending_discards.extend(dead.drain())
            rt._flush()

    def finished(self, phase: str, signature: int | None) -> None:
        """An iteration of ``phase`` of shape ``signature`` (None: unknown) ended."""
        if signature is None:
            return
        self.last[phase] = signature
        if self.opens_run:
            self.opening[phase] = signature

    def predict(self, phase: str) -> Plan | None:
        """The plan of the shape expected next in ``phase``: the variant table's
        prediction among that phase's plans; else, where a run of the phase starts
        here, the shape its last run started with (an evaluation's first batch);
        else the phase's last shape (a training step resumes its plan at once
        after an evaluation)."""
        rt = self.rt
        phase_of = rt._learner.phase_of
        for sig in rt.variants.predict():
            plan = rt.plans.get(sig)
            if plan is not None and phase_of.get(sig, "train") == phase:
                return plan
        for sig in ((self.opening.get(phase),) if self.opens_run else ()) + (self.last.get(phase),):
            plan = rt.plans.get(sig) if sig is not None else None
            if plan is not None:
                return plan
        return None

    def hold(self) -> None:
        """Do nothing this iteration (the "none" plan): acting loses in its phase."""
        rt = self.rt
        rt._mode = "none"
        rt._frozen = rt._acting_launch_free = rt._counting_launches = False
        rt._addresses = rt._reference = rt._keymap = None
        rt.wants_launches = False
        rt._next_launch = rt._clock.next_event = -1
        rt._discard_keys = frozenset()
        rt._oversized = {}
        rt._clock.follow({})
        rt._clock.set_due(-1)

    def report(self, payoff: dict) -> dict:
        """Per phase: iterations learned, plans kept, and (``payoff``: the
        :class:`~umrt.policy.runtime.payoff.Payoff` report) whether the runtime acts
        there, why not, and the times it compared."""
        learner = self.rt._learner
        out = {}
        for phase in sorted(set(learner.learned) | set(payoff) | {self.rt._phase}):
            out[phase] = {"learned": learner.learned.get(phase, 0), "plans": len(learner.phase_plans(phase)),
                          **payoff.get(phase, _NO_PAYOFF)}
        return out
