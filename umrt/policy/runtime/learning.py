"""Learning an iteration: recording it in stable keys and compiling its plan."""
from __future__ import annotations

from collections import OrderedDict

from umrt.hardware import HardwareProfile
from umrt.policy.runtime.planner import IterationRecord, Plan, Planner
from umrt.policy.runtime.ranges import NO_ALLOC
from umrt.predict.tables import CorrelationTable, DataTable, ObjectKeys
from umrt.trace.events import Alloc, Launch

SIGNATURE_MASK = (1 << 63) - 1  # the iteration signature's width (and the running hash's)


class Learner:
    """Records iterations launch by launch and compiles a :class:`Plan` per
    iteration shape (its signature), keeping the last ``max_variants``.

    The runtime's hot path appends allocations, frees and boundaries to the
    :class:`IterationRecord` itself; launches come here (:meth:`record_launch`).
    """

    def __init__(self, keys: ObjectKeys, plans: OrderedDict[int, Plan], counters: dict[str, int],
                 max_variants: int) -> None:
        self.keys, self.plans, self.counters, self.max_variants = keys, plans, counters, max_variants
        self.correlation = CorrelationTable()
        self.data = DataTable()
        self.signature = 0  # of the iteration so far: its launches, births and deaths
        self.learned = 0  # iterations learned
        self.relearn = False  # learn the next iteration (its shape was unknown)
        self.seek_left = 0  # iterations still learned to find a shape that ran without launches
        self.plan_runs: dict[int, int] = {}  # signature -> iterations its plan ran through
        self.planner: Planner | None = None
        self.profile: HardwareProfile | None = None

    def new_planner(self, budget_bytes: int, profile: HardwareProfile | None, *, headroom: float,
                    op_level: bool, swap: bool = False) -> None:
        """Plan for ``budget_bytes`` on ``profile`` from now on (``swap``: the backend has the
        copy-engine path, see :class:`~umrt.policy.runtime.planner.Planner`)."""
        self.profile = profile
        self.planner = Planner(max(1, int(budget_bytes)), profile, headroom=headroom, op_level=op_level, swap=swap)

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
        key_of = self.keys.key_of
        seen: dict[int, None] = {}
        for a in ev.accesses:
            k = key_of.get(a.obj)
            if k is not None:
                seen[k] = None
        keys = tuple(seen)
        rec.exec_ids.append(ev.exec_id)
        rec.uses.append(keys)
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

    def learn(self, rec: IterationRecord) -> None:
        """A learned iteration's plan (:meth:`compile`). After a shape no plan knew ran
        without launches, the iterations after it are learned until one is new (an
        eval pass every few steps comes back only then), at most ``seek_left`` of them."""
        new = self.compile(rec)
        if self.seek_left:
            self.seek_left = 0 if new else self.seek_left - 1
            self.relearn = self.seek_left > 0

    def ran(self, signature: int) -> None:
        """The plan of ``signature`` ran through an iteration."""
        self.plan_runs[signature] = self.plan_runs.get(signature, 0) + 1
        if len(self.plan_runs) > 4 * self.max_variants:
            self.plan_runs = {k: v for k, v in self.plan_runs.items() if k in self.plans}

    def runs(self, signature: int) -> int:
        """Iterations the plan of ``signature`` ran through (it is trusted after ``probe_iterations``)."""
        return self.plan_runs.get(signature, 0)

    def compile(self, rec: IterationRecord) -> bool:
        """A plan for the learned iteration's shape; whether the shape was new."""
        sig = rec.signature
        if sig in self.plans:
            self.plans.move_to_end(sig)
            return False
        plan = self.planner.plan(rec)
        self.counters["plans_compiled"] += 1
        self.plans[sig] = plan
        while len(self.plans) > self.max_variants:
            self.plans.popitem(last=False)
        return True
