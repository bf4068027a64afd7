"""umrt's steady state served natively: one iteration's allocation stream, compiled once.

In steady state umrt's pool gives each allocation of an iteration the same address
every iteration (its plan keys allocations by size and ordinal), and the runtime's
decisions repeat. A *steady schedule* is that iteration compiled to arrays
(:func:`compile_schedule`, from what :class:`SteadyRecorder` recorded):

* the allocation stream: allocation ordinal ``i`` -> its size and planned address;
* the decisions, keyed by position: ``at allocation i`` (run before its address is
  returned) or ``at the free of allocation i's block``; each a kind
  (:class:`DecisionKind`), a device, an advice, ranges, a stream and an event. Backend
  calls (:class:`RecordingBackend`) are merged and coalesced; CUDA API calls recorded
  with their exact arguments (:class:`RecordingApi` around ``CudaBackend``'s adapter:
  prefetches, advice, batch discards, event records and stream waits, with the stream
  and event handles) replay verbatim, in order, so the schedule reproduces the
  backend's stream ordering. The backend's spare events can repeat only every few
  iterations: :func:`compile_steady` finds that period (:func:`repeat_period`) and
  compiles that many iterations as one cycle (:func:`compile_cycle`);
* the running hash of the sizes (:func:`mix`, the runtime's own allocation step),
  checked at every allocation.

Two implementations behave identically (``tests/test_steady.py`` holds them to the
same addresses, events and CUDA calls): :class:`NativeSteadySchedule` (ctypes over
``kernels/steady_alloc.cpp``: no Python and no GIL in ``malloc`` / ``free``) and
:class:`PythonSteadySchedule` (the fallback). :func:`load_steady` picks the native one
when it builds, else warns once and returns the Python one.

``malloc`` returns the planned address, or ``0`` after a *deviation* (a size, device or
stream the schedule does not expect, a planned block overlapping a live one, a decision
that would touch a block live now but dead at that point of the recorded window, a
full event buffer, a failed CUDA call), which disarms the schedule: the caller falls back to
Python (the pool) and the reason is in :meth:`SteadySchedule.deviation`. ``free``
returns True for a block the schedule handed out (it stays the schedule's until freed,
even disarmed), False otherwise. Events (:data:`EV_ALLOC`, :data:`EV_FREE`,
:data:`EV_BOUNDARY` when the stream wraps to the next iteration) are buffered, bounded
(``capacity``; a malloc that could overflow it disarms instead, so no event is lost)
and handed over by ``drain``. ``adopt`` hands blocks live before arming (the recorded
iteration's survivors) to the schedule; ``disown`` disarms it (Deviation.STOPPED) and
hands every live block back.

CUDA calls go through a table (:class:`CudaTable`): seven functions and the streams
prefetches and discards go to by default. :class:`ApiTable` fills it from a
:class:`umrt.backends.cuda.CudaApi` (the adapters ``CudaBackend`` uses; tests pass the
fake runtime). C tables keep Python off the path: :func:`cudart_table` (over the
process's libcudart, :func:`loaded_libcudart`) and :func:`counting_table` (counts
only, :func:`counted`). This is a standalone component: the live bridge does not use
it yet.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import enum
import functools
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from umrt.backends.base import PAGE, Advice, Backend, ForwardingBackend, Range, SwapPath
from umrt.backends.cuda import CudaApi
from umrt.errors import CudaError, UmrtError
from umrt.native.build import build_native, native_source, warn_not_built

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
    RECORD_EVENT = 5  # cudaEventRecord(event, stream)
    WAIT_EVENT = 6  # cudaStreamWaitEvent(stream, event, 0)


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
    STOPPED = 9  # disown() while armed: "stopped by Python"
    TOUCH = 10  # a decision would touch a block live now that was dead there in the recorded window
    REENTERED = 11  # an allocation from inside a decision's CUDA call (a Python table's callback)


# Each kind's call: its CudaTable method and its field of the C table (CTable).
CALL_NAMES = {DecisionKind.PREFETCH: "prefetch", DecisionKind.DISCARD: "discard",
               DecisionKind.DISCARD_PREFETCH: "discard_prefetch", DecisionKind.POPULATE: "populate",
               DecisionKind.ADVISE: "advise", DecisionKind.RECORD_EVENT: "record_event",
               DecisionKind.WAIT_EVENT: "wait_event"}


def mix(h: int, size: int) -> int:
    """One allocation's step of the runtime's running hash (restarts at 0 each iteration)."""
    return ((h * HASH_MUL) ^ (size << 1)) & HASH_MASK


# ---------------------------------------------------------------------------
# The CUDA table.
# ---------------------------------------------------------------------------
@runtime_checkable
class CudaTable(Protocol):
    """The CUDA calls a schedule's decisions make; each returns 0 or a CUDA error code.

    A decision with its own stream (non-zero) runs there. Otherwise ``copy_stream`` /
    ``discard_stream`` is where prefetches / discards go (``None`` or 0: the stream the
    allocation or free was called with); populates, event records and waits go to that
    stream. :meth:`provides` says which calls exist (a due decision without its call
    disarms the schedule, as a NULL entry of the C table does).
    """

    copy_stream: int | None
    discard_stream: int | None

    def provides(self, kind: DecisionKind) -> bool:
        """Whether the table has the call for decisions of ``kind``."""

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to ``device`` (HOST: -1)."""

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        """cudaMemDiscardBatchAsync of all ``ranges`` (one call)."""

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        """cudaMemDiscardAndPrefetchBatchAsync of all ``ranges`` to ``device`` (one call)."""

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to the GPU on the compute stream."""

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        """cudaMemAdvise."""

    def record_event(self, event: int, stream: int) -> int:
        """cudaEventRecord."""

    def wait_event(self, stream: int, event: int) -> int:
        """cudaStreamWaitEvent (flags 0)."""

    def clear_error(self) -> int:
        """Called after a call that failed: reset the runtime's per-thread last error
        (``cudaGetLastError``) so that the framework's next launch check does not see it."""


