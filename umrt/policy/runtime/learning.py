"""Learning an iteration: recording it in stable keys and compiling its plan."""
from __future__ import annotations

from collections import OrderedDict

from umrt.hardware import HardwareProfile
from umrt.policy.runtime.planner import IterationRecord, Plan, Planner
from umrt.policy.runtime.ranges import NO_ALLOC
from umrt.predict.tables import CorrelationTable, DataTable, ObjectKeys
from umrt.trace.events import Alloc, Launch

SIGNATURE_MASK = (1 << 63) - 1  # the iteration signature's width (and the running hash's)
#: Compiled plans kept per loop phase (one per iteration shape; the phase's least
#: recently used dropped).
MAX_VARIANTS = 8


class Learner:
    """Records iterations launch by launch and compiles a :class:`Plan` per
    iteration shape (its signature), keeping the last :data:`MAX_VARIANTS` per phase.

    The runtime's hot path appends allocations, frees and boundaries to the
    :class:`IterationRecord` itself; launches come here (:meth:`record_launch`).
    """

    def __init__(self, keys: ObjectKeys, plans: OrderedDict[int, Plan], counters: dict[str, int]) -> None:
        self.keys, self.plans, self.counters, self.max_variants = keys, plans, counters, MAX_VARIANTS
        self.correlation = CorrelationTable()
        self.data = DataTable()
        self.signature = 0  # of the iteration so far: its launches, births and deaths
        # Per phase of the loop (IterationBoundary.phase): a training step and an
        # evaluation batch are learned, planned and predicted apart.
        self.learned: dict[str, int] = {}  # phase -> iterations learned
        self.relearn: set[str] = set()  # phases whose next iteration is learned (its shape was unknown)
        self.seek_left: dict[str, int] = {}  # phase -> iterations still learned to find a shape that ran without launches
        self.phase_of: dict[int, str] = {}  # signature -> the phase its iterations belong to
        self.plan_runs: dict[int, int] = {}  # signature -> iterations its plan ran through
        self._left_events: dict[int, int] = {}  # signature -> the events of the last step that left its plan
        self.planner: Planner | None = None
        self.migration_planner: Planner | None = None
        self.profile: HardwareProfile | None = None

    def new_planner(self, budget_bytes: int, profile: HardwareProfile | None, *,
                    op_level: bool, swap: bool = False) -> None:
        """Plan for ``budget_bytes`` on ``profile`` from now on (``swap``: the backend has the
        copy-engine path, see :class:`~umrt.policy.runtime.planner.Planner`)."""
        self.profile = profile
        self.planner = Planner(max(1, int(budget_bytes)), profile, op_level=op_level, swap=swap)
        # where plans may swap, each also gets a migration-only twin (see PathTrial)
        self.migration_planner = (Planner(max(1, int(budget_bytes)), profile, op_level=op_level)
                                  if swap else None)

    def new_record(self, alloc_of: dict[int, Alloc]) -> IterationRecord:
        """A record of the iteration starting now, with what is alive."""
        live = self.keys.obj_of
        rec = IterationRecord(start_live=set(live))
        for k, obj in live.items():
            ev = alloc_of.get(obj, NO_ALLOC)
            rec.sizes[k], rec.kinds[k] = ev.nbytes, ev.kind
        return rec

    def record_launch(self, rec: IterationRecord, ev: Launch, n_frees: int) -> None:
        """Launch ``ev`` in the record: the keys it touches, its compute time, the
        allocations and frees before it; the tables and the signature learn it."""
        keys = rec.add_uses(ev.accesses, self.keys.key_of.get)
        rec.exec_ids.append(ev.exec_id)
        rec.times.append(self.compute_time(ev.flops, ev.bytes, ev.precision))
        rec.alloc_counts.append(self.keys.ordinal)
        rec.free_counts.append(n_frees)
        self.correlation.observe(ev.exec_id)
        self.data.observe(ev.exec_id, keys)
        # The signature covers the launch sequence and where objects are born
        # and die, so two shapes that launch alike but allocate differently differ.
        self.signature = ((self.signature * 1000003) ^ ev.exec_id ^ (self.keys.ordinal << 20) ^ n_frees) & SIGNATURE_MASK

    def compute_time(self, flops: int, nbytes: int, precision: str = "") -> float:
        """A launch's compute time on the profile."""
        prof = self.profile
        if prof is not None:
            return prof.compute_time(flops, nbytes, precision)
        return max(flops / 100e12, nbytes / 1e12, 5e-6)  # no profile: a V100-class guess

    def learn(self, rec: IterationRecord, phase: str, *, fits: str | None = None, left: int | None = None) -> bool:
        """A learned iteration of ``phase``: its plan (:meth:`compile`; ``fits``: see
        :meth:`Planner.plan`; ``left``: the plan the iteration left, if any); whether its shape was new. After a shape no plan knew ran
        without launches, the iterations of its phase after it are recorded until one is new
        (at most ``seek_left[phase]`` of them, see ``Runtime._start_iteration``): a new one
        ends the search."""
        self.learned[phase] = self.learned.get(phase, 0) + 1
        self.phase_of[rec.signature] = phase
        new = self.compile(rec, fits=fits, left=left)
        if new:  # the stranger was found: stop seeking it
            self.seek_left.pop(phase, None)
            self.relearn.discard(phase)
        return new

    def seek(self, phase: str) -> None:
        """An iteration of ``phase`` left every plan: learn the next one of that phase
        (and, if it ran without launches, the ones after it until a new shape shows)."""
        self.relearn.add(phase)

    def forget_held_fits(self) -> bool:
        """Drop the plans that found nothing to do only because all the memory the layout
        held fitted the GPU (it holds more now): their shapes are learned again. Whether
        there were any."""
        stale = [sig for sig, plan in self.plans.items() if plan.stats.get("fits_as_held")]
        for sig in stale:
            del self.plans[sig]
        return bool(stale)

    def forget(self, signature: int) -> None:
        """Drop the plan of ``signature``: its shape is learned again, and the new plan
        probed before it is trusted."""
        self.plans.pop(signature, None)
        self.plan_runs.pop(signature, None)
        self._left_events.pop(signature, None)

    def phase_plans(self, phase: str) -> list[int]:
        """Signatures of the plans of ``phase``, least recently used first."""
        return [sig for sig in self.plans if self.phase_of.get(sig, "train") == phase]

    def ran(self, signature: int) -> None:
        """The plan of ``signature`` ran through an iteration."""
        self.plan_runs[signature] = self.plan_runs.get(signature, 0) + 1
        if len(self.plan_runs) > 4 * self.max_variants:
            self.plan_runs = {k: v for k, v in self.plan_runs.items() if k in self.plans}

    def runs(self, signature: int) -> int:
        """Iterations the plan of ``signature`` ran through (the runtime trusts it after its ``PROBE_ITERATIONS``)."""
        return self.plan_runs.get(signature, 0)

    def compile(self, rec: IterationRecord, *, fits: str | None = None, left: int | None = None) -> bool:
        """A plan for the learned iteration's shape; whether the shape was new. Each
        loop phase keeps its last :data:`MAX_VARIANTS` plans (the least recently used of
        its own go): the many shapes of variable-length training steps never push
        out the evaluation's. A known shape keeps its plan (a short last batch, same launches
        at other sizes, does not replace the full batch's), unless the plan's objects are gone
        (:meth:`Plan.outlived`), or two steps that ``left`` this shape's plan allocated as it does
        and ran the same events: the plan was learned on the first step after a change of shape
        (a longer context), which freed the step before's tensors. (One such step is no reason:
        another thread's frees may come late once, and a plan learned on that step would leave
        the next.)"""
        sig = rec.signature
        old = self.plans.get(sig)
        stale = False
        if old is not None and left == sig and old.allocates(*rec.sizes_hash()):
            events = hash(tuple(rec.tokens))
            stale = self._left_events.pop(sig, None) == events
            if not stale:
                self._left_events[sig] = events
        if old is not None and not old.outlived(self.keys.obj_of) and not stale:
            self.plans.move_to_end(sig)
            return False
        self.forget(sig)
        plan = self.planner.plan(rec, fits=fits)
        if plan.swap and self.migration_planner is not None:
            plan.migration_only = self.migration_planner.plan(rec)
        self.counters["plans_compiled"] += 1
        self.plans[sig] = plan
        phase = self.phase_of.get(sig, "train")
        same = self.phase_plans(phase)
        for old in same[: max(0, len(same) - self.max_variants)]:
            del self.plans[old]
        return True
