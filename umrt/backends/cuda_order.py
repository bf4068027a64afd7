"""How the ``cuda`` backend orders its streams: counted runtime calls and events.

:class:`CountedCalls` issues every runtime call the backend makes and counts
it under its CUDA name. :class:`StreamOrder` keeps the events that order the
backend's *copy stream* (prefetches, evictions) against the kernels' *compute
stream* and the streams discards run on (see the module docstring of
:mod:`umrt.backends.cuda`): the copies queued on each range until a kernel
(or a discard) is made to wait for them, and the discards the copy stream is
not yet ordered after.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from umrt.backends.base import Range

__all__ = ["LEGACY_STREAMS", "MAX_PENDING", "CountedCalls", "StreamOrder", "is_legacy_stream", "same_stream",
           "stream_key"]

MAX_PENDING = 256  # copy-stream events awaiting a kernel before they are folded together
LEGACY_STREAMS = (0, 1)  # the NULL stream and cudaStreamLegacy (driver_types.h): the legacy default stream


def stream_key(stream: Any) -> Any:
    """A stream handle as a dict key: its integer value (ints, ``cudaStream_t``), else the object."""
    try:
        return int(stream)
    except (TypeError, ValueError):
        return stream


def is_legacy_stream(stream: Any) -> bool:
    """Whether a stream handle is the legacy default stream: ``0`` or ``cudaStreamLegacy`` (1)."""
    return stream_key(stream) in LEGACY_STREAMS


def same_stream(a: Any, b: Any) -> bool:
    """Whether two handles name the same stream."""
    return a is b or stream_key(a) == stream_key(b)


def overlaps(a: Sequence[Range], b: Sequence[Range]) -> bool:
    """Whether any range of ``a`` overlaps any range of ``b``."""
    x = np.array(a, dtype=np.int64).reshape(-1, 2)
    y = np.array(b, dtype=np.int64).reshape(-1, 2)
    return bool(((x[:, None, 0] < y[None, :, 0] + y[None, :, 1]) & (y[None, :, 0] < x[:, None, 0] + x[:, None, 1])).any())


class CountedCalls:
    """Makes runtime calls through an adapter, counting each under its CUDA name in :attr:`counts`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, counted as one ``name`` call."""
        self.counts[name] += 1
        return fn(*args)


class StreamOrder:
    """The events between ``copy_stream``, the compute stream and the discard streams.

    ``api`` is the runtime adapter (:class:`umrt.backends.cuda.CudaApi`), ``call``
    the backend's :class:`CountedCalls`.
    """

    def __init__(self, api: Any, call: CountedCalls, copy_stream: Any) -> None:
        self.api = api
        self._call = call
        self.copy_stream = copy_stream
        # Work queued on the copy stream, oldest first: (event, entry number), and the ranges
        # of all of it as arrays (start, end, entry number) so launch() tests them at once.
        self.pending: list[tuple[Any, int]] = []
        self._next_entry = 0
        self._p_start = self._p_end = self._p_entry = np.empty(0, dtype=np.int64)
        # Spare events by handle, the lowest handed out first: which handle a call gets
        # depends only on which are spare, not on the order they were given back, so a
        # steady iteration makes the same calls with the same handles every time (a native
        # schedule replays them, umrt.native).
        self._spare_events: dict[int, Any] = {}
        self._spare_order: list[int] = []  # a heap of the spare handles
        # Ranges discarded that the copy stream is not yet ordered after, and per stream that
        # discarded, an event recorded after its newest discard.
        self._discarded: list[Range] = []
        self._discard_events: dict[Any, Any] = {}

    # -- events ------------------------------------------------------------------
    def event(self) -> Any:
        """A spare event, or a new one."""
        if self._spare_order:
            return self._spare_events.pop(heapq.heappop(self._spare_order))
        return self._call("cudaEventCreateWithFlags", self.api.create_event)

    def _spare(self, *events: Any) -> None:
        """Give events back for reuse."""
        for event in events:
            key = int(event)
            if key not in self._spare_events:
                self._spare_events[key] = event
                heapq.heappush(self._spare_order, key)

    def record(self, event: Any, stream: Any) -> None:
        self._call("cudaEventRecord", self.api.record_event, event, stream)

    def wait(self, stream: Any, event: Any) -> None:
        self._call("cudaStreamWaitEvent", self.api.stream_wait_event, stream, event)

    def stream_after(self, waiter: Any, source: Any) -> None:
        """Order everything queued on ``waiter`` from now on after the work queued on ``source`` so far."""
        event = self.event()
        self.record(event, source)
        self.wait(waiter, event)
        # Recording an event only snapshots the stream's work, so it can be reused at once.
        self._spare(event)

    # -- copies ------------------------------------------------------------------
    def copied(self, ranges: list[Range], compute_stream: Any) -> None:
        """Copies of ``ranges`` were just queued on the copy stream: remember them with an event."""
        event = self.event()
        self.record(event, self.copy_stream)
        entry = self._next_entry
        self._next_entry += 1
        self.pending.append((event, entry))
        r = np.array(ranges, dtype=np.int64).reshape(-1, 2)
        self._p_start = np.concatenate((self._p_start, r[:, 0]))
        self._p_end = np.concatenate((self._p_end, r[:, 0] + r[:, 1]))
        self._p_entry = np.concatenate((self._p_entry, np.full(len(r), entry, dtype=np.int64)))
        if len(self.pending) > MAX_PENDING:
            # Ranges no kernel touched for a long time: order the compute stream after all
            # of them at once (the newest event covers the rest) to keep launch() cheap.
            self.wait(compute_stream, event)
            self._spare(*(ev for ev, _ in self.pending))
            self._clear_pending()

    def wait_copies(self, stream: Any, touched: Sequence[Range]) -> None:
        """Make ``stream`` wait for the copies queued on any of ``touched``.

        The copies it is then ordered after are forgotten: ``stream`` is the compute
        stream, or the discard stream, whose work the compute stream's later kernels
        come after (same stream, or the legacy stream's implicit synchronization)."""
        if not self.pending or not touched:
            return
        t = np.array(touched, dtype=np.int64).reshape(-1, 2)
        # [start, end) overlaps [p, p + n): start < p + n and p < end
        hit = ((self._p_start[:, None] < t[:, 0] + t[:, 1]) & (t[:, 0] < self._p_end[:, None])).any(axis=1)
        if not hit.any():
            return
        newest = int(self._p_entry[hit].max())
        last = newest - self.pending[0][1]
        # Copy-stream order: waiting on the latest overlapping event covers all earlier ones.
        self.wait(stream, self.pending[last][0])
        self._spare(*(ev for ev, _ in self.pending[: last + 1]))
        del self.pending[: last + 1]
        keep = int(np.searchsorted(self._p_entry, newest, side="right"))
        self._p_start, self._p_end, self._p_entry = self._p_start[keep:], self._p_end[keep:], self._p_entry[keep:]

    def _clear_pending(self) -> None:
        self.pending.clear()
        self._p_start = self._p_end = self._p_entry = np.empty(0, dtype=np.int64)

    # -- discards ----------------------------------------------------------------
    def discarded(self, stream: Any, ranges: list[Range]) -> None:
        """Remember a discard or discard-and-prefetch with an event after it, until the
        copy stream is ordered after it: a copy of these ranges must not run at the
        same time. (Populates run on the compute stream, which evictions follow.)"""
        # The stream's event is recorded again (a wait takes an event's state when it is
        # enqueued, so earlier waits keep theirs): the same handle every time, so a steady
        # iteration's calls repeat exactly (umrt.native replays them).
        event = self._discard_events.get(stream_key(stream))
        if event is None:
            event = self._discard_events[stream_key(stream)] = self.event()
        self.record(event, stream)
        self._discarded.extend(ranges)
        if len(self._discarded) > MAX_PENDING:
            self.copy_after_discards()

    def discard_running(self, ranges: Sequence[Range]) -> bool:
        """Whether a discard the copy stream is not yet ordered after touches ``ranges``."""
        return bool(self._discarded) and overlaps(self._discarded, ranges)

    def copy_after_discards(self) -> None:
        """Order the copy stream after the discards queued so far (not after later kernels)."""
        for event in self._discard_events.values():
            self.wait(self.copy_stream, event)
            self._spare(event)
        self._discard_events.clear()
        self._discarded.clear()

    def synchronized(self) -> None:
        """Every stream was synchronized: nothing is pending, every event is spare."""
        self._spare(*(ev for ev, _ in self.pending))
        self._clear_pending()
        self._spare(*self._discard_events.values())
        self._discard_events.clear()
        self._discarded.clear()