class ApiTable:
    """A :class:`CudaTable` over a :class:`umrt.backends.cuda.CudaApi` (the adapters
    ``CudaBackend`` calls; tests give it the fake runtime). A failed call returns 1 and
    keeps its message in ``errors``. Without the batch calls (CUDA 12) it provides no
    discards. Stream and event handles reach the api as integers."""

    def __init__(self, api: Any, copy_stream: int | None = None, discard_stream: int | None = None) -> None:
        self.api = api
        self.copy_stream = copy_stream
        self.discard_stream = discard_stream
        self.errors: list[str] = []

    def provides(self, kind: DecisionKind) -> bool:
        return bool(self.api.has_batch) or kind not in (DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH)

    def _run(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            fn(*args)
        except CudaError as exc:
            self.errors.append(str(exc))
            return 1
        return 0

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        return self._run(self.api.discard_batch, list(ranges), stream)

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        return self._run(self.api.discard_and_prefetch_batch, list(ranges), device, stream)

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        return self._run(self.api.advise, ptr, nbytes, Advice(advice), device)

    def record_event(self, event: int, stream: int) -> int:
        return self._run(self.api.record_event, event, stream)

    def wait_event(self, stream: int, event: int) -> int:
        return self._run(self.api.stream_wait_event, stream, event)

    def clear_error(self) -> int:
        """Nothing to reset: a failed call came back as an exception of umrt's adapter, made
        through its own binding of the runtime (cuda-bindings links its own instance), not
        through the libcudart whose last error torch checks."""
        return 0


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
    """One call: a Backend call (:class:`RecordingBackend`; ``exact`` False, stream 0,
    compiled merged and coalesced) or a CUDA API call with its exact arguments
    (:class:`RecordingApi`; ``exact`` True, replayed verbatim on ``stream``, with ``event``
    for RECORD_EVENT / WAIT_EVENT). Stream 0 means the table's copy / discard stream, else
    the caller's stream (see :class:`CudaTable`)."""

    kind: DecisionKind
    ranges: tuple[Range, ...]
    device: int = 0
    advice: int = 0
    stream: int = 0
    event: int = 0
    exact: bool = False


@dataclass(frozen=True)
class Unschedulable:
    """A CUDA API call a schedule cannot repeat (``name``: the :class:`CudaApi` method):
    :func:`compile_schedule` refuses an iteration that made one."""

    name: str


@dataclass(frozen=True)
class Mark:
    """A point of the recorded window where the program's kernels may have run since the
    last allocation or free: a module boundary (the live bridge's hooks) where the policy
    acts. A schedule cannot see it, so calls made after it replay at the *next* allocation
    or free (after those kernels, never before them: an eviction before the kernels that
    write the data would make them refault)."""

    what: str = "module"


Recorded = AllocAt | FreeAt | CallAt | Unschedulable | Mark


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

    def drop(self, ranges: Sequence[Range]) -> None:
        """Dead ranges discarded beside the kernels: a schedule replays them as a discard."""
        self.log.append(CallAt(DecisionKind.DISCARD, tuple(ranges)))
        self._b.drop(ranges)

    @property
    def swap(self) -> SwapPath:
        """The backend's swap path, its copies out and back logged as :class:`Unschedulable`."""
        return _UnschedulableSwap(self._b.swap, self.log)


class _UnschedulableSwap(SwapPath):
    """A swap path whose copies a schedule cannot repeat: each is logged, then forwarded."""

    def __init__(self, swap: SwapPath, log: list) -> None:
        super().__init__(swap.backend)
        self._swap = swap
        self._log = log
        self.copy_engines = swap.copy_engines

    def out(self, ranges: Sequence[Range]) -> None:
        self._log.append(Unschedulable("swap.out"))
        self._swap.out(ranges)

    def back(self, ranges: Sequence[Range]) -> None:
        self._log.append(Unschedulable("swap.back"))
        self._swap.back(ranges)

    def wait(self, ranges: Sequence[Range]) -> None:
        self._swap.wait(ranges)

    def release(self, ranges: Sequence[Range]) -> None:
        self._swap.release(ranges)

    def reserve(self, nbytes: int) -> None:
        self._swap.reserve(nbytes)


def _handle(handle: Any) -> int:
    """A stream or event handle as an integer (``None``: 0; cuda-bindings handles convert with ``int``)."""
    return 0 if handle is None else int(handle)


class RecordingApi(CudaApi):
    """A :class:`umrt.backends.cuda.CudaApi` that forwards every call to ``api`` and appends
    the ones a schedule replays to ``log`` as exact :class:`CallAt` (prefetch, advise, the
    batch discards, event records and waits, with their stream and event handles as
    integers); calls that would make an iteration non-repeatable (``malloc_managed``,
    ``free``, ``stream_synchronize``, ``create_event``, ``create_stream``) as
    :class:`Unschedulable`. A call is logged before it is forwarded (a failed call too)."""

    def __init__(self, api: CudaApi, log: list) -> None:
        self.api = api
        self.log = log
        self.version = api.version
        self.has_batch = api.has_batch
        self.has_copies = api.has_copies
        self.process_runtime = api.process_runtime

    def device_count(self) -> int:
        return self.api.device_count()

    def set_device(self, device: int) -> None:
        self.api.set_device(device)

    def concurrent_managed_access(self, device: int) -> bool:
        return self.api.concurrent_managed_access(device)

    def mem_get_info(self) -> tuple[int, int]:
        return self.api.mem_get_info()

    def malloc_managed(self, nbytes: int) -> int:
        self.log.append(Unschedulable("malloc_managed"))
        return self.api.malloc_managed(nbytes)

    def free(self, ptr: int) -> None:
        self.log.append(Unschedulable("free"))
        self.api.free(ptr)

    def create_stream(self, blocking: bool = False) -> Any:
        self.log.append(Unschedulable("create_stream"))
        return self.api.create_stream(blocking)

    def create_event(self) -> Any:
        self.log.append(Unschedulable("create_event"))
        return self.api.create_event()

    def stream_synchronize(self, stream: Any) -> None:
        self.log.append(Unschedulable("stream_synchronize"))
        self.api.stream_synchronize(stream)

    # The swap path: a schedule has no copy calls (nor pinned memory), so a window that
    # swapped is not repeated natively.
    def host_alloc(self, nbytes: int) -> int:
        self.log.append(Unschedulable("host_alloc"))
        return self.api.host_alloc(nbytes)

    def free_host(self, ptr: int) -> None:
        self.log.append(Unschedulable("free_host"))
        self.api.free_host(ptr)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.log.append(Unschedulable("memcpy"))
        self.api.memcpy(dst, src, nbytes, stream)

    def record_event(self, event: Any, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.RECORD_EVENT, (), stream=_handle(stream), event=_handle(event),
                               exact=True))
        self.api.record_event(event, stream)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(CallAt(DecisionKind.WAIT_EVENT, (), stream=_handle(stream), event=_handle(event),
                               exact=True))
        self.api.stream_wait_event(stream, event)

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.PREFETCH, ((int(ptr), int(nbytes)),), device, stream=_handle(stream),
                               exact=True))
        self.api.prefetch(ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self.log.append(CallAt(DecisionKind.ADVISE, ((int(ptr), int(nbytes)),), device, int(advice), exact=True))
        self.api.advise(ptr, nbytes, advice, device)

    def discard_batch(self, ranges: Sequence[Range], stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD, tuple((int(p), int(n)) for p, n in ranges),
                               stream=_handle(stream), exact=True))
        self.api.discard_batch(ranges, stream)

    def discard_and_prefetch_batch(self, ranges: Sequence[Range], device: int, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD_PREFETCH, tuple((int(p), int(n)) for p, n in ranges), device,
                               stream=_handle(stream), exact=True))
        self.api.discard_and_prefetch_batch(ranges, device, stream)


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

    def wrap_api(self, api: CudaApi) -> RecordingApi:
        """``api`` (a ``CudaBackend``'s adapter), recording its CUDA calls exactly into this recorder."""
        return RecordingApi(api, self.log)

    def on_pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        """A ``ManagedPool`` listener: ``("alloc" | "free", ptr, nbytes)``."""
        self.log.append(AllocAt(nbytes, ptr) if what == "alloc" else FreeAt(ptr))

    def mark(self, what: str = "module") -> None:
        """Kernels may have run since the last pool event (a module boundary): see :class:`Mark`."""
        self.log.append(Mark(what))

    def take(self) -> list[Recorded]:
        """What was recorded since the last call (one iteration, if called at its boundaries)."""
        out, self.log[:] = list(self.log), []
        return out


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
    lives_across = _lives_across(entries)  # address -> ordinal of a block that lives across the cycle's end
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
            ordinal = ordinal_at.get(entry.ptr, lives_across.get(entry.ptr))
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


