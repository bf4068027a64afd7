"""Where the runtime's objects are, and the page ranges a decision moves."""
from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from operator import attrgetter

from umrt.memory.base import LiveRecord
from umrt.policy.runtime.planner import PAGE
from umrt.predict.tables import ObjectKeys
from umrt.trace.events import Alloc

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


class DeadPages:
    """Whole pages the dead left free, object by object (never merged across
    objects, so each range lies inside one managed allocation): added at a
    death, taken back where a newborn lands on them."""

    __slots__ = ("_starts", "_end")

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted
        self._end: dict[int, int] = {}  # start -> end

    def __bool__(self) -> bool:
        return bool(self._starts)

    def died(self, ptr: int, nbytes: int) -> None:
        """An object at ``[ptr, ptr + nbytes)`` died: its whole pages are free."""
        start, end = -(-ptr // PAGE) * PAGE, (ptr + nbytes) // PAGE * PAGE
        if end > start:
            self.take(start, end - start)  # a stale entry there (a range reused unseen) goes
            bisect.insort(self._starts, start)
            self._end[start] = end

    def take(self, ptr: int, nbytes: int) -> None:
        """``[ptr, ptr + nbytes)`` is in use again (a newborn, a segment given back):
        the pages it touches are no longer free; the rest of their ranges stay."""
        starts, ends = self._starts, self._end
        end = ptr + nbytes
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0 or ends[starts[i]] <= ptr:
            i += 1
        while i < len(starts) and starts[i] < end:
            s = starts.pop(i)
            e = ends.pop(s)
            lo, hi = ptr // PAGE * PAGE, -(-end // PAGE) * PAGE
            if s < lo:
                starts.insert(i, s)
                ends[s] = lo
                i += 1
            if hi < e:
                starts.insert(i, hi)
                ends[hi] = e
                i += 1

    def nbytes(self) -> int:
        """The bytes of every free range."""
        return sum(self._end[s] - s for s in self._starts)

    def drain(self) -> list[tuple[int, int]]:
        """Every free range, as ``(ptr, nbytes)``; the set is empty after."""
        out = [(s, self._end[s] - s) for s in self._starts]
        self._starts, self._end = [], {}
        return out
