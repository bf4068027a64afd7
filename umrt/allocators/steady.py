"""umrt's steady state served natively: one iteration's allocation stream, compiled once.

In steady state umrt's pool gives each allocation of an iteration the same address
every iteration (its plan keys allocations by size and ordinal), and the runtime's
decisions repeat. A *steady schedule* is that iteration compiled to arrays
(:func:`compile_schedule`, from what :class:`SteadyRecorder` recorded):

* the allocation stream: allocation ordinal ``i`` -> its size and planned address;
* the decisions, keyed by position: ``at allocation i`` (run before its address is
  returned) or ``at the free of allocation i's block``; each a kind
  (:class:`DecisionKind`), a device, an advice and coalesced ranges;
* the running hash of the sizes (:func:`mix`, the runtime's own allocation step),
  checked at every allocation.

Two implementations behave identically (``tests/test_steady.py`` holds them to the
same addresses, events and CUDA calls): :class:`NativeSteadySchedule` (ctypes over
``kernels/steady_alloc.cpp``: no Python and no GIL in ``malloc`` / ``free``) and
:class:`PythonSteadySchedule` (the fallback). :func:`load_steady` picks the native one
when it builds, else warns once and returns the Python one.

``malloc`` returns the planned address, or ``0`` after a *deviation* (a size, device or
stream the schedule does not expect, a planned block overlapping a live one, a full
event buffer, a failed CUDA call), which disarms the schedule: the caller falls back to
Python (the pool) and the reason is in :meth:`SteadySchedule.deviation`. ``free``
returns True for a block the schedule handed out (it stays the schedule's until freed,
even disarmed), False otherwise. Events (:data:`EV_ALLOC`, :data:`EV_FREE`,
:data:`EV_BOUNDARY` when the stream wraps to the next iteration) are buffered, bounded
(``capacity``; a malloc that could overflow it disarms instead, so no event is lost)
and handed over by ``drain``.

CUDA calls go through a table (:class:`CudaTable`): five functions, the streams
prefetches and discards go to. :class:`ApiTable` fills it from a
:class:`umrt.backends.cuda.CudaApi` (the adapters ``CudaBackend`` uses; tests pass the
fake runtime). This is a standalone component: the live bridge does not use it yet.
"""
from __future__ import annotations

import bisect
import ctypes
import enum
import functools
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from umrt.backends.base import PAGE, Advice, Backend, ForwardingBackend, Range
from umrt.errors import CudaError, UmrtError

EV_ALLOC, EV_FREE, EV_BOUNDARY = 0, 1, 2
SteadyEvent = tuple[int, int, int, int]  # (EV_*, ordinal (EV_BOUNDARY: the iteration), ptr, size)
HASH_MUL = 1000003
HASH_MASK = (1 << 63) - 1  # umrt.policy.runtime.learning.SIGNATURE_MASK
DEFAULT_CAPACITY = 1 << 16  # events (24 bytes each natively): ~20 gpt2 iterations undrained


class SteadyError(UmrtError):
    """A steady schedule cannot be compiled or made from what it was given."""


class DecisionKind(enum.IntEnum):
    """What a decision asks of CUDA (``kernels/steady_alloc.cpp``: enum Kind)."""

    PREFETCH = 0  # to ``device`` (HOST: an eviction), on the table's copy stream
    DISCARD = 1  # on the table's discard stream
    DISCARD_PREFETCH = 2  # discard and prefetch to ``device``, on the discard stream
    POPULATE = 3  # prefetch to ``device`` on the caller's (compute) stream
    ADVISE = 4  # cudaMemAdvise(advice, device)


class Deviation(enum.IntEnum):
    """Why a schedule disarmed (``kernels/steady_alloc.cpp``: enum Dev)."""

    NONE = 0
    SIZE = 1
    HASH = 2
    LIVE = 3
    BUFFER = 4
    CALL = 5
    DEVICE = 6
    STREAM = 7
    NO_TABLE = 8


_CALL_NAMES = {DecisionKind.PREFETCH: "prefetch", DecisionKind.DISCARD: "discard",
               DecisionKind.DISCARD_PREFETCH: "discard_prefetch", DecisionKind.POPULATE: "populate",
               DecisionKind.ADVISE: "advise"}