def _lives_across(entries: Sequence[Recorded]) -> dict[int, int]:
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
    for ptr, k in _lives_across(entries).items():
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


class PythonSteadySchedule:
    """The pure-Python schedule: line for line what ``kernels/steady_alloc.cpp`` does."""

    native = False

    def __init__(self, arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY) -> None:
        _check(arrays, capacity)
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
        """A table of C functions (:func:`cudart_table`, :func:`counting_table`), called through ctypes."""
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
                    raise _adopt_error(k, addr, ordinal, self.a)
                end = addr + self.a.sizes[ordinal]
                i = bisect.bisect_right(starts, addr)
                if (i and ends[starts[i - 1]] > addr) or (i < len(starts) and starts[i] < end):
                    raise _adopt_error(k, addr, ordinal, self.a)
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


def _adopt_error(k: int, addr: int, ordinal: int, arrays: ScheduleArrays) -> SteadyError:
    """Why block ``k`` of an adopt call was rejected (the same words for both twins)."""
    if not 0 <= ordinal < len(arrays.sizes):
        return SteadyError(f"adopt: block {k} at {addr:#x}: allocation {ordinal} is not in the schedule "
                           f"(0..{len(arrays.sizes) - 1})")
    return SteadyError(f"adopt: block {k} at {addr:#x} (+{arrays.sizes[ordinal]}, allocation {ordinal}) overlaps "
                       "a live block")


