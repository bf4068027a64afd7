"""The loop's phases in the runtime: a training step and an evaluation batch are
learned, planned and predicted apart (``IterationBoundary.phase``).

:class:`LoopPhases` keeps, per phase, the shape its last iteration had and the
one its last run opened with (what the runtime predicts when a run of the
phase starts, or when the variant table has lost track), switches the running
phase, and reports each phase.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.learning import Learner
    from umrt.policy.runtime.planner import Plan
    from umrt.predict.tables import VariantTable

__all__ = ["LoopPhases"]

_NO_PAYOFF = {"baseline_ms": None, "acting_ms": None, "acting_vs_baseline": None, "acting": True,
              "stopped_because": None}


class LoopPhases:
    """The runtime's loop phases: the running one (:attr:`phase`), and per phase the
    shapes it last ran and opened a run with.

    Parameters
    ----------
    learner, plans, variants:
        The runtime's learner (which phase each shape is of, what each phase learned),
        its plans by signature and its variant table; read, never changed.
    """

    def __init__(self, learner: Learner, plans: Mapping[int, Plan], variants: VariantTable) -> None:
        self.learner = learner
        self.plans = plans
        self.variants = variants
        self.phase = "train"  # the running iteration's loop phase (IterationBoundary.phase)
        self.last: dict[str, int] = {}  # phase -> the shape of its last iteration
        self.opening: dict[str, int] = {}  # phase -> the shape its last run opened with
        self.opens_run = True  # the running iteration is the first of a run of its phase

    def in_phase(self, signature: int) -> bool:
        """Whether the plan of ``signature`` is one of the running iteration's phase."""
        return self.learner.phase_of.get(signature, "train") == self.phase

    def boundary(self, phase: str) -> None:
        """The next iteration is of ``phase``."""
        self.opens_run = phase != self.phase
        self.phase = phase

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
        phase_of = self.learner.phase_of
        for sig in self.variants.predict():
            plan = self.plans.get(sig)
            if plan is not None and phase_of.get(sig, "train") == phase:
                return plan
        for sig in ((self.opening.get(phase),) if self.opens_run else ()) + (self.last.get(phase),):
            plan = self.plans.get(sig) if sig is not None else None
            if plan is not None:
                return plan
        return None

    def report(self, payoff: dict) -> dict:
        """Per phase: iterations learned, plans kept, and (``payoff``: the
        :class:`~umrt.policy.runtime.payoff.Payoff` report) whether the runtime acts
        there, why not, and the times it compared."""
        learner = self.learner
        out = {}
        for phase in sorted(set(learner.learned) | set(payoff) | {self.phase}):
            out[phase] = {"learned": learner.learned.get(phase, 0), "plans": len(learner.phase_plans(phase)),
                          **payoff.get(phase, _NO_PAYOFF)}
        return out
