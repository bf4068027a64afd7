"""Do no harm: whether acting pays, per phase of the training loop.

The runtime's plans are made from a model of the GPU (the hardware profile's
rates); where the model is wrong for a program, acting can lose to doing
nothing. :class:`Payoff` compares the two on what a real runtime can see,
the time of its own iterations: simulated in a simulation, measured live
with CUDA events (:meth:`umrt.policy.base.Policy.iteration_time`). For each
loop phase (a training step, an evaluation batch) it keeps the times of the
iterations in which the runtime moved nothing of its own plan (learning,
recovering, or holding back) as the baseline, by iteration shape, and
compares each iteration that followed a plan from start to end with the
baseline of its shape (of its phase, where the shape has none: a phase's
shapes differ, an evaluation's first and last batches from the others).
Once ``window`` such ratios are in and their median is more than ``margin``
above 1 (or the last two are each more than 1.5: a loss that clear is not
waited on), acting loses for that phase: the runtime stops acting for it (the
"none" plan: the driver alone, as plain Unified Memory) and says so in its
report. A phase whose shape changes (a new plan is compiled for it) gets
another chance.

A baseline taken only before acting began can flatter doing nothing: a
learning iteration runs on what set-up left resident, which no steady
iteration sees again. So the first time acting looks like losing in a phase
whose baseline is that old, short of a clear loss, the verdict waits for one
iteration of the phase held back (:meth:`Payoff.wants_baseline`): doing
nothing now, on the layout doing nothing falls back to (the runtime's pool
stops planning for it). That sample replaces the phase's baseline and
decides; where acting wins, it goes on, and the pool plans again.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict, deque

__all__ = ["Payoff", "BASELINE", "ACTING"]

BASELINE, ACTING = "baseline", "acting"  # what an iteration's time is a sample of
_KEEP = 64  # iterations whose role is kept until their time arrives (live times come late)
#: Acting that took more than CLEAR_LOSS times the baseline in each of the last CLEAR_SAMPLES
#: iterations loses without waiting for ``window`` of them (every such iteration costs that much).
CLEAR_SAMPLES, CLEAR_LOSS = 2, 1.5
#: The runtime's check: the last WINDOW acting iterations of a phase against its baseline
#: (0: the runtime does not check), losing when more than MARGIN slower.
WINDOW, MARGIN = 3, 0.05


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

    def __init__(self, window: int = WINDOW, margin: float = MARGIN) -> None:
        if window < 1 or margin < 0:
            raise ValueError("window must be >= 1 and margin >= 0")
        self.window, self.margin = window, margin
        self._roles: OrderedDict[int, tuple[str, str, int]] = OrderedDict()  # iteration -> (phase, role, shape)
        self.baseline: dict[str, deque[float]] = {}  # phase -> seconds
        self._shape_baseline: dict[tuple[str, int], deque[float]] = {}  # (phase, shape) -> seconds
        self.acting: dict[str, deque[float]] = {}  # phase -> seconds
        self.ratios: dict[str, deque[float]] = {}  # phase -> acting / the baseline of its shape
        self.stopped: dict[str, str] = {}  # phase -> why acting stopped for it
        self._shape_acting: dict[tuple[str, int], deque[float]] = {}  # (phase, shape) -> seconds
        self._recheck: dict[str, bool] = {}  # phase -> a held-back iteration is wanted (False: it runs)
        self._fresh: set[str] = set()  # phases whose baseline was taken while acting went on

    def iteration(self, index: int, phase: str, role: str | None, shape: int = 0) -> None:
        """Iteration ``index`` of ``phase`` ended; ``role``: what its time is a sample
        of (:data:`BASELINE`, :data:`ACTING`), or None (it acted part-way, or is the
        run's first, whose time is set-up's); ``shape``: its signature (0: unknown)."""
        if role is None:
            return
        self._roles[index] = (phase, role, shape)
        while len(self._roles) > _KEEP:
            self._roles.popitem(last=False)

    def timed(self, index: int, seconds: float) -> str | None:
        """Iteration ``index`` took ``seconds``: the phase where acting now loses, if
        this sample decided it (it is then in :attr:`stopped`)."""
        entry = self._roles.pop(index, None)
        if entry is None:
            return None
        phase, role, shape = entry
        if seconds <= 0:  # no time (a live timing lost): a held iteration's check wants another
            if role == BASELINE and self._recheck.get(phase) is False:
                self._recheck[phase] = True
            return None
        if role == BASELINE:
            if phase in self._recheck:
                return self._rechecked(phase, shape, seconds)
            self.baseline.setdefault(phase, deque(maxlen=16)).append(seconds)
            if shape:
                self._shape_baseline.setdefault((phase, shape), deque(maxlen=4)).append(seconds)
            return None
        self.acting.setdefault(phase, deque(maxlen=16)).append(seconds)
        if shape:
            self._shape_acting.setdefault((phase, shape), deque(maxlen=4)).append(seconds)
        base = self._shape_baseline.get((phase, shape)) or self.baseline.get(phase)
        if not base:
            return None
        ratios = self.ratios.setdefault(phase, deque(maxlen=16))
        ratios.append(seconds / statistics.median(base))
        if phase in self.stopped or phase in self._recheck:
            return None
        last = list(ratios)[-self.window:]
        clear = len(last) >= CLEAR_SAMPLES and min(last[-CLEAR_SAMPLES:]) > CLEAR_LOSS
        if clear:
            last = last[-CLEAR_SAMPLES:]  # a loss this clear needs no more samples, nor a check
        elif len(last) < self.window:
            return None
        ratio = statistics.median(last)
        if ratio <= 1 + self.margin:
            return None
        if not clear and phase not in self._fresh:
            self._recheck[phase] = True  # first, doing nothing now (see the module's docstring)
            return None
        self.stopped[phase] = (f"its last {len(last)} {phase} iterations acting took {ratio:.2f}x the time of "
                               "the same iterations doing nothing")
        return phase

    def wants_baseline(self, phase: str) -> bool:
        """Whether the next iteration of ``phase`` should do nothing, as a fresh
        baseline for a verdict that waits on it; the caller that holds one back
        says so with :meth:`holding`."""
        return self._recheck.get(phase, False)

    def checking(self, phase: str) -> bool:
        """Whether a verdict on ``phase`` waits on an iteration held back (wanted, or
        held and not timed yet)."""
        return phase in self._recheck

    def holding(self, phase: str) -> None:
        """An iteration of ``phase`` is held back for :meth:`wants_baseline`."""
        if phase in self._recheck:
            self._recheck[phase] = False

    def _rechecked(self, phase: str, shape: int, seconds: float) -> str | None:
        """A baseline taken while acting went on arrived: it replaces the phase's
        baseline and decides the verdict that waited on it."""
        del self._recheck[phase]
        self._fresh.add(phase)
        for key in [k for k in self._shape_baseline if k[0] == phase]:
            del self._shape_baseline[key]
        self.baseline[phase] = deque([seconds], maxlen=16)
        if shape:
            self._shape_baseline[(phase, shape)] = deque([seconds], maxlen=4)
        acting = (self._shape_acting.get((phase, shape)) if shape else None) or self.acting[phase]
        last = list(acting)[-self.window:]
        ratio = statistics.median(last) / seconds
        self.ratios[phase] = deque([ratio], maxlen=16)
        if ratio <= 1 + self.margin:
            return None
        self.stopped[phase] = (f"its last {len(last)} {phase} iterations acting took {ratio:.2f}x the time of "
                               "an iteration held back doing nothing")
        return phase

    def allows(self, phase: str) -> bool:
        """Whether the runtime may act in ``phase``."""
        return phase not in self.stopped

    def new_shape(self, phase: str) -> None:
        """A new shape of ``phase`` was learned: acting gets another chance there."""
        if self.stopped.pop(phase, None) is not None:
            self.ratios.pop(phase, None)

    def report(self) -> dict:
        """Per phase: the median times (ms) of iterations doing nothing and acting,
        the median ratio of acting to doing nothing (shape for shape) over the last
        ``window``, and whether acting stopped there, and why."""
        out = {}
        for phase in sorted(set(self.baseline) | set(self.acting) | set(self.stopped)):
            base, act, ratios = self.baseline.get(phase), self.acting.get(phase), self.ratios.get(phase)
            out[phase] = {
                "baseline_ms": round(statistics.median(base) * 1e3, 4) if base else None,
                "acting_ms": round(statistics.median(act) * 1e3, 4) if act else None,
                "acting_vs_baseline": round(statistics.median(list(ratios)[-self.window:]), 4) if ratios else None,
                "acting": phase not in self.stopped,
                "stopped_because": self.stopped.get(phase),
            }
        return out