def _check(arrays: ScheduleArrays, capacity: int) -> None:
    n = len(arrays.sizes)
    if n == 0 or len(arrays.addrs) != n or len(arrays.alloc_begin) != n + 1 or len(arrays.free_begin) != n + 1:
        raise SteadyError(f"inconsistent schedule arrays: {n} sizes, {len(arrays.addrs)} addresses, "
                          f"{len(arrays.alloc_begin)} / {len(arrays.free_begin)} decision offsets (need n + 1)")
    nd = len(arrays.dec_kind)
    if not len(arrays.dec_device) == len(arrays.dec_advice) == len(arrays.dec_stream) == len(arrays.dec_event) == nd:
        raise SteadyError(f"inconsistent schedule arrays: {nd} decision kinds but {len(arrays.dec_device)} devices, "
                          f"{len(arrays.dec_advice)} advices, {len(arrays.dec_stream)} streams, "
                          f"{len(arrays.dec_event)} events")
    gb = arrays.guard_begin
    if (len(gb) != nd + 1 or gb[0] != 0 or any(b < a for a, b in zip(gb, gb[1:], strict=False))
            or gb[-1] != len(arrays.guard_ordinal)):
        raise SteadyError(f"inconsistent schedule arrays: {len(gb)} guard offsets for {nd} decisions (need n + 1, "
                          f"ascending from 0 to {len(arrays.guard_ordinal)})")
    if any(not 0 <= k < len(DecisionKind) for k in arrays.dec_kind):
        raise SteadyError(f"inconsistent schedule arrays: a decision kind outside 0..{len(DecisionKind) - 1}")
    if capacity < 3:
        raise SteadyError(f"event buffer capacity {capacity}: it must hold at least 3 events")
    st = arrays.iteration_starts
    if not st or st[0] != 0 or any(b <= a for a, b in zip(st, st[1:], strict=False)) or st[-1] >= n:
        raise SteadyError(f"inconsistent schedule arrays: iteration starts {st[:8]} (ascending ordinals from 0, "
                          f"below {n})")


