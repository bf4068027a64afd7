"""Pinned host memory for the swap path: one pool, allocated once, cut into slots.

A ``cudaHostAlloc`` of gigabytes costs milliseconds to seconds (it pins every
page), so the ``cuda`` backend never pins per step: :class:`StagingPool` is
sized once, before the first step that swaps, from the plan's most bytes away
at one time (:meth:`StagingPool.reserve`), checked against the host's memory
first (:func:`host_available_bytes`), and reused for every swap after. A slot
holds one swapped-out range until it comes back (or dies); a slot given back
after its copy back remembers that copy's event, and the next copy into its
bytes waits for it (a copy out must never overwrite bytes still being copied
back).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umrt.config import format_bytes
from umrt.errors import ConfigError

__all__ = ["Slot", "StagingPool", "host_available_bytes"]

SLOT_ALIGN = 64 << 10  # slots start on 64 KiB: the copy engines' best alignment, and the GPU's page


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Host memory available for new allocations (Linux ``MemAvailable``), or None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Slot:
    """A swapped-out range's place in the pool: ``offset`` into it, ``nbytes`` long."""

    offset: int
    nbytes: int


class StagingPool:
    """One pinned allocation, handed out as slots (first fit over the free extents).

    ``alloc(nbytes) -> ptr`` and ``free(ptr)`` are the runtime's ``cudaHostAlloc`` /
    ``cudaFreeHost`` (the backend passes its counted calls).
    """

    def __init__(self, alloc: Callable[[int], int], free: Callable[[int], None],
                 share: Callable[[Any], Any] | None = None) -> None:
        self._alloc, self._free = alloc, free
        # Called when a free extent that waits for a copy back is split in two: both parts
        # wait for it now (the owner counts the references to its events).
        self._share = share or (lambda event: event)
        self.base = 0  # the pinned allocation (0: none yet)
        self.nbytes = 0
        self._free_starts: list[int] = []  # free extents by offset: start -> length
        self._free_len: dict[int, int] = {}
        self._busy: dict[int, Any] = {}  # free extent start -> the copy back its bytes wait for (an event)
        self.in_use = 0
        self.peak_in_use = 0
        self.allocations = 0  # cudaHostAlloc calls made (one, unless a plan needed more later)

    def reserve(self, nbytes: int, available: int | None = None) -> None:
        """Make the pool at least ``nbytes`` (rounded up to a slot), allocating it now if it has
        to grow and nothing is in use; ``available``: the host's free memory, checked first."""
        nbytes = -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN
        if nbytes <= self.nbytes:
            return
        if available is not None and nbytes > available:
            raise ConfigError(
                f"umrt's plan keeps up to {format_bytes(nbytes)} off the GPU at once in pinned host memory, but "
                f"this host has {format_bytes(available)} available (MemAvailable): give the GPU more memory "
                "(UMRT_GPU_MEMORY), free host memory, or train with a smaller batch")
        if self.in_use:
            return  # slots are in use: the pool cannot move; what does not fit is migrated instead
        if self.base:
            self._free(self.base)
        self.base = self._alloc(nbytes)
        self.nbytes = nbytes
        self.allocations += 1
        self._free_starts = [0]
        self._free_len = {0: nbytes}
        self._busy = {}

    def grows(self, nbytes: int) -> bool:
        """Whether :meth:`reserve` of ``nbytes`` would need a larger pool."""
        return -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN > self.nbytes

    def take(self, nbytes: int) -> tuple[Slot, list[Any]] | None:
        """A slot of ``nbytes``, and the events of the copies back its bytes must wait for;
        None when no free extent holds it."""
        size = -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN
        for start in self._free_starts:
            length = self._free_len[start]
            if length >= size:
                busy = self._busy.pop(start, None)
                waits = [busy] if busy is not None else []
                self._free_starts.remove(start)
                del self._free_len[start]
                if length > size:  # the rest still waits for that copy back
                    self._insert(start + size, length - size, self._share(busy) if busy is not None else None)
                self.in_use += size
                self.peak_in_use = max(self.peak_in_use, self.in_use)
                return Slot(start, size), waits
        return None

    def give_back(self, slot: Slot, busy: Any = None) -> None:
        """The slot is free again; ``busy``: the event of the copy back still reading it."""
        self.in_use -= slot.nbytes
        self._insert(slot.offset, slot.nbytes, busy)

    def ptr(self, slot: Slot) -> int:
        """The slot's host address."""
        return self.base + slot.offset

    def release(self) -> None:
        """Give the pinned memory back (the backend waited for every copy first)."""
        if self.base:
            self._free(self.base)
        self.base = self.nbytes = self.in_use = 0
        self._free_starts, self._free_len, self._busy = [], {}, {}

    def _insert(self, start: int, length: int, busy: Any = None) -> None:
        """A free extent (merged with its neighbours only when neither waits for a copy back)."""
        if busy is not None:
            self._busy[start] = busy
        i = bisect.bisect_left(self._free_starts, start)
        if busy is None and i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start and prev not in self._busy:
                self._free_len[prev] += length
                start, i = prev, i - 1
                length = self._free_len[prev]
                self._free_starts.pop(i)
        if busy is None and i < len(self._free_starts):
            nxt = self._free_starts[i]
            if start + length == nxt and nxt not in self._busy:
                length += self._free_len.pop(nxt)
                self._free_starts.pop(i)
        self._free_starts.insert(i, start)
        self._free_len[start] = length
