"""A backend's memory half, faked for tests and the CPU benches: :class:`BumpBackend`.

A layout (umrt's pool, the model of PyTorch's caching allocator, ``ManagedPool``) asks its
backend for managed segments and gives them back, and nothing else; this hands out
addresses and keeps the books, with no memory behind them.
"""
from __future__ import annotations

from umrt.hardware import MIB


class BumpBackend:
    """Managed segments from a bump allocator, never reused.

    Each segment's size is rounded up to ``align`` (2 MiB, as cudaMallocManaged's large
    allocations are) and the next segment starts ``gap`` bytes after it; every address is
    shifted by ``misalign``. With the defaults the segments are 2 MiB-aligned and adjacent;
    ``align=1, gap=4096`` leaves each one 4 KiB past the end of the one before, not aligned
    to anything; ``gap=2 * MIB`` keeps aligned segments apart. ``frees=False``: a free fails
    the test (for a layout that must never give memory back).

    ``live`` (address -> size) holds the segments not freed, ``mallocs`` every segment handed
    out, ``(address, size)`` in order.
    """

    def __init__(self, *, align: int = 2 * MIB, gap: int = 0, misalign: int = 0, frees: bool = True) -> None:
        self.align, self.gap, self.frees = align, gap, frees
        self.next = (1 << 40) + misalign
        self.live: dict[int, int] = {}
        self.mallocs: list[tuple[int, int]] = []

    def malloc(self, nbytes: int) -> int:
        ptr = self.next
        self.next += -(-nbytes // self.align) * self.align + self.gap
        self.live[ptr] = nbytes
        self.mallocs.append((ptr, nbytes))
        return ptr

    def free(self, ptr: int) -> None:
        if not self.frees:
            raise AssertionError(f"segment {ptr:#x} given back to a backend that expects none back")
        del self.live[ptr]