# ctypes signatures of the table's functions (kernels/steady_alloc.cpp: umrt_cuda_table).
_u64p = ctypes.POINTER(ctypes.c_uint64)
PREFETCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p)
DISCARD_FN = ctypes.CFUNCTYPE(ctypes.c_int, _u64p, _u64p, ctypes.c_int64, ctypes.c_void_p)
DISCARD_PREFETCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, _u64p, _u64p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p)
ADVISE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int)
RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p)
WAIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
CLEAR_FN = ctypes.CFUNCTYPE(ctypes.c_int)


class CTable(ctypes.Structure):
    """``struct umrt_cuda_table``: C function pointers (NULL: the call is missing) and
    the copy / discard streams (NULL: the caller's), and ``clear_error``, called after a
    call that failed (libcudart's ``cudaGetLastError``; NULL: none). Made by :func:`cudart_table`,
    :func:`counting_table`, or :meth:`NativeSteadySchedule.set_table` from a Python table."""

    _fields_ = [("prefetch", PREFETCH_FN), ("discard", DISCARD_FN), ("discard_prefetch", DISCARD_PREFETCH_FN),
                ("populate", PREFETCH_FN), ("advise", ADVISE_FN), ("record_event", RECORD_FN),
                ("wait_event", WAIT_FN), ("copy_stream", ctypes.c_void_p), ("discard_stream", ctypes.c_void_p),
                ("clear_error", CLEAR_FN)]



def _c_ranges(ptrs: Any, lens: Any, n: int) -> list[Range]:
    return [(int(ptrs[i]), int(lens[i])) for i in range(n)]


class CFunctionTable:
    """A :class:`CudaTable` that calls a :class:`CTable`'s C functions through ctypes
    (how the Python twin runs the tables the native schedule runs)."""

    def __init__(self, table: CTable) -> None:
        self.c = table
        self.copy_stream = table.copy_stream
        self.discard_stream = table.discard_stream

    def provides(self, kind: DecisionKind) -> bool:
        return bool(getattr(self.c, CALL_NAMES[kind]))

    @staticmethod
    def _arrays(ranges: Sequence[Range]) -> tuple[Any, Any, int]:
        n = len(ranges)
        return ((ctypes.c_uint64 * max(1, n))(*(p for p, _ in ranges)),
                (ctypes.c_uint64 * max(1, n))(*(m for _, m in ranges)), n)

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self.c.prefetch(ptr, nbytes, device, stream or None)

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        ptrs, lens, n = self._arrays(ranges)
        return self.c.discard(ctypes.cast(ptrs, _u64p), ctypes.cast(lens, _u64p), n, stream or None)

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        ptrs, lens, n = self._arrays(ranges)
        return self.c.discard_prefetch(ctypes.cast(ptrs, _u64p), ctypes.cast(lens, _u64p), n, device, stream or None)

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self.c.populate(ptr, nbytes, device, stream or None)

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        return self.c.advise(ptr, nbytes, advice, device)

    def record_event(self, event: int, stream: int) -> int:
        return self.c.record_event(event, stream or None)

    def wait_event(self, stream: int, event: int) -> int:
        return self.c.wait_event(stream or None, event)

    def clear_error(self) -> int:
        return self.c.clear_error() if self.c.clear_error else 0


