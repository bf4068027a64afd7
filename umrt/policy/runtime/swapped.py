"""What the runtime has swapped out: ranges whose data is only in pinned memory.

The runtime's plan copies a range out through the copy engines (``Backend.swap.out``)
and brings it back before its next reader (``swap.back``). Until then, nothing but
that plan brings the data back, so the runtime restores every range here wherever it
stops following the plan that swapped it (:meth:`Swapped.restore`).
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
        self.signature: tuple[int, bool] | None = None
        self._counters = counters
        self._off_gpu = off_gpu
        self._swap: SwapPath | None = None

    def connect(self, swap: SwapPath) -> None:
        """The backend's swap path (the runtime's ``attach``)."""
        self._swap = swap

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def out(self, ranges: list[Range], nbytes: int) -> None:
        """Copy ``ranges`` (``nbytes`` of objects) to pinned memory, then discard them on the GPU."""
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

    def restore(self) -> None:
        """Copy back every range still swapped out, and make the kernels queued from now on
        wait for it: the plan that would have brought them back is no longer followed."""
        if not self.ranges:
            return
        ranges = list(self.ranges.items())
        self.ranges.clear()
        self._swap.back(ranges)
        self._swap.wait(ranges)
        for p, n in ranges:
            self._off_gpu.remove(p, n)
        self._counters["swap_restores"] += 1

    def forget(self, start: int, end: int, *, release: bool) -> None:
        """The ranges inside ``[start, end)`` died (an object freed, ``release``: their pinned
        copies are dropped too) or left with their segment: nothing is brought back."""
        gone = [(p, n) for p, n in self.ranges.items() if start <= p < end]
        for p, _ in gone:
            del self.ranges[p]
        if gone and release:
            self._swap.release(gone)
