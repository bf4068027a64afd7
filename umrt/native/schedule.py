"""A steady schedule: recorded steady iterations compiled to arrays, and what serves one.

In steady state umrt's pool gives each allocation of an iteration the same address
every iteration (its plan keys allocations by size and ordinal), and the runtime's
decisions repeat. A *steady schedule* is that iteration compiled to arrays
(:class:`ScheduleArrays`, by :func:`compile_schedule` from what
:class:`umrt.native.recorder.SteadyRecorder` recorded):

* the allocation stream: allocation ordinal ``i`` -> its size and planned address;
* the decisions, keyed by position: ``at allocation i`` (run before its address is
  returned) or ``at the free of allocation i's block``; each a kind
  (:class:`~umrt.native.constants.DecisionKind`), a device, an advice, ranges, a stream and
  an event. Backend calls are merged and coalesced; exact CUDA API calls replay verbatim,
  in order, so the schedule reproduces the backend's stream ordering. The backend's spare
  events can repeat only every few iterations: :func:`compile_steady` finds that period
  (:func:`repeat_period`) and compiles that many iterations as one cycle
  (:func:`compile_cycle`);
* the running hash of the sizes (:func:`~umrt.native.constants.mix`), checked at every
  allocation.

:class:`SteadySchedule` is what serves one; its two implementations are the Python twin
(:mod:`umrt.native.twin`) and the native library through ctypes (:mod:`umrt.native.binding`).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from umrt.backends.base import PAGE, Range
from umrt.errors import UmrtError
from umrt.native.constants import DecisionKind, Deviation, SteadyEvent
from umrt.native.recorder import AllocAt, CallAt, FreeAt, Mark, Recorded, Unschedulable
from umrt.native.tables import CudaTable


class SteadyError(UmrtError):
    """A steady schedule cannot be compiled or made from what it was given."""


Decision = tuple[DecisionKind, int, int, list[Range], int, int]  # kind, device, advice, ranges, stream, event


@dataclass
class ScheduleArrays:
    """A compiled steady schedule (the arrays both implementations take)."""

    sizes: list[int]
    addrs: list[int]
    alloc_begin: list[int]  # decisions at allocation i: [alloc_begin[i], alloc_begin[i+1])
    free_begin: list[int]  # decisions at the free of allocation i's block
    dec_kind: list[int] = field(default_factory=list)
    dec_device: list[int] = field(default_factory=list)
    dec_advice: list[int] = field(default_factory=list)
    dec_stream: list[int] = field(default_factory=list)  # 0: the table's / caller's stream (CudaTable)
    dec_event: list[int] = field(default_factory=list)  # RECORD_EVENT / WAIT_EVENT: the event handle
    range_begin: list[int] = field(default_factory=lambda: [0])  # decision d: [range_begin[d], [d+1])
    range_ptr: list[int] = field(default_factory=list)
    range_len: list[int] = field(default_factory=list)
    iteration_starts: list[int] = field(default_factory=lambda: [0])  # a cycle of iterations: each first ordinal
    # Decision d may touch, of the blocks live when it runs, only those of allocations
    # guard_ordinal[guard_begin[d]:guard_begin[d + 1]]: the ones live and overlapping its
    # ranges at that point of the recorded window. Any other live block it would touch was
    # dead there (freed later than recorded): the schedule deviates (TOUCH) before any call.
    guard_begin: list[int] = field(default_factory=lambda: [0])
    guard_ordinal: list[int] = field(default_factory=list)

    def decisions(self, begin: int, end: int) -> list[Decision]:
        """Decisions ``[begin, end)`` as ``(kind, device, advice, ranges, stream, event)``."""
        return [(DecisionKind(self.dec_kind[d]), self.dec_device[d], self.dec_advice[d],
                 list(zip(self.range_ptr[self.range_begin[d]:self.range_begin[d + 1]],
                          self.range_len[self.range_begin[d]:self.range_begin[d + 1]], strict=True)),
                 self.dec_stream[d], self.dec_event[d])
                for d in range(begin, end)]

    def adopt_error(self, k: int, addr: int, ordinal: int) -> SteadyError:
        """Why block ``k`` of an adopt call was rejected (the same words for both twins)."""
        if not 0 <= ordinal < len(self.sizes):
            return SteadyError(f"adopt: block {k} at {addr:#x}: allocation {ordinal} is not in the schedule "
                               f"(0..{len(self.sizes) - 1})")
        return SteadyError(f"adopt: block {k} at {addr:#x} (+{self.sizes[ordinal]}, allocation {ordinal}) "
                           "overlaps a live block")

    def check(self, capacity: int) -> None:
        """Raise :class:`SteadyError` unless the arrays are consistent (both twins check them
        before they serve) and ``capacity`` holds at least 3 events."""
        n = len(self.sizes)
        if n == 0 or len(self.addrs) != n or len(self.alloc_begin) != n + 1 or len(self.free_begin) != n + 1:
            raise SteadyError(f"inconsistent schedule arrays: {n} sizes, {len(self.addrs)} addresses, "
                              f"{len(self.alloc_begin)} / {len(self.free_begin)} decision offsets (need n + 1)")
        nd = len(self.dec_kind)
        if not len(self.dec_device) == len(self.dec_advice) == len(self.dec_stream) == len(self.dec_event) == nd:
            raise SteadyError(f"inconsistent schedule arrays: {nd} decision kinds but {len(self.dec_device)} devices, "
                              f"{len(self.dec_advice)} advices, {len(self.dec_stream)} streams, "
                              f"{len(self.dec_event)} events")
        gb = self.guard_begin
        if (len(gb) != nd + 1 or gb[0] != 0 or any(b < a for a, b in zip(gb, gb[1:], strict=False))
                or gb[-1] != len(self.guard_ordinal)):
            raise SteadyError(f"inconsistent schedule arrays: {len(gb)} guard offsets for {nd} decisions (need n + 1, "
                              f"ascending from 0 to {len(self.guard_ordinal)})")
        if any(not 0 <= k < len(DecisionKind) for k in self.dec_kind):
            raise SteadyError(f"inconsistent schedule arrays: a decision kind outside 0..{len(DecisionKind) - 1}")
        if capacity < 3:
            raise SteadyError(f"event buffer capacity {capacity}: it must hold at least 3 events")
        st = self.iteration_starts
        if not st or st[0] != 0 or any(b <= a for a, b in zip(st, st[1:], strict=False)) or st[-1] >= n:
            raise SteadyError(f"inconsistent schedule arrays: iteration starts {st[:8]} (ascending ordinals from 0, "
                              f"below {n})")


def coalesce(ranges: Iterable[Range], bounds: Callable[[int], tuple[int, int] | None] | None = None) -> list[Range]:
    """Sorted ranges with touching and overlapping ones merged (within one allocation
    when ``bounds(ptr) -> (base, nbytes)`` says which holds a pointer)."""
    out: list[list[int]] = []
    for p, n in sorted((p, n) for p, n in ranges if n > 0):
        if out and p <= out[-1][0] + out[-1][1] and (
                bounds is None or bounds(p) == bounds(out[-1][0])):
            out[-1][1] = max(out[-1][0] + out[-1][1], p + n) - out[-1][0]
        else:
            out.append([p, n])
    return [(p, n) for p, n in out]


def _shrink(ranges: list[Range]) -> list[Range]:
    """Ranges shrunk inward to whole 64 KiB pages (what CudaBackend discards)."""
    out = []
    for p, n in ranges:
        lo, hi = -(-p // PAGE) * PAGE, (p + n) // PAGE * PAGE
        if hi > lo:
            out.append((lo, hi - lo))
    return out


def _overlaps(a: list[Range], b: list[Range]) -> bool:
    return any(p < q + m and q < p + n for p, n in a for q, m in b)


def _exact_decision(call: CallAt) -> Decision:
    """An exact (CUDA API level) call as one decision, verbatim. A prefetch on the NULL
    stream (0) becomes a POPULATE: the caller's stream, whatever the table's copy stream."""
    kind = call.kind
    if kind == DecisionKind.PREFETCH and call.stream == 0:
        kind = DecisionKind.POPULATE
    advice = call.advice if kind == DecisionKind.ADVISE else 0
    return (kind, call.device, advice, [(int(p), int(n)) for p, n in call.ranges], call.stream, call.event)


def _merge_calls(calls: list[CallAt], bounds) -> list[Decision]:
    """Calls at one position -> decisions. Exact calls are one decision each, in order.
    Between them, a Backend call joins the latest decision of its (kind, device, advice)
    unless a later decision of another kind touches its ranges (which would reorder
    them); their ranges are coalesced, discards shrunk to whole pages."""
    out: list[Decision] = []
    groups: list[tuple[tuple, list[Range]]] = []

    def flush() -> None:
        for (kind, device, advice), ranges in groups:
            merged = coalesce(ranges, bounds)
            if kind in (DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH):
                merged = _shrink(merged)
            if merged:
                out.append((kind, device, advice, merged, 0, 0))
        groups.clear()

    for call in calls:
        if call.exact:
            flush()
            out.append(_exact_decision(call))
            continue
        key = (call.kind, call.device, call.advice if call.kind == DecisionKind.ADVISE else 0)
        ranges = [(int(p), int(n)) for p, n in call.ranges]
        target = None
        for g in range(len(groups) - 1, -1, -1):
            if groups[g][0] == key:
                target = g
                break
            if _overlaps(groups[g][1], ranges):
                break
        if target is None:
            groups.append((key, ranges))
        else:
            groups[target][1].extend(ranges)
    flush()
    return out


def _check_repeats(recorded: Sequence[Recorded], previous: Sequence[Recorded]) -> None:
    """Raise unless the exact CUDA calls of ``recorded`` are those of ``previous``."""
    now = [e for e in recorded if isinstance(e, CallAt) and e.exact]
    before = [e for e in previous if isinstance(e, CallAt) and e.exact]
    if now == before:
        return
    k = next((i for i, (x, y) in enumerate(zip(now, before, strict=False)) if x != y),
             min(len(now), len(before)))
    what = f"{now[k]} against {before[k]}" if k < min(len(now), len(before)) else (
        f"{len(now)} calls against {len(before)}")
    raise SteadyError(f"the iteration's CUDA calls differ from the previous iteration's at call {k} ({what}): "
                      "they do not repeat every iteration (CudaBackend's spare events can cycle with a longer "
                      "period), so a replay of this one could wait on the wrong event")


def compile_schedule(recorded: Sequence[Recorded],
                     bounds: Callable[[int], tuple[int, int] | None] | None = None, *,
                     previous: Sequence[Recorded] | None = None) -> ScheduleArrays:
    """Compile one recorded steady iteration into a schedule.

    A call is attributed to the latest allocation or free before it (``at allocation
    i``: run before its address is returned; ``at the free of allocation i's block``),
    unless a :class:`Mark` (a module boundary: kernels may have run) came between: then
    to the next allocation or free, before that one's own calls (calls move later past
    kernels the schedule cannot see, never earlier). Calls before the iteration's first
    allocation or free go to allocation 0. The free of a block an earlier iteration
    allocated and the iteration allocates again at the same address before it ends (a
    block that lives across the step: the cycle repeats) keys its calls by that
    allocation's ordinal, as the schedule frees that block; the free of any other block
    not allocated in the iteration sends its calls to the next allocation or free. ``bounds`` (``CudaBackend.allocation_of``) keeps
    coalesced ranges inside one managed allocation. Exact calls (:class:`RecordingApi`)
    are compiled verbatim, in order: no merging, coalescing or reordering. An event a
    call waits for was recorded in the iteration before (or earlier in this one): the
    replay is right only if the iteration's calls repeat every iteration, which
    ``previous`` (the iteration recorded just before) checks.

    Raises:
        SteadyError: the iteration has no allocation, made an :class:`Unschedulable`
            call, its exact calls differ from ``previous``'s, it made calls after its last
            allocation or free that would replay after the optimizer step's kernels, or an
            entry is not a :class:`Recorded` one.
    """
    if previous is not None:
        _check_repeats(recorded, previous)
    return compile_cycle([recorded], bounds)


def repeat_period(iterations: Sequence[Sequence[Recorded]], max_period: int = 4) -> int | None:
    """The smallest ``p`` such that the last ``p`` recorded iterations made the same exact
    CUDA calls as the ``p`` before them (``CudaBackend``'s spare events can cycle every
    few iterations), or None (not within ``max_period``, or too few iterations)."""
    exact = [[e for e in it if isinstance(e, CallAt) and e.exact] for it in iterations]
    for p in range(1, max_period + 1):
        if 2 * p > len(exact):
            return None
        if exact[-p:] == exact[-2 * p:-p]:
            return p
    return None


def compile_steady(iterations: Sequence[Sequence[Recorded]],
                   bounds: Callable[[int], tuple[int, int] | None] | None = None,
                   max_period: int = 4) -> ScheduleArrays:
    """Compile the last recorded iterations into a schedule that repeats: as many as
    their CUDA calls take to repeat (:func:`repeat_period`; ``iterations`` holds at least
    twice that many, oldest first). Arm it before the iteration after the last one.

    Raises:
        SteadyError: the calls do not repeat within ``max_period`` iterations, or
            :func:`compile_cycle` refuses them.
    """
    period = repeat_period(iterations, max_period)
    if period is None:
        raise SteadyError(f"the CUDA calls of the last {len(iterations)} recorded iterations do not repeat with a "
                          f"period of at most {max_period} (each period needs two recorded repeats)")
    return compile_cycle(list(iterations[-period:]), bounds)


def compile_cycle(iterations: Sequence[Sequence[Recorded]],
                  bounds: Callable[[int], tuple[int, int] | None] | None = None) -> ScheduleArrays:
    """Compile consecutive recorded iterations into one schedule that serves them in turn
    (see :func:`compile_schedule` for how calls are keyed): the running hash restarts and
    an EV_BOUNDARY is emitted at each iteration's first allocation
    (``ScheduleArrays.iteration_starts``).

    Raises:
        SteadyError: as :func:`compile_schedule`, or an iteration has no allocation.
    """
    sizes: list[int] = []
    addrs: list[int] = []
    starts: list[int] = []
    at_alloc: dict[int, list[CallAt]] = {}
    at_free: dict[int, list[CallAt]] = {}
    ordinal_at: dict[int, int] = {}  # address -> ordinal of the allocation last placed there
    target: list[CallAt] | None = None
    pending: list[CallAt] = []  # calls waiting for the next allocation
    entries: list[Recorded] = []
    previous_allocations = 0
    for k, recorded in enumerate(iterations):
        allocations = sum(isinstance(e, AllocAt) for e in recorded)
        if allocations == 0 and len(iterations) > 1:
            raise SteadyError(f"recorded iteration {k} of the cycle has no allocation")
        starts.append(starts[-1] + previous_allocations if starts else 0)
        previous_allocations = allocations
        entries.extend(recorded)
    live_at_end = lives_across(entries)  # address -> ordinal of a block that lives across the cycle's end
    trailing = False  # the calls pending were made after a Mark with no pool event since
    for entry in entries:
        if isinstance(entry, AllocAt):
            if entry.size <= 0:
                raise SteadyError(f"allocation {len(sizes)} of {entry.size} bytes: sizes must be positive")
            ordinal_at[entry.ptr] = len(sizes)
            target = at_alloc.setdefault(len(sizes), [])
            target.extend(pending)
            pending, trailing = [], False
            sizes.append(int(entry.size))
            addrs.append(int(entry.ptr))
        elif isinstance(entry, FreeAt):
            ordinal = ordinal_at.get(entry.ptr, live_at_end.get(entry.ptr))
            if ordinal is None:  # a block from before the cycle: the schedule does not free it
                target = None
                continue
            target = at_free.setdefault(ordinal, [])
            target.extend(pending)
            pending, trailing = [], False
        elif isinstance(entry, Mark):
            target, trailing = None, True
        elif isinstance(entry, CallAt):
            (pending if target is None else target).append(entry)
        elif isinstance(entry, Unschedulable):
            raise SteadyError(f"the recorded iteration called {entry.name} (after allocation {len(sizes) - 1}): "
                              "a steady schedule cannot repeat it")
        else:
            raise SteadyError(f"not a recorded allocation, free or call: {entry!r}")
    if not sizes:
        raise SteadyError("the recorded iteration has no allocation: nothing to compile")
    if pending and trailing:
        raise SteadyError(f"{len(pending)} call(s) made at a module boundary after the iteration's last allocation "
                          "or free would replay after the optimizer step's kernels (at the next iteration's first "
                          f"allocation); the first: {pending[0]}")
    # Calls after the last event open the next iteration: before those recorded at its allocation 0.
    at_alloc[0] = pending + at_alloc.get(0, [])
    arrays = ScheduleArrays(sizes, addrs, [], [], iteration_starts=starts)
    decisions_alloc = [_merge_calls(at_alloc.get(i, []), bounds) for i in range(len(sizes))]
    decisions_free = [_merge_calls(at_free.get(i, []), bounds) for i in range(len(sizes))]
    guards_alloc, guards_free = _guards(entries, sizes, decisions_alloc, decisions_free)
    for table, guards, begins in ((decisions_alloc, guards_alloc, arrays.alloc_begin),
                                  (decisions_free, guards_free, arrays.free_begin)):
        begins.append(len(arrays.dec_kind))
        for i, decisions in enumerate(table):
            for k, (kind, device, advice, ranges, stream, event) in enumerate(decisions):
                arrays.dec_kind.append(int(kind))
                arrays.dec_device.append(device)
                arrays.dec_advice.append(advice)
                arrays.dec_stream.append(stream)
                arrays.dec_event.append(event)
                for p, n in ranges:
                    arrays.range_ptr.append(p)
                    arrays.range_len.append(n)
                arrays.range_begin.append(len(arrays.range_ptr))
                arrays.guard_ordinal.extend(guards.get((i, k), ()))
                arrays.guard_begin.append(len(arrays.guard_ordinal))
            begins.append(len(arrays.dec_kind))
    return arrays


def lives_across(entries: Sequence[Recorded]) -> dict[int, int]:
    """The blocks the cycle allocates and leaves live at its end, as ``{address: ordinal}``:
    in steady state each is freed in the next cycle, before its address is allocated again."""
    live: dict[int, int] = {}
    ordinal = 0
    for entry in entries:
        if isinstance(entry, AllocAt):
            live[entry.ptr] = ordinal
            ordinal += 1
        elif isinstance(entry, FreeAt):
            live.pop(entry.ptr, None)
    return live


class _LiveBlocks:
    """Blocks live at a point of a recorded window: start -> (end, allocation ordinal)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.blocks: dict[int, tuple[int, int]] = {}

    def add(self, start: int, end: int, ordinal: int) -> None:
        if start not in self.blocks:
            bisect.insort(self.starts, start)
        self.blocks[start] = (end, ordinal)

    def pop(self, start: int) -> int | None:
        entry = self.blocks.pop(start, None)
        if entry is None:
            return None
        del self.starts[bisect.bisect_left(self.starts, start)]
        return entry[1]

    def touched(self, ranges: Sequence[Range]) -> list[int]:
        """The ordinals of the live blocks ``ranges`` overlap, ascending."""
        out: set[int] = set()
        for p, n in ranges:
            i = max(0, bisect.bisect_right(self.starts, p) - 1)
            while i < len(self.starts) and self.starts[i] < p + n:
                start = self.starts[i]
                end, ordinal = self.blocks[start]
                if end > p:
                    out.add(ordinal)
                i += 1
        return sorted(out)


