"""umrt's managed pool: the seam between framework allocators and the backend.

Framework shims (:mod:`umrt.allocators.torch`, :mod:`umrt.allocators.cupy`)
only need ``malloc(nbytes, stream) -> ptr`` and ``free(ptr)``.
:class:`ManagedPool` provides them over any :class:`umrt.memory.base.Layout`
placed on a backend's managed memory (by default umrt's ``LifetimePool``).
A layout that reuses a dead block *in place* for the next allocation of its
size is what makes the CUDA 12 discard fallback work: its stale pages are
overwritten where they are instead of being migrated.

Blocks are reused only on the stream they were allocated on (one layout per
stream), which keeps reuse stream-ordered without synchronising, like
PyTorch's caching allocator. A block used on other streams too (torch's
``Tensor.record_stream``, :meth:`ManagedPool.record_stream`) is, at its free,
ordered after those streams' work so far, as the caching allocator does with
an event per recorded stream: its stream waits for an event recorded on each,
so neither its next owner nor a discard of it can run before them. Work done
at a free (a discard) goes to the block's own stream: the backend's compute
stream is that stream for the length of the free.

The pool knows no kind at ``malloc`` (each block is announced to its layout
as :attr:`Kind.OTHER`, which the default ``LifetimePool(live_feed=True)``
reads as unknown). What lets the layout plan comes from the live bridge
(:class:`umrt.drive.live.LiveBridge`): :meth:`ManagedPool.observe` (iteration
boundaries, layer events) and :meth:`ManagedPool.hint_kind` (what a block
turned out to hold). Layouts without ``observe`` / ``hint_kind`` (the
caching-allocator model) simply do not get them.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from umrt import stats
from umrt.backends.cuda import CudaBackend
from umrt.errors import CudaError
from umrt.memory.base import LearningLayout, PlanningLayout
from umrt.memory.caching import LayoutError
from umrt.memory.pool import LifetimePool
from umrt.trace.events import Event, IterationBoundary, Kind, LayerEnter, LayerExit


class ManagedOutOfMemoryError(CudaError):
    """The backend could not allocate more managed memory (host and device are full)."""


def default_layout_factory(backend: Any) -> Any:
    """umrt's lifetime-aware pool as an allocator feeds it, ``LifetimePool(backend, live_feed=True)``."""
    return LifetimePool(backend, live_feed=True)


