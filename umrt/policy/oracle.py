"""The oracle: the best plan found for a cell with the whole trace known.

It is the reference a policy is measured against ("umrt reaches 0.95 of the
oracle"), so it must be at least as good as what a policy that sees only the
past can do. It is a search, not a claim of optimality: for the cell's profile
and budget it simulates each of a few candidate plans (:data:`CANDIDATES`), all
made from the whole trace before the first step, each timed where its own
warm-up ends and the fastest again where the oracle's run reports, until the
fastest was timed there (a plan can still be settling), and follows it. Every
candidate is a schedule of ordinary calls (prefetch, pre-evict, discard,
advise) a runtime could issue; the choice among them is made offline, by the
simulator (the model the figures come from).

Why a search. The previous oracle was one plan, the Belady schedule below:
the fewest bytes moved. umrt beat it in every cell of the bench grid
(1.14-1.43x its throughput) because time, not traffic, is what counts: that
plan hoists every prefetch as early as room allows, so the copy queue holds
far-future objects ahead of the next launch's and compute waits; its newborns
fault their first pages in; it placed objects with PyTorch's caching allocator,
whose 2 MB blocks mix lifetimes. umrt's planner moves more bytes (104 GB vs 71
GB per GPT-2 XL step on the H100 profile at 20%, before the H100 recalibration)
but each in time for its launch, populates newborns, on umrt's lifetime-aware
pool. The oracle now runs on that pool and
includes umrt's planner, handed the exact steady iteration from the first
step (no learning, compute times from the profile), under several settings
of what the planner leaves open, next to the Belady schedule, which still
wins where traffic dominates (small budgets on slow links).

The candidates (:data:`CANDIDATES`):

* ``none``: no call at all, the driver alone (plain ``um`` on umrt's pool):
  where everything fits, doing nothing is best.
* ``um``: the same on PyTorch's caching allocator, plain ``um`` itself: where
  tensors are small, the driver's batched faults cost less than a plan's
  calls, and the oracle is never slower than plain Unified Memory.
* ``belady`` (:func:`plan_cyclic`): Belady eviction done early (the resident
  object needed farthest in the future leaves right after its last use);
  prefetch as early as capacity allows (at most one iteration ahead);
  discard of dead data on Free; optimizer state and data only launches
  larger than the budget touch stay on the host, accessed over the link
  (PreferredLocation=host + AccessedBy=GPU). The plan never holds more
  resident bytes than the budget less a headroom.
* ``planner*``: :class:`~umrt.policy.runtime.planner.Planner` over
  :func:`iteration_record` (the template iteration as umrt's runtime would
  record it), followed as the runtime follows its plan: moves at decision
  points, newborns on pages taken off the GPU populated by prefetch, dead
  data discarded (``planner-keep-dead``: reused in place instead),
  oversized launches host-mapped for their own duration; under several
  settings of what the planner leaves open.
* ``umrt-runtime``: umrt's runtime itself, learning two iterations and then
  following its plan. It plans what ``planner`` plans, but the simulator's
  steady state depends a little on history and on the order of the ranges
  within a call, so the two land a few percent apart either side; with it
  among the candidates, umrt never beats the oracle, and "umrt reaches 0.95
  of the oracle" asks exactly whether another plan is more than 5% faster.

Following the plan. The replay feeds the steady-state iteration again and
again with fresh ids for the objects born in it, so the plan is made over
the *template* iteration (the trace's last training step,
:func:`template_index`) and followed by position:
the N-th Alloc/Free/Launch after an :class:`IterationBoundary` is the
template's N-th. Ids are mapped as events arrive (an Alloc names a newborn,
a Launch's accesses name what it touches); an object still alive at the end
of an iteration is the one its successor iteration frees. An iteration that
does not match the template (warm-up, a different step) is left to the
driver (newborns on pages taken off the GPU are still populated).

What it does not guarantee: optimality. It searches a few families of
plans; a policy outside them can still win somewhere (on the recalibrated
model, the static advice of ``um-advise`` beats every candidate on the
synthetic ``training_trace`` at 20%, where compute is tiny and migration
costs dominate). The bench checks that no policy beats the oracle
(``bench --check-targets``), and ``tests/test_oracle.py`` does on small
models at the grid's budgets.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from umrt.backends.base import HOST, Advice, Backend, SegmentWatch
from umrt.backends.ranges import RangeSet
from umrt.errors import ConfigError, UmrtError
from umrt.hardware import HardwareProfile
from umrt.memory.base import Layout
from umrt.memory.chosen import ChosenLayout
from umrt.memory.pool import LifetimePool
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.runtime import Runtime
from umrt.policy.runtime.planner import Action, IterationRecord, Plan, Planner, min_host_map_bytes
from umrt.policy.runtime.ranges import whole_pages
from umrt.policy.runtime.reuse import without
from umrt.trace.events import (
    Alloc,
    Event,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
    Trace,
)

__all__ = ["OraclePolicy", "OraclePlan", "Template", "plan_cyclic", "iteration_record", "CANDIDATES", "ChosenLayout"]

_NEVER = 1 << 62
_PERSISTENT = None  # the "lap" of an object alive in every iteration

Uid = tuple  # (template obj, lap) — lap None for persistent objects


@dataclass
class Template:
    """The steady-state iteration, as the oracle follows it.

    ``ops`` holds one entry per Alloc/Free/Launch: ``("A", obj, nbytes)``,
    ``("F", obj)`` or ``("L", exec_id, objs)`` (``objs``: the objects of the
    launch's accesses, in order).
    """

    ops: list[tuple]
    sizes: dict[int, int]
    born: dict[int, int]  # obj -> position of its Alloc in the iteration
    freed: dict[int, int]  # obj -> position of its Free
    pair: dict[int, int]  # carried obj freed here -> the obj born here that plays its part next time
    kinds: dict[int, Kind] = field(default_factory=dict)
    teardown: frozenset[int] = frozenset()  # freed after it as the script ended (:func:`teardown`)

    @classmethod
    def from_trace(cls, trace: Trace) -> Template:
        spans = trace.iteration_spans()
        if not spans:
            raise ConfigError("the oracle needs a trace with at least one complete iteration")
        sizes = {e.obj: e.nbytes for e in trace.events if isinstance(e, Alloc)}
        last = template_index(trace)
        iterations = [_ops(trace.events[a + 1 : b]) for a, b in spans[: last + 1]]
        gone = teardown(trace)
        ops = [op for op in iterations[-1] if not (op[0] == "F" and op[1] in gone)]
        born = {op[1]: i for i, op in enumerate(ops) if op[0] == "A"}
        freed = {op[1]: i for i, op in enumerate(ops) if op[0] == "F"}
        # A carried object freed in this iteration was born in an earlier one
        # at some position; the object born at that same position here is the
        # one the next iteration will free in its place.
        born_at = {i: obj for obj, i in born.items() if obj not in freed}
        alloc_pos: dict[int, int] = {}
        for it in iterations[:-1]:
            for i, op in enumerate(it):
                if op[0] == "A":
                    alloc_pos[op[1]] = i
        pair = {}
        for obj in freed:
            if obj not in born and alloc_pos.get(obj) in born_at:
                partner = born_at[alloc_pos[obj]]
                if sizes.get(partner) == sizes.get(obj):
                    pair[obj] = partner
        kinds = {e.obj: e.kind for e in trace.events if isinstance(e, Alloc)}
        return cls(ops, sizes, born, freed, pair, kinds, frozenset(gone))

    def uid(self, obj: int, lap: int) -> Uid:
        """The identity, across laps, of template object ``obj`` seen in lap ``lap``."""
        if obj in self.pair:
            return (self.pair[obj], lap - 1)
        if obj in self.born or obj in self.freed:
            return (obj, lap)
        return (obj, _PERSISTENT)


def _ops(events: list[Event]) -> list[tuple]:
    out: list[tuple] = []
    for e in events:
        if isinstance(e, Launch):
            out.append(("L", e.exec_id, tuple(a.obj for a in e.accesses)))
        elif isinstance(e, Alloc):
            out.append(("A", e.obj, e.nbytes))
        elif isinstance(e, Free):
            out.append(("F", e.obj))
    return out


@dataclass
class OraclePlan:
    """Actions per template position (issued before that op executes)."""

    length: int
    capacity: int  # bytes the plan may keep resident
    evict: dict[int, list[Uid]] = field(default_factory=lambda: defaultdict(list))
    prefetch: dict[int, list[Uid]] = field(default_factory=lambda: defaultdict(list))
    peak_bytes: int = 0  # most planned resident bytes at any point of the steady-state lap
    unplanned_launches: int = 0  # launches whose working set alone exceeds the capacity
    unplanned: set[int] = field(default_factory=set)  # their positions
    remote_at: dict[int, list[Uid]] = field(default_factory=dict)  # their non-resident objects, read remotely
    remote: frozenset[int] = frozenset()  # template objects kept on the host, read over the link


def plan_cyclic(template: Template, capacity: int, *, page_bytes: int = 64 << 10, laps: int = 3,
                remote: frozenset[int] = frozenset()) -> OraclePlan:
    """Plan the steady state of ``template`` repeated forever within ``capacity`` bytes.

    The iteration is unrolled ``laps`` times from an empty GPU; the actions
    of the middle lap (positions ``L .. 2L-1``, reported modulo ``L``) are the
    steady-state plan, since the first lap absorbs the cold start. Objects in
    ``remote`` stay on the host (accessed over the link) and are not planned.
    """
    L = len(template.ops)
    plan = OraclePlan(length=L, capacity=capacity, remote=frozenset(remote))
    if L == 0:
        return plan
    n = laps * L

    def size(uid: Uid) -> int:
        nbytes = template.sizes.get(uid[0], 0)
        return -(-max(nbytes, 1) // page_bytes) * page_bytes

    # Unrolled uses, births and deaths.
    uses: dict[int, list[Uid]] = {}
    uses_of: dict[Uid, list[int]] = defaultdict(list)
    birth: dict[Uid, int] = {}
    death: dict[int, Uid] = {}
    for lap in range(laps):
        base = lap * L
        for i, op in enumerate(template.ops):
            t = base + i
            if op[0] == "L":
                u = list(dict.fromkeys(template.uid(o, lap) for o in op[2] if o not in remote))
                uses[t] = u
                for x in u:
                    uses_of[x].append(t)
            elif op[0] == "A":
                birth[template.uid(op[1], lap)] = t
            else:
                death[t] = template.uid(op[1], lap)

    # Pass 1: Belady (farthest next use) over the unrolled stream.
    nxt = {x: 0 for x in uses_of}  # index into uses_of[x] of the next use

    def next_use(x: Uid) -> int:
        lst, k = uses_of[x], nxt[x]
        return lst[k] if k < len(lst) else _NEVER

    resident: dict[Uid, int] = {}  # uid -> position it came in
    last_use: dict[Uid, int] = {}
    # [in, out) residency; ends by pre-eviction (issued at out), by Free, or not at all.
    intervals: list[tuple[int, int, Uid, bool]] = []  # (in, out, uid, out is a pre-eviction)
    heap: list[tuple[int, int, Uid]] = []
    counter = 0
    used = 0
    for t in range(n):
        if t in death:
            x = death[t]
            if x in resident:
                intervals.append((resident.pop(x), t, x, False))
                used -= size(x)
            continue
        u = uses.get(t)
        if u is None:
            continue
        need = [x for x in u if x not in resident]
        if sum(size(x) for x in u) > capacity:
            # Its working set alone exceeds the budget (e.g. a foreach optimizer
            # step over every parameter): what is resident is used in place, the
            # rest is read and written over the link for this launch only
            # (AccessedBy), so nothing is faulted in and nothing evicted.
            if L <= t < 2 * L:
                plan.unplanned_launches += 1
                plan.unplanned.add(t - L)
                plan.remote_at[t - L] = need
            need = []
        need_bytes = sum(size(x) for x in need)
        in_use = set(u)
        parked = []
        while used + need_bytes > capacity and heap:
            neg, c, v = heapq.heappop(heap)
            if v not in resident or -neg != next_use(v):
                continue  # stale entry
            if v in in_use:
                parked.append((neg, c, v))
                continue
            intervals.append((resident.pop(v), last_use[v] + 1, v, True))
            used -= size(v)
        for e in parked:
            heapq.heappush(heap, e)
        for x in need:
            resident[x] = t
            used += size(x)
        for x in u:
            nxt[x] += 1
            last_use[x] = t
            if x in resident:
                counter += 1
                heapq.heappush(heap, (-next_use(x), counter, x))
    intervals.extend((start, n, x, False) for x, start in resident.items())

    # Pass 2: planned residency per position, then hoist every prefetch as
    # early as capacity allows (earliest-needed first).
    diff = np.zeros(n + 1, dtype=np.int64)
    for start, end, x, _ in intervals:
        diff[start] += size(x)
        diff[end] -= size(x)
    usage = np.cumsum(diff)[:n]
    prev_end: dict[Uid, int] = {}
    for start, end, x, evicted in sorted(intervals, key=lambda iv: iv[0]):
        s = size(x)
        lo = max(start - L, birth.get(x, 0), prev_end.get(x, -1) + 1, 0)
        p = start
        if lo < start:
            window = usage[lo:start]
            bad = np.flatnonzero(window + s > capacity)
            p = lo + (int(bad[-1]) + 1 if bad.size else 0)
            usage[p:start] += s
        if L <= p < 2 * L:
            plan.prefetch[p - L].append(x)
        if evicted and L <= end < 2 * L:
            plan.evict[end - L].append(x)
        prev_end[x] = end
    plan.peak_bytes = int(usage[L : 2 * L].max()) if n else 0
    return plan


# -- umrt's planner with the whole trace known ------------------------------------------


def template_index(trace: Trace) -> int:
    """The iteration the oracle plans: the trace's last training step (its last
    iteration where the trace has no training step, or no phases)."""
    phases = trace.iteration_phases()
    return max((i for i, p in enumerate(phases) if p == "train"), default=len(phases) - 1)


def teardown(trace: Trace) -> set[int]:
    """The objects the template iteration frees as the script ends, not as a step does.

    A script recorded to its end (shadow mode) frees its model, its optimizer's state and
    what its steps hand on (an RNN's hidden state) after its last step's last launch: in the
    template, where it is the trace's last iteration, the frees after its last launch beyond
    as many as the training step before made there. Planned as the step's, they made what
    a step hands on look dead, and the oracle dropped an RNN's state before the next step."""
    spans, phases = trace.iteration_spans(), trace.iteration_phases()
    last = template_index(trace)
    before = max((i for i, p in enumerate(phases[:last]) if p == "train"), default=None)
    if last != len(spans) - 1 or before is None:
        return set()

    def trailing_frees(span: tuple[int, int]) -> list[int]:
        events = trace.events[span[0] + 1 : span[1]]
        end = max((i for i, e in enumerate(events) if isinstance(e, Launch)), default=-1)
        return [e.obj for e in events[end + 1 :] if isinstance(e, Free)]

    return set(trailing_frees(spans[last])[len(trailing_frees(spans[before])):])


def iteration_record(trace: Trace, template: Template, profile: HardwareProfile) -> IterationRecord:
    """The template iteration as umrt's runtime records one, known exactly from the trace.

    Keys are the trace's own object ids (the template's); compute times come
    from ``profile`` as the runtime predicts them; a survivor's carried key is
    the object it plays the part of in the next iteration (``template.pair``).
    """
    a, b = trace.iteration_spans()[template_index(trace)]
    live: dict[int, Alloc] = {}
    for e in trace.events[:a]:
        if isinstance(e, Alloc):
            live[e.obj] = e
        elif isinstance(e, Free):
            live.pop(e.obj, None)
    rec = IterationRecord(start_live=set(live))
    for obj, e in live.items():
        rec.sizes[obj], rec.kinds[obj] = e.nbytes, e.kind
    launches = allocs = frees = 0
    for e in trace.events[a + 1 : b]:
        if isinstance(e, Free) and e.obj in template.teardown:
            continue
        if isinstance(e, Launch):
            rec.exec_ids.append(e.exec_id)
            rec.add_uses(e.accesses, lambda obj: obj if obj in rec.sizes else None)
            rec.times.append(profile.compute_time(e.flops, e.bytes, e.precision))
            rec.alloc_counts.append(allocs)
            rec.free_counts.append(frees)
            launches += 1
        elif isinstance(e, Alloc):
            rec.add_alloc(launches, e.obj, e)
            allocs += 1
        elif isinstance(e, Free):
            if e.obj in rec.sizes:
                rec.frees.append((launches, e.obj))
            frees += 1
        elif isinstance(e, (LayerEnter, LayerExit)):
            rec.boundaries.append(launches)
    rec.carried = {born: freed for freed, born in template.pair.items()}
    return rec


# -- the candidates -----------------------------------------------------------------------

RUNTIME = "umrt-runtime"

#: The oracle's candidate plans, by name: ``"belady"`` is :func:`plan_cyclic`'s
#: schedule (the fewest bytes moved); the others are umrt's own
#: :class:`~umrt.policy.runtime.planner.Planner` with these options, fed the exact
#: iteration from the first step on (:func:`iteration_record`). The options
#: span what the planner leaves open: how full the GPU may get, whether
#: short-lived objects stay pinned, when evictions are issued, how often it
#: decides, whether anything stays on the host. ``none`` is the empty plan
#: (the driver alone) on umrt's pool: where everything fits, doing nothing
#: is best; ``um`` the same on PyTorch's caching allocator, plain ``um`` itself
#: (so the oracle is never slower than plain Unified Memory).
CANDIDATES: dict[str, dict] = {
    "none": {},
    "um": {},
    "belady": {},
    "planner": {"headroom": 0.9},  # what umrt's runtime plans, minus its learning
    "planner-full": {"headroom": 0.97},  # a fuller GPU
    "planner-late-evict": {"headroom": 0.9, "early_evict": False},  # evict when the room is needed
    "planner-unpinned": {"headroom": 0.9, "short_launches": 1},  # temporaries may be evicted too
    "planner-unpinned-full": {"headroom": 0.97, "short_launches": 1},
    "planner-local": {"headroom": 0.9, "remote_access": False},  # nothing read over the link
    "planner-keep-dead": {"headroom": 0.9, "discard": False},  # dead ranges reused in place, not discarded
    "planner-migrate": {"headroom": 0.9, "swap": False},  # page migration only, no copy engines
    # umrt's runtime as it runs: two iterations learned, then its planner's schedule. The same
    # plan as "planner", but the simulator's steady state depends a little on history and on
    # the order of ranges within a call (its keys order them), so it can land either side.
    RUNTIME: {},
}
BEST = "best"
NO_CALLS = ("none", "um")  # the candidates that make no call


class TemplateIds:
    """Which object of this run a template object is: ids differ from iteration to
    iteration, so the oracle learns them as the program runs (its allocations and
    its launches' accesses, matched against the template)."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self.current: dict[int, int] = {}  # template obj -> runtime obj, this iteration
        self.previous: dict[int, int] = {}  # same, previous iteration
        # A long-lived template object -> the runtime object last seen playing its part (a
        # run that makes its model or optimizer again, as k-fold training does, replaces them)
        self.long_lived: dict[int, int] = {}
        self._carried_twin = {y: x for x, y in template.pair.items()}

    def next_iteration(self) -> None:
        self.previous, self.current = self.current, {}

    @staticmethod
    def matches(op: tuple, event: Event) -> bool:
        """Whether ``event`` is the template's next ``op``."""
        if op[0] == "L":
            return isinstance(event, Launch) and event.exec_id == op[1] and len(event.accesses) == len(op[2])
        if op[0] == "A":
            return isinstance(event, Alloc) and event.nbytes == op[2]
        return isinstance(event, Free)

    def learn(self, op: tuple, event: Event) -> None:
        """The ids ``event`` (which matched ``op``) names."""
        if op[0] == "A":
            self.current[op[1]] = event.obj
        elif op[0] == "L":
            t = self.template
            for obj, access in zip(op[2], event.accesses, strict=True):
                self.current[obj] = access.obj
                if obj not in t.born and obj not in t.freed:
                    self.long_lived[obj] = access.obj

    def resolve(self, uid: Uid) -> int | None:
        """The runtime id of a planned object in the current iteration (lap 1 of the plan)."""
        obj, lap = uid
        cur, prev = self.current, self.previous
        if lap is _PERSISTENT:
            return cur.get(obj, prev.get(obj, self.long_lived.get(obj, obj)))
        if lap == 1:
            if obj in cur or obj in self.template.born:
                return cur.get(obj)
            return prev.get(obj, obj)  # carried in, no twin: assume its id is kept
        if lap == 0:  # born in the previous iteration, still alive
            if obj in prev:
                return prev[obj]
            carried = self._carried_twin.get(obj)  # first iteration followed: learn from the carried twin
            return cur.get(carried, carried) if carried is not None else None
        return None

    def resolve_key(self, key: int) -> int | None:
        """The runtime id of the planner's ``key`` (a template object) in the current iteration."""
        t = self.template
        if key in self.current:
            return self.current[key]
        if key in t.born:
            return None  # not born yet in this iteration
        if key in t.freed:  # carried in: born in the previous iteration as its twin
            twin = t.pair.get(key)
            return self.previous.get(twin) if twin is not None else None
        return self.long_lived.get(key, key)  # long-lived: its id is kept (until the run makes it again)


class OraclePolicy(Policy):
    """The best of several plans made from the whole trace (see the module docstring).

    Options: ``plan`` (``"best"``, the default: simulate every candidate of
    :data:`CANDIDATES` on this cell's profile and budget and follow the
    fastest; or one candidate's name), and for the ``belady`` plan:
    ``headroom`` (fraction of the budget kept free for page rounding and 2 MB
    blocks shared between objects, default 0.05), ``page_bytes`` (objects are
    counted in whole pages of this size, default 64 KB, the driver's big
    page), ``discard`` (drop freed objects' pages, default True),
    ``remote_access`` (keep data that only launches larger than the budget
    touch on the host, accessed over the link; default True).
    """

    name = "oracle"

    def __init__(self, trace: Trace | None = None, *, plan: str = BEST, headroom: float = 0.05,
                 page_bytes: int = 64 << 10, discard: bool = True, remote_access: bool = True) -> None:
        if trace is None:
            raise ConfigError("the oracle plans from the whole future: pass the trace (make_policy('oracle', trace=...))")
        if plan != BEST and plan not in CANDIDATES:
            raise ConfigError(f"unknown oracle plan {plan!r}; valid: {BEST}, {', '.join(CANDIDATES)}")
        if not 0.0 <= headroom < 1.0:
            raise ConfigError(f"oracle headroom must be in [0, 1), got {headroom!r}")
        if page_bytes <= 0:
            raise ConfigError(f"oracle page_bytes must be positive, got {page_bytes!r}")
        self.trace = trace
        self.template = Template.from_trace(trace)
        self.choice = plan
        # umrt's pool learns the first iteration and refines its plan after the second:
        # from the fourth every object is where it stays. umrt's runtime needs longer.
        self._warmup = 3 if plan not in (BEST, RUNTIME) else max(3, _runtime().warmup_iterations)
        self.runtime: Policy | None = None  # the runtime followed, when that candidate is chosen
        self._layout_backend: Backend | None = None
        self.options = {"headroom": headroom, "page_bytes": page_bytes, "discard": discard,
                        "remote_access": remote_access}
        self.headroom, self.page_bytes, self.discard, self.remote_access = headroom, page_bytes, discard, remote_access
        self.candidate_times: dict[str, float] = {}  # plan -> simulated steady iteration, or whole run for a loop of several phases (plan="best")
        self.plan: OraclePlan | None = None  # the belady schedule, when it is the one followed
        self.schedule: Plan | None = None  # the planner's, when it is
        self._actions: dict[int, Action] = {}  # the planner's, by launch ordinal
        self._launch = 0  # launches of this iteration followed so far
        self._least_mapped = 0  # smaller ranges are not host-mapped for one launch (min_host_map_bytes)
        self._remote_persistent: set[int] = set()
        self._advised: dict[int, tuple[int, int]] = {}  # runtime obj -> range advised host-mapped
        self._advise_set: list[tuple[int, int]] = []  # pending advice calls
        self._advise_unset: list[tuple[int, int]] = []
        self._temp_advised: list[tuple[int, int]] = []  # advised for one launch; withdrawn after it
        self._pos: int | None = None  # position in the template; None before the first boundary
        self._lost = False  # this iteration strayed from the template
        self.ids = TemplateIds(self.template)  # template objects -> this run's object ids
        self._nbytes: dict[int, int] = {}
        self._discards: list[tuple[int, int]] = []  # pending calls, issued by _flush
        self._evicts: list[tuple[int, int]] = []
        self._releases: list[tuple[int, int]] = []  # dead pages to hand back (see _act_belady)
        self._prefetches: list[tuple[int, int]] = []
        self._pending_objs: set[int] = set()
        # Pages the oracle took off the GPU (discarded, evicted, host-mapped) or that no one
        # populated yet (new pool segments): a newborn there is populated (planner plans).
        self._away = RangeSet()
        self._swapped = SwappedOut()  # live pages swapped out: copied back before use
        self.stats = {"prefetches": 0, "evictions": 0, "discards": 0, "host_mapped": 0, "matched_iterations": 0,
                      "unmatched_iterations": 0, "unresolved": 0, "populated": 0, "swap_outs": 0, "swap_ins": 0}

    @property
    def warmup_iterations(self) -> int:
        """Iterations before the steady state of every plan this oracle may follow."""
        return self._warmup

    def make_layout(self, backend: Backend) -> Layout:
        """umrt's lifetime-aware pool, the layout umrt's runtime runs with (made in
        :meth:`attach`, once the plan is chosen: the runtime's has its own hooks)."""
        self._layout_backend = backend
        return ChosenLayout()

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self._least_mapped = min_host_map_bytes(ctx.profile)
        if self.choice == BEST:
            self.choice = self._best(ctx)
        if isinstance(ctx.layout, ChosenLayout):
            ctx.layout.bind(self._make_layout(ctx))
        if self.choice == "belady":
            self._plan_belady(ctx.budget_bytes)
        elif self.choice not in NO_CALLS + (RUNTIME,):
            options = dict(CANDIDATES[self.choice])
            keep_dead = not options.pop("discard", True)
            swap = options.pop("swap", True) and ctx.backend.swap.pinned_copies
            rec = iteration_record(self.trace, self.template, ctx.profile)
            planner = Planner(max(1, int(ctx.budget_bytes)), ctx.profile, swap=swap, **options)
            self.schedule = planner.plan(rec)
            if keep_dead:  # dead ranges are reused in place: no discard, no populate of them
                self.schedule = replace(self.schedule, discard=frozenset())
            self._actions = self.schedule.action_at()

    def _make_layout(self, ctx: PolicyContext) -> Layout:
        """The chosen plan's layout: umrt's pool, watched by the oracle or by the runtime it follows."""
        backend = self._layout_backend or ctx.backend
        if self.choice == "um":
            return super().make_layout(backend)  # PyTorch's caching allocator
        if self.choice == RUNTIME:
            self.runtime = _runtime()
            layout = self.runtime.make_layout(backend)
            self.runtime.attach(PolicyContext(ctx.backend, layout, ctx.budget_bytes, ctx.profile))
            return layout
        budget = ctx.budget_bytes  # (as the runtime's pool: no plan's region while all it holds fits)
        return LifetimePool(SegmentWatch(backend, self._segment_made, self._released), needs_plan=lambda n: n > budget)

    def _best(self, ctx: PolicyContext) -> str:
        """Simulate every candidate plan on this profile and budget; the fastest steady iteration wins."""
        if not isinstance(ctx.profile, HardwareProfile):
            raise ConfigError("the oracle picks its plan by simulating each candidate: it needs the hardware "
                              "profile (PolicyContext.profile); or name one plan (plan='belady')")
        if ctx.simulate is None:
            raise ConfigError("the oracle picks its plan by simulating each candidate: it runs in a simulation "
                              "(PolicyContext.simulate); or name one plan (plan='belady')")
        # Each plan's steady iteration, as the bench reports it. The replay repeats
        # the last recorded iteration to get there, which only a steady iteration
        # allows: a trace of fewer than three, or whose last one frees what it did
        # not make and will not hand on (a script's teardown), is ranked on its own.
        recorded = len(self.trace.iteration_spans())
        t = self.template
        repeatable = recorded >= 3 and not t.teardown and not (set(t.freed) - set(t.born) - set(t.pair))
        # A loop of several phases (training steps and evaluation batches) has no one
        # steady iteration: each plan is ranked on the whole recorded run instead.
        whole_run = len(set(self.trace.iteration_phases())) > 1
        at: dict[str, int] = {}  # plan -> the iterations its time was taken at

        def timed(name: str, iterations: int | None = None) -> float:
            candidate = OraclePolicy(self.trace, plan=name, **self.options)
            if iterations is None:  # its own steady state
                steady = candidate.steady_iterations()
                iterations = recorded if whole_run else steady if repeatable else min(recorded, steady)
            at[name] = iterations
            result = ctx.simulate(self.trace, candidate, ctx.profile, int(ctx.budget_bytes), iterations=iterations)
            return sum(result.iteration_times_s) if whole_run else result.iteration_time_s

        self.candidate_times.update((name, timed(name)) for name in CANDIDATES)
        if whole_run or not repeatable:
            return min(self.candidate_times, key=self.candidate_times.__getitem__)
        # A plan can still be settling where its own warm-up ends: the fastest is timed again at
        # this oracle's steady iteration, until the fastest was timed there. So the oracle, as
        # reported there, is never slower than a candidate timed there (umrt's runtime is).
        reported = self.steady_iterations()
        while at[best := min(self.candidate_times, key=self.candidate_times.__getitem__)] != reported:
            self.candidate_times[best] = timed(best, reported)
        return best

    def _plan_belady(self, budget_bytes: int) -> None:
        capacity = int(budget_bytes * (1.0 - self.headroom))
        self.plan = plan_cyclic(self.template, capacity, page_bytes=self.page_bytes)
        if self.remote_access:
            # Data touched only by launches too big for the budget (the foreach
            # optimizer step over every parameter) would be faulted in and
            # evicted again on every pass: it is cheaper read and written in
            # place over the link (PreferredLocation=host + AccessedBy=GPU).
            # Taking it out can make other launches fit, so repeat until stable.
            used_at: dict[int, set[int]] = defaultdict(set)
            for i, op in enumerate(self.template.ops):
                if op[0] == "L":
                    for obj in op[2]:
                        used_at[obj].add(i)
            # Optimizer state is read and rewritten once per step, in one burst:
            # streaming it over the link costs the same bytes as migrating it in
            # and out, without evicting anything.
            remote = frozenset(o for o in used_at if self.template.kinds.get(o) == Kind.OPTIMIZER_STATE)
            if remote:
                self.plan = plan_cyclic(self.template, capacity, page_bytes=self.page_bytes, remote=remote)
            for _ in range(4):
                more = {o for o, at in used_at.items() if at <= self.plan.unplanned} - remote
                if not more:
                    break
                remote = remote | more
                self.plan = plan_cyclic(self.template, capacity, page_bytes=self.page_bytes, remote=remote)
        t = self.template
        self._remote_persistent = {o for o in self.plan.remote if o not in t.born and o not in t.freed}

    def iteration_time(self, index: int, seconds: float) -> None:
        """The runtime followed gets the iteration times a runtime gets (its checks use them)."""
        if self.runtime is not None:
            self.runtime.iteration_time(index, seconds)

    def on_event(self, event: Event) -> None:
        if self.runtime is not None:
            self.runtime.on_event(event)
            return
        if self.choice in NO_CALLS:
            return  # the empty plan: the driver alone
        if isinstance(event, IterationBoundary):
            self._boundary()
            return
        if self._temp_advised and not isinstance(event, (LayerEnter, LayerExit)):
            self._advise_unset.extend(self._temp_advised)  # the launch that needed remote access has run
            self._temp_advised = []
        if isinstance(event, Alloc):
            self._nbytes[event.obj] = event.nbytes
            if event.obj in self._remote_persistent:  # ids of long-lived objects never change
                self._host_map(event.obj)
            if self._discards or self._releases:
                self._spare(event.obj)
            self._populate(event.obj)
        elif isinstance(event, Free):
            rng = self._advised.pop(event.obj, None)
            if rng is not None:
                self._advise_unset.append(rng)
            if self._swapped.ranges and event.obj in self._nbytes:  # dead: its staged copy is dropped
                try:
                    at = self.ctx.layout.address(event.obj)
                    dead = self._swapped.take(at, at + self._nbytes[event.obj])
                except (UmrtError, KeyError):
                    dead = []
                if dead:
                    self.ctx.backend.swap.release(dead)
        elif not isinstance(event, Launch):
            return
        if self._pos is None or self._lost:
            return
        p = self._pos
        self._pos += 1
        ops = self.template.ops
        if p >= len(ops) or not TemplateIds.matches(ops[p], event):
            self._lost = True
            self._swapped.restore(self.ctx.backend, self._away)
            return
        self._learn(ops[p], event)
        if self.schedule is not None:
            self._act_planned(p, event)
        else:
            self._act_belady(p, event)

    def report(self) -> dict:
        out = dict(self.stats)
        out["plan"] = self.choice
        if self.candidate_times:
            out["candidate_times_s"] = dict(self.candidate_times)
        if self.plan is not None:
            out.update(planned_peak_bytes=self.plan.peak_bytes, plan_capacity_bytes=self.plan.capacity,
                       unplanned_launches=self.plan.unplanned_launches)
        if self.schedule is not None:
            out.update(planned_peak_bytes=self.schedule.stats.get("planned_peak_bytes", 0),
                       plan_capacity_bytes=self.schedule.stats.get("capacity_bytes", 0),
                       unplanned_launches=len(self.schedule.remote_at))
        return out

    # -- following the template -------------------------------------------------

    def _boundary(self) -> None:
        self._flush()
        if self._pos is not None:
            done = self._pos == len(self.template.ops) and not self._lost
            self.stats["matched_iterations" if done else "unmatched_iterations"] += 1
            t = self.template
            if not done or t.teardown or set(t.freed) - set(t.born) - set(t.pair):
                # The next iteration may not play this one's part (this one strayed, or it frees
                # what it did not make, as a script's last step does): nothing stays swapped out.
                self._swapped.restore(self.ctx.backend, self._away)
        self.ids.next_iteration()
        self._pos, self._lost = 0, False
        self._launch = 0
        if self.schedule is not None and self.schedule.remote:
            self._host_map_keys(self.schedule.remote)

    def _learn(self, op: tuple, event: Event) -> None:
        self.ids.learn(op, event)
        if op[0] == "A" and self.plan is not None and op[1] in self.plan.remote and event.obj not in self._advised:
            self._host_map(event.obj)

    def _range(self, obj: int | None, fallback: int = 0) -> tuple[int, int] | None:
        """``(ptr, nbytes)`` of a live runtime object, or None (counted as unresolved)."""
        if obj is None:
            self.stats["unresolved"] += 1
            return None
        try:
            ptr = self.ctx.layout.address(obj)
        except (UmrtError, KeyError):
            self.stats["unresolved"] += 1
            return None
        nbytes = self._nbytes.get(obj, fallback)
        return (ptr, nbytes) if nbytes > 0 else None

    def _resolve_into(self, uids: list[Uid], out: list[tuple[int, int]]) -> None:
        for uid in uids:
            obj = self.ids.resolve(uid)
            rng = self._range(obj, self.template.sizes.get(uid[0], 0))
            if rng is not None:
                out.append(rng)
                self._pending_objs.add(obj)

    # -- the belady plan ------------------------------------------------------------

    def _act_belady(self, p: int, event: Event) -> None:
        # Actions are collected and issued in one call per kind just before the
        # next launch (each call costs CPU time on a real GPU and in the sim).
        plan = self.plan
        assert plan is not None, "attach() was not called"
        if isinstance(event, Free):
            if event.obj in self._pending_objs:
                self._flush()  # it must move before its range is reused
            nbytes = self._nbytes.get(event.obj, 0)
            if self.discard and nbytes > 0:
                # The object is dying right now: its content is dead by definition.
                # (Its range stays in the allocator's cache; until the next launch
                # nothing can write there, so the discard may wait for the flush.)
                ptr = self.ctx.layout.address(event.obj)
                self._discards.append((ptr, nbytes))
                # The discarded pages still hold GPU memory; moving the big pages
                # that lie wholly inside the object to the host frees it at no
                # copy cost (nothing valid is left to copy), so the plan's
                # accounting holds. Pages shared with live neighbours stay put.
                lo = -(-ptr // self.page_bytes) * self.page_bytes
                hi = (ptr + nbytes) // self.page_bytes * self.page_bytes
                if hi > lo:
                    self._releases.append((lo, hi - lo))
        if p in plan.evict:
            self._resolve_into(plan.evict[p], self._evicts)
        if p in plan.prefetch:
            self._resolve_into(plan.prefetch[p], self._prefetches)
        if p in plan.remote_at:
            ranges: list[tuple[int, int]] = []
            self._resolve_into(plan.remote_at[p], ranges)
            ranges = [r for r in ranges if r not in self._advised.values() and r[1] >= self._least_mapped]
            self._advise_set.extend(ranges)
            self._temp_advised.extend(ranges)
        if isinstance(event, Launch):
            self._flush()

    # -- the planner's plan ---------------------------------------------------------

    def _act_planned(self, p: int, event: Event) -> None:
        """Follow umrt's plan as its runtime does: discard what dies after a long
        life, host-map oversized launches, move at decision points (newborns on
        pages taken off the GPU are populated in any iteration: :meth:`_populate`)."""
        plan = self.schedule
        key = self.template.ops[p][1]
        if isinstance(event, Free):
            if key in plan.discard:
                self._discard_dead(event.obj)
        elif isinstance(event, Launch):
            i = self._launch
            self._launch += 1
            self._flush()
            action = self._actions.get(i)
            if action is not None:
                self._move(action)
            if i in plan.remote_at:
                born, heads = plan.remote_fresh.get(i, ()), plan.remote_head.get(i, {})
                keyed, on_gpu = [], []
                for k in plan.remote_at[i]:
                    r = self._range(self.ids.resolve_key(k))
                    if r is not None and k in born and 0 < heads.get(k, 0) < r[1]:  # its head fits the GPU
                        on_gpu.append((r[0], heads[k]))
                        r = (r[0] + heads[k], r[1] - heads[k])
                    if r is not None and r not in self._advised.values() and r[1] >= self._least_mapped:
                        keyed.append((k, r))
                ranges = [r for _, r in keyed]
                # newborns the launch writes first: their dead pages go to the host without a copy
                fresh = [x for x in (whole_pages(*r) for k, r in keyed if k in born) if x is not None]
                if fresh or on_gpu:
                    self._flush()
                if fresh:
                    self.ctx.backend.discard_and_prefetch(fresh, HOST)
                    self._away.add_all(fresh)
                if on_gpu:
                    self.ctx.backend.prefetch(on_gpu, self.ctx.backend.device)
                    self._away.remove_all(on_gpu)
                self._advise_set.extend(ranges)
                self._temp_advised.extend(ranges)
                self._flush()

    def _populate(self, obj: int) -> None:
        """A newborn: the parts of its range the oracle took off the GPU (discarded, evicted,
        host-mapped) or never populated (a new pool segment) are prefetched to the GPU before its
        kernel, in one call (a first touch faults them in far slower); unlike the runtime's, the
        call does not take in the free pages of the newborn's 2 MB blocks."""
        rng = self._range(obj)
        if rng is None:
            return
        ptr, end = rng[0], rng[0] + rng[1]
        if any(p < end and ptr < p + n for p, n in self._discards + self._releases):
            self._flush()  # the dead range it reuses is dropped first (and so is away), never after
        if not self._away.overlaps(*rng):
            return
        pieces = self._away.take(*rng)
        if pieces:
            self.ctx.backend.populate(pieces)
            self.stats["populated"] += 1

    def _discard_dead(self, obj: int) -> None:
        rng = self._range(obj)
        if rng is not None and (inner := whole_pages(*rng)) is not None:
            self._discards.append(inner)

    def _move(self, action: Action) -> None:
        backend = self.ctx.backend

        def pages(keys: tuple[int, ...]) -> list[tuple[int, int]]:
            """The whole pages of the planner's ``keys`` alive now (as the runtime resolves a swap)."""
            ranges = (self._range(self.ids.resolve_key(k)) for k in keys)
            return [x for x in (whole_pages(*r) for r in ranges if r is not None) if x is not None]

        if action.swap_out:
            out = pages(action.swap_out)
            if out:
                backend.swap.out(out)
                self.stats["swap_outs"] += len(out)
                for r in out:
                    self._away.add(*r)
                    self._swapped.ranges[r[0]] = r[1]
        if action.swap_in:
            ins = pages(action.swap_in)
            if ins:
                backend.swap.back(ins)
                self.stats["swap_ins"] += len(ins)
                for r in ins:
                    self._away.remove(*r)
                    self._swapped.ranges.pop(r[0], None)
        if action.ready:
            backend.swap.wait(pages(action.ready))
        if action.drop:
            dead = pages(action.drop)
            if dead:
                backend.drop(dead)
                self.stats["discards"] += len(dead)
                self._away.add_all(dead)
        evicts = [r for r in (self._range(self.ids.resolve_key(k)) for k in action.evict) if r is not None]
        out = [x for x in (whole_pages(*r) for r in evicts) if x is not None]
        if out:
            self.ctx.backend.prefetch(out, HOST)
            self.stats["evictions"] += len(out)
            self._away.add_all(out)
        ins = [r for r in (self._range(self.ids.resolve_key(k)) for k in action.prefetch) if r is not None]
        if ins:
            self.ctx.backend.prefetch(ins, self.ctx.backend.device)
            self.stats["prefetches"] += len(ins)
            self._away.remove_all(ins)

    def _host_map_keys(self, keys) -> None:
        """Keep long-lived objects on the host, read over the link, and move them out now."""
        ranges = []
        for key in keys:
            obj = self.ids.resolve_key(key)
            if obj is None or obj in self._advised:
                continue
            try:
                rng = (self.ctx.layout.address(obj), self._nbytes.get(obj, 0))
            except (UmrtError, KeyError):
                continue
            if rng[1] > 0:
                self._advised[obj] = rng
                ranges.append(rng)
        if ranges:
            backend = self.ctx.backend
            backend.advise(ranges, Advice.SET_PREFERRED_LOCATION, HOST)
            backend.advise(ranges, Advice.SET_ACCESSED_BY, self.ctx.backend.device)
            out = [x for x in (whole_pages(*r) for r in ranges) if x is not None]
            if out:
                backend.prefetch(out, HOST)
                self._away.add_all(out)
            self.stats["host_mapped"] += len(ranges)

    # -- calls ----------------------------------------------------------------------

    def _host_map(self, obj: int) -> None:
        nbytes = self._nbytes.get(obj, 0)
        if nbytes > 0:
            rng = (self.ctx.layout.address(obj), nbytes)
            self._advised[obj] = rng
            self._advise_set.append(rng)

    def _spare(self, obj: int) -> None:
        """A newborn on a dead range not discarded yet takes it as it is, as umrt's runtime does."""
        ptr = self.ctx.layout.address(obj)
        end = ptr + self._nbytes.get(obj, 0)
        self._discards = without(self._discards, ptr, end)
        self._releases = [r for r in self._releases if r[0] + r[1] <= ptr or r[0] >= end]

    def _segment_made(self, ptr: int, nbytes: int) -> None:
        """The pool made a segment: its pages are populated as newborns land there."""
        self._away.add(ptr, nbytes)

    def _released(self, ptr: int, nbytes: int) -> None:
        """The pool handed a segment back: pending calls inside it are moot."""
        end = ptr + nbytes
        self._away.remove(ptr, nbytes)
        self._swapped.take(ptr, end)

        def outside(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
            return [r for r in ranges if not ptr <= r[0] < end]

        self._discards, self._releases = outside(self._discards), outside(self._releases)
        self._evicts, self._prefetches = outside(self._evicts), outside(self._prefetches)
        self._temp_advised, self._advise_unset = outside(self._temp_advised), outside(self._advise_unset)

    def _flush(self) -> None:
        backend = self.ctx.backend
        device = self.ctx.backend.device
        if self._discards:
            # umrt's plans drop dead ranges beside the kernels, as its runtime does (a newborn
            # there is populated first); the belady plan moves their pages out right after
            (backend.drop if self.schedule is not None else backend.discard)(self._discards)
            self.stats["discards"] += len(self._discards)
            self._away.add_all(self._discards)
        if self._advise_unset:
            backend.advise(self._advise_unset, Advice.UNSET_PREFERRED_LOCATION, HOST)
            backend.advise(self._advise_unset, Advice.UNSET_ACCESSED_BY, device)
        if self._advise_set:
            backend.advise(self._advise_set, Advice.SET_PREFERRED_LOCATION, HOST)
            backend.advise(self._advise_set, Advice.SET_ACCESSED_BY, device)
            self.stats["host_mapped"] += len(self._advise_set)
        if self._evicts or self._releases:
            backend.prefetch(self._releases + self._evicts, HOST)
            self.stats["evictions"] += len(self._evicts)
            self._away.add_all(self._releases + self._evicts)
        if self._prefetches:
            backend.prefetch(self._prefetches, device)
            self.stats["prefetches"] += len(self._prefetches)
            self._away.remove_all(self._prefetches)
        self._discards, self._releases, self._evicts, self._prefetches = [], [], [], []
        self._advise_set, self._advise_unset = [], []
        self._pending_objs = set()


def _runtime() -> Policy:
    """umrt's runtime with its defaults (the ``umrt-runtime`` candidate)."""
    return Runtime()


class SwappedOut:
    """Ranges a plan swapped out, as it handed them to ``swap.out`` (``ranges``: ptr -> bytes)."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}

    def take(self, start: int, end: int) -> list[tuple[int, int]]:
        """Forget the ranges inside ``[start, end)``; return them."""
        out = [(p, n) for p, n in self.ranges.items() if start <= p < end]
        for p, _ in out:
            del self.ranges[p]
        return out

    def restore(self, backend: Backend, away: RangeSet) -> None:
        """Copy every range back now and make the kernels wait for it (no plan will)."""
        if self.ranges:
            ranges = list(self.ranges.items())
            self.ranges.clear()
            backend.swap.back(ranges)
            backend.swap.wait(ranges)
            for r in ranges:
                away.remove(*r)