def _guards(entries: Sequence[Recorded], sizes: Sequence[int], decisions_alloc: Sequence[list[Decision]],
            decisions_free: Sequence[list[Decision]]) -> tuple[dict, dict]:
    """For each decision, the allocations whose blocks it may touch: those live where it
    runs in the recorded window (the cycle repeats: the blocks it left live are live at its
    start), as ``{(ordinal, k): [ordinals]}`` for the k-th decision at allocation / free of
    ``ordinal``. Event records and waits touch no memory and get none."""
    live = _LiveBlocks()
    for ptr, k in lives_across(entries).items():
        live.add(ptr, ptr + sizes[k], k)
    guards_alloc: dict[tuple[int, int], list[int]] = {}
    guards_free: dict[tuple[int, int], list[int]] = {}

    def guard(into: dict, decisions: list[Decision], at: int) -> None:
        for k, (kind, _, _, ranges, _, _) in enumerate(decisions):
            if kind not in (DecisionKind.RECORD_EVENT, DecisionKind.WAIT_EVENT):
                into[(at, k)] = live.touched(ranges)

    ordinal = 0
    for entry in entries:
        if isinstance(entry, AllocAt):
            live.add(entry.ptr, entry.ptr + entry.size, ordinal)
            guard(guards_alloc, decisions_alloc[ordinal], ordinal)
            ordinal += 1
        elif isinstance(entry, FreeAt):
            freed = live.pop(entry.ptr)
            if freed is not None:
                guard(guards_free, decisions_free[freed], freed)
    return guards_alloc, guards_free