def _guarded(fn: Callable[..., int]) -> Callable[..., int]:
    """A table function for a ctypes callback: an exception becomes error 999 (a callback cannot raise)."""
    def call(*args: Any) -> int:
        try:
            return int(fn(*(0 if a is None else a for a in args)))  # a NULL stream arrives as None
        except Exception as exc:  # noqa: BLE001 - nothing may escape a C callback
            print(f"umrt: steady schedule CUDA table call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 999
    return call


def _c_table_of(table: CudaTable) -> CTable:
    """A :class:`CTable` of ctypes callbacks into a Python table (its missing calls: NULL)."""
    fns = {
        "prefetch": PREFETCH_FN(_guarded(table.prefetch)),
        "discard": DISCARD_FN(_guarded(lambda ptrs, lens, n, stream: table.discard(_c_ranges(ptrs, lens, n), stream))),
        "discard_prefetch": DISCARD_PREFETCH_FN(_guarded(
            lambda ptrs, lens, n, device, stream: table.discard_prefetch(_c_ranges(ptrs, lens, n), device, stream))),
        "populate": PREFETCH_FN(_guarded(table.populate)),
        "advise": ADVISE_FN(_guarded(table.advise)),
        "record_event": RECORD_FN(_guarded(table.record_event)),
        "wait_event": WAIT_FN(_guarded(table.wait_event)),
    }
    c = CTable(copy_stream=table.copy_stream or None, discard_stream=table.discard_stream or None)
    for kind, name in CALL_NAMES.items():
        if table.provides(kind):
            setattr(c, name, fns[name])
    fns["clear_error"] = CLEAR_FN(_guarded(table.clear_error))
    c.clear_error = fns["clear_error"]
    c.keep = fns  # the callbacks must outlive every call the schedule makes
    return c


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
            (u64 * max(1, nd))(*arrays.dec_stream), (u64 * max(1, nd))(*arrays.dec_event),
            (i64 * (nd + 1))(*arrays.range_begin), nr, (u64 * max(1, nr))(*arrays.range_ptr),
            (u64 * max(1, nr))(*arrays.range_len), len(arrays.iteration_starts),
            (i64 * len(arrays.iteration_starts))(*arrays.iteration_starts), (i64 * (nd + 1))(*arrays.guard_begin),
            len(arrays.guard_ordinal), (i64 * max(1, len(arrays.guard_ordinal)))(*arrays.guard_ordinal), capacity)
        if not self.handle:
            raise SteadyError("the native schedule rejected the arrays (inconsistent decision, range or iteration offsets)")
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
        self.set_c_table(_c_table_of(table))

    def set_c_table(self, table: CTable) -> None:
        """A table of C functions (no Python on the path: :func:`cudart_table`,
        :func:`counting_table`); copied into the schedule, and kept alive by it."""
        self._table_keep = table
        self.lib.umrt_steady_set_table(self.handle, ctypes.byref(table))

    def adopt(self, blocks: Iterable[tuple[int, int]]) -> None:
        """See :meth:`PythonSteadySchedule.adopt`."""
        blocks = [(int(addr), int(ordinal)) for addr, ordinal in blocks]
        k = len(blocks)
        addrs = (ctypes.c_uint64 * max(1, k))(*(b[0] for b in blocks))
        ordinals = (ctypes.c_int64 * max(1, k))(*(b[1] for b in blocks))
        bad = self.lib.umrt_steady_adopt(self.handle, k, addrs, ordinals)
        if bad:
            raise _adopt_error(bad - 1, *blocks[bad - 1], self.a)

    def disown(self) -> list[tuple[int, int, int]]:
        """See :meth:`PythonSteadySchedule.disown`."""
        room = max(16, self.state()[2])
        while True:
            addrs, sizes, ordinals = (ctypes.c_uint64 * room)(), (ctypes.c_uint64 * room)(), (ctypes.c_int64 * room)()
            k = self.lib.umrt_steady_disown(self.handle, room, addrs, sizes, ordinals)
            if k >= 0:
                return list(zip(addrs[:k], sizes[:k], ordinals[:k], strict=True))
            room = -k + 16  # more blocks went live meanwhile: try again with room for them

    def arm(self, device: int = 0, stream: int = 0) -> None:
        self.lib.umrt_steady_arm(self.handle, device, _stream_arg(stream))

    @property
    def armed(self) -> bool:
        return bool(self.lib.umrt_steady_armed(self.handle))

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        return self._malloc(self.handle, size, device, stream or None) or 0

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        return bool(self._free(self.handle, ptr, size, device, stream or None))

    def missing_calls(self) -> list[str]:
        """See :meth:`PythonSteadySchedule.missing_calls`."""
        mask = int(self.lib.umrt_steady_missing(self.handle))
        return [CALL_NAMES[kind] for kind in DecisionKind if mask & (1 << kind)]

    def record_stream(self, ptr: int, stream: int) -> bool:
        """See :meth:`PythonSteadySchedule.record_stream`."""
        return bool(self.lib.umrt_steady_record_stream(self.handle, ptr, stream or None))

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        cap = self.capacity if max_events is None else min(max_events, self.capacity)
        if self._drain_buf is None or len(self._drain_buf[0]) < cap:
            size = max(cap, self.capacity)
            self._drain_buf = ((ctypes.c_int32 * size)(), (ctypes.c_int64 * size)(), (ctypes.c_uint64 * size)(),
                               (ctypes.c_uint64 * size)())
        kinds, ordinals, ptrs, sizes = self._drain_buf
        k = self.lib.umrt_steady_drain(self.handle, kinds, ordinals, ptrs, sizes, cap)
        return list(zip(kinds[:k], ordinals[:k], ptrs[:k], sizes[:k], strict=True))

    def clear_events(self) -> int:
        return int(self.lib.umrt_steady_clear_events(self.handle))

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
    """``umrt/native/steady_alloc.cpp``."""
    return native_source("steady_alloc.cpp")