def mix(h: int, size: int) -> int:
    """One allocation's step of the runtime's running hash (restarts at 0 each iteration)."""
    return ((h * HASH_MUL) ^ (size << 1)) & HASH_MASK


# ---------------------------------------------------------------------------
# The CUDA table.
# ---------------------------------------------------------------------------
@runtime_checkable
class CudaTable(Protocol):
    """The CUDA calls a schedule's decisions make; each returns 0 or a CUDA error code.

    ``copy_stream`` / ``discard_stream``: where prefetches / discards go (``None``: the
    stream the allocation or free was called with); populates go to that stream.
    """

    copy_stream: int | None
    discard_stream: int | None

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to ``device`` (HOST: -1)."""

    def discard(self, ptr: int, nbytes: int, stream: int) -> int:
        """cudaMemDiscardBatchAsync of one range."""

    def discard_prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemDiscardAndPrefetchBatchAsync of one range."""

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to the GPU on the compute stream."""

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        """cudaMemAdvise."""


class ApiTable:
    """A :class:`CudaTable` over a :class:`umrt.backends.cuda.CudaApi` (the adapters
    ``CudaBackend`` calls; tests give it the fake runtime). A failed call returns 1 and
    keeps its message in ``errors``."""

    def __init__(self, api: Any, copy_stream: int | None = None, discard_stream: int | None = None) -> None:
        self.api = api
        self.copy_stream = copy_stream
        self.discard_stream = discard_stream
        self.errors: list[str] = []

    def _run(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            fn(*args)
        except CudaError as exc:
            self.errors.append(str(exc))
            return 1
        return 0

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def discard(self, ptr: int, nbytes: int, stream: int) -> int:
        return self._run(self.api.discard_batch, [(ptr, nbytes)], stream)

    def discard_prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.discard_and_prefetch_batch, [(ptr, nbytes)], device, stream)

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        return self._run(self.api.advise, ptr, nbytes, Advice(advice), device)


# ---------------------------------------------------------------------------
# Recording a steady iteration and compiling it.
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocAt:
    """The pool placed an allocation of ``size`` bytes at ``ptr``."""

    size: int
    ptr: int


@dataclass(frozen=True)
class FreeAt:
    """The block at ``ptr`` was freed."""

    ptr: int


@dataclass(frozen=True)
class CallAt:
    """The runtime asked the backend for this (one Backend call)."""

    kind: DecisionKind
    ranges: tuple[Range, ...]
    device: int = 0
    advice: int = 0


Recorded = AllocAt | FreeAt | CallAt


class RecordingBackend(ForwardingBackend):
    """A backend that also appends each decision call to ``log`` (a :class:`CallAt`)."""

    def __init__(self, backend: Backend, log: list) -> None:
        super().__init__(backend)
        self.log = log

    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        self.log.append(CallAt(DecisionKind.PREFETCH, tuple(ranges), device))
        self._b.prefetch(ranges, device)

    def populate(self, ranges: Sequence[Range]) -> None:
        self.log.append(CallAt(DecisionKind.POPULATE, tuple(ranges), self._b.device))
        self._b.populate(ranges)

    def discard(self, ranges: Sequence[Range]) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD, tuple(ranges)))
        self._b.discard(ranges)

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """``CudaBackend.discard_and_prefetch`` (recorded, then forwarded)."""
        self.log.append(CallAt(DecisionKind.DISCARD_PREFETCH, tuple(ranges), device))
        self._b.discard_and_prefetch(ranges, device)

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        self.log.append(CallAt(DecisionKind.ADVISE, tuple(ranges), device, int(advice)))
        self._b.advise(ranges, advice, device)


class SteadyRecorder:
    """Records one iteration: the pool's allocations and frees and the backend calls
    between them, in order. Wrap the runtime's backend with :meth:`wrap` and add
    :meth:`on_pool_event` to ``ManagedPool.listeners`` *first* (before the live bridge,
    so an allocation is recorded before the decisions it triggers)."""

    def __init__(self) -> None:
        self.log: list[Recorded] = []

    def wrap(self, backend: Backend) -> RecordingBackend:
        """``backend``, recording its decision calls into this recorder."""
        return RecordingBackend(backend, self.log)

    def on_pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        """A ``ManagedPool`` listener: ``("alloc" | "free", ptr, nbytes)``."""
        self.log.append(AllocAt(nbytes, ptr) if what == "alloc" else FreeAt(ptr))

    def take(self) -> list[Recorded]:
        """What was recorded since the last call (one iteration, if called at its boundaries)."""
        out, self.log[:] = list(self.log), []
        return out


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
    range_begin: list[int] = field(default_factory=lambda: [0])  # decision d: [range_begin[d], [d+1])
    range_ptr: list[int] = field(default_factory=list)
    range_len: list[int] = field(default_factory=list)

    def decisions(self, begin: int, end: int) -> list[tuple[DecisionKind, int, int, list[Range]]]:
        """Decisions ``[begin, end)`` as ``(kind, device, advice, ranges)``."""
        return [(DecisionKind(self.dec_kind[d]), self.dec_device[d], self.dec_advice[d],
                 list(zip(self.range_ptr[self.range_begin[d]:self.range_begin[d + 1]],
                          self.range_len[self.range_begin[d]:self.range_begin[d + 1]], strict=True)))
                for d in range(begin, end)]


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


def _merge_calls(calls: list[CallAt], bounds) -> list[tuple[DecisionKind, int, int, list[Range]]]:
    """Calls at one position -> decisions: a call joins the latest decision of its
    (kind, device, advice) unless a later decision of another kind touches its ranges
    (which would reorder them); ranges are coalesced, discards shrunk to whole pages."""
    groups: list[tuple[tuple, list[Range]]] = []
    for call in calls:
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
    out = []
    for (kind, device, advice), ranges in groups:
        merged = coalesce(ranges, bounds)
        if kind in (DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH):
            merged = _shrink(merged)
        if merged:
            out.append((kind, device, advice, merged))
    return out


def compile_schedule(recorded: Sequence[Recorded],
                     bounds: Callable[[int], tuple[int, int] | None] | None = None) -> ScheduleArrays:
    """Compile one recorded steady iteration into a schedule.

    A call is attributed to the latest allocation or free before it (``at allocation
    i``: run before its address is returned; ``at the free of allocation i's block``);
    calls before the iteration's first allocation or free go to allocation 0. Frees of
    blocks the iteration did not allocate (allocated in an earlier iteration) key their
    calls by the ordinal of the allocation now at that address if any, else the calls
    go to the next allocation. ``bounds`` (``CudaBackend.allocation_of``) keeps
    coalesced ranges inside one managed allocation.

    Raises:
        SteadyError: the iteration has no allocation, or an entry is not a
            :class:`Recorded` one.
    """
    sizes: list[int] = []
    addrs: list[int] = []
    at_alloc: dict[int, list[CallAt]] = {}
    at_free: dict[int, list[CallAt]] = {}
    ordinal_at: dict[int, int] = {}  # address -> ordinal of the allocation last placed there
    target: list[CallAt] | None = None
    pending: list[CallAt] = []  # calls waiting for the next allocation
    for entry in recorded:
        if isinstance(entry, AllocAt):
            if entry.size <= 0:
                raise SteadyError(f"allocation {len(sizes)} of {entry.size} bytes: sizes must be positive")
            ordinal_at[entry.ptr] = len(sizes)
            target = at_alloc.setdefault(len(sizes), [])
            target.extend(pending)
            pending = []
            sizes.append(int(entry.size))
            addrs.append(int(entry.ptr))
        elif isinstance(entry, FreeAt):
            ordinal = ordinal_at.get(entry.ptr)
            target = pending if ordinal is None else at_free.setdefault(ordinal, [])
        elif isinstance(entry, CallAt):
            (pending if target is None else target).append(entry)
        else:
            raise SteadyError(f"not a recorded allocation, free or call: {entry!r}")
    if not sizes:
        raise SteadyError("the recorded iteration has no allocation: nothing to compile")
    at_alloc.setdefault(0, []).extend(pending)  # calls after the last event: the next iteration's start
    arrays = ScheduleArrays(sizes, addrs, [], [])
    decisions_alloc = [_merge_calls(at_alloc.get(i, []), bounds) for i in range(len(sizes))]
    decisions_free = [_merge_calls(at_free.get(i, []), bounds) for i in range(len(sizes))]
    for table, begins in ((decisions_alloc, arrays.alloc_begin), (decisions_free, arrays.free_begin)):
        begins.append(len(arrays.dec_kind))
        for decisions in table:
            for kind, device, advice, ranges in decisions:
                arrays.dec_kind.append(int(kind))
                arrays.dec_device.append(device)
                arrays.dec_advice.append(advice)
                for p, n in ranges:
                    arrays.range_ptr.append(p)
                    arrays.range_len.append(n)
                arrays.range_begin.append(len(arrays.range_ptr))
            begins.append(len(arrays.dec_kind))
    return arrays


# ---------------------------------------------------------------------------
# The two implementations.
# ---------------------------------------------------------------------------
class SteadySchedule(Protocol):
    """What both implementations offer (see the module docstring)."""

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

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        """The buffered events, oldest first."""

    def deviation(self) -> tuple[Deviation, int, str]:
        """``(code, allocation ordinal, message)`` of what disarmed it (NONE, -1, "")."""

    def state(self) -> tuple[int, int, int, int]:
        """``(position, iteration, live blocks, buffered events)``."""


class PythonSteadySchedule:
    """The pure-Python schedule: line for line what ``kernels/steady_alloc.cpp`` does."""

    native = False

    def __init__(self, arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY) -> None:
        _check(arrays, capacity)
        self.a = arrays
        self.capacity = capacity
        self._hashes = []
        h = 0
        for size in arrays.sizes:
            h = mix(h, size)
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

    def set_table(self, table: CudaTable | None) -> None:
        with self._lock:
            self._table = table

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
        with self._lock:
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
            h = mix(0 if p == 0 else self._hash, size)
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
            if p == 0 and self._position == n:
                self._iteration += 1
                self._events.append((EV_BOUNDARY, self._iteration, 0, 0))
            self._position, self._hash = p + 1, h
            bisect.insort(self._starts, addr)
            self._live[addr] = (addr + size, p)
            self._events.append((EV_ALLOC, p, addr, size))
            self._run(a.alloc_begin[p], a.alloc_begin[p + 1], stream, "allocation", p)
            return addr

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        with self._lock:
            entry = self._live.pop(ptr, None)
            if entry is None:
                return False
            del self._starts[bisect.bisect_left(self._starts, ptr)]
            ordinal = entry[1]
            self._events.append((EV_FREE, ordinal, ptr, self.a.sizes[ordinal]))
            if self._armed:
                self._run(self.a.free_begin[ordinal], self.a.free_begin[ordinal + 1], stream or 0, "free", ordinal)
            return True

    def _run(self, begin: int, end: int, stream: int, where: str, ordinal: int) -> bool:
        t = self._table
        a = self.a
        for d in range(begin, end):
            kind, device, advice = a.dec_kind[d], a.dec_device[d], a.dec_advice[d]
            name = _CALL_NAMES[DecisionKind(kind)]
            if t is None:
                self._deviate(Deviation.NO_TABLE, ordinal, f"{where} of allocation {ordinal}: the CUDA table has "
                              f"no {name}")
                return False
            for r in range(a.range_begin[d], a.range_begin[d + 1]):
                p, n = a.range_ptr[r], a.range_len[r]
                if kind == DecisionKind.PREFETCH:
                    rc = t.prefetch(p, n, device, stream if t.copy_stream is None else t.copy_stream)
                elif kind == DecisionKind.DISCARD:
                    rc = t.discard(p, n, stream if t.discard_stream is None else t.discard_stream)
                elif kind == DecisionKind.DISCARD_PREFETCH:
                    rc = t.discard_prefetch(p, n, device, stream if t.discard_stream is None else t.discard_stream)
                elif kind == DecisionKind.POPULATE:
                    rc = t.populate(p, n, device, stream)
                else:
                    rc = t.advise(p, n, advice, device)
                if rc != 0:
                    self._deviate(Deviation.CALL, ordinal, f"{where} of allocation {ordinal}: {name}({p:#x}, {n}) "
                                  f"failed with CUDA error {rc}")
                    return False
        return True

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        with self._lock:
            k = len(self._events) if max_events is None else min(max_events, len(self._events))
            out, self._events[:k] = self._events[:k], []
            return out

    def deviation(self) -> tuple[Deviation, int, str]:
        with self._lock:
            return self._deviation

    def state(self) -> tuple[int, int, int, int]:
        with self._lock:
            return (self._position, self._iteration, len(self._live), len(self._events))


def _check(arrays: ScheduleArrays, capacity: int) -> None:
    n = len(arrays.sizes)
    if n == 0 or len(arrays.addrs) != n or len(arrays.alloc_begin) != n + 1 or len(arrays.free_begin) != n + 1:
        raise SteadyError(f"inconsistent schedule arrays: {n} sizes, {len(arrays.addrs)} addresses, "
                          f"{len(arrays.alloc_begin)} / {len(arrays.free_begin)} decision offsets (need n + 1)")
    if capacity < 3:
        raise SteadyError(f"event buffer capacity {capacity}: it must hold at least 3 events")


# ctypes signatures of the table's functions (kernels/steady_alloc.cpp: umrt_cuda_table).
PREFETCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p)
DISCARD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)
ADVISE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int)


class _Table(ctypes.Structure):
    _fields_ = [("prefetch", PREFETCH_FN), ("discard", DISCARD_FN), ("discard_prefetch", PREFETCH_FN),
                ("populate", PREFETCH_FN), ("advise", ADVISE_FN), ("copy_stream", ctypes.c_void_p),
                ("discard_stream", ctypes.c_void_p)]


def _guarded(fn: Callable[..., int]) -> Callable[..., int]:
    """A table function for a ctypes callback: an exception becomes error 999 (a callback cannot raise)."""
    def call(*args: Any) -> int:
        try:
            return int(fn(*(0 if a is None else a for a in args)))  # a NULL stream arrives as None
        except Exception as exc:  # noqa: BLE001 - nothing may escape a C callback
            print(f"umrt: steady schedule CUDA table call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 999
    return call


def _stream_arg(stream: int | None) -> int:
    return stream or 0


class NativeSteadySchedule:
    """The schedule in ``kernels/steady_alloc.cpp``, through ctypes (see :func:`load_steady`)."""

    native = True

    def __init__(self, lib: ctypes.CDLL, arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY) -> None:
        self.handle: int | None = None
        _check(arrays, capacity)
        self.lib = lib
        self.a = arrays
        self.capacity = capacity
        u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
        n, nd, nr = len(arrays.sizes), len(arrays.dec_kind), len(arrays.range_ptr)
        self.handle = lib.umrt_steady_create(
            n, (u64 * n)(*arrays.sizes), (u64 * n)(*arrays.addrs), (i64 * (n + 1))(*arrays.alloc_begin),
            (i64 * (n + 1))(*arrays.free_begin), nd, (i32 * max(1, nd))(*arrays.dec_kind),
            (i32 * max(1, nd))(*arrays.dec_device), (i32 * max(1, nd))(*arrays.dec_advice),
            (i64 * (nd + 1))(*arrays.range_begin), nr, (u64 * max(1, nr))(*arrays.range_ptr),
            (u64 * max(1, nr))(*arrays.range_len), capacity)
        if not self.handle:
            raise SteadyError("the native schedule rejected the arrays (inconsistent decision or range offsets)")
        self._table_keep: Any = None
        self._drain_buf: tuple | None = None
        self._malloc = lib.umrt_steady_malloc
        self._free = lib.umrt_steady_free

    def __del__(self) -> None:
        handle, self.handle = self.handle, None
        if handle:
            self.lib.umrt_steady_destroy(handle)

    def set_table(self, table: CudaTable | None) -> None:
        if table is None:
            self.lib.umrt_steady_set_table(self.handle, None)
            self._table_keep = None
            return
        c = _Table(PREFETCH_FN(_guarded(table.prefetch)), DISCARD_FN(_guarded(table.discard)),
                   PREFETCH_FN(_guarded(table.discard_prefetch)), PREFETCH_FN(_guarded(table.populate)),
                   ADVISE_FN(_guarded(table.advise)), table.copy_stream, table.discard_stream)
        self._table_keep = c  # the callbacks must outlive every call the schedule makes
        self.lib.umrt_steady_set_table(self.handle, ctypes.byref(c))

    def set_c_table(self, table: _Table) -> None:
        """A table of C functions (no Python on the path); kept alive by the schedule."""
        self._table_keep = table
        self.lib.umrt_steady_set_table(self.handle, ctypes.byref(table))

    def arm(self, device: int = 0, stream: int = 0) -> None:
        self.lib.umrt_steady_arm(self.handle, device, _stream_arg(stream))

    @property
    def armed(self) -> bool:
        return bool(self.lib.umrt_steady_armed(self.handle))

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        return self._malloc(self.handle, size, device, stream or None) or 0

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        return bool(self._free(self.handle, ptr, size, device, stream or None))

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        cap = self.capacity if max_events is None else min(max_events, self.capacity)
        if self._drain_buf is None or len(self._drain_buf[0]) < cap:
            size = max(cap, self.capacity)
            self._drain_buf = ((ctypes.c_int32 * size)(), (ctypes.c_int64 * size)(), (ctypes.c_uint64 * size)(),
                               (ctypes.c_uint64 * size)())
        kinds, ordinals, ptrs, sizes = self._drain_buf
        k = self.lib.umrt_steady_drain(self.handle, kinds, ordinals, ptrs, sizes, cap)
        return list(zip(kinds[:k], ordinals[:k], ptrs[:k], sizes[:k], strict=True))

    def deviation(self) -> tuple[Deviation, int, str]:
        buf = ctypes.create_string_buffer(512)
        position = ctypes.c_int64()
        code = self.lib.umrt_steady_deviation(self.handle, buf, len(buf), ctypes.byref(position))
        return Deviation(code), position.value, buf.value.decode("utf-8", "replace")

    def state(self) -> tuple[int, int, int, int]:
        out = (ctypes.c_int64 * 4)()
        self.lib.umrt_steady_state(self.handle, out)
        return tuple(out)


# ---------------------------------------------------------------------------
# Building and loading.
# ---------------------------------------------------------------------------
def steady_source() -> Path:
    """``kernels/steady_alloc.cpp`` (found by path, like the torch shim)."""
    return Path(__file__).resolve().parents[2] / "kernels" / "steady_alloc.cpp"


def build_library() -> str:
    """Compile the native schedule (torch's extension cache: once per source and torch
    version) and return the library's path. Raises on any build failure."""
    import torch  # optional: the build uses torch's cpp_extension; the Python schedule needs no torch
    from torch.utils import cpp_extension  # optional: same

    source = steady_source()
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing from the umrt installation")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    name = "umrt_steady_alloc_" + re.sub(r"\W", "_", torch.__version__)
    started = time.monotonic()
    path = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O2", "-std=c++17"],
                              with_cuda=False, is_python_module=False)
    if time.monotonic() - started > 2:
        print(f"umrt: compiled the native steady schedule in {time.monotonic() - started:.0f} s "
              "(cached for later runs)", file=sys.stderr)
    return str(path)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, u64, i64, i32, c_int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int
    sigs = {
        "umrt_steady_create": (vp, [i64, vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, vp, vp, i64]),
        "umrt_steady_destroy": (None, [vp]),
        "umrt_steady_set_table": (None, [vp, vp]),
        "umrt_steady_arm": (None, [vp, c_int, vp]),
        "umrt_steady_armed": (c_int, [vp]),
        "umrt_steady_malloc": (vp, [vp, u64, c_int, vp]),
        "umrt_steady_free": (c_int, [vp, u64, u64, c_int, vp]),
        "umrt_steady_drain": (i64, [vp, vp, vp, vp, vp, i64]),
        "umrt_steady_deviation": (i32, [vp, ctypes.c_char_p, i64, vp]),
        "umrt_steady_state": (None, [vp, vp]),
        "umrt_steady_noop_malloc": (vp, [vp, u64, c_int, vp]),
        "umrt_steady_noop_free": (c_int, [vp, u64, u64, c_int, vp]),
        "umrt_steady_run": (i64, [vp, i64, vp, vp, vp, i64, c_int, vp]),
    }
    for fname, (restype, argtypes) in sigs.items():
        fn = getattr(lib, fname)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The built native schedule library, or ``None`` after one warning saying why."""
    try:
        return _declare(ctypes.CDLL(build_library()))
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the Python schedule"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(
            f"umrt: could not build the native steady schedule ({type(exc).__name__}: {first_line}); the "
            "steady state is served by the pure-Python schedule instead (same behaviour, slower). It needs "
            "a C++ compiler, ninja and torch.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_steady(arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY, *,
                native: bool = True) -> NativeSteadySchedule | PythonSteadySchedule:
    """The schedule for ``arrays``: native when the library builds (first use), else
    the Python one (after one warning); ``native=False`` asks for the Python one."""
    lib = native_library() if native else None
    if lib is None:
        return PythonSteadySchedule(arrays, capacity)
    return NativeSteadySchedule(lib, arrays, capacity)