class SteadySchedule(Protocol):
    """What both implementations offer (:class:`umrt.native.twin.PythonSteadySchedule` and
    :class:`umrt.native.binding.NativeSteadySchedule`; see :mod:`umrt.native.twin`)."""

    def set_table(self, table: CudaTable | None) -> None:
        """The CUDA calls decisions make (``None``: none; a due decision then disarms)."""

    def arm(self, device: int = 0, stream: int = 0) -> None:
        """Serve the stream from allocation 0 on ``device`` / ``stream``; clears the deviation."""

    @property
    def armed(self) -> bool:
        """Whether ``malloc`` serves the schedule."""

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """The planned address, or 0 (disarmed: fall back)."""

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        """True when the block was the schedule's (freed here)."""

    def record_stream(self, ptr: int, stream: int) -> bool:
        """A block used on ``stream`` too: True when it is the schedule's (which then
        deviates unless ``stream`` is the one it serves)."""

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        """The buffered events, oldest first."""

    def clear_events(self) -> int:
        """Drop the buffered events; how many there were."""

    def deviation(self) -> tuple[Deviation, int, str]:
        """``(code, allocation ordinal, message)`` of what disarmed it (NONE, -1, "")."""

    def state(self) -> tuple[int, int, int, int]:
        """``(position, iteration, live blocks, buffered events)``."""

    def missing_calls(self) -> list[str]:
        """The calls its decisions need that its table lacks."""