def build_library() -> str:
    """Compile the native schedule and return the library's path. Raises on any build failure."""
    return build_native(steady_source(), "umrt_steady_alloc", "the native steady schedule", ["-ldl"])


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, u64, i64, i32, c_int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int
    sigs = {
        "umrt_steady_create": (vp, [i64, vp, vp, vp, vp, i64, vp, vp, vp, vp, vp, vp, i64, vp, vp, i64, vp, vp, i64, vp,
                                    i64]),
        "umrt_steady_adopt": (i64, [vp, i64, vp, vp]),
        "umrt_steady_disown": (i64, [vp, i64, vp, vp, vp]),
        "umrt_steady_cudart_table": (c_int, [ctypes.c_char_p, vp, ctypes.c_char_p, i64]),
        "umrt_steady_counting_table": (None, [vp]),
        "umrt_steady_counted": (None, [vp]),
        "umrt_steady_counted_reset": (None, []),
        "umrt_steady_destroy": (None, [vp]),
        "umrt_steady_set_table": (None, [vp, vp]),
        "umrt_steady_arm": (None, [vp, c_int, vp]),
        "umrt_steady_armed": (c_int, [vp]),
        "umrt_steady_missing": (i32, [vp]),
        "umrt_steady_malloc": (vp, [vp, u64, c_int, vp]),
        "umrt_steady_free": (c_int, [vp, u64, u64, c_int, vp]),
        "umrt_steady_record_stream": (c_int, [vp, u64, vp]),
        "umrt_steady_drain": (i64, [vp, vp, vp, vp, vp, i64]),
        "umrt_steady_clear_events": (i64, [vp]),
        "umrt_steady_deviation": (i32, [vp, ctypes.c_char_p, i64, vp]),
        "umrt_steady_state": (None, [vp, vp]),
        "umrt_steady_noop_malloc": (vp, [vp, u64, c_int, vp]),
        "umrt_steady_noop_free": (c_int, [vp, u64, u64, c_int, vp]),
        "umrt_steady_run": (i64, [vp, i64, vp, vp, vp, i64, c_int, vp]),
        "umrt_steady_plant_bugs": (None, [c_int]),
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
        warn_not_built("the native steady schedule", exc,
                       "the steady state is served by the pure-Python schedule instead (same behaviour, slower)")
        return None


def load_steady(arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY, *,
                native: bool = True) -> NativeSteadySchedule | PythonSteadySchedule:
    """The schedule for ``arrays``: native when the library builds (first use), else
    the Python one (after one warning); ``native=False`` asks for the Python one."""
    lib = native_library() if native else None
    if lib is None:
        return PythonSteadySchedule(arrays, capacity)
    return NativeSteadySchedule(lib, arrays, capacity)


# ---------------------------------------------------------------------------
# C tables: the real CUDA runtime, and a counter.
# ---------------------------------------------------------------------------
def _library() -> ctypes.CDLL:
    lib = native_library()
    if lib is None:
        raise SteadyError("the native steady schedule did not build (see the warning): no C tables without it")
    return lib


def cudart_table(path: str, copy_stream: int | None = None, discard_stream: int | None = None) -> CTable:
    """A :class:`CTable` over the libcudart at ``path`` (``umrt_steady_cudart_table``:
    dlopen, CUDA 13 shapes, or CUDA 12's without discards), for
    :meth:`NativeSteadySchedule.set_c_table`. ``table.version`` is the runtime version.

    Raises:
        SteadyError: the native library did not build, or the runtime cannot be used.
    """
    lib = _library()
    table = CTable()
    err = ctypes.create_string_buffer(512)
    version = lib.umrt_steady_cudart_table(str(path).encode(), ctypes.byref(table), err, len(err))
    if version <= 0:
        raise SteadyError(f"no CUDA table over {path}: {err.value.decode('utf-8', 'replace')}")
    table.copy_stream, table.discard_stream = copy_stream or None, discard_stream or None
    table.version = version
    return table


# The libraries of torch's (and CuPy's) that call the CUDA runtime: the libcudart they
# resolve is the runtime instance whose per-thread state (the last error, the current
# device) torch reads.
CUDART_USERS = ("libc10_cuda.so", "libtorch_cuda.so", "libcupy")


def loaded_libcudart(maps: str = "/proc/self/maps") -> tuple[str | None, str]:
    """``(path, reason)``: the libcudart shared library torch uses in this process (found in
    ``/proc/self/maps``), else ``(None, why not)``. With one loaded, that one; with several
    (torch's, CuPy's, another CUDA version's: separate runtime instances), the one torch's
    own CUDA library (``libc10_cuda.so``) resolves ``cudaGetLastError`` to, never a guess.
    cuda-bindings links the runtime statically: importing it alone loads no libcudart."""
    try:
        text = Path(maps).read_text()
    except OSError as exc:
        return None, f"cannot read {maps}: {exc}"
    paths = {line.split(None, 5)[5] for line in text.splitlines() if len(line.split(None, 5)) == 6}
    found = sorted(p for p in paths if re.search(r"/libcudart\.so[.\d]*$", p))
    if not found:
        return None, f"no libcudart.so in {maps} (load torch.cuda or CuPy's runtime first)"
    if len(found) == 1:
        return found[0], f"loaded by this process ({maps})"
    real = {os.path.realpath(p): p for p in found}
    for user in CUDART_USERS:
        for path in sorted(p for p in paths if Path(p).name.startswith(user)):
            resolved = _resolves_to(path, "cudaGetLastError")
            if resolved is not None and os.path.realpath(resolved) in real:
                return real[os.path.realpath(resolved)], f"the copy {Path(path).name} uses, of {len(found)} loaded"
    return None, (f"{len(found)} libcudart libraries loaded ({', '.join(found)}) and none is known to be torch's: "
                  "the schedule's calls go through umrt's Python adapter")


class _DlInfo(ctypes.Structure):
    """``Dl_info`` (glibc ``dlfcn.h``)."""

    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _resolves_to(library: str, symbol: str) -> str | None:
    """The file of the library that defines ``symbol`` as ``library`` (already loaded) sees it:
    ``dlsym`` on its handle searches it and its dependencies, ``dladdr`` names the file."""
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
        libc = ctypes.CDLL(None)
        info = _DlInfo()
        if not address or not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
            return None
        return info.dli_fname.decode()
    except (OSError, AttributeError):
        return None


COUNTED_KINDS = tuple(DecisionKind)  # the order of umrt_steady_counted's counts


def counting_table() -> CTable:
    """A :class:`CTable` whose calls only count themselves (per kind, atomically) and succeed."""
    table = CTable()
    _library().umrt_steady_counting_table(ctypes.byref(table))
    return table


def counted() -> dict[str, int]:
    """Calls the counting tables made since :func:`reset_counted`, by call name."""
    out = (ctypes.c_int64 * len(COUNTED_KINDS))()
    _library().umrt_steady_counted(out)
    return {CALL_NAMES[kind]: int(out[kind]) for kind in COUNTED_KINDS}


def reset_counted() -> None:
    """Zero the counting tables' counts."""
    _library().umrt_steady_counted_reset()
