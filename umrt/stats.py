"""Memory statistics for umrt's managed pool (torch's own stats do not work with
a pluggable allocator, see pytorch #133281).

* :func:`memory_stats` - a dict like ``torch.cuda.memory_stats`` for the
  whole process: allocated, peak, reserved, resident and migrated bytes.
* :func:`statistics` - a context manager in RMM's shape
  (``rmm.statistics.statistics``): the counters of allocations made inside
  the block, nestable; plus :func:`push_statistics`, :func:`pop_statistics`
  and :func:`get_statistics`.

``acting`` and ``stopped_reason`` say whether umrt's runtime is acting (a
policy is live and nothing has failed) and, once it stopped after an error,
why (``"CudaError: cudaMemDiscardBatchAsync failed: ..."``).

``resident_bytes`` and ``migrated_bytes`` count what umrt itself placed and
moved (prefetches, evictions); pages the driver migrates on demand faults
are invisible to a CUDA program, so resident is a lower bound. NVML's device
"memory used" (``umrt run`` telemetry) is the outside view.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(eq=False)
class Statistics:
    """Allocation counters (the fields of ``rmm.statistics.Statistics``)."""

    current_bytes: int = 0
    current_count: int = 0
    peak_bytes: int = 0
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0

    def _alloc(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.current_count += 1
        self.total_bytes += nbytes
        self.total_count += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.peak_count = max(self.peak_count, self.current_count)

    def _free(self, nbytes: int) -> None:
        self.current_bytes -= nbytes
        self.current_count -= 1


_lock = threading.Lock()
_process = Statistics()
_stack: list[Statistics] = []
class ReservesMemory(Protocol):
    """The pool's side of :func:`memory_stats`."""

    def reserved_bytes(self) -> int:
        """Managed bytes the pool holds."""


class CountsMoves(Protocol):
    """The backend's side of :func:`memory_stats` (umrt's ``CudaBackend``)."""

    h2d_bytes: int
    d2h_bytes: int
    discarded_bytes: int

    def resident_bytes(self) -> int:
        """Bytes umrt placed on the GPU (a lower bound)."""

    def counters(self) -> dict:
        """``populated_bytes`` and ``calls`` (CUDA call name -> count), among others."""


_sources: dict[str, Any] = {"pool": None, "backend": None, "steady": None, "phases": None}


@dataclass
class RuntimeStatus:
    """Whether umrt's runtime acts, and why it stopped (None while it acts or never ran)."""

    acting: bool = False
    stopped_reason: str | None = None


_status = RuntimeStatus()


def attach(*, pool: ReservesMemory | None = None, backend: CountsMoves | None = None, steady: Any = None) -> None:
    """Called by :func:`umrt.enable`: where reserved/resident/migrated bytes come from,
    and the native steady state's report (``steady.report``, a dataclass).

    A new session: no runtime acts yet (and no earlier failure is reported).
    """
    _sources["pool"], _sources["backend"], _sources["steady"] = pool, backend, steady
    _sources["phases"] = None
    with _lock:
        _status.acting, _status.stopped_reason = False, None


def watch_phases(source: Any) -> None:
    """Where :func:`memory_stats` reads the live policy's phases from: a callable
    returning ``{phase: {"acting": bool, "stopped_because": str | None, ...}}``
    (:meth:`umrt.drive.live.LiveBridge.phase_report`)."""
    _sources["phases"] = source


def runtime_started() -> None:
    """The live runtime started acting (:meth:`umrt.drive.live.LiveBridge.start`)."""
    with _lock:
        _status.acting, _status.stopped_reason = True, None


def runtime_stopped(reason: str) -> None:
    """The live runtime stopped acting after an error; ``reason`` names it."""
    with _lock:
        _status.acting, _status.stopped_reason = False, reason


def runtime_closed() -> None:
    """The live runtime was closed (``umrt.disable``); a failure's reason stays readable."""
    with _lock:
        _status.acting = False


def runtime_status() -> RuntimeStatus:
    """A copy of the runtime's status."""
    with _lock:
        return dataclasses.replace(_status)


def record_alloc(nbytes: int) -> None:
    """A pool handed out ``nbytes`` (requested size)."""
    with _lock:
        _process._alloc(nbytes)
        for frame in _stack:
            frame._alloc(nbytes)


def record_free(nbytes: int) -> None:
    """A pool took back an allocation of ``nbytes`` (requested size)."""
    with _lock:
        _process._free(nbytes)
        for frame in _stack:
            frame._free(nbytes)


def record_served(count: int, nbytes: int) -> None:
    """A native steady schedule served ``count`` allocations of ``nbytes`` in all (whole
    steps, each leaving as much live as it found): totals only."""
    with _lock:
        for frame in (_process, *_stack):
            frame.total_count += count
            frame.total_bytes += nbytes


