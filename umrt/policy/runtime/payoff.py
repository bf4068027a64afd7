"""Do no harm: whether acting pays, per phase of the training loop.

The runtime's plans are made from a model of the GPU (the hardware profile's
rates); where the model is wrong for a program, acting can lose to doing
nothing. :class:`Payoff` compares the two on what a real runtime can see,
the time of its own iterations: simulated in a simulation, measured live
with CUDA events (:meth:`umrt.policy.base.Policy.iteration_time`). For each
loop phase (a training step, an evaluation batch) it keeps the times of the
iterations in which the runtime moved nothing of its own plan (learning,
recovering, or holding back) as the baseline, and those of the iterations it
followed a plan from start to end; once ``window`` of the latter are in and
their median is more than ``margin`` above the baseline's, acting loses for
that phase: the runtime stops acting for it (the "none" plan: the driver
alone, as plain Unified Memory) and says so in its report. A phase whose
shape changes (a new plan is compiled for it) gets another chance.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict, deque

__all__ = ["Payoff", "BASELINE", "ACTING"]

BASELINE, ACTING = "baseline", "acting"  # what an iteration's time is a sample of
_KEEP = 64  # iterations whose role is kept until their time arrives (live times come late)


class Payoff:
    """Per phase: the times of iterations that did not act and of those that did,
    and the phases where acting was found to lose.

    Parameters
    ----------
    window:
        Acting iterations (the last ones) whose median is compared, at least 1.
    margin:
        How much slower than the baseline acting may be before it counts as
        losing (0.05: 5%, within what a live clock's noise moves).
    """

    def __init__(self, window: int = 3, margin: float = 0.05) -> None:
        if window < 1 or margin < 0:
            raise ValueError("window must be >= 1 and margin >= 0")
        self.window, self.margin = window, margin
        self._roles: OrderedDict[int, tuple[str, str]] = OrderedDict()  # iteration -> (phase, role)
        self.baseline: dict[str, deque[float]] = {}
        self.acting: dict[str, deque[float]] = {}
        self.stopped: dict[str, str] = {}  # phase -> why acting stopped for it

    def iteration(self, index: int, phase: str, role: str | None) -> None:
        """Iteration ``index`` of ``phase`` ended; ``role``: what its time is a sample
        of (:data:`BASELINE`, :data:`ACTING`), or None (it acted part-way, or is the
        run's first, whose time is set-up's)."""
        if role is None:
            return
        self._roles[index] = (phase, role)
        while len(self._roles) > _KEEP:
            self._roles.popitem(last=False)

    def timed(self, index: int, seconds: float) -> str | None:
        """Iteration ``index`` took ``seconds``: the phase where acting now loses, if
        this sample decided it (it is then in :attr:`stopped`)."""
        entry = self._roles.pop(index, None)
        if entry is None or seconds <= 0:
            return None
        phase, role = entry
        samples = (self.baseline if role == BASELINE else self.acting).setdefault(phase, deque(maxlen=16))
        samples.append(seconds)
        if phase in self.stopped or role != ACTING:
            return None
        acting, base = self.acting[phase], self.baseline.get(phase)
        if len(acting) < self.window or not base:
            return None
        act_s = statistics.median(list(acting)[-self.window:])
        base_s = statistics.median(base)
        if act_s <= base_s * (1 + self.margin):
            return None
        self.stopped[phase] = (f"acting took {act_s * 1e3:.3g} ms per {phase} iteration against "
                               f"{base_s * 1e3:.3g} ms doing nothing")
        return phase

    def allows(self, phase: str) -> bool:
        """Whether the runtime may act in ``phase``."""
        return phase not in self.stopped

    def new_shape(self, phase: str) -> None:
        """A new shape of ``phase`` was learned: acting gets another chance there."""
        if self.stopped.pop(phase, None) is not None:
            self.acting.pop(phase, None)

    def report(self) -> dict:
        """Per phase: the median baseline and acting times (ms) and whether acting
        stopped there, and why."""
        out = {}
        for phase in sorted(set(self.baseline) | set(self.acting) | set(self.stopped)):
            base, act = self.baseline.get(phase), self.acting.get(phase)
            out[phase] = {
                "baseline_ms": round(statistics.median(base) * 1e3, 4) if base else None,
                "acting_ms": round(statistics.median(list(act)[-self.window:]) * 1e3, 4) if act else None,
                "acting": phase not in self.stopped,
                "stopped_because": self.stopped.get(phase),
            }
        return out
