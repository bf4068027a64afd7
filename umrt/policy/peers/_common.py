"""Helpers the peer policies share: 2 MB block arithmetic, range lists,
per-block liveness, and stable object keys across iterations.

Everything here is what a real runtime can observe: the addresses its own
allocator handed out, the events the program issued, and (for driver-level
systems such as DeepUM) the faults the GPU raised.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from umrt.backends.base import BLOCK, Range
from umrt.errors import UmrtError
from umrt.policy.base import Policy
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit


def block_of(addr: int) -> int:
    """The 2 MB block holding ``addr``."""
    return addr - addr % BLOCK


def blocks_of(ptr: int, nbytes: int) -> range:
    """The 2 MB blocks a byte range ``[ptr, ptr + nbytes)`` overlaps."""
    if nbytes <= 0:
        return range(block_of(ptr), block_of(ptr))
    return range(block_of(ptr), block_of(ptr + nbytes - 1) + BLOCK, BLOCK)


def block_ranges(blocks: Iterable[int]) -> list[Range]:
    """Whole 2 MB blocks as ranges, one per block: neighbouring blocks may
    belong to different managed allocations, and a range must not span two."""
    return [(b, BLOCK) for b in sorted(set(blocks))]


def object_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Object ranges for one call, sorted, duplicates and empty ones dropped
    (never merged: neighbours may sit in different managed allocations)."""
    return sorted({r for r in ranges if r[1] > 0})


class BlockLiveness:
    """How many live objects overlap each 2 MB block.

    A block whose count drops to zero holds only dead bytes: its contents may
    be discarded instead of copied back to the host (DeepUM's invalidation).
    """

    def __init__(self) -> None:
        self._live: dict[int, int] = {}
        self._ranges: dict[int, Range] = {}

    def alloc(self, obj: int, ptr: int, nbytes: int) -> None:
        self._ranges[obj] = (ptr, nbytes)
        for b in blocks_of(ptr, max(nbytes, 1)):
            self._live[b] = self._live.get(b, 0) + 1

    def free(self, obj: int) -> list[int]:
        """Forget ``obj``; return the blocks that became entirely dead."""
        rng = self._ranges.pop(obj, None)
        if rng is None:
            return []
        dead = []
        for b in blocks_of(rng[0], max(rng[1], 1)):
            n = self._live.get(b, 0) - 1
            if n <= 0:
                self._live.pop(b, None)
                dead.append(b)
            else:
                self._live[b] = n
        return dead

    def is_live(self, block: int) -> bool:
        return block in self._live


class AllocationOrderKeys:
    """Names objects so the same tensor gets the same key in every iteration.

    Object ids are not stable across iterations (a replay remaps them, a live
    run hands out fresh ones), so, as Sentinel and Capuchin do, an object is
    named by *when* it was allocated: objects created before the first
    iteration boundary keep ``("setup", id)``; the others are
    ``(ordinal, nbytes)`` with ``ordinal`` the allocation's position within
    its iteration. A key stays with its object until the object is freed.

    Not :class:`umrt.predict.tables.ObjectKeys` (umrt's own): that one re-keys
    an object surviving an iteration by the iteration's signature, which the
    papers' systems do not; the peers' profiles are keyed as above.
    """

    def __init__(self) -> None:
        self.iterations_seen = 0  # iteration boundaries seen so far
        self._ordinal = 0
        self._key: dict[int, tuple] = {}
        self._obj: dict[tuple, int] = {}  # live key -> object id
        self.info: dict[int, tuple[int, Kind]] = {}  # live object -> (nbytes, kind)

    def observe(self, event) -> None:
        """Feed every event before looking anything up; call :meth:`forget` after a Free."""
        if isinstance(event, IterationBoundary):
            self.iterations_seen += 1
            self._ordinal = 0
        elif isinstance(event, Alloc):
            if self.iterations_seen == 0:
                key = ("setup", event.obj)
            else:
                key = (self._ordinal, event.nbytes)
                self._ordinal += 1
            self._key[event.obj] = key
            self._obj[key] = event.obj
            self.info[event.obj] = (event.nbytes, event.kind)

    def key(self, obj: int) -> tuple:
        return self._key.get(obj, ("unknown", obj))

    def peek(self, obj: int, nbytes: int) -> tuple:
        """The key the next Alloc (of ``obj``, ``nbytes``) will get."""
        return ("setup", obj) if self.iterations_seen == 0 else (self._ordinal, nbytes)

    def obj(self, key: tuple) -> int | None:
        """The live object holding ``key`` now, if any."""
        return self._obj.get(key)

    def ranges(self, keys: Iterable[tuple], address) -> list[Range]:
        """``(address(obj), nbytes)`` of the live, non-empty objects holding
        ``keys``, in the order of ``keys``."""
        out = []
        for k in keys:
            obj = self._obj.get(k)
            if obj is not None:
                n = self.info[obj][0]
                if n > 0:
                    out.append((address(obj), n))
        return out

    def forget(self, event) -> None:
        if isinstance(event, Free):
            key = self._key.pop(event.obj, None)
            if key is not None and self._obj.get(key) == event.obj:
                del self._obj[key]
            self.info.pop(event.obj, None)


@dataclass
class ObjectProfile:
    """What one iteration did with one object."""

    nbytes: int
    kind: Kind
    alloc_at: int  # launch ordinal at which it was allocated (-1: before the iteration)
    free_at: int  # launch ordinal at which it was freed (-1: outlives the iteration)
    uses: list[int] = field(default_factory=list)  # launch ordinals that accessed it
    counts: int = 0  # accesses (Sentinel's access count)


