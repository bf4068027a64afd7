"""A set of byte ranges: sorted, disjoint ``[start, end)`` intervals.

What the act layer keeps about memory it moved (the runtime's pages that are
not on the GPU because umrt discarded or evicted them, the backend's
residency) is a set of byte ranges; :class:`RangeSet` adds, removes and takes
them out by overlap in ``O(log n + k)`` for ``k`` intervals touched.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

Range = tuple[int, int]  # (ptr, nbytes), as umrt.backends.base.Range


class RangeSet:
    """Sorted, disjoint, merged ``[start, end)`` intervals."""

    __slots__ = ("_starts", "_ends")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __bool__(self) -> bool:
        return bool(self._starts)

    @property
    def ends(self) -> list[int]:
        """The intervals' ends, in order (the list itself: empty when the set is;
        for a hot path's truth test, read only)."""
        return self._ends

    def overlaps(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` overlaps the set."""
        i = bisect.bisect_right(self._ends, ptr)
        return i < len(self._starts) and self._starts[i] < ptr + nbytes

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[Range]:
        """The intervals as ``(ptr, nbytes)``, in address order."""
        return ((s, e - s) for s, e in zip(self._starts, self._ends, strict=True))

    def nbytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def _span(self, start: int, end: int) -> tuple[int, int]:
        """Indices ``[i, j)`` of the intervals overlapping or touching ``[start, end]``."""
        i = bisect.bisect_left(self._ends, start)
        j = bisect.bisect_right(self._starts, end)
        return i, j

    def add(self, ptr: int, nbytes: int) -> None:
        """Add ``[ptr, ptr + nbytes)``, merging with what it overlaps or touches."""
        if nbytes <= 0:
            return
        start, end = ptr, ptr + nbytes
        i, j = self._span(start, end)
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def take(self, ptr: int, nbytes: int) -> list[Range]:
        """Remove ``[ptr, ptr + nbytes)`` and return the parts of it that were in the set."""
        if nbytes <= 0 or not self._starts:
            return []
        start, end = ptr, ptr + nbytes
        i = bisect.bisect_right(self._ends, start)  # first interval ending after start
        j = bisect.bisect_left(self._starts, end)  # first interval starting at or after end
        if i >= j:
            return []
        taken = [(max(s, start), min(e, end)) for s, e in zip(self._starts[i:j], self._ends[i:j], strict=True)]
        keep_s: list[int] = []
        keep_e: list[int] = []
        if self._starts[i] < start:
            keep_s.append(self._starts[i])
            keep_e.append(start)
        if self._ends[j - 1] > end:
            keep_s.append(end)
            keep_e.append(self._ends[j - 1])
        self._starts[i:j] = keep_s
        self._ends[i:j] = keep_e
        return [(s, e - s) for s, e in taken]

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether all of ``[ptr, ptr + nbytes)`` is in the set."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and self._ends[i] >= ptr + nbytes

    def gaps(self, ptr: int, nbytes: int) -> list[Range]:
        """The parts of ``[ptr, ptr + nbytes)`` not in the set, in address order."""
        end = ptr + nbytes
        i = bisect.bisect_right(self._ends, ptr)  # first interval ending after ptr
        out: list[Range] = []
        cursor = ptr
        starts, ends = self._starts, self._ends
        while cursor < end and i < len(starts) and starts[i] < end:
            if starts[i] > cursor:
                out.append((cursor, starts[i] - cursor))
            cursor = max(cursor, ends[i])
            i += 1
        if cursor < end:
            out.append((cursor, end - cursor))
        return out

    def first_gap(self, ptr: int, nbytes: int) -> int:
        """The first byte of ``[ptr, ptr + nbytes)`` not in the set (``ptr + nbytes`` if none)."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        end = self._ends[i] if i >= 0 and self._ends[i] > ptr else ptr
        return min(end, ptr + nbytes)

    def remove(self, ptr: int, nbytes: int) -> None:
        """Remove ``[ptr, ptr + nbytes)`` from the set."""
        self.take(ptr, nbytes)

    def add_all(self, ranges: Iterable[Range]) -> None:
        """Add each ``(ptr, nbytes)`` of ``ranges``."""
        for ptr, nbytes in ranges:
            self.add(ptr, nbytes)

    def remove_all(self, ranges: Iterable[Range]) -> None:
        """Remove each ``(ptr, nbytes)`` of ``ranges``."""
        for ptr, nbytes in ranges:
            self.take(ptr, nbytes)

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
