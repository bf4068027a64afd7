"""A best-fit sub-allocator over block-aligned segments: each arena of umrt's
pool (:class:`~umrt.memory.pool.LifetimePool`) and each planned region's space."""
from __future__ import annotations

import bisect
from collections.abc import Callable

__all__ = ["Arena", "GPU_FIT_SCAN"]

# Free blocks a fit on the GPU looks through (smallest first) before best fit takes any.
GPU_FIT_SCAN = 64


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


class Arena:
    """Best-fit sub-allocator over block-aligned segments of one arena.

    Blocks are split exactly and coalesced with free neighbours inside the
    same segment; segments are kept until :meth:`release`. With ``slab``, a
    miss for ``s`` bytes obtains room for up to ``k`` such objects (at most
    ``slab`` bytes) when that wastes less of the last 2 MB block: model state
    comes in runs of equal sizes (one tensor per layer, times parameters,
    gradients and optimizer moments), and the room left is open to any size.
    """

    def __init__(self, malloc: Callable[[int], int], release: Callable[[int], None], name: str, *,
                 alignment: int, block: int, slab: int = 0) -> None:
        self._malloc, self._release = malloc, release
        self.name, self.alignment, self.block, self.slab = name, alignment, block, slab
        self.segments: list[tuple[int, int]] = []
        self._seg_starts: set[int] = set()
        self._seg_ends: set[int] = set()
        self._free_keys: list[tuple[int, int]] = []  # sorted (size, ptr)
        self._free_starts: list[int] = []  # sorted ptr
        self._free_at: dict[int, int] = {}  # ptr -> size
        self._free_end: dict[int, int] = {}  # end -> ptr
        self.used: dict[int, int] = {}  # ptr -> size

    def alloc(self, size: int) -> int:
        ptr = self.fit(size)
        if ptr is None:
            seg = self._segment_size(size)
            ptr = self._malloc(seg)
            self.segments.append((ptr, seg))
            self._seg_starts.add(ptr)
            self._seg_ends.add(ptr + seg)
            self._add_free(ptr, seg)
            ptr = self.fit(size)
        return ptr

    def fit(self, size: int) -> int | None:
        """``size`` bytes at the start of the smallest free block that holds them, or None
        (no segment is obtained)."""
        i = bisect.bisect_left(self._free_keys, (size, -1))
        if i == len(self._free_keys):
            return None
        fsize, ptr = self._free_keys[i]
        self._del_free(ptr, fsize)
        if fsize > size:
            self._add_free(ptr + size, fsize - size)
        self.used[ptr] = size
        return ptr

    def first_fit(self, size: int, edges: tuple[int, ...] = ()) -> int | None:
        """``size`` bytes at the lowest address free, never across one of ``edges``; None if none."""
        for start, end in ((s, s + self._free_at[s]) for s in self._free_starts):
            for p in (start, *(e for e in edges if start < e < end)):
                if p + size <= end and not any(p < e < p + size for e in edges):
                    self.take(p, size)
                    return p
        return None

    def fit_on_gpu(self, size: int, on_gpu: Callable[[int, int], list[tuple[int, int]]]) -> int | None:
        """Like :meth:`fit`, in the smallest free block (of the first :data:`GPU_FIT_SCAN` that
        hold ``size``) with ``size`` aligned bytes that ``on_gpu`` (the parts of a range on the
        GPU) says are all there: at the start of the smallest such part of it, not the first (a
        small object there would split a large part where a fragment would do: an evaluation's
        next batch, fetched as its last batch ends, cut the room its first layers had); None if
        there is none."""
        i = bisect.bisect_left(self._free_keys, (size, -1))
        align = self.alignment
        for fsize, ptr in self._free_keys[i:i + GPU_FIT_SCAN]:
            best: tuple[int, int] | None = None  # (bytes of the part, where size goes in it)
            for p, n in on_gpu(ptr, fsize):
                start = _up(p, align)
                if start + size <= p + n and (best is None or (n, start) < best):
                    best = (n, start)
            if best is not None:
                self.take(best[1], size)
                return best[1]
        return None

    def take(self, ptr: int, size: int) -> bool:
        """``[ptr, ptr + size)`` if it lies inside one free block (a planned place); False,
        doing nothing, if any of it is in use."""
        i = bisect.bisect_right(self._free_starts, ptr) - 1
        if i < 0:
            return False
        start = self._free_starts[i]
        n = self._free_at[start]
        if ptr + size > start + n:
            return False
        self._del_free(start, n)
        if ptr > start:
            self._add_free(start, ptr - start)
        if start + n > ptr + size:
            self._add_free(ptr + size, start + n - ptr - size)
        self.used[ptr] = size
        return True

    def fits(self, size: int) -> bool:
        """Whether a free block of ``size`` bytes is there (no new segment needed)."""
        return bisect.bisect_left(self._free_keys, (size, -1)) < len(self._free_keys)

    def free(self, ptr: int) -> int | None:
        """Free the block at ``ptr``; the start of its segment if that is empty now, else None."""
        size = self.used.pop(ptr)
        end = ptr + size
        if end not in self._seg_ends and end in self._free_at:
            nsize = self._free_at[end]
            self._del_free(end, nsize)
            size += nsize
        if ptr not in self._seg_starts and ptr in self._free_end:
            pptr = self._free_end[ptr]
            psize = self._free_at[pptr]
            self._del_free(pptr, psize)
            ptr, size = pptr, psize + size
        self._add_free(ptr, size)
        # Free blocks never span two segments: one from a segment's start to an end is all of it.
        return ptr if ptr in self._seg_starts and ptr + size in self._seg_ends else None

    def _segment_size(self, size: int) -> int:
        block = self.block
        best = _up(size, block)
        waste = (best - size) / best
        for k in range(2, 9):
            seg = _up(k * size, block)
            if k * size > self.slab or waste <= 1 / 64:
                break
            if (seg - k * size) / seg < waste:
                best, waste = seg, (seg - k * size) / seg
        return best

    def adopt(self, ptr: int, nbytes: int, used: list[tuple[int, int]]) -> None:
        """Serve from the segment ``[ptr, ptr + nbytes)``, obtained elsewhere,
        whose ``used`` blocks (``(ptr, size)``) stay live: the rest is free."""
        self.segments.append((ptr, nbytes))
        self._seg_starts.add(ptr)
        self._seg_ends.add(ptr + nbytes)
        cursor = ptr
        for p, n in sorted(used):
            if p > cursor:
                self._add_free(cursor, p - cursor)
            self.used[p] = n
            cursor = max(cursor, p + n)
        if cursor < ptr + nbytes:
            self._add_free(cursor, ptr + nbytes - cursor)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block, ``(ptr, nbytes)``."""
        return list(self._free_at.items())

    def release(self) -> None:
        """Return every segment to the backend (only when nothing is live)."""
        assert not self.used
        for ptr, _ in self.segments:
            self._release(ptr)
        self.segments = []
        self._seg_starts, self._seg_ends = set(), set()
        self._free_keys, self._free_starts, self._free_at, self._free_end = [], [], {}, {}

    def release_empty(self) -> None:
        """Return the segments nothing lives in (a free block spans each of them)."""
        empty = [(p, n) for p, n in self.segments if self._free_at.get(p) == n]
        for ptr, n in empty:
            self._drop(ptr, n)
        if empty:
            gone = {p for p, _ in empty}
            self.segments = [sg for sg in self.segments if sg[0] not in gone]

    def release_segment(self, ptr: int) -> None:
        """Return the empty segment starting at ``ptr`` (as :meth:`free` reported it)."""
        i = next(i for i, (p, _) in enumerate(self.segments) if p == ptr)
        self._drop(*self.segments.pop(i))

    def _drop(self, ptr: int, n: int) -> None:
        self._del_free(ptr, n)
        self._seg_starts.discard(ptr)
        self._seg_ends.discard(ptr + n)
        self._release(ptr)

    def _add_free(self, ptr: int, size: int) -> None:
        bisect.insort(self._free_keys, (size, ptr))
        bisect.insort(self._free_starts, ptr)
        self._free_at[ptr] = size
        self._free_end[ptr + size] = ptr

    def _del_free(self, ptr: int, size: int) -> None:
        del self._free_keys[bisect.bisect_left(self._free_keys, (size, ptr))]
        del self._free_starts[bisect.bisect_left(self._free_starts, ptr)]
        del self._free_at[ptr]
        del self._free_end[ptr + size]
