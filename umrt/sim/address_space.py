"""The simulated GPU's managed address space and what its bytes hold.

:class:`AddressSpace` hands out 2 MB-aligned allocations from
:data:`~umrt.sim.engine_state.VA_BASE` (bump allocation with first-fit
reuse of freed blocks) and turns byte ranges into the 64 KB page spans the
engine works on. :class:`DefinedBytes` tracks which bytes hold data, apart
from where their pages are: a byte is *defined* once written (by a launch or
the host) and undefined again when discarded, freed or marked dead; a launch
that reads an undefined byte raises :class:`~umrt.errors.DataIntegrityError`.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

from umrt.backends.base import Range
from umrt.backends.ranges import RangeSet
from umrt.errors import DataIntegrityError
from umrt.sim import engine as E
from umrt.sim.engine_state import VA_BASE

__all__ = ["AddressSpace", "DefinedBytes"]


class AddressSpace:
    """Live managed allocations, 2 MB aligned, and the blocks handed out so far (:attr:`top`)."""

    def __init__(self) -> None:
        self.top = 0  # blocks handed out so far
        self._holes: list[tuple[int, int]] = []  # freed blocks: (first block, count), sorted
        self._allocs: dict[int, int] = {}  # ptr -> nbytes
        self._starts: list[int] = []  # sorted ptrs

    def allocate(self, nbytes: int) -> int:
        """Place an allocation of ``nbytes`` (> 0): the first hole that holds it, else past :attr:`top`."""
        nb = -(-nbytes // E.BLOCK)
        first = None
        for i, (start, count) in enumerate(self._holes):
            if count >= nb:
                first = start
                self._holes[i : i + 1] = [(start + nb, count - nb)] if count > nb else []
                break
        if first is None:
            first = self.top
            self.top += nb
        ptr = VA_BASE + first * E.BLOCK
        self._allocs[ptr] = nbytes
        self._starts.insert(bisect_left(self._starts, ptr), ptr)
        return ptr

    def release(self, ptr: int) -> tuple[int, int]:
        """Forget the allocation at ``ptr``; return its blocks ``(first, count)``, now a hole."""
        nbytes = self._allocs.pop(ptr, None)
        if nbytes is None:
            raise ValueError(f"free of {ptr:#x}, which is not a live allocation")
        del self._starts[bisect_left(self._starts, ptr)]
        first = (ptr - VA_BASE) // E.BLOCK
        nb = -(-nbytes // E.BLOCK)
        self._holes.insert(bisect_left(self._holes, (first, 0)), (first, nb))
        return first, nb

    def find(self, ptr: int, n: int) -> int:
        """The base of the allocation holding all of ``[ptr, ptr + n)``; ValueError if none does."""
        i = bisect_right(self._starts, ptr) - 1
        if i < 0 or n < 0 or ptr + n > self._starts[i] + self._allocs[self._starts[i]]:
            raise ValueError(f"range of {n} bytes at {ptr:#x} is not inside one managed allocation")
        return self._starts[i]

    def coalesce(self, ranges: Sequence[Range]) -> list[Range]:
        """Sorted ``ranges`` with those that overlap or touch within one allocation merged (as the
        ``cuda`` backend merges a prefetch's ranges into calls)."""
        merged: list[list[int]] = []
        for ptr, n in sorted((int(p), int(n)) for p, n in ranges):
            base = self.find(ptr, n)
            if merged and merged[-1][2] == base and merged[-1][0] + merged[-1][1] >= ptr:
                merged[-1][1] = max(merged[-1][0] + merged[-1][1], ptr + n) - merged[-1][0]
            else:
                merged.append([ptr, n, base])
        return [(a, n) for a, n, _ in merged]

    def page_spans(self, ranges: Sequence[Range], inward: bool) -> tuple[np.ndarray, np.ndarray]:
        """The 64 KB pages ``[lo[r], hi[r])`` each range covers: every page it touches, or
        (``inward``) only the pages wholly inside it, an allocation's tail page counting as whole."""
        lo = np.empty(len(ranges), np.int64)
        hi = np.empty(len(ranges), np.int64)
        for i, (ptr, n) in enumerate(ranges):
            base = self.find(ptr, n)
            a, b = ptr - VA_BASE, ptr + n - VA_BASE
            if inward:
                if ptr + n == base + self._allocs[base]:
                    b += E.PAGE - 1  # the allocation's tail page holds nothing else
                lo[i], hi[i] = -(-a // E.PAGE), b // E.PAGE
            else:
                lo[i], hi[i] = a // E.PAGE, -(-b // E.PAGE)
            if hi[i] < lo[i]:
                hi[i] = lo[i]
        return lo, hi

    def where(self, ptr: int, n: int) -> str:
        """Where ``[ptr, ptr + n)`` lies, for an error message."""
        try:
            base = self.find(ptr, n)
        except ValueError:
            return "no live allocation"
        return f"allocation {base:#x} + {ptr - base}"


class DefinedBytes:
    """The bytes of ``space`` that hold data."""

    def __init__(self, space: AddressSpace) -> None:
        self.space = space
        self._defined = RangeSet()

    def launch(self, reads: Sequence[Range], writes: Sequence[Range]) -> None:
        """A kernel reads ``reads`` (each must be defined) and then defines ``writes``."""
        defined = self._defined
        for ptr, n in reads:
            if n > 0 and not defined.covers(ptr, n):
                self._integrity_error(ptr, n)
        for ptr, n in writes:
            if n > 0:
                defined.add(ptr, n)

    def write(self, ranges: Sequence[Range]) -> None:
        """The ranges now hold data."""
        for ptr, n in ranges:
            self._defined.add(ptr, n)

    def forget(self, ranges: Sequence[Range]) -> None:
        """The ranges hold no data (discarded, freed, dead)."""
        for ptr, n in ranges:
            self._defined.remove(ptr, n)

    def take(self, ranges: Sequence[Range]) -> list[Range]:
        """Forget the ranges; return the parts of them that held data."""
        out: list[Range] = []
        for ptr, n in ranges:
            out.extend(self._defined.take(ptr, n))
        return out

    def _integrity_error(self, ptr: int, n: int) -> None:
        bad = self._defined.first_gap(ptr, n)
        raise DataIntegrityError(
            f"a launch reads {n} bytes at {ptr:#x} ({self.space.where(ptr, n)}) but byte {bad:#x} holds no data: "
            "it was discarded while live, freed, or never written"
        )
