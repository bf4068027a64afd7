"""Sentinel (Ren, Luo, Wu, Zhang, Jeon, HPCA 2021): object-level migration
driven by one profiled training step, as a policy over managed memory.

* **Profiling** — the first complete iteration is observed at object (tensor)
  granularity: which tensors each launch touches, how often, and where the
  layer boundaries (LayerEnter/LayerExit events) fall. Tensors are named by
  allocation order within the iteration, so the profile applies to every
  later iteration.
* **Allocation** — short-lived tensors (the recorder's temporaries) are
  placed in their own segments, a reserved region prefetched to the GPU and
  never migrated; long-lived tensors never share a 2 MB block with them.
* **Migration intervals counted in layers** — at the start of each interval
  the tensors the *next* interval needs are prefetched, highest access count
  first, within the memory left; a long-lived tensor is evicted as soon as
  nothing else in the current interval uses it (and the next interval does
  not need it). The interval length comes from a small performance model
  (compute of an interval vs. migration for the next, with a memory
  constraint) unless the ``interval`` option fixes it.
"""
from __future__ import annotations

import bisect

from umrt.backends.base import HOST
from umrt.errors import ConfigError
from umrt.memory.base import Layout
from umrt.memory.caching import CachingAllocatorLayout
from umrt.policy.peers._common import IterationProfile, ProfilingPolicy, object_ranges
from umrt.trace.events import Alloc, IterationBoundary, Kind, Launch, LayerEnter

__all__ = ["SentinelPolicy", "SentinelLayout"]

INTERVAL_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_INTERVAL = 8  # the paper's best on ResNet-32, used when no hardware model is known
RESERVE_MAX_SHARE = 0.25  # largest share of the budget the pinned short-lived region may take
PLAN_HEADROOM = 0.9  # of the memory left, for 2 MB-block sharing and allocator rounding


def is_short_lived(kind: Kind) -> bool:
    """Before any profile exists: the recorder's temporaries."""
    return kind == Kind.TEMPORARY


class SentinelLayout(Layout):
    """Short-lived and long-lived objects in separate caching-allocator pools,
    so they never share a 2 MB block (Sentinel's re-organised allocation).
    ``classify(obj, nbytes, kind)`` says whether an object is short-lived."""

    def __init__(self, backend, classify=None) -> None:
        self.short = CachingAllocatorLayout(backend)
        self.long = CachingAllocatorLayout(backend)
        self._classify = classify or (lambda obj, nbytes, kind: is_short_lived(kind))
        self._where: dict[int, CachingAllocatorLayout] = {}
        self._seen_short = 0

    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        layout = self.short if self._classify(obj, nbytes, kind) else self.long
        self._where[obj] = layout
        return layout.alloc(obj, nbytes, kind)

    def free(self, obj: int) -> None:
        self._where.pop(obj).free(obj)

    def address(self, obj: int) -> int:
        return self._where[obj].address(obj)

    def footprint(self) -> int:
        return self.short.footprint() + self.long.footprint()

    def short_segments(self) -> list[tuple[int, int]]:
        return self.short.segments()

    def new_short_segments(self) -> list[tuple[int, int]]:
        """Segments of the short-lived region obtained since the last call."""
        segs = self.short.segments()
        new, self._seen_short = segs[self._seen_short:], len(segs)
        return new


