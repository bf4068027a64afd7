"""The steady schedule in Python: the twin of ``steady_alloc.cpp``, rule for rule.

Both implementations behave identically (``tests/test_steady.py`` holds them to the same
addresses, events and CUDA calls): :class:`umrt.native.binding.NativeSteadySchedule`
(ctypes over ``steady_alloc.cpp``: no Python and no GIL in ``malloc`` / ``free``) and
:class:`PythonSteadySchedule` (the fallback, where the library does not build).
:func:`umrt.native.binding.load_steady` picks the native one when it builds.

``malloc`` returns the planned address, or ``0`` after a *deviation* (a size, device or
stream the schedule does not expect, a planned block overlapping a live one, a decision
that would touch a block live now but dead at that point of the recorded window, a
full event buffer, a failed CUDA call), which disarms the schedule: the caller falls back to
Python (the pool) and the reason is in :meth:`~umrt.native.schedule.SteadySchedule.deviation`.
``free`` returns True for a block the schedule handed out (it stays the schedule's until freed,
even disarmed), False otherwise. Events (:data:`~umrt.native.constants.EV_ALLOC`,
``EV_FREE``, ``EV_BOUNDARY`` when the stream wraps to the next iteration) are buffered, bounded
(``capacity``; a malloc that could overflow it disarms instead, so no event is lost)
and handed over by ``drain``. ``adopt`` hands blocks live before arming (the recorded
iteration's survivors) to the schedule; ``disown`` disarms it (Deviation.STOPPED) and
hands every live block back. Decisions run through a :class:`~umrt.native.tables.CudaTable`.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterable

from umrt.native.constants import (
    CALL_NAMES,
    DEFAULT_CAPACITY,
    EV_ALLOC,
    EV_BOUNDARY,
    EV_FREE,
    DecisionKind,
    Deviation,
    SteadyEvent,
    mix,
)
from umrt.native.schedule import ScheduleArrays
from umrt.native.tables import CFunctionTable, CTable, CudaTable


class PythonSteadySchedule:
    """The pure-Python schedule: line for line what ``steady_alloc.cpp`` does."""

    native = False

    def __init__(self, arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY) -> None:
        arrays.check(capacity)
        self.a = arrays
        self.capacity = capacity
        self._starts_iteration = set(arrays.iteration_starts)
        self._hashes = []
        h = 0
        for i, size in enumerate(arrays.sizes):
            h = mix(0 if i in self._starts_iteration else h, size)
            self._hashes.append(h)
        self._lock = threading.Lock()
        self._table: CudaTable | None = None
        self._armed = False
        self._device = 0
        self._stream = 0
        self._position = 0
        self._iteration = 0
        self._hash = 0
        self._starts: list[int] = []  # live block starts, sorted
        self._live: dict[int, tuple[int, int]] = {}  # start -> (end, ordinal)
        self._events: list[SteadyEvent] = []
        self._deviation = (Deviation.NONE, -1, "")
        # The thread running decisions holds the lock: what it calls again (a free by the
        # garbage collector inside a table call) must not take it (threading.Lock is not
        # recursive). Frees arriving so are served once the decisions ran.
        self._inside = threading.local()
        self._deferred: list[tuple[int, int]] = []

    def _reentered(self) -> bool:
        return self._inside.__dict__.get("active", False)  # (per thread: unset on a thread that never ran one)

    def set_table(self, table: CudaTable | None) -> None:
        with self._lock:
            self._table = table

    def set_c_table(self, table: CTable) -> None:
        """A table of C functions (:func:`umrt.native.binding.cudart_table`,
        :func:`umrt.native.binding.counting_table`), called through ctypes."""
        self.set_table(CFunctionTable(table))

    def arm(self, device: int = 0, stream: int = 0) -> None:
        with self._lock:
            self._armed, self._device, self._stream = True, device, stream or 0
            self._position, self._hash = 0, 0
            self._deviation = (Deviation.NONE, -1, "")

    @property
    def armed(self) -> bool:
        return self._armed

    def _deviate(self, code: Deviation, position: int, message: str) -> None:
        self._armed = False
        self._deviation = (code, position, message)

    def _overlapping(self, start: int, end: int) -> int | None:
        i = bisect.bisect_right(self._starts, start)
        if i and self._live[self._starts[i - 1]][0] > start:
            return self._starts[i - 1]
        if i < len(self._starts) and self._starts[i] < end:
            return self._starts[i]
        return None

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        stream = stream or 0
        if self._reentered():  # from inside one of its decisions' calls: the lock is this thread's
            if self._armed:
                n = len(self.a.sizes)
                self._deviate(Deviation.REENTERED, 0 if self._position == n else self._position,
                              f"an allocation of {size} bytes from inside a decision's CUDA call")
            return 0
        with self._lock:
            try:
                return self._malloc(size, device, stream)
            finally:
                self._serve_deferred()

    def _malloc(self, size: int, device: int, stream: int) -> int:
        if not self._armed:
            return 0
        a = self.a
        n = len(a.sizes)
        p = 0 if self._position == n else self._position
        if device != self._device:
            self._deviate(Deviation.DEVICE, p, f"allocation {p}: device {device}, the schedule serves "
                          f"device {self._device}")
            return 0
        if stream != self._stream:
            self._deviate(Deviation.STREAM, p, f"allocation {p}: stream {stream:#x}, the schedule serves "
                          f"stream {self._stream:#x}")
            return 0
        if len(self._events) + len(self._live) + 3 > self.capacity:
            self._deviate(Deviation.BUFFER, p, f"allocation {p}: the event buffer is full "
                          f"({len(self._events)} events not drained, capacity {self.capacity})")
            return 0
        if size != a.sizes[p]:
            self._deviate(Deviation.SIZE, p, f"allocation {p}: {size} bytes, the schedule expects {a.sizes[p]}")
            return 0
        starts = p in self._starts_iteration
        h = mix(0 if starts else self._hash, size)
        if h != self._hashes[p]:
            self._deviate(Deviation.HASH, p, f"allocation {p}: running hash {h}, the schedule expects "
                          f"{self._hashes[p]}")
            return 0
        addr = a.addrs[p]
        hit = self._overlapping(addr, addr + size)
        if hit is not None:
            self._deviate(Deviation.LIVE, p, f"allocation {p}: its block {addr:#x} (+{size}) overlaps live "
                          f"block {hit:#x} of allocation {self._live[hit][1]}")
            return 0
        bisect.insort(self._starts, addr)
        self._live[addr] = (addr + size, p)
        if not self._check(a.alloc_begin[p], a.alloc_begin[p + 1], "allocation", p):
            del self._starts[bisect.bisect_left(self._starts, addr)]
            del self._live[addr]
            return 0
        if starts and (p != 0 or self._position == n):  # not the first allocation after arming
            self._iteration += 1
            self._events.append((EV_BOUNDARY, self._iteration, 0, 0))
        self._position, self._hash = p + 1, h
        self._events.append((EV_ALLOC, p, addr, size))
        self._run(a.alloc_begin[p], a.alloc_begin[p + 1], stream, "allocation", p)
        return addr

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        if self._reentered():  # from inside one of its decisions' calls: served once they ran
            if ptr not in self._live:
                return False
            self._deferred.append((ptr, stream or 0))
            return True
        with self._lock:
            try:
                return self._free(ptr, stream or 0)
            finally:
                self._serve_deferred()

    def _free(self, ptr: int, stream: int) -> bool:
        entry = self._live.pop(ptr, None)
        if entry is None:
            return False
        del self._starts[bisect.bisect_left(self._starts, ptr)]
        ordinal = entry[1]
        self._events.append((EV_FREE, ordinal, ptr, self.a.sizes[ordinal]))
        begin, end = self.a.free_begin[ordinal], self.a.free_begin[ordinal + 1]
        if self._armed and self._check(begin, end, "free", ordinal):
            self._run(begin, end, stream, "free", ordinal)
        return True

    def _serve_deferred(self) -> None:
        """The frees deferred while this thread ran decisions (the lock held)."""
        while self._deferred and not self._reentered():
            ptr, stream = self._deferred.pop(0)
            self._free(ptr, stream)

    def missing_calls(self) -> list[str]:
        """The calls its decisions make that its table lacks (a CUDA 12 runtime has no batched
        discard): armed, it would disarm at the first of them, every time."""
        with self._lock:
            t = self._table
            kinds = {DecisionKind(k) for k in self.a.dec_kind}
            return [CALL_NAMES[k] for k in sorted(kinds) if t is None or not t.provides(k)]

    def record_stream(self, ptr: int, stream: int) -> bool:
        """torch's ``record_stream``: the block at ``ptr`` is used on ``stream`` too. For a
        live block of the schedule on another stream than the one it serves: deviate
        (STREAM, if armed; the schedule orders nothing across streams) and return True.
        False for a block not its own."""
        stream = stream or 0
        with contextlib.nullcontext() if self._reentered() else self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return False
            if stream != self._stream and self._armed:
                n = len(self.a.sizes)
                self._deviate(Deviation.STREAM, 0 if self._position == n else self._position,
                              f"record_stream: block {ptr:#x} of allocation {entry[1]} is used on stream "
                              f"{stream:#x} too")
            return True

    def _check(self, begin: int, end: int, where: str, ordinal: int) -> bool:
        """Decisions ``[begin, end)`` touch no live block but those live where they ran in
        the recorded window; else deviate (TOUCH) before any of them runs."""
        a = self.a
        for d in range(begin, end):
            if a.dec_kind[d] in (DecisionKind.RECORD_EVENT, DecisionKind.WAIT_EVENT):
                continue
            allowed = a.guard_ordinal[a.guard_begin[d]:a.guard_begin[d + 1]]
            for r in range(a.range_begin[d], a.range_begin[d + 1]):
                p, n = a.range_ptr[r], a.range_len[r]
                i = max(0, bisect.bisect_right(self._starts, p) - 1)
                while i < len(self._starts) and self._starts[i] < p + n:
                    start = self._starts[i]
                    block_end, block = self._live[start]
                    if block_end > p and block not in allowed:
                        self._deviate(Deviation.TOUCH, ordinal, f"{where} of allocation {ordinal}: its "
                                      f"{CALL_NAMES[DecisionKind(a.dec_kind[d])]} of ({p:#x}, {n}) would touch live "
                                      f"block {start:#x} of allocation {block}, dead at that point of the "
                                      "recorded window")
                        return False
                    i += 1
        return True

    def _run(self, begin: int, end: int, stream: int, where: str, ordinal: int) -> bool:
        self._inside.active = True
        try:
            return self._run_calls(begin, end, stream, where, ordinal)
        finally:
            self._inside.active = False

    def _run_calls(self, begin: int, end: int, stream: int, where: str, ordinal: int) -> bool:
        t = self._table
        a = self.a
        for d in range(begin, end):
            kind, device, advice = a.dec_kind[d], a.dec_device[d], a.dec_advice[d]
            own, event = a.dec_stream[d], a.dec_event[d]
            name = CALL_NAMES[DecisionKind(kind)]
            if t is None or not t.provides(DecisionKind(kind)):
                self._deviate(Deviation.NO_TABLE, ordinal, f"{where} of allocation {ordinal}: the CUDA table has "
                              f"no {name}")
                return False
            r0, r1 = a.range_begin[d], a.range_begin[d + 1]
            rc, what = 0, ""
            if kind in (DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH):
                on = own or t.discard_stream or stream
                ranges = list(zip(a.range_ptr[r0:r1], a.range_len[r0:r1], strict=True))
                rc = t.discard(ranges, on) if kind == DecisionKind.DISCARD else t.discard_prefetch(ranges, device, on)
                what = f"{name}({r1 - r0} ranges from {a.range_ptr[r0] if r1 > r0 else 0:#x})"
            elif kind in (DecisionKind.RECORD_EVENT, DecisionKind.WAIT_EVENT):
                on = own or stream
                rc = t.record_event(event, on) if kind == DecisionKind.RECORD_EVENT else t.wait_event(on, event)
                what = f"{name}(event {event:#x}, stream {on:#x})"
            else:
                for r in range(r0, r1):
                    p, n = a.range_ptr[r], a.range_len[r]
                    if kind == DecisionKind.PREFETCH:
                        rc = t.prefetch(p, n, device, own or t.copy_stream or stream)
                    elif kind == DecisionKind.POPULATE:
                        rc = t.populate(p, n, device, own or stream)
                    else:
                        rc = t.advise(p, n, advice, device)
                    if rc != 0:
                        what = f"{name}({p:#x}, {n})"
                        break
            if rc != 0:
                self._clear_error(t)  # as the native twin: the failed call's last error is not left for torch
                self._deviate(Deviation.CALL, ordinal, f"{where} of allocation {ordinal}: {what} failed with "
                              f"CUDA error {rc}")
                return False
        return True

    @staticmethod
    def _clear_error(table: CudaTable) -> None:
        table.clear_error()

    def adopt(self, blocks: Iterable[tuple[int, int]]) -> None:
        """Make live blocks the schedule's: ``(address, ordinal)``, a block allocated at
        allocation ``ordinal`` of the recorded iteration (its size: ``sizes[ordinal]``).
        Their frees then run their free decisions and emit EV_FREE. All or nothing.

        Raises:
            SteadyError: an ordinal outside the schedule, or a block overlapping a live one.
        """
        blocks = [(int(addr), int(ordinal)) for addr, ordinal in blocks]
        with self._lock:
            starts, ends = list(self._starts), {k: v[0] for k, v in self._live.items()}
            for k, (addr, ordinal) in enumerate(blocks):
                if not 0 <= ordinal < len(self.a.sizes):
                    raise self.a.adopt_error(k, addr, ordinal)
                end = addr + self.a.sizes[ordinal]
                i = bisect.bisect_right(starts, addr)
                if (i and ends[starts[i - 1]] > addr) or (i < len(starts) and starts[i] < end):
                    raise self.a.adopt_error(k, addr, ordinal)
                starts.insert(i, addr)
                ends[addr] = end
            for addr, ordinal in blocks:
                bisect.insort(self._starts, addr)
                self._live[addr] = (addr + self.a.sizes[ordinal], ordinal)

    def disown(self) -> list[tuple[int, int, int]]:
        """Disarm (if armed: deviation STOPPED) and hand back every live block as
        ``(address, size, ordinal)``, ascending; later frees of them return False (the
        caller frees them). Buffered events stay drainable."""
        with self._lock:
            if self._armed:
                n = len(self.a.sizes)
                self._deviate(Deviation.STOPPED, 0 if self._position == n else self._position, "stopped by Python")
            out = [(addr, self._live[addr][0] - addr, self._live[addr][1]) for addr in self._starts]
            self._starts.clear()
            self._live.clear()
            return out

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        with self._lock:
            k = len(self._events) if max_events is None else min(max_events, len(self._events))
            out, self._events[:k] = self._events[:k], []
            return out

    def clear_events(self) -> int:
        with self._lock:
            events, self._events = self._events, []
        return len(events)

    def deviation(self) -> tuple[Deviation, int, str]:
        with self._lock:
            return self._deviation

    def state(self) -> tuple[int, int, int, int]:
        with self._lock:
            return (self._position, self._iteration, len(self._live), len(self._events))
