"""What the runtime has swapped out: ranges whose data is only in pinned memory.

The runtime's plan copies a range out through the copy engines (``Backend.swap.out``)
and brings it back before its next reader (``swap.back``), at one decision; the kernels
wait for that copy (``swap.wait``) at the decision before the reader, often a later one.
Until then, nothing but that plan brings the data back or makes the kernels wait for it,
so wherever the runtime stops following the plan that swapped it, it restores every range
still away and waits for every copy back still unwaited (:meth:`Swapped.restore`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from umrt.backends.base import SwapPath
    from umrt.backends.ranges import RangeSet

Range = tuple[int, int]


class Swapped:
    """The swapped-out ranges (``ptr -> nbytes``) and the plan that swapped them
    (``signature``: its signature and whether it swaps; that plan brings them back). ``counters``: the runtime's
    (``swap_calls``, ``swapped_out_bytes``, ``swapped_in_bytes``, ``swap_restores``);
    ``off_gpu``: the runtime's set of ranges it took off the GPU."""

    def __init__(self, counters: dict, off_gpu: RangeSet) -> None:
        self.ranges: dict[int, int] = {}
        self.arriving: dict[int, int] = {}  # copied back, ptr -> nbytes; the kernels do not wait for them yet
        self.signature: tuple[int, bool] | None = None
        self._counters = counters
        self._off_gpu = off_gpu
        self._swap: SwapPath | None = None

    def connect(self, swap: SwapPath) -> None:
        """The backend's swap path (the runtime's ``attach``)."""
        self._swap = swap

    def __bool__(self) -> bool:
        return bool(self.ranges) or bool(self.arriving)

    def out(self, ranges: list[Range], nbytes: int, by: tuple[int, bool]) -> None:
        """Copy ``ranges`` (``nbytes`` of objects) to pinned memory, then discard them on the GPU;
        ``by``: the plan doing it (:attr:`signature`), the one that brings them back (a plan the
        guard switched to mid-step, say, not the one the step started on)."""
        self.signature = by
        self._swap.out(ranges)
        c = self._counters
        c["swap_calls"] += 1
        c["swapped_out_bytes"] += nbytes
        for p, n in ranges:
            self._off_gpu.add(p, n)
            self.ranges[p] = n

    def back(self, ranges: list[Range], nbytes: int) -> None:
        """Populate ``ranges`` on the GPU and copy back what of them was swapped out (the rest is prefetched)."""
        self._swap.back(ranges)
        c = self._counters
        c["swap_calls"] += 1
        c["swapped_in_bytes"] += nbytes
        for p, n in ranges:
            self._off_gpu.remove(p, n)
            self.ranges.pop(p, None)
            self.arriving[p] = n

    def ready(self, ranges: list[Range]) -> None:
        """The kernels queued from now on wait for the copies back into ``ranges``."""
        self._swap.wait(ranges)
        if self.arriving:
            waited = [p for p, n in self.arriving.items() if any(q < p + n and p < q + m for q, m in ranges)]
            for p in waited:
                del self.arriving[p]

    def restore(self) -> None:
        """Copy back every range still swapped out, and make the kernels queued from now on
        wait for it and for every copy back not waited for yet: the plan that would have
        brought them back, or made its readers wait, is no longer followed."""
        if not self.ranges and not self.arriving:
            return
        ranges = list(self.ranges.items())
        self.ranges.clear()
        if ranges:
            self._swap.back(ranges)
            for p, n in ranges:
                self._off_gpu.remove(p, n)
        waits = sorted([*ranges, *self.arriving.items()])
        self.arriving.clear()
        self._swap.wait(waits)
        self._counters["swap_restores"] += 1

    def forget(self, start: int, end: int, *, release: bool) -> None:
        """The ranges inside ``[start, end)`` died (an object freed, ``release``: their pinned
        copies are dropped too) or left with their segment: nothing is brought back."""
        gone = [(p, n) for p, n in self.ranges.items() if start <= p < end]
        for p, _ in gone:
            del self.ranges[p]
        for p in [p for p in self.arriving if start <= p < end]:
            del self.arriving[p]
        if gone and release:
            self._swap.release(gone)