class SentinelPolicy(ProfilingPolicy):
    """Options: ``interval`` (layers per migration interval; default from the
    performance model), ``reserve`` (keep the short-lived region resident;
    default on)."""

    name = "sentinel"

    def __init__(self, trace=None, *, interval: int | None = None, reserve: bool = True) -> None:
        if interval is not None and int(interval) < 1:
            raise ConfigError(f"sentinel: interval must be >= 1 layer, got {interval}")
        self.fixed_interval = None if interval is None else int(interval)
        self.reserve = bool(reserve)
        super().__init__()
        self.interval: int | None = None
        self._short_keys: set | None = None  # short-lived objects, once profiled
        self._pin = self.reserve  # keep the short-lived region resident
        self._reserve_bytes = 0
        self._launch = 0  # launch ordinal within the current iteration
        # Per launch ordinal: keys to prefetch (ordered) and keys to evict, before that launch.
        self._prefetch_at: dict[int, list[tuple]] = {}
        self._evict_at: dict[int, list[tuple]] = {}
        self.counters = {"prefetched_bytes": 0, "evicted_bytes": 0, "intervals": 0, "plans": 0}

    def make_layout(self, backend) -> Layout:
        return SentinelLayout(backend, self._classify)

    def _classify(self, obj: int, nbytes: int, kind: Kind) -> bool:
        if self._short_keys is None:
            return is_short_lived(kind)
        return self.keys.peek(obj, nbytes) in self._short_keys

    # -- events -----------------------------------------------------------------

    def on_event(self, event) -> None:
        self.keys.observe(event)
        self.profiler.observe(event)
        if isinstance(event, Launch):
            if self._plan_sig is not None:
                self._act(self._launch)
            self._launch += 1
        elif isinstance(event, Alloc):
            layout = self.ctx.layout
            if self._pin and isinstance(layout, SentinelLayout):
                segs = layout.new_short_segments()
                if segs:
                    self.ctx.backend.prefetch(segs, self.ctx.backend.device)
        elif isinstance(event, IterationBoundary):
            self.next_iteration()
            self._launch = 0
        self.keys.forget(event)

    # -- acting -----------------------------------------------------------------

    def _act(self, n: int) -> None:
        evict = self._evict_at.get(n)
        if evict:
            ranges = object_ranges(self.keys.ranges(evict, self.ctx.layout.address))
            if ranges:
                self.ctx.backend.prefetch(ranges, HOST)
                self.counters["evicted_bytes"] += sum(r[1] for r in ranges)
        fetch = self._prefetch_at.get(n)
        if fetch is not None:
            self.counters["intervals"] += 1
            ranges = self.keys.ranges(fetch, self.ctx.layout.address)  # priority order: highest access count first
            if ranges:
                self.ctx.backend.prefetch(ranges, self.ctx.backend.device)
                self.counters["prefetched_bytes"] += sum(r[1] for r in ranges)

    # -- planning ---------------------------------------------------------------

    def _layer_starts(self, p: IterationProfile) -> list[int]:
        """Launch ordinals where a layer starts (each LayerEnter); every launch
        is a layer when the trace has no layer events."""
        starts = sorted({m for m, e in zip(p.layer_marks, p.layer_events, strict=False)
                         if isinstance(e, LayerEnter) and m < p.n_launches})
        if not starts:
            return list(range(p.n_launches))
        if starts[0] != 0:
            starts.insert(0, 0)
        return starts

    def _intervals(self, starts: list[int], n: int, length: int) -> list[tuple[int, int]]:
        bounds = starts[::length] + [n]
        return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def _needs(self, p: IterationProfile, spans) -> list[dict[tuple, int]]:
        """Per interval: long-lived key -> access count."""
        long = {k for k in p.objects if k not in self._short_keys}
        needs = []
        for a, b in spans:
            d: dict[tuple, int] = {}
            for i in range(a, b):
                for k in p.launch_keys[i]:
                    if k in long:
                        d[k] = d.get(k, 0) + 1
            needs.append(d)
        return needs

    def _model_cost(self, p: IterationProfile, spans, needs, avail: int) -> float:
        """Sentinel's performance model: an interval takes the longer of its
        compute, the migration of the next interval's new tensors (H2D) and
        the eviction of its own finished ones (D2H, concurrent); what does not
        fit in the memory left is paid as demand migration."""
        prof = self.ctx.profile
        rate = prof.transfer_rate(2 << 20)
        rate_out = prof.transfer_rate(2 << 20, "d2h")
        objs = p.objects
        total = 0.0
        for j, (a, b) in enumerate(spans):
            compute = sum(prof.compute_time(p.launch_flops[i], p.launch_bytes[i], p.launch_precision[i])
                          for i in range(a, b))
            cur, nxt = needs[j], needs[(j + 1) % len(spans)]
            size = lambda ks: sum(objs[k].nbytes for k in ks)  # noqa: E731
            new = size(k for k in nxt if k not in cur)
            # Evicted after their last use here: long-lived tensors still alive afterwards.
            out = size(k for k in cur if k not in nxt and not (0 <= objs[k].free_at <= b))
            over = max(0, size(set(nxt) | set(cur)) - avail)
            total += max(compute, new / rate, out / rate_out) + over / rate + (over > 0) * prof.fault_batch_latency_s
        return total

    def _short_lived(self, p: IterationProfile) -> set:
        """Objects born and dead within one layer (no layer boundary in their lifetime)."""
        marks = sorted(set(p.layer_marks))
        short = set()
        for k, o in p.objects.items():
            if o.alloc_at >= 0 and o.free_at >= 0:
                i = bisect.bisect_right(marks, o.alloc_at)
                if i == len(marks) or marks[i] >= o.free_at:
                    short.add(k)
        return short

    def _plan(self, p: IterationProfile) -> None:
        self.counters["plans"] += 1
        self._prefetch_at, self._evict_at = {}, {}
        if p.n_launches == 0:
            return
        self._short_keys = short = self._short_lived(p)
        # The reserve holds the short-lived objects alive at once (their peak).
        deltas = sorted([(p.objects[k].alloc_at, p.objects[k].nbytes) for k in short]
                        + [(p.objects[k].free_at, -p.objects[k].nbytes) for k in short])
        live = peak = 0
        for _, d in deltas:
            live += d
            peak = max(peak, live)
        layout = self.ctx.layout
        if isinstance(layout, SentinelLayout):  # the region is what the short pool holds
            peak = max(peak, layout.short.footprint())
        self._reserve_bytes = peak
        # A reserve that would crowd out the long-lived working set is not kept pinned.
        self._pin = self.reserve and peak <= RESERVE_MAX_SHARE * self.ctx.budget_bytes
        starts = self._layer_starts(p)
        avail = int(PLAN_HEADROOM * max(0, self.ctx.budget_bytes - (peak if self._pin else 0)))
        if self.fixed_interval is not None:
            length = self.fixed_interval
        elif self.ctx.profile is None:
            length = DEFAULT_INTERVAL
        else:
            costs = {}
            for cand in INTERVAL_CANDIDATES:
                if cand > len(starts) and costs:
                    break
                spans = self._intervals(starts, p.n_launches, cand)
                costs[cand] = self._model_cost(p, spans, self._needs(p, spans), avail)
            length = min(costs, key=costs.get)
        self.interval = length
        spans = self._intervals(starts, p.n_launches, length)
        needs = self._needs(p, spans)
        for j, (a, b) in enumerate(spans):
            cur, nxt = needs[j], needs[(j + 1) % len(spans)]
            # At the start of interval j: what j still lacks, then what j+1 needs,
            # highest access count first, within the memory left.
            order = sorted(cur, key=cur.get, reverse=True)
            order += sorted((k for k in nxt if k not in cur), key=nxt.get, reverse=True)
            fetch, used = [], 0
            for k in order:
                o = p.objects[k]
                if used + o.nbytes > avail:
                    continue
                used += o.nbytes
                fetch.append(k)
            self._prefetch_at[a] = fetch
            # Evict a long-lived tensor right after its last use in j, unless j+1 needs it.
            last: dict[tuple, int] = {}
            for i in range(a, b):
                for k in p.launch_keys[i]:
                    if k in cur:
                        last[k] = i
            for k, i in last.items():
                o = p.objects[k]
                dies = o.free_at >= 0 and o.uses[-1] == i  # dead after this use: nothing to save
                if k not in nxt and not dies and i + 1 < p.n_launches:
                    self._evict_at.setdefault(i + 1, []).append(k)

    def report(self) -> dict:
        return dict(self.counters, interval_layers=self.interval, reserve_bytes=self._reserve_bytes,
                    reserve_pinned=self._pin)
