"""Swap or migrate, per shape, by the iteration times the runtime observes.

The planner takes a plan's objects off the GPU through the copy engines where the
profile's figures say that beats page migration, object by object. Whether the whole
iteration is faster so is another question (both directions at once, the discards and
populations, compute beside the copies): the runtime compiles a migration-only plan
beside each plan that swaps, acts on each in turn, and keeps the faster, measured as
the payoff check measures (simulated, or CUDA events live).
"""
from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from umrt.policy.runtime.planner import Plan

#: Timed iterations of each kind before the faster is kept (the gap is large where it matters).
SAMPLES = 1
#: Samples a shape waits for their times before it keeps the planner's choice without them.
UNTIMED = 4 * SAMPLES
#: Acting iterations a shape's trial takes: one of each kind to change over, one to time.
TRIAL_ITERATIONS = 2 * (SAMPLES + 1) + 1
SWAP, MIGRATE = "swap", "migrate"


class PathTrial:
    """Per plan signature: the times of iterations that ran the swapping plan and its
    migration-only twin (``Plan.migration_only``), until one is kept."""

    def __init__(self) -> None:
        self.times: dict[int, dict[str, list[float]]] = {}
        self.kept: dict[int, str] = {}  # signature -> the kind it settled on
        self._pending: dict[int, tuple[int, str]] = {}  # iteration index -> (signature, kind)
        self._last: dict[int, str] = {}  # signature -> the kind its last acting iteration ran

    def pick(self, plan: Plan) -> Plan:
        """The plan to act on now: the swapping plan or its twin, the one with fewer
        samples (the swapping plan first), or the one kept."""
        twin = plan.migration_only
        if twin is None:
            return plan
        kept = self.kept.get(plan.signature)
        if kept is not None:
            return twin if kept == MIGRATE else plan
        return twin if self._samples(plan.signature, MIGRATE) < self._samples(plan.signature, SWAP) else plan

    def trying(self, plan: Plan) -> bool:
        """Whether ``plan``'s shape is still between its two paths (acting on either then
        stays recorded, not launch-free: a change of path needs the launches)."""
        return plan.signature not in self.kept and (plan.migration_only is not None or plan.signature in self._last)

    def _samples(self, sig: int, kind: str) -> int:
        """Samples of ``kind`` for ``sig``, those whose time is still to come included."""
        return len(self.times.get(sig, {}).get(kind, ())) + sum(e == (sig, kind) for e in self._pending.values())

    def ran(self, index: int, plan: Plan) -> None:
        """Iteration ``index`` followed ``plan`` to its end: its time is a sample once known, if
        the iteration before of its shape ran the same kind (the first after a change pays for
        the change: what the other kind left on or off the GPU)."""
        sig = plan.signature
        if sig in self.kept:
            return
        kind = SWAP if plan.swap else MIGRATE
        if kind == MIGRATE and sig not in self._last:
            return  # a plan that never swapped: nothing to compare
        warm, self._last[sig] = self._last.get(sig) == kind, kind
        if not warm:
            return
        self._pending[index] = (sig, kind)
        while len(self._pending) > 64:
            self._pending.pop(next(iter(self._pending)))
        if not self.times.get(sig) and self._samples(sig, SWAP) + self._samples(sig, MIGRATE) > UNTIMED:
            self.kept[sig] = SWAP  # no times come (no CUDA events here): the planner's choice stands

    def timed(self, index: int, seconds: float) -> tuple[int, str] | None:
        """Iteration ``index`` took ``seconds``: ``(signature, kind kept)`` if this sample decided it."""
        entry = self._pending.pop(index, None)
        if entry is None or seconds <= 0:
            return None
        sig, kind = entry
        t = self.times.setdefault(sig, {SWAP: [], MIGRATE: []})
        t[kind].append(seconds)
        if len(t[SWAP]) >= SAMPLES and len(t[MIGRATE]) >= SAMPLES:
            self.kept[sig] = MIGRATE if median(t[MIGRATE]) < median(t[SWAP]) else SWAP
            return sig, self.kept[sig]
        return None

    def report(self) -> dict:
        """``{"swap": n, "migrate": n}``: shapes settled on each path."""
        out = {SWAP: 0, MIGRATE: 0}
        for kind in self.kept.values():
            out[kind] += 1
        return out