def memory_stats() -> dict[str, Any]:
    """Process-wide counters of umrt's pool and backend, and whether umrt acts.

    Keys: ``allocated_bytes`` (live, requested sizes), ``peak_allocated_bytes``,
    ``allocation_count``, ``reserved_bytes`` (managed memory the pool holds),
    ``resident_bytes`` (placed on the GPU by umrt; a lower bound),
    ``migrated_bytes`` (= ``h2d_bytes + d2h_bytes`` moved by umrt's prefetches),
    ``h2d_bytes``, ``d2h_bytes``, ``discarded_bytes``, ``populated_bytes``
    (pages umrt discarded, made resident again for a newborn without a copy),
    ``swapped_out_bytes`` / ``swapped_in_bytes`` (copied to pinned host memory and back:
    umrt's swap path, counted in ``d2h_bytes`` / ``h2d_bytes``
    too) and ``staging_bytes`` (the pinned host memory the swap path holds) (ints); ``swap_copy``
    (str: what copies swapped ranges, ``"sm"`` for umrt's SM copy kernel, ``"engines"`` for
    ``cudaMemcpyAsync``, ``""`` where ranges leave by migration: CUDA 12); ``cuda_calls`` (dict:
    CUDA runtime call name -> calls umrt issued, e.g. ``cudaMemPrefetchAsync``);
    ``acting`` (bool: the runtime is live and has not failed) and
    ``stopped_reason`` (str, or None while it acts or when it never ran);
    ``native_steady`` (dict: :class:`umrt.native.server.SteadyReport`, the native
    steady state's phase and counters; empty without a session); ``phases``
    (dict: loop phase, ``"train"`` or ``"eval"`` -> ``acting`` (False once acting
    was found to lose to doing nothing there: umrt then does nothing in that
    phase), ``stopped_because``, ``baseline_ms`` and ``acting_ms`` (median
    iteration times measured with CUDA events doing nothing and acting),
    ``acting_vs_baseline``, ``learned``, ``plans``, ``unsure`` (True while predictions kept
    failing there: umrt acts on none and only checks them), ``resting`` (True while its shapes
    never repeat: umrt records and plans none of its iterations); empty before the runtime runs). In the native
    steady state the byte and count keys advance at hand-backs only (they are
    the same at every step boundary while the schedule repeats); the
    :func:`statistics` totals count the allocations it served at each step. Diff
    two snapshots around a training step for what umrt issued per step.
    """
    pool: ReservesMemory | None = _sources["pool"]
    backend: CountsMoves | None = _sources["backend"]
    steady = _sources["steady"]
    phases_of = _sources["phases"]
    phases = phases_of() if phases_of is not None else {}  # outside the lock: the bridge takes its own
    h2d = d2h = resident = discarded = 0
    counters: dict = {}
    if backend is not None:
        h2d, d2h, discarded = int(backend.h2d_bytes), int(backend.d2h_bytes), int(backend.discarded_bytes)
        resident, counters = int(backend.resident_bytes()), backend.counters()
    with _lock:
        return {
            "allocated_bytes": _process.current_bytes,
            "peak_allocated_bytes": _process.peak_bytes,
            "allocation_count": _process.current_count,
            "reserved_bytes": int(pool.reserved_bytes()) if pool is not None else 0,
            "resident_bytes": resident,
            "migrated_bytes": h2d + d2h,
            "h2d_bytes": h2d,
            "d2h_bytes": d2h,
            "discarded_bytes": discarded,
            "populated_bytes": int(counters.get("populated_bytes", 0)),
            "swapped_out_bytes": int(counters.get("swapped_out_bytes", 0)),
            "swapped_in_bytes": int(counters.get("swapped_in_bytes", 0)),
            "staging_bytes": int(counters.get("staging_bytes", 0)),
            "swap_copy": str(counters.get("swap_copy", "")),
            "cuda_calls": dict(counters.get("calls", {})),
            "acting": _status.acting,
            "stopped_reason": _status.stopped_reason,
            "native_steady": dataclasses.asdict(steady.report) if steady is not None else {},
            "phases": phases,
        }


def reserved_bytes() -> int:
    """The managed memory umrt's pool holds (0 before a pool is attached)."""
    pool: ReservesMemory | None = _sources["pool"]
    return int(pool.reserved_bytes()) if pool is not None else 0


def process_statistics() -> Statistics:
    """A copy of the whole process's allocation counters (totals included)."""
    with _lock:
        return dataclasses.replace(_process)


def reset_accumulated_memory_stats() -> None:
    """Count the process's totals from now on (like torch's): what is live counts as made."""
    with _lock:
        _process.total_bytes = _process.current_bytes
        _process.total_count = _process.current_count


def reset_peak_memory_stats() -> None:
    """Set the process peak to the current allocated bytes (like torch's)."""
    with _lock:
        _process.peak_bytes = _process.current_bytes
        _process.peak_count = _process.current_count


def push_statistics() -> Statistics:
    """Start a new frame of counters; allocations are counted in every open frame."""
    frame = Statistics()
    with _lock:
        _stack.append(frame)
    return frame


def pop_statistics() -> Statistics:
    """Close the innermost frame and return its counters."""
    with _lock:
        if not _stack:
            raise RuntimeError("pop_statistics() without a matching push_statistics()")
        return _stack.pop()


def get_statistics() -> Statistics:
    """A copy of the innermost frame (or of the process counters when none is open)."""
    with _lock:
        return dataclasses.replace(_stack[-1] if _stack else _process)


@contextlib.contextmanager
def statistics() -> Iterator[Statistics]:
    """Count allocations made inside the block::

        with umrt.statistics() as stats:
            model(x).sum().backward()
        print(stats.peak_bytes)
    """
    frame = push_statistics()
    try:
        yield frame
    finally:
        with _lock:
            for i, open_frame in enumerate(_stack):
                if open_frame is frame:  # identity: equal counters are not the same frame
                    del _stack[i]
                    break