@dataclass
class IterationProfile:
    """One iteration, as a profiling runtime sees it, in stable keys.

    ``launch_keys[i]`` are the keys launch ``i`` accessed; ``layer_marks`` the
    launch ordinal at each LayerEnter/LayerExit (the layer boundary sits just
    before that launch), with ``layer_events`` the events themselves;
    ``backward_from`` the ordinal of the first launch after the first
    backward LayerEnter (``len(launch_keys)`` if none).
    """

    launch_keys: list[tuple] = field(default_factory=list)
    launch_flops: list[int] = field(default_factory=list)
    launch_bytes: list[int] = field(default_factory=list)
    launch_precision: list[str] = field(default_factory=list)
    objects: dict[tuple, ObjectProfile] = field(default_factory=dict)
    layer_marks: list[int] = field(default_factory=list)
    layer_events: list = field(default_factory=list)
    backward_from: int = -1

    @property
    def n_launches(self) -> int:
        return len(self.launch_keys)

    def signature(self) -> int:
        """Equal for iterations that allocate and launch alike (a plan made from
        one applies to the other)."""
        return hash((tuple(self.launch_keys), len(self.layer_marks)))


class IterationProfiler:
    """Records iteration number ``target`` (1 = the first complete one) into an
    :class:`IterationProfile`; ``done`` once the iteration has ended."""

    @classmethod
    def next(cls, keys: AllocationOrderKeys) -> IterationProfiler:
        """A profiler for the iteration that starts now (after its boundary was observed)."""
        return cls(keys, target=keys.iterations_seen)

    def __init__(self, keys: AllocationOrderKeys, target: int = 1) -> None:
        self.keys = keys
        self.target = target
        self.profile = IterationProfile()
        self.done = False

    @property
    def active(self) -> bool:
        return not self.done and self.keys.iterations_seen == self.target

    def observe(self, event) -> None:
        """Call after ``keys.observe(event)`` and before ``keys.forget(event)``."""
        if self.done:
            return
        if isinstance(event, IterationBoundary) and self.keys.iterations_seen > self.target:
            self.done = True
            p = self.profile
            if p.backward_from < 0:
                p.backward_from = p.n_launches
            return
        if not self.active:
            return
        p = self.profile
        n = p.n_launches
        if isinstance(event, Launch):
            ks = []
            for a in event.accesses:
                k = self.keys.key(a.obj)
                o = p.objects.get(k)
                if o is None:
                    nbytes, kind = self.keys.info.get(a.obj, (a.offset + a.length, Kind.OTHER))
                    o = p.objects[k] = ObjectProfile(nbytes, kind, -1, -1)
                if not o.uses or o.uses[-1] != n:
                    o.uses.append(n)
                    ks.append(k)
                o.counts += 1
            p.launch_keys.append(tuple(ks))
            p.launch_flops.append(event.flops)
            p.launch_bytes.append(event.bytes)
            p.launch_precision.append(event.precision)
        elif isinstance(event, Alloc):
            k = self.keys.key(event.obj)
            o = p.objects.get(k)
            if o is None:
                p.objects[k] = ObjectProfile(event.nbytes, event.kind, n, -1)
            else:
                # Born at the end of the iteration for the next one (an input batch):
                # the same key that was freed earlier, so it is live across the boundary.
                o.free_at = -1
        elif isinstance(event, Free):
            o = p.objects.get(self.keys.key(event.obj))
            if o is not None:
                o.free_at = n
        elif isinstance(event, (LayerEnter, LayerExit)):
            p.layer_marks.append(n)
            p.layer_events.append(event)
            if event.phase == "backward" and p.backward_from < 0:
                p.backward_from = n


class ProfilingPolicy(Policy):
    """A peer that plans from one profiled iteration (Sentinel, vDNN): ``keys``
    and ``profiler`` see every event, and :meth:`next_iteration`, called at
    each iteration boundary, re-plans (:meth:`_plan`) whenever the iteration
    just profiled differed from the one the plan came from (the first step
    creates optimizer state; later ones repeat)."""

    def __init__(self) -> None:
        self.keys = AllocationOrderKeys()
        self.profiler = IterationProfiler(self.keys, target=1)
        self._plan_sig: int | None = None

    def _plan(self, profile: IterationProfile) -> None:
        raise NotImplementedError

    def next_iteration(self) -> None:
        if self.profiler.done:
            sig = self.profiler.profile.signature()
            if sig != self._plan_sig:
                self._plan(self.profiler.profile)
                self._plan_sig = sig
        self.profiler = IterationProfiler.next(self.keys)


def profile_trace(trace, iteration: int = -1) -> tuple[IterationProfile, AllocationOrderKeys]:
    """Profile one complete iteration of a trace (default: the last one)."""
    n = len(trace.iteration_spans())
    if n == 0:
        raise UmrtError("the trace holds no complete iteration")
    target = (iteration % n) + 1
    keys = AllocationOrderKeys()
    prof = IterationProfiler(keys, target)
    for ev in trace.events:
        keys.observe(ev)
        prof.observe(ev)
        keys.forget(ev)
        if prof.done:
            break
    return prof.profile, keys


def next_use(uses: list[int], after: int) -> int | None:
    """The first use at an ordinal ``> after``, if any."""
    i = bisect.bisect_right(uses, after)
    return uses[i] if i < len(uses) else None