class ManagedPool:
    """Managed-memory pool over a backend.

    Args:
        backend: a :class:`umrt.backends.base.Backend` (``CudaBackend`` on a GPU).
        layout_factory: ``callable(backend) -> Layout``; default :func:`default_layout_factory`.

    ``listeners`` receive ``("alloc", ptr, nbytes)`` / ``("free", ptr, nbytes)``
    (the object registry of the runtime subscribes here). ``before_malloc``
    hooks receive ``nbytes`` before the block is placed (the live bridge opens
    an iteration there, so the layout counts the block in it); they must not
    raise.
    """

    def __init__(self, backend: Any, layout_factory: Callable[[Any], Any] | None = None, *,
                 populate_limit: int = 0) -> None:
        self.backend = backend
        self._factory = layout_factory or default_layout_factory
        # New segments are populated on the GPU as they are made (one prefetch each:
        # no copy, ~11 ms per 2 GiB on the H100, where first-touch faults populate at
        # 3.4-8 GB/s) while the populated segments fit this many bytes (the budget).
        self.populate_limit = populate_limit
        self.stopped_planning: str | None = None  # why the layouts stopped planning (stop_planning)
        self._stopped_budget: int | None = None  # the GPU memory stop_planning was told of
        self._unplanned = False  # the iteration now is served best-fit (serve_unplanned)
        self._populated: dict[int, int] = {}  # segment -> bytes populated at its making
        self._segments: dict[int, int] = {}  # segment -> bytes, of every layout
        self._held = self._peak_held = 0  # their bytes, now and at most
        self._layouts: dict[Any, Any] = {}  # stream -> layout
        self._live: dict[int, tuple[Any, int, int]] = {}  # ptr -> (layout, obj, nbytes); obj 0: adopted
        self._block_stream: dict[int, Any] = {}  # ptr -> the stream it was allocated on
        self._used_on: dict[int, set] = {}  # ptr -> other streams it was used on (record_stream)
        self._retired: list[Any] = []  # layouts that place nothing any more (retire_layout)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # torch frees from the autograd thread too
        # A free that arrives while this thread is inside the pool (Python's garbage
        # collector can release a tensor in the middle of a layout call) waits until
        # the pool is done, so a layout is never re-entered half-way.
        self._busy = 0
        self._deferred: list[int] = []
        self._stream: Any = None  # the stream of the last allocation (the backend's compute stream)
        self.listeners: list[Callable[[str, int, int], None]] = []
        self.before_malloc: list[Callable[[int], None]] = []
        # What a layout made later (a stream's first malloc) is told first: the iteration
        # and the modules running, as observed so far.
        self._boundary: Event | None = None
        self._open_layers: list[Event] = []

    def malloc(self, nbytes: int, stream: Any = 0) -> int:
        """A managed block of at least ``nbytes``; ``0`` for a zero-byte request."""
        if nbytes < 0:
            raise ValueError(f"malloc of {nbytes} bytes")
        if nbytes == 0:
            return 0
        if stream != self._stream:
            # The program's kernels now run on this stream (torch passes its current one):
            # work ordered with kernels (a discard of a dead range this block may reuse) goes there.
            self._stream = stream
            if isinstance(self.backend, CudaBackend):
                self.backend.set_compute_stream(stream)
        for hook in self.before_malloc:
            hook(nbytes)
        with self._lock:
            self._busy += 1
            try:
                layout = self._layouts.get(stream)
                if layout is None:
                    layout = self._layouts[stream] = self._new_layout()
                obj = next(self._ids)
                try:
                    ptr = layout.alloc(obj, nbytes, Kind.OTHER)
                except CudaError as exc:
                    raise ManagedOutOfMemoryError(
                        f"out of managed memory allocating {nbytes} bytes "
                        f"(umrt holds {self.reserved_bytes()} bytes): {exc}"
                    ) from exc
                self._live[ptr] = (layout, obj, nbytes)
                self._block_stream[ptr] = stream
            finally:
                self._busy -= 1
        stats.record_alloc(nbytes)
        for listener in self.listeners:
            listener("alloc", ptr, nbytes)
        self._free_deferred()
        return ptr

    def record_stream(self, ptr: int, stream: Any) -> None:
        """The live block at ``ptr`` is used on ``stream`` too (torch's ``Tensor.record_stream``):
        at its free, its stream is ordered after ``stream``'s work so far.

        Raises:
            CudaError: no live block of this pool starts at ``ptr``.
        """
        with self._lock:
            if ptr not in self._live:
                raise CudaError(f"record_stream of {ptr:#x}, which is not a live block of umrt's pool")
            if stream != self._block_stream.get(ptr, stream):
                self._used_on.setdefault(ptr, set()).add(stream)

    def free(self, ptr: int) -> None:
        """Return a block; it stays cached for reuse on its stream (after the work of the
        other streams it was used on, :meth:`record_stream`)."""
        if ptr == 0:
            return
        with self._lock:
            if self._busy:  # re-entered from inside the pool on this thread: later
                self._deferred.append(ptr)
                return
            self._busy += 1
            try:
                try:
                    layout, obj, nbytes = self._live.pop(ptr)
                except KeyError:
                    raise CudaError(f"free of {ptr:#x}, which umrt's pool did not allocate") from None
                stream = self._block_stream.pop(ptr, self._stream)
                users = self._used_on.pop(ptr, ())
                follows = isinstance(self.backend, CudaBackend)
                if follows:
                    for other in users:  # its next owner (on its stream) and its discard wait for them
                        self.backend.order_after(stream, other)
                switched = follows and stream != self._stream
                if switched:  # work done at the free (a discard) goes where the block was used
                    self.backend.set_compute_stream(stream)
                if obj:
                    layout.free(obj)
            finally:
                self._busy -= 1
        try:
            stats.record_free(nbytes)
            for listener in self.listeners:
                listener("free", ptr, nbytes)
        finally:
            if switched:  # back to the program's stream, ordered after the block's
                self.backend.set_compute_stream(self._stream)
        self._free_deferred()

    def _free_deferred(self) -> None:
        """The frees that arrived while the pool was busy on this thread."""
        while True:
            with self._lock:
                if self._busy or not self._deferred:
                    return
                ptr = self._deferred.pop(0)
            self.free(ptr)

    def observe(self, event: Event) -> None:
        """Pass one program event (an iteration boundary, a layer event) to every
        stream's layout that reads events (``layout.observe``)."""
        with self._lock:
            self._busy += 1
            try:
                if isinstance(event, IterationBoundary):
                    self._boundary, self._open_layers = event, []
                elif isinstance(event, LayerEnter):
                    self._open_layers.append(event)
                elif isinstance(event, LayerExit) and self._open_layers:
                    self._open_layers.pop()
                for layout in self._layouts.values():
                    if isinstance(layout, LearningLayout):
                        layout.observe(event)  # a boundary may plan: no free half-way through it
            finally:
                self._busy -= 1
        self._free_deferred()

    def _new_layout(self) -> Any:
        layout = self._factory(_Segments(self))
        if isinstance(layout, LifetimePool) and layout.needs_plan is None:
            layout.needs_plan = self.needs_plan
        if isinstance(layout, LearningLayout) and self._boundary is not None:
            for event in (self._boundary, *self._open_layers):
                layout.observe(event)
        if self.stopped_planning is not None and isinstance(layout, PlanningLayout):
            layout.stop_planning(self.stopped_planning, self._stopped_budget)
        if self._unplanned and isinstance(layout, PlanningLayout):
            layout.serve_unplanned(True)
        return layout

    def stop_planning(self, why: str, budget_bytes: int | None = None) -> None:
        """Every stream's layout that plans (umrt's pool) serves best-fit from now on, as a
        caching allocator does, and so does each layout made later; live blocks stay where
        they are. The live bridge calls it when umrt stops acting in training steps
        (``budget_bytes``: :meth:`umrt.memory.pool.LifetimePool.stop_planning`'s)."""
        with self._lock:
            if self.stopped_planning is None:
                self.stopped_planning, self._stopped_budget = why, budget_bytes
            for layout in self._layouts.values():
                if isinstance(layout, PlanningLayout):
                    layout.stop_planning(why, budget_bytes)

    def resume_planning(self) -> None:
        """Every stream's layout that stopped planning for :meth:`stop_planning` plans
        again from its next training step, and so does each layout made later."""
        with self._lock:
            self.stopped_planning = self._stopped_budget = None
            for layout in self._layouts.values():
                if isinstance(layout, PlanningLayout):
                    layout.resume_planning()

    def serve_unplanned(self, unplanned: bool) -> None:
        """Whether every stream's layout that plans serves the iteration starting now
        best-fit, its plan kept (:meth:`umrt.memory.pool.LifetimePool.serve_unplanned`)."""
        with self._lock:
            self._unplanned = unplanned
            for layout in self._layouts.values():
                if isinstance(layout, PlanningLayout):
                    layout.serve_unplanned(unplanned)

    def hint_kind(self, ptr: int, kind: Kind) -> bool:
        """Tell the layout holding the live block that starts at ``ptr`` what it holds.

        Returns False, doing nothing, when no live block of this pool starts at
        ``ptr`` (memory umrt did not allocate) or its layout takes no hints.

        Raises:
            LayoutError: ``kind`` is not a :class:`~umrt.trace.events.Kind`.
        """
        try:
            kind = Kind(kind)
        except ValueError:
            raise LayoutError(f"kind hint for block {ptr:#x}: unknown kind {kind!r}") from None
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return False
            layout, obj, _ = entry
            if not obj or not isinstance(layout, LifetimePool):
                return False
            layout.hint_kind(obj, kind)
            return True

    def size_of(self, ptr: int) -> int:
        """Requested bytes of a live block."""
        return self._live[ptr][2]

    def peak_reserved_bytes(self) -> int:
        """The most managed bytes the layouts have held at once."""
        return self._peak_held

    def needs_plan(self, _layout_peak: int) -> bool:
        """Whether a layout should plan where its objects go (the moves umrt makes need
        it): not while all the pool has held fits ``populate_limit``, the GPU memory the run
        has (nothing then has to move), nor a plan's region added to it; always without one."""
        return self.populate_limit <= 0 or self._peak_held > self.populate_limit

    def reserved_bytes(self) -> int:
        """Managed bytes obtained from the backend (the layouts' footprints)."""
        with self._lock:
            return sum(layout.footprint() for layout in (*self._layouts.values(), *self._retired))

    @property
    def stream(self) -> Any:
        """The stream of the last allocation (torch's current stream)."""
        return self._stream

    def live_blocks(self) -> dict[int, int]:
        """Every live block: start -> requested bytes."""
        with self._lock:
            return {ptr: entry[2] for ptr, entry in self._live.items()}

    def retire_layout(self, stream: Any) -> None:
        """New allocations on ``stream`` come from a fresh layout from now on.

        The old layout keeps its segments and its live blocks (their frees still
        reach it) but never places a block again: what it thinks is free may be in
        use (a catch-up after the native steady state found Python's view of the
        layout off, :class:`umrt.native.server.SteadyServer`). Its memory is given
        back only when the process ends.
        """
        with self._lock:
            old = self._layouts.pop(stream, None)
            if old is not None:
                self._retired.append(old)

    def adopt(self, ptr: int, nbytes: int) -> None:
        """Count a block the pool did not place as live (served natively while Python
        did not follow). Retire the layout its memory came from first
        (:meth:`retire_layout`): it must never hand that memory out. Its free only
        forgets it; the listeners are not told (the caller tells the runtime).

        Raises:
            CudaError: a live block already starts at ``ptr``.
        """
        with self._lock:
            if ptr in self._live:
                raise CudaError(f"adopting {ptr:#x}: the pool already has a live block there")
            self._live[ptr] = (None, 0, nbytes)

    def empty_cache(self) -> None:
        """Give cached, unused memory back where the layout supports it (``release()``)."""
        with self._lock:
            for layout in self._layouts.values():
                if isinstance(layout, LifetimePool):
                    layout.release()


class _Segments:
    """The backend as a pool's layout sees it: each segment it makes is populated on
    the GPU at once while the pool's populated segments fit ``populate_limit``."""

    def __init__(self, pool: ManagedPool) -> None:
        self._pool = pool
        self._b = pool.backend

    def malloc(self, nbytes: int) -> int:
        ptr = self._b.malloc(nbytes)
        pool = self._pool
        pool._segments[ptr] = nbytes
        pool._held += nbytes
        pool._peak_held = max(pool._peak_held, pool._held)
        if sum(pool._populated.values()) + nbytes <= pool.populate_limit:
            self._b.populate([(ptr, nbytes)])
            pool._populated[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        pool = self._pool
        pool._populated.pop(ptr, None)
        pool._held -= pool._segments.pop(ptr, 0)
        self._b.free(ptr)

    def __getattr__(self, name: str) -> Any:  # prefetch, device, mem_info, ...
        return getattr(self._b, name)
