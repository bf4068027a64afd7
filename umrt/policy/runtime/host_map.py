"""Advice the runtime holds on live objects: host-mapped and ReadMostly ranges."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from umrt.backends.base import HOST, Advice, Backend
from umrt.backends.ranges import RangeSet
from umrt.hardware import HardwareProfile
from umrt.policy.runtime.planner import min_host_map_bytes
from umrt.policy.runtime.ranges import NO_ALLOC, whole_pages
from umrt.predict.tables import ObjectKeys
from umrt.trace.events import Alloc


class HostMapper:
    """Keeps objects on the host, read over the link (PreferredLocation=host +
    AccessedBy=GPU), and advises parameters ReadMostly; undoes the advice when an
    object dies or the launch it was made for has run.

    The runtime's hot path reads :attr:`mapped`, :attr:`read_mostly_objects` and
    :attr:`launch_mapped` directly: they are never rebound, only changed in place.
    """

    def __init__(self, keys: ObjectKeys, alloc_of: dict[int, Alloc], off_gpu: RangeSet,
                 counters: dict[str, int]) -> None:
        self.keys, self.alloc_of, self.off_gpu, self.counters = keys, alloc_of, off_gpu, counters
        self.mapped: dict[int, tuple[int, int]] = {}  # host-mapped obj -> its range
        self.read_mostly_objects: set[int] = set()  # objects advised ReadMostly
        self.launch_mapped: list[tuple[int, int]] = []  # ranges host-mapped for the launch that just ran
        self.backend: Backend | None = None
        self.address: Callable[[int], int] | None = None
        self.profile: HardwareProfile | None = None

    def connect(self, backend: Backend, address: Callable[[int], int], profile: HardwareProfile | None) -> None:
        """Advise through ``backend``; ``address`` places a live object."""
        self.backend, self.address, self.profile = backend, address, profile

    def live_ranges(self, keys: Iterable[int], skip) -> list[tuple[int, tuple[int, int]]]:
        """``(obj, (ptr, nbytes))`` for each key's live, non-empty object not
        in ``skip``, in key order."""
        return [(obj, r) for _, obj, r in self._live(keys, skip)]

    def _live(self, keys: Iterable[int], skip) -> list[tuple[int, int, tuple[int, int]]]:
        """``(key, obj, (ptr, nbytes))``: :meth:`live_ranges` with each key."""
        out = []
        obj_of, alloc_of, address = self.keys.obj_of, self.alloc_of, self.address
        for k in keys:
            obj = obj_of.get(k)
            if obj is None or obj in skip:  # checked first: most are skipped every iteration
                continue
            n = alloc_of.get(obj, NO_ALLOC).nbytes
            if n > 0:
                out.append((k, obj, (address(obj), n)))
        return out

    def advise_read_mostly(self, keys: Iterable[int]) -> None:
        """Parameters are only read between two optimizer steps: with
        ReadMostly the GPU holds a duplicate, and evicting it costs no copy
        back (the step's write collapses the duplicates; the next read makes
        them again)."""
        ranges = []
        for obj, r in self.live_ranges(keys, self.read_mostly_objects):
            self.read_mostly_objects.add(obj)
            ranges.append(r)
        if ranges:
            self.backend.advise(ranges, Advice.SET_READ_MOSTLY, self.backend.device)

    def unset_read_mostly(self, obj: int) -> None:
        """An object advised ReadMostly dies: its range must not pass the advice on."""
        self.read_mostly_objects.discard(obj)
        self.backend.advise([(self.address(obj), self.alloc_of.get(obj, NO_ALLOC).nbytes)],
                            Advice.UNSET_READ_MOSTLY, self.backend.device)

    def map(self, keys: Iterable[int]) -> None:
        """Keep these long-lived objects on the host, read over the link
        (PreferredLocation=host + AccessedBy=GPU), and move them out now."""
        ranges = []
        for obj, r in self.live_ranges(keys, self.mapped):
            self.mapped[obj] = r
            ranges.append(r)
        if not ranges:
            return
        be = self.backend
        be.advise(ranges, Advice.SET_PREFERRED_LOCATION, HOST)
        be.advise(ranges, Advice.SET_ACCESSED_BY, be.device)
        out = [r for r in (whole_pages(p, n) for p, n in ranges) if r is not None]
        if out:
            be.prefetch(out, HOST)
            for p, n in out:
                self.off_gpu.add(p, n)
        self.counters["host_mapped_bytes"] += sum(n for _, n in ranges)

    def unmap(self, obj: int) -> None:
        """A host-mapped object dies: its range must not pass the advice on."""
        r = self.mapped.pop(obj)
        self.backend.advise([r], Advice.UNSET_ACCESSED_BY, self.backend.device)
        self.backend.advise([r], Advice.UNSET_PREFERRED_LOCATION, HOST)

    def map_for_launch(self, keys: Iterable[int], fresh: frozenset[int] = frozenset(),
                       heads: dict[int, int] | None = None) -> None:
        """A launch larger than the budget is about to run: what of it is not
        resident is read and written over the link (PreferredLocation=host +
        AccessedBy=GPU) instead of being faulted in and evicted again within
        the launch. Undone before the next launch (:meth:`unmap_launch`). Only
        ranges large enough to pay for their four cudaMemAdvise calls (112 us
        each on the H100; see :func:`~umrt.policy.runtime.planner.min_host_map_bytes`):
        the rest faults in as it would anyway.

        ``fresh``: keys the launch is the first to touch (``Plan.remote_fresh``). A
        newborn may sit on GPU pages (populated at its birth, or a range reused in
        place), where advice alone leaves it: the launch would then write it there
        and evict its own inputs to make room. Its contents are dead, so its whole
        pages go to the host without a copy first (a discard and prefetch).

        ``heads``: fresh keys whose first bytes fit the room the GPU has
        (``Plan.remote_head``): those are populated on the GPU instead, and only the
        rest of the object is written over the link."""
        least = min_host_map_bytes(self.profile)
        heads = heads or {}
        live, on_gpu = [], []
        for k, _, (p, n) in self._live(keys, self.mapped):
            head = heads.get(k, 0) if k in fresh else 0
            if 0 < head < n:
                on_gpu.append((p, head))
                p, n = p + head, n - head
            if n >= least:
                live.append((k, (p, n)))
        ranges = [r for _, r in live]
        be = self.backend
        dead = [w for w in (whole_pages(p, n) for k, (p, n) in live if k in fresh) if w is not None]
        if dead:
            be.discard_and_prefetch(dead, HOST)
            self.off_gpu.add_all(dead)
        if on_gpu:  # (populated whether or not the rest is worth mapping, as the oracle does)
            be.prefetch(on_gpu, be.device)
            self.off_gpu.remove_all(on_gpu)
        if ranges:
            be.advise(ranges, Advice.SET_PREFERRED_LOCATION, HOST)
            be.advise(ranges, Advice.SET_ACCESSED_BY, be.device)
            self.launch_mapped[:] = ranges
            self.counters["launch_host_mapped_bytes"] += sum(n for _, n in ranges)

    def unmap_launch(self) -> None:
        """Undo :meth:`map_for_launch` (its launch has been queued)."""
        ranges = list(self.launch_mapped)
        self.launch_mapped.clear()
        be = self.backend
        be.advise(ranges, Advice.UNSET_ACCESSED_BY, be.device)
        be.advise(ranges, Advice.UNSET_PREFERRED_LOCATION, HOST)

    def released(self, ptr: int, end: int) -> None:
        """The segment ``[ptr, end)`` was handed back: advice held for the launch
        that just ran must not be undone on freed memory."""
        if self.launch_mapped:
            self.launch_mapped[:] = [r for r in self.launch_mapped if not ptr <= r[0] < end]
