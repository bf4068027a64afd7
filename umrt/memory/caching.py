"""A model of PyTorch's CUDA caching allocator, as a :class:`Layout`.

This is the layout every policy runs with by default: it places objects the
way ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) does on
one stream, so that the 2 MB blocks the simulator migrates are shared between
objects exactly as they would be under PyTorch. The rules modelled, with the
names of the constants in that file (same values from PyTorch 1.x to 2.x):

* every request is rounded up to a multiple of ``kMinBlockSize`` = 512 B
  (``round_size``; the optional ``roundup_power2_divisions`` setting is off by
  default and not modelled);
* rounded requests ``<= kSmallSize`` (1 MiB) use the *small* pool, the others
  the *large* pool (``get_pool``);
* on a miss a new segment is obtained: ``kSmallBuffer`` (2 MiB) for small
  requests, ``kLargeBuffer`` (20 MiB) for requests ``< kMinLargeAlloc``
  (10 MiB), else the request rounded up to ``kRoundLarge`` (2 MiB)
  (``get_allocation_size``);
* best fit: the smallest cached free block of the request's pool that is big
  enough, lowest address first among equal sizes (the pools are ``std::set``
  ordered by ``(stream, size, ptr)``, searched with ``lower_bound``);
* a block is split when the remainder is ``>= kMinBlockSize`` in the small
  pool, ``> kSmallSize`` in the large pool (``should_split``; the default
  ``max_split_size`` is unlimited);
* a freed block merges with free neighbours of its segment
  (``free_block`` / ``try_merge_blocks``) and stays cached: segments are never
  returned to the backend (nothing here models ``empty_cache`` or the
  free-and-retry path after a failed ``cudaMalloc``, because managed memory
  does not fail for lack of device memory).

Zero-byte requests get a 512 B block (PyTorch returns ``nullptr`` instead),
so that every live object has a distinct, valid address.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from umrt.errors import UmrtError
from umrt.memory.base import Layout
from umrt.trace.events import Kind

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "LayoutError",
    "CachingAllocatorLayout",
    "round_size",
    "allocation_size",
]

# c10/cuda/CUDACachingAllocator.cpp (constants at the top of the file).
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 << 20  # kRoundLarge: round up large allocations to 2 MiB


class LayoutError(UmrtError):
    """A layout was asked something inconsistent (an object placed twice, an unknown object)."""


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 B (at least 512 B)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment obtained for a (rounded) request on a miss."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    """A contiguous piece of one segment, free or holding one object."""

    ptr: int
    size: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False


class CachingAllocatorLayout(Layout):
    """PyTorch's caching allocator over a backend's managed segments.

    ``footprint()`` is the bytes of segments obtained from ``backend.malloc``
    (PyTorch's ``reserved_bytes``); it never shrinks.
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        # Free blocks per pool, as sorted (size, ptr) keys plus a ptr -> block map.
        self._free_keys: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._free: dict[int, _Block] = {}
        self._objects: dict[int, tuple[_Block, int]] = {}  # obj -> (block, requested bytes)
        self._segments: list[tuple[int, int]] = []
        self._reserved = 0
        self.allocated_bytes = 0  # rounded bytes of live blocks (PyTorch's allocated_bytes)
        self.live_bytes = 0  # requested bytes of live objects
        self.peak_live_bytes = 0

    # -- Layout ---------------------------------------------------------------

    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        if obj in self._objects:
            raise LayoutError(f"object {obj} is already live in the layout")
        if nbytes < 0:
            raise LayoutError(f"object {obj}: negative size {nbytes}")
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._take_free(size, small)
        if block is None:
            block = self._new_segment(allocation_size(size), small)
        if self._should_split(block, size):
            rest = _Block(block.ptr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        self._objects[obj] = (block, nbytes)
        self.allocated_bytes += block.size
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return block.ptr

    def free(self, obj: int) -> None:
        try:
            block, nbytes = self._objects.pop(obj)
        except KeyError:
            raise LayoutError(f"free of object {obj}, which is not live in the layout") from None
        self.allocated_bytes -= block.size
        self.live_bytes -= nbytes
        block.allocated = False
        # try_merge_blocks with both neighbours of the same segment.
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._remove_free(prev)
            block.ptr, block.size, block.prev = prev.ptr, prev.size + block.size, prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:
            self._remove_free(nxt)
            block.size, block.next = block.size + nxt.size, nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(block)

    def address(self, obj: int) -> int:
        try:
            return self._objects[obj][0].ptr
        except KeyError:
            raise LayoutError(f"object {obj} is not live in the layout") from None

    def footprint(self) -> int:
        return self._reserved

    # -- introspection --------------------------------------------------------

    def segments(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every segment obtained from the backend, in order."""
        return list(self._segments)

    def block_size(self, obj: int) -> int:
        """Bytes of the block serving ``obj`` (its rounded, possibly unsplit, size)."""
        return self._objects[obj][0].size

    def live_objects(self) -> dict[int, tuple[int, int]]:
        """``obj -> (ptr, requested nbytes)`` for every live object."""
        return {o: (b.ptr, n) for o, (b, n) in self._objects.items()}

    # -- internals --------------------------------------------------------------

    def _take_free(self, size: int, small: bool) -> _Block | None:
        keys = self._free_keys[small]
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        _, ptr = keys.pop(i)
        return self._free.pop(ptr)

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free_keys[block.small], (block.size, block.ptr))
        self._free[block.ptr] = block

    def _remove_free(self, block: _Block) -> None:
        keys = self._free_keys[block.small]
        i = bisect.bisect_left(keys, (block.size, block.ptr))
        del keys[i]
        del self._free[block.ptr]

    def _new_segment(self, nbytes: int, small: bool) -> _Block:
        ptr = self.backend.malloc(nbytes)
        self._segments.append((ptr, nbytes))
        self._reserved += nbytes
        return _Block(ptr, nbytes, small)

    @staticmethod
    def _should_split(block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return remaining > K_SMALL_SIZE
