"""The ``cuda`` backend's range bookkeeping: its managed allocations and what it placed on the GPU.

:class:`Allocations` answers which allocation holds an address, validates and
merges the ranges a call names (each must lie inside one allocation), and
keeps the bytes umrt itself placed on the GPU (prefetched and not evicted;
demand faults are invisible to the runtime).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from umrt.backends.base import Range
from umrt.errors import CudaError

__all__ = ["Allocations"]


class Allocations:
    """Live managed allocations (``ptr -> nbytes``) and the residency set.

    ``merge_across_allocations``: :meth:`checked` merges ranges of two allocations
    that touch in the address space (see :class:`umrt.backends.cuda.CudaBackend`).
    """

    def __init__(self, merge_across_allocations: bool = False) -> None:
        self.merge_across_allocations = merge_across_allocations
        self._allocs: dict[int, int] = {}  # ptr -> nbytes
        self._starts: list[int] = []  # sorted allocation starts, for range lookups
        self._resident: list[Range] = []  # disjoint, sorted: what umrt placed on the GPU

    def add(self, ptr: int, nbytes: int) -> None:
        """A new allocation."""
        self._allocs[ptr] = nbytes
        bisect.insort(self._starts, ptr)

    def remove(self, ptr: int) -> int:
        """Forget the allocation at ``ptr`` (and its residency); return its size."""
        nbytes = self._allocs.pop(ptr)
        self._starts.pop(bisect.bisect_left(self._starts, ptr))
        self.place([(ptr, nbytes)], on_device=False)
        return nbytes

    def __contains__(self, ptr: int) -> bool:
        """Whether an allocation starts at ``ptr``."""
        return ptr in self._allocs

    def __iter__(self) -> Iterator[int]:
        """The allocations' addresses (a snapshot: the caller may free them meanwhile)."""
        return iter(list(self._allocs))

    def size(self, ptr: int) -> int:
        """The size of the allocation starting at ``ptr``."""
        return self._allocs[ptr]

    def allocation_of(self, ptr: int) -> tuple[int, int] | None:
        """``(base, nbytes)`` of the managed allocation holding ``ptr``, or None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        base = self._starts[i]
        size = self._allocs[base]
        return (base, size) if ptr < base + size else None

    def checked(self, call: str, ranges: Sequence[Range]) -> list[Range]:
        """Validate that each range lies inside one allocation; merge overlapping and
        touching ranges (across allocations only with ``merge_across_allocations``)."""
        out: list[Range] = []
        for ptr, n in sorted((int(p), int(n)) for p, n in ranges):
            if n <= 0:
                raise CudaError(f"{call}: empty or negative range ({ptr:#x}, {n})")
            alloc = self.allocation_of(ptr)
            if alloc is None or ptr + n > alloc[0] + alloc[1]:
                raise CudaError(f"{call}: range ({ptr:#x}, {n}) is not inside one managed allocation of this backend")
            if out:
                start, end = out[-1][0], out[-1][0] + out[-1][1]
                # A range that starts at or before the previous one's end: the same allocation
                # (overlapping or touching), or the next one, right where the previous ends.
                if end >= ptr and (alloc[0] <= start or (self.merge_across_allocations and end == ptr)):
                    out[-1] = (start, max(end, ptr + n) - start)
                    continue
            out.append((ptr, n))
        return out

    def place(self, ranges: Sequence[Range], on_device: bool) -> None:
        """Add ``ranges`` to (or cut them from) the sorted, disjoint residency set."""
        res = self._resident
        for ptr, n in ranges:
            end = ptr + n
            i = bisect.bisect_right(res, (ptr, float("inf"))) - 1
            if i < 0 or res[i][0] + res[i][1] <= ptr:
                i += 1
            j = bisect.bisect_left(res, (end, -1))
            hit = res[i:j]  # intervals overlapping [ptr, end)
            if on_device:
                if hit:
                    ptr, end = min(ptr, hit[0][0]), max(end, hit[-1][0] + hit[-1][1])
                res[i:j] = [(ptr, end - ptr)]
            else:
                pieces = []
                if hit and hit[0][0] < ptr:
                    pieces.append((hit[0][0], ptr - hit[0][0]))
                if hit and hit[-1][0] + hit[-1][1] > end:
                    pieces.append((end, hit[-1][0] + hit[-1][1] - end))
                res[i:j] = pieces

    def resident_bytes(self) -> int:
        """Bytes umrt placed on the GPU and has not evicted."""
        return sum(n for _, n in self._resident)
