"""The ``cuda`` backend's swap path: copies to pinned slots and back, their streams and events.

:class:`CudaSwapPath` is :attr:`umrt.backends.cuda.CudaBackend.swap` (and does its
``drop``). On CUDA 13 with concurrent managed access it copies each range to a pinned
slot and back, with umrt's SM copy kernel (:mod:`umrt.backends.sm_copy`;
``UMRT_SWAP_COPY=engines``: ``cudaMemcpyAsync`` on the copy engines); elsewhere (CUDA 12
has no discard) it migrates, as the default
:class:`~umrt.backends.base.SwapPath`. :class:`SwapStreams` keeps its streams and
what is in flight on them. Each kind of work has a non-blocking stream of its
own, so none waits behind another's queue (a stream runs its work in order, and
a discard queued after a copy waits for it):

* ``out``: the copies to pinned memory (SM copies: a stream of the greatest priority),
  each after the kernels queued before it
  (an event on the compute stream: the range's last writer) and after the copy
  back that last read its slot;
* ``discard``: the swap path's discards, each after its copy out (an event);
* ``populate``: the populations before a copy back, each after its range's discard;
* ``in``: the copies back, each after its population; its event is what the
  compute stream waits for before the range's first reader (``swap.wait``, or
  ``launch`` of a kernel that touches it);
* ``drop``: dead ranges discarded beside the kernels, after those queued so far;
  a population of such a range (a newborn landing there) waits for it.

Per range it keeps the slot and the event each later step waits for
(:class:`Swapped`); ranges are the whole pages the runtime resolves, the same
range out and back in.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from umrt.backends.base import HOST, Range, SwapPath
from umrt.backends.cuda_order import CountedCalls, overlaps
from umrt.backends.ranges import RangeSet
from umrt.backends.staging import Slot, StagingPool, host_available_bytes
from umrt.errors import CudaError

__all__ = ["CudaSwapPath", "SwapStreams", "Swapped", "whole_pages"]

PAGE_ALIGN = 64 << 10  # discards and swaps move whole 64 KiB pages: a partial page may hold a neighbour


def whole_pages(ptr: int, nbytes: int) -> Range | None:
    """The whole 64 KiB pages inside ``[ptr, ptr + nbytes)``, or None."""
    start = -(-ptr // PAGE_ALIGN) * PAGE_ALIGN
    end = (ptr + nbytes) // PAGE_ALIGN * PAGE_ALIGN
    return (start, end - start) if end > start else None


def away_over(away: dict[int, tuple[int, Any]], ptr: int, nbytes: int) -> list[int]:
    """The starts of the ranges ``away`` (start -> (bytes, ...)) that overlap ``[ptr, ptr + nbytes)``,
    in order, one that starts before it too: the runtime swaps coalesced ranges out, and may move
    one object of such a range alone."""
    return sorted(p for p, (m, _) in away.items() if p < ptr + nbytes and p + m > ptr)


@dataclass
class Swapped:
    """One range off the GPU: its slot, and the event of its discard (the copy out before it)."""

    slot: Slot
    discarded: Any


@dataclass
class SwapStreams:
    """The swap path's streams and what is in flight on them (see the module docstring)."""

    api: Any
    call: CountedCalls
    streams: dict[str, Any] = field(default_factory=dict)  # kind -> stream, made on first use
    away: dict[int, tuple[int, Swapped]] = field(default_factory=dict)  # ptr -> (bytes, its slot and discard)
    coming: dict[int, tuple[int, Any]] = field(default_factory=dict)  # ptr -> (bytes, its copy back's event)
    drops: list[tuple[list[Range], Any]] = field(default_factory=list)  # dead ranges and their discard's event
    spare: list[Any] = field(default_factory=list)
    held: dict[int, list] = field(default_factory=dict)  # event handle -> [event, references]

    def stream(self, kind: str, urgent: bool = False) -> Any:
        """The stream for ``kind`` of work (created non-blocking on first use; ``urgent``: at the
        device's greatest priority, for SM copies, whose blocks the scheduler then prefers)."""
        s = self.streams.get(kind)
        if s is None:
            if urgent:
                s = self.call("cudaStreamCreateWithPriority", self.api.create_urgent_stream)
            else:
                s = self.call("cudaStreamCreateWithFlags", self.api.create_stream, False)
            self.streams[kind] = s
        return s

    def event(self) -> Any:
        """A fresh event, or one no longer waited on."""
        if self.spare:
            return self.spare.pop()
        return self.call("cudaEventCreateWithFlags", self.api.create_event)

    def hold(self, event: Any, times: int = 1) -> Any:
        """``event`` is waited on later by ``times`` more things: it is not reused before."""
        entry = self.held.setdefault(int(event), [event, 0])
        entry[1] += times
        return event

    def let_go(self, event: Any) -> None:
        """One thing that would wait on ``event`` no longer will: reuse it when none does."""
        entry = self.held.get(int(event))
        if entry is None:
            self.spare.append(event)
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.held[int(event)]
            self.spare.append(event)

    def mark(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (its work so far)."""
        ev = self.event()
        self.call("cudaEventRecord", self.api.record_event, ev, stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        self.call("cudaStreamWaitEvent", self.api.stream_wait_event, stream, event)

    def coming_over(self, ranges: Sequence[Range]) -> list[int]:
        """Ranges copied back whose copy a kernel on ``ranges`` must wait for: their starts."""
        if not self.coming:
            return []
        return [p for p, (n, _) in self.coming.items() if overlaps([(p, n)], ranges)]

    def drops_over(self, ranges: Sequence[Range]) -> list[int]:
        """Indices of pending drops that touch ``ranges``."""
        return [i for i, (dead, _) in enumerate(self.drops) if overlaps(dead, ranges)]

    def synchronized(self) -> None:
        """Every stream was synchronized: nothing is in flight (the ranges away stay away)."""
        for _, ev in self.coming.values():
            self.let_go(ev)
        for _, ev in self.drops:
            self.let_go(ev)
        self.coming.clear()
        self.drops.clear()


def new_pool(api: Any, call: CountedCalls, streams: SwapStreams) -> StagingPool:
    """The backend's staging pool, its pinned memory allocated and freed through counted calls
    (an event a split free extent waits for is held once more)."""
    return StagingPool(lambda n: call("cudaHostAlloc", api.host_alloc, n),
                       lambda p: call("cudaFreeHost", api.free_host, p), streams.hold)


class _CurrentApi:
    """The backend's runtime adapter at the time of each call: the native steady state wraps
    it while it records a window (:class:`umrt.native.recorder.RecordingApi`), and the swap
    path's calls must be in that record as the backend's own are."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend.api, name)


class CudaSwapPath(SwapPath):
    """The ``cuda`` backend's swap path (see the module docstring). ``call`` is the backend's
    counted calls, ``dropped`` its set of ranges discarded and not repopulated since."""

    def __init__(self, backend: Any, call: CountedCalls, dropped: RangeSet) -> None:
        super().__init__(backend)
        self._call = call
        self._dropped = dropped
        self.api = _CurrentApi(backend)  # the backend's adapter as it is at each call (a native window records it)
        self.streams = SwapStreams(self.api, call)
        self.pool = new_pool(self.api, call, self.streams)
        self.out_bytes = 0  # swapped out, and in
        self.in_bytes = 0
        self.late = 0  # announced kernels that touched a range still away (brought back first)
        self.sm_failed = ""  # why the SM copy kernel failed, if it did (the copy engines copy since)
        self.sm_built = False  # the SM copy kernel was compiled (build_copies)

    @property
    def pinned_copies(self) -> bool:  # type: ignore[override]
        """CUDA 13 (discard) through an adapter with pinned memory and copies, on a GPU with
        concurrent managed access. CUDA 12 has no discard: ranges leave by page migration."""
        b = self.backend
        return bool(self.api.has_batch and self.api.has_copies and b.concurrent)

    @property
    def sm(self) -> bool:
        """Whether the copies are umrt's SM copy kernel (``UMRT_SWAP_COPY=sm``, an adapter that
        launches it, and no launch of it failed), not ``cudaMemcpyAsync`` on the copy engines."""
        return self.backend.swap_copy == "sm" and bool(self.api.has_sm_copy) and not self.sm_failed

    @property
    def copies_with(self) -> str:
        """What copies swapped ranges now: ``"sm"`` (the SM copy kernel), ``"engines"``
        (``cudaMemcpyAsync``), or ``""`` (no pinned copies here: ranges leave by migration)."""
        if not self.pinned_copies:
            return ""
        return "sm" if self.sm else "engines"

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """One copy between a slot and a managed range on ``stream``: the SM copy kernel, or
        ``cudaMemcpyAsync``. A kernel that cannot be built or launched is said once, and the copy
        engines copy from then on (a failure of the GPU itself fails their copy too)."""
        if self.sm:
            try:
                self._call("umrt_sm_copy", self.api.sm_copy, dst, src, nbytes, stream)
                return
            except CudaError as exc:
                self.sm_broke(exc)
        self._call("cudaMemcpyAsync", self.api.memcpy, dst, src, nbytes, stream)

    def sm_broke(self, exc: CudaError) -> None:
        """The SM copy kernel failed: say so once; the copy engines copy from now on."""
        self.sm_failed = str(exc)
        warnings.warn(f"umrt: {exc}; copying with cudaMemcpyAsync from now on", RuntimeWarning, stacklevel=3)

    @property
    def away(self) -> bool:
        """Whether any range is swapped out now."""
        return bool(self.streams.away)

    def reserve(self, nbytes: int) -> None:
        """Size the pinned staging for ``nbytes`` away at once (the plan's most), before the
        first step that swaps: one ``cudaHostAlloc``, checked against the host's available
        memory (a clear error naming both figures), reused from then on."""
        if self.pinned_copies and nbytes > 0:
            if self.pool.base and self.pool.grows(nbytes) and not self.pool.in_use:
                self.synchronized()  # the old pinned memory goes: no copy may still use it
            self.pool.reserve(nbytes, host_available_bytes())
            self.build_copies()

    def build_copies(self) -> None:
        """The SM copy kernel is compiled once, before the first step that copies; one that cannot
        be built is said once, and the copy engines copy instead."""
        if self.sm and not self.sm_built:
            try:
                self._call("umrt_sm_copy (build)", self.api.build_sm_copy)
                self.sm_built = True
            except CudaError as exc:
                self.sm_broke(exc)

    def out(self, ranges: Sequence[Range]) -> None:
        """Copy ranges out to pinned slots, then discard them.

        Whole 64 KiB pages only (a partial page may hold a neighbour). The copy stream waits
        for the kernels queued so far (the ranges' last writer) and the prefetches queued so
        far, and each slot for the copy back that last read it; the discard waits for the
        copies. What finds no slot (or no swap path: CUDA 12) leaves by a prefetch to the host.

        Each range leaves as its own entry, never merged with a neighbour it touches: the runtime
        may bring back or release one of two neighbours without the other (an entry holding both
        would be brought back with the first, or dropped with it, the other's data lost)."""
        b = self.backend
        b.allocations.checked("cudaMemcpyAsync", ranges)  # (validated; merged, ranges would share an entry)
        sw, pool = self.streams, self.pool
        pages: list[Range] = []
        for r in sorted(filter(None, (whole_pages(int(p), int(n)) for p, n in ranges))):
            if not (pages and r[0] < pages[-1][0] + pages[-1][1]) and not away_over(sw.away, *r):
                pages.append(r)
        if not pages:
            return
        if not self.pinned_copies:
            b.prefetch(pages, HOST)
            return
        out, disc = sw.stream("out", self.sm), sw.stream("discard")
        written = sw.mark(b.compute_stream)
        sw.wait(out, written)
        sw.let_go(written)
        b.order.stream_after(out, b.copy_stream)
        moved, rest = [], []
        for ptr, n in pages:
            got = pool.take(n)
            if got is None:
                rest.append((ptr, n))
                continue
            slot, waits = got
            for ev in waits:
                sw.wait(out, ev)
                sw.let_go(ev)
            self.copy(pool.ptr(slot), ptr, n, out)
            moved.append((ptr, n, slot))
        if moved:
            copied = sw.mark(out)
            sw.wait(disc, copied)
            sw.let_go(copied)
            done_ranges = [(p, n) for p, n, _ in moved]
            self._call("cudaMemDiscardBatchAsync", self.api.discard_batch, done_ranges, disc)
            done = sw.hold(sw.mark(disc), len(moved))
            for p, n, slot in moved:
                sw.away[p] = (n, Swapped(slot, done))
                self._dropped.add(p, n)
            b.order.discarded(disc, done_ranges)
            b.allocations.place(done_ranges, on_device=False)
            moved_bytes = sum(n for _, n in done_ranges)
            self.out_bytes += moved_bytes
            b.d2h_bytes += moved_bytes
            b.discarded_bytes += moved_bytes
        if rest:
            b.prefetch(rest, HOST)

    def back(self, ranges: Sequence[Range]) -> None:
        """Populate swapped-out ranges on the GPU and copy them back from their slots; kernels
        wait for the copy (:meth:`wait`, or the backend's ``launch`` of one that touches them).
        Ranges (or parts) not swapped out are prefetched."""
        b = self.backend
        checked = b.allocations.checked("cudaMemcpyAsync", ranges)
        if checked:
            rest = self.take_back(checked)
            if rest:
                b.prefetch(rest, b.device)

    def wait(self, ranges: Sequence[Range]) -> None:
        """The compute stream waits for the copies back into ``ranges`` (each event once)."""
        sw = self.streams
        waited: set[int] = set()
        for p in sw.coming_over(ranges):
            _, ev = sw.coming.pop(p)
            if int(ev) not in waited:
                waited.add(int(ev))
                sw.wait(self.backend.compute_stream, ev)
            sw.let_go(ev)

    def release(self, ranges: Sequence[Range]) -> None:
        """Ranges swapped out died: their slots go back, nothing is copied back. Their copy
        out and discard may still be running: a later drop or population of those ranges
        waits for it (kept with the drops)."""
        sw = self.streams
        for ptr, n in ranges:
            for p in [p for p in sw.away if ptr <= p < ptr + n]:
                m, entry = sw.away.pop(p)
                self.pool.give_back(entry.slot)
                sw.drops.append(([(p, m)], entry.discarded))  # its reference moves there

    def drop(self, checked: list[Range]) -> None:
        """Discard dead ranges beside the kernels: on a stream of their own, after the kernels
        queued so far; a population of them (a newborn landing there) waits for it
        (:meth:`wait_drops`). CUDA 12: nothing, as a discard."""
        b = self.backend
        pages = [r for r in (whole_pages(p, n) for p, n in checked) if r]
        if self.streams.away:
            self.release(pages)
        if not pages or not self.api.has_batch or not b.concurrent:
            return
        sw = self.streams
        stream = self.drop_stream()
        self.wait_over(stream, pages)
        used = sw.mark(b.compute_stream)
        sw.wait(stream, used)
        sw.let_go(used)
        b.order.wait_copies(stream, pages)
        self._call("cudaMemDiscardBatchAsync", self.api.discard_batch, pages, stream)
        sw.drops.append((pages, sw.hold(sw.mark(stream))))
        b.discarded_bytes += sum(n for _, n in pages)
        b.allocations.place(pages, on_device=False)
        for p, n in pages:
            self._dropped.add(p, n)
        b.order.discarded(stream, pages)

    def drop_stream(self) -> Any:
        """The stream dead ranges are discarded on: one of the swap path's own (non-blocking;
        on the legacy stream 0 the discard fails, and on the compute stream kernels would wait
        for it)."""
        return self.streams.stream("drop")

    def wait_over(self, stream: Any, ranges: Sequence[Range]) -> None:
        """``stream`` (about to discard ``ranges``) waits for the discards of them still
        running (a drop's, or a released swap's, after its copy out, which must not race it)
        and for their copies back still running (a step cut short frees what was coming back
        before any kernel waited for it)."""
        sw = self.streams
        for i in sw.drops_over(ranges):
            sw.wait(stream, sw.drops[i][1])
        for p in sw.coming_over(ranges):
            sw.wait(stream, sw.coming[p][1])

    def wait_drops(self, stream: Any, ranges: Sequence[Range]) -> None:
        """``stream`` (about to populate ``ranges``) waits for the drops of them still running."""
        sw = self.streams
        if not sw.drops:
            return
        hit = sw.drops_over(ranges)
        for i in hit:
            sw.wait(stream, sw.drops[i][1])
            sw.let_go(sw.drops[i][1])
        sw.drops = [d for i, d in enumerate(sw.drops) if i not in hit]

    def take_back(self, ranges: list[Range]) -> list[Range]:
        """Swap in the ranges away that overlap ``ranges`` (whole, as they went out); return the
        parts of ``ranges`` none covers."""
        b = self.backend
        sw, pool = self.streams, self.pool
        back: list[tuple[int, int, Swapped]] = []
        rest: list[Range] = []
        for ptr, n in ranges:
            inside = away_over(sw.away, ptr, n)  # whole entries, one that starts before the range too
            at = ptr
            for p in inside:
                m, entry = sw.away.pop(p)
                if p > at:
                    rest.append((at, p - at))
                back.append((p, m, entry))
                at = max(at, p + m)
            if at < ptr + n:
                rest.append((at, ptr + n - at))
        if not back:
            return ranges
        pop, inn = sw.stream("populate"), sw.stream("in", self.sm)
        waited: set[int] = set()
        for _, _, entry in back:
            if int(entry.discarded) not in waited:
                waited.add(int(entry.discarded))
                sw.wait(pop, entry.discarded)
            sw.let_go(entry.discarded)
        for p, m, _ in back:  # populated on the GPU (no copy: discarded pages), after their discard
            self._call("cudaMemPrefetchAsync", self.api.prefetch, p, m, b.device, pop)
        populated = sw.mark(pop)
        sw.wait(inn, populated)
        sw.let_go(populated)
        for p, m, entry in back:
            self.copy(p, pool.ptr(entry.slot), m, inn)
        copied = sw.hold(sw.mark(inn), 2 * len(back))
        for p, m, entry in back:
            sw.coming[p] = (m, copied)
            pool.give_back(entry.slot, busy=copied)
            self._dropped.remove(p, m)
        b.allocations.place([(p, m) for p, m, _ in back], on_device=True)
        moved = sum(m for _, m, _ in back)
        self.in_bytes += moved
        b.h2d_bytes += moved
        return rest

    def not_away(self, ranges: list[Range]) -> list[Range]:
        """``ranges`` less the parts swapped out (they are off the GPU already)."""
        away = RangeSet()
        for p, (n, _) in self.streams.away.items():
            away.add(p, n)
        out: list[Range] = []
        for ptr, n in ranges:
            at = ptr
            for q, m in away.take(ptr, n):
                if q > at:
                    out.append((at, q - at))
                at = q + m
            if at < ptr + n:
                out.append((at, ptr + n - at))
        return out

    def synchronized(self) -> None:
        """Every stream was synchronized (the backend's ``synchronize``)."""
        for stream in self.streams.streams.values():
            self._call("cudaStreamSynchronize", self.api.stream_synchronize, stream)
        self.streams.synchronized()
