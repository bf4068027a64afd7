"""Where the runtime's objects are, and the page ranges a decision moves."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter

from umrt.backends.base import BLOCK
from umrt.backends.ranges import RangeSet
from umrt.errors import UmrtError
from umrt.memory.base import LiveRecord
from umrt.policy.runtime.planner import PAGE
from umrt.predict.tables import ObjectKeys
from umrt.trace.events import Access, Alloc

_PTR_N = attrgetter("ptr", "nbytes")  # a live record -> (ptr, nbytes), at C speed
_MEMO_MAX = 4096  # memoized decision ranges kept (cleared beyond; 8 shapes x ~300 decisions fit)


class _Unknown:
    """What the runtime knows of an object it never saw allocated."""

    __slots__ = ()
    nbytes = 0
    kind = None


#: Stands in for the :class:`Alloc` of an object the runtime never saw allocated.
NO_ALLOC = _Unknown()


class Where:
    """Where a live object is: ``.ptr`` and ``.nbytes`` (as the pool's live records)."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


class AddressIndex:
    """``obj -> Where`` over ``Layout.address`` and the runtime's own sizes,
    for a layout without a ``live_index`` (the caching-allocator model)."""

    __slots__ = ("_address", "_alloc_of")

    def __init__(self, address: Callable[[int], int], alloc_of: dict[int, Alloc]) -> None:
        self._address, self._alloc_of = address, alloc_of

    def __getitem__(self, obj: int) -> Where:
        return Where(self._address(obj), self._alloc_of.get(obj, NO_ALLOC).nbytes)


class DecisionRanges:
    """The ranges each decision moves, memoized per key tuple (evictions and
    prefetches apart): in steady state the pool gives every role the same
    address each iteration, so the page rounding is done once."""

    def __init__(self, keys: ObjectKeys) -> None:
        self.keys = keys
        self.evict_memo: dict[int, tuple] = {}
        self.prefetch_memo: dict[int, tuple] = {}
        self._live_index: Mapping[int, LiveRecord] = {}
        self._address: Callable[[int], int] | None = None

    def connect(self, live_index: Mapping[int, LiveRecord], address: Callable[[int], int]) -> None:
        """Read objects' places from ``live_index``; ``address`` raises the layout's
        own error for an object that is not in it."""
        self._live_index, self._address = live_index, address

    def forget(self) -> None:
        """Drop every memoized range (the memory under them may have been handed back)."""
        self.evict_memo.clear()
        self.prefetch_memo.clear()

    def resolve(self, keys: tuple[int, ...], evict: bool, frozen: bool) -> tuple[list, int, int]:
        """The ranges a decision moves for ``keys``: ``(ranges, bytes, keys not alive)``.

        Where each object is, ``(ptr, nbytes)``, is read for all keys at once
        (C-level lookups); the ranges are a pure function of that, memoized per
        key tuple. Anything that moved (or a key that is not alive) is computed
        afresh. ``frozen``: every object is where it was when the memo was made
        (checked at each allocation), so a memoized answer is returned unread.
        """
        memo = self.evict_memo if evict else self.prefetch_memo
        hit = memo.get(id(keys))
        if frozen and hit is not None and hit[4] is keys:
            return hit[1], hit[2], hit[3]  # every object since is where it was then
        objs = tuple(map(self.keys.obj_of.get, keys))
        try:
            if None in objs:
                lives = self._live_index
                where = tuple(None if o is None else _PTR_N(lives[o]) for o in objs)
            else:
                where = tuple(map(_PTR_N, map(self._live_index.__getitem__, objs)))
        except KeyError as e:
            self._address(e.args[0])  # the layout's own error says why
            raise
        if hit is None or hit[0] != where or hit[4] is not keys:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            hit = memo[id(keys)] = (where, *moves(where, evict), keys)
        return hit[1], hit[2], hit[3]


def moves(where: tuple, evict: bool) -> tuple[tuple[tuple[int, int], ...], int, int]:
    """``(ranges, bytes, not alive)`` for objects at ``where`` (``(ptr, nbytes)``
    or ``None`` for a key not alive): moved out as whole pages only
    (``evict``, :func:`whole_pages`), or in as they are."""
    ranges = []
    moved = unresolved = 0
    for w in where:
        if w is None:
            unresolved += not evict
            continue
        ptr, n = w
        if evict:
            r = whole_pages(ptr, n)
            if r is not None:
                ranges.append(r)
                moved += r[1]
        elif n > 0:
            ranges.append((ptr, n))
            moved += n
        else:
            unresolved += 1
    return tuple(ranges), moved, unresolved


def whole_pages(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """The whole pages inside ``[ptr, ptr + nbytes)``: moving a page out or
    discarding it must never touch a neighbour's bytes."""
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + nbytes) // PAGE * PAGE
    return (start, end - start) if end > start else None


def free_pieces(off_gpu: RangeSet, free: RangeSet, addresses: list[int],
                newborns: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``newborns`` ``(ordinal, nbytes)`` off the GPU with nothing live there, taken out of both sets."""
    pieces: list[tuple[int, int]] = []
    for o, nbytes in newborns:
        if o < len(addresses):
            for p, n in free.take(addresses[o], nbytes):
                pieces += off_gpu.take(p, n)
    pieces.sort()
    return pieces


def free_blocks(segments: Mapping[int, int], live: Iterable[LiveRecord], off_gpu: RangeSet,
                block: int) -> list[tuple[int, int]]:
    """The ``block``-aligned blocks of ``segments`` (``ptr -> nbytes``) that no ``live`` object
    touches, less what of them is in ``off_gpu``; each range inside one segment (a discard's must)."""
    free = RangeSet()
    free.add_all(segments.items())
    for rec in live:
        lo = rec.ptr // block * block
        free.remove(lo, -(-(rec.ptr + rec.nbytes) // block) * block - lo)
    free.remove_all(off_gpu)
    return [r for ptr, nbytes in sorted(segments.items()) for r in free.take(ptr, nbytes)]


def touch_blocks(blocks: set[int], accesses: Iterable[Access], live: Mapping[int, LiveRecord] | AddressIndex) -> None:
    """Add to ``blocks`` the 2 MB blocks the ``accesses`` reach (of ``live`` objects; others: none)."""
    for a in accesses:
        try:
            ptr = live[a.obj].ptr + a.offset
        except (KeyError, UmrtError):  # (not live: the layout's error)
            continue
        blocks.update(range(ptr // BLOCK, (ptr + max(a.length, 1) - 1) // BLOCK + 1))
