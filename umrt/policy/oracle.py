"""The oracle: a policy that is handed the whole future.

It is the best-known reference, not a claim of optimality. From the trace's
steady-state iteration it plans, ahead of time and at object granularity:

* **Belady eviction, done early** — when an object must come in and the
  budget is full, the resident object needed farthest in the future leaves;
  its eviction is issued right after its last use, so the driver never has
  to evict on a fault;
* **prefetch as early as capacity allows** — each object a launch needs is
  prefetched at the earliest point (at most one iteration ahead) from which
  the planned resident bytes stay within the budget until that launch;
* **discard of dead data on Free** — a freed object's pages are dropped, not
  copied back. Nothing live is ever discarded;
* **access over the link where migrating cannot pay** — optimizer state (read
  and rewritten once per step, in one burst) and whatever a launch larger
  than the whole budget cannot hold are read and written in place in host
  memory (PreferredLocation=host + AccessedBy=GPU) instead of being faulted
  in and evicted again.

The plan never holds more resident bytes than the budget (less a headroom
for page rounding and objects sharing 2 MB blocks). A launch whose own
working set exceeds the budget uses what is resident in place and the rest
over the link, for that launch only.

The replay feeds the steady-state iteration again and again with fresh ids
for the objects born in it, so the plan is made over the *template*
iteration (the trace's last one) and followed by position: the N-th
Alloc/Free/Launch after an :class:`IterationBoundary` is the template's N-th.
Ids are mapped as events arrive (an Alloc names a newborn, a Launch's
accesses name what it touches); an object still alive at the end of an
iteration is the one its successor iteration frees. An iteration that does
not match the template (warm-up, a different step) is left to the driver.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from umrt.backends.base import HOST, Advice
from umrt.errors import ConfigError, UmrtError
from umrt.policy.base import Policy, PolicyContext
from umrt.trace.events import Alloc, Event, Free, IterationBoundary, Kind, Launch, Trace

__all__ = ["OraclePolicy", "OraclePlan", "Template", "plan_cyclic"]

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

    @classmethod
    def from_trace(cls, trace: Trace) -> Template:
        spans = trace.iteration_spans()
        if not spans:
            raise ConfigError("the oracle needs a trace with at least one complete iteration")
        sizes = {e.obj: e.nbytes for e in trace.events if isinstance(e, Alloc)}
        iterations = [_ops(trace.events[a + 1 : b]) for a, b in spans]
        ops = iterations[-1]
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
        return cls(ops, sizes, born, freed, pair, kinds)

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


class OraclePolicy(Policy):
    """Belady pre-eviction, earliest prefetch and discard, planned from the whole trace.

    Options: ``headroom`` (fraction of the budget kept free for page
    rounding and 2 MB blocks shared between objects, default 0.05),
    ``page_bytes`` (objects are counted in whole pages of this size,
    default 64 KB, the driver's big page), ``discard`` (drop freed objects'
    pages, default True), ``remote_access`` (keep data that only launches
    larger than the budget touch on the host, accessed over the link;
    default True).
    """

    name = "oracle"

    def __init__(self, trace: Trace | None = None, *, headroom: float = 0.05,
                 page_bytes: int = 64 << 10, discard: bool = True, remote_access: bool = True) -> None:
        if trace is None:
            raise ConfigError("the oracle plans from the whole future: pass the trace (make_policy('oracle', trace=...))")
        if not 0.0 <= headroom < 1.0:
            raise ConfigError(f"oracle headroom must be in [0, 1), got {headroom!r}")
        if page_bytes <= 0:
            raise ConfigError(f"oracle page_bytes must be positive, got {page_bytes!r}")
        self.template = Template.from_trace(trace)
        self.headroom = headroom
        self.page_bytes = page_bytes
        self.discard = discard
        self.remote_access = remote_access
        self._remote_persistent: set[int] = set()
        self._advised: dict[int, tuple[int, int]] = {}  # runtime obj -> range advised host-mapped
        self._advise_set: list[tuple[int, int]] = []  # pending advice calls
        self._advise_unset: list[tuple[int, int]] = []
        self._temp_advised: list[tuple[int, int]] = []  # advised for one launch; withdrawn after it
        self.plan: OraclePlan | None = None
        self._pos: int | None = None  # position in the template; None before the first boundary
        self._lost = False  # this iteration strayed from the template
        self._cur: dict[int, int] = {}  # template obj -> runtime obj, this iteration
        self._prev: dict[int, int] = {}  # same, previous iteration
        self._rpair = {y: x for x, y in self.template.pair.items()}
        self._nbytes: dict[int, int] = {}
        self._discards: list[tuple[int, int]] = []  # pending calls, issued by _flush
        self._evicts: list[tuple[int, int]] = []
        self._releases: list[tuple[int, int]] = []  # dead pages to hand back (see _act)
        self._prefetches: list[tuple[int, int]] = []
        self._pending_objs: set[int] = set()
        self.stats = {"prefetches": 0, "evictions": 0, "discards": 0, "host_mapped": 0, "matched_iterations": 0,
                      "unmatched_iterations": 0, "unresolved": 0}

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        capacity = int(ctx.budget_bytes * (1.0 - self.headroom))
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

    def on_event(self, event: Event) -> None:
        if isinstance(event, IterationBoundary):
            self._boundary()
            return
        if self._temp_advised:  # the launch that needed remote access has run
            self._advise_unset.extend(self._temp_advised)
            self._temp_advised = []
        if isinstance(event, Alloc):
            self._nbytes[event.obj] = event.nbytes
            if event.obj in self._remote_persistent:  # ids of long-lived objects never change
                self._host_map(event.obj)
        elif isinstance(event, Free):
            rng = self._advised.pop(event.obj, None)
            if rng is not None:
                self._advise_unset.append(rng)
        elif not isinstance(event, Launch):
            return
        if self._pos is None or self._lost:
            return
        p = self._pos
        self._pos += 1
        ops = self.template.ops
        if p >= len(ops) or not self._matches(ops[p], event):
            self._lost = True
            return
        self._learn(ops[p], event)
        self._act(p, event)

    def report(self) -> dict:
        out = dict(self.stats)
        if self.plan is not None:
            out.update(planned_peak_bytes=self.plan.peak_bytes, plan_capacity_bytes=self.plan.capacity,
                       unplanned_launches=self.plan.unplanned_launches)
        return out

    # -- following the template -------------------------------------------------

    def _boundary(self) -> None:
        self._flush()
        if self._pos is not None:
            done = self._pos == len(self.template.ops) and not self._lost
            self.stats["matched_iterations" if done else "unmatched_iterations"] += 1
        self._prev, self._cur = self._cur, {}
        self._pos, self._lost = 0, False

    @staticmethod
    def _matches(op: tuple, event: Event) -> bool:
        if op[0] == "L":
            return isinstance(event, Launch) and event.exec_id == op[1] and len(event.accesses) == len(op[2])
        if op[0] == "A":
            return isinstance(event, Alloc) and event.nbytes == op[2]
        return isinstance(event, Free)

    def _learn(self, op: tuple, event: Event) -> None:
        if op[0] == "A":
            self._cur[op[1]] = event.obj
            if op[1] in self.plan.remote and event.obj not in self._advised:
                self._host_map(event.obj)
        elif op[0] == "L":
            for obj, access in zip(op[2], event.accesses, strict=True):
                self._cur[obj] = access.obj

    def _resolve(self, uid: Uid) -> int | None:
        """The runtime id of a planned object in the current iteration (lap 1 of the plan)."""
        obj, lap = uid
        if lap is _PERSISTENT:
            return self._cur.get(obj, self._prev.get(obj, obj))
        if lap == 1:
            if obj in self._cur or obj in self.template.born:
                return self._cur.get(obj)
            return self._prev.get(obj, obj)  # carried in, no twin: assume its id is kept
        if lap == 0:  # born in the previous iteration, still alive
            if obj in self._prev:
                return self._prev[obj]
            carried = self._rpair.get(obj)  # first iteration followed: learn from the carried twin
            return self._cur.get(carried, carried) if carried is not None else None
        return None

    def _resolve_into(self, uids: list[Uid], out: list[tuple[int, int]]) -> None:
        for uid in uids:
            obj = self._resolve(uid)
            if obj is None:
                self.stats["unresolved"] += 1
                continue
            try:
                ptr = self.ctx.layout.address(obj)
            except (UmrtError, KeyError):
                self.stats["unresolved"] += 1
                continue
            nbytes = self._nbytes.get(obj, self.template.sizes.get(uid[0], 0))
            if nbytes > 0:
                out.append((ptr, nbytes))
                self._pending_objs.add(obj)

    def _act(self, p: int, event: Event) -> None:
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
            ranges = [r for r in ranges if r not in self._advised.values()]
            self._advise_set.extend(ranges)
            self._temp_advised.extend(ranges)
        if isinstance(event, Launch):
            self._flush()

    def _host_map(self, obj: int) -> None:
        nbytes = self._nbytes.get(obj, 0)
        if nbytes > 0:
            rng = (self.ctx.layout.address(obj), nbytes)
            self._advised[obj] = rng
            self._advise_set.append(rng)

    def _flush(self) -> None:
        backend = self.ctx.backend
        device = getattr(backend, "device", 0)
        if self._discards:
            backend.discard(self._discards)
            self.stats["discards"] += len(self._discards)
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
        if self._prefetches:
            backend.prefetch(self._prefetches, getattr(backend, "device", 0))
            self.stats["prefetches"] += len(self._prefetches)
        self._discards, self._releases, self._evicts, self._prefetches = [], [], [], []
        self._advise_set, self._advise_unset = [], []
        self._pending_objs = set()
