"""Dead ranges a newborn takes at once: discarded for nothing the first time, then kept for it.

The runtime discards the range of an object that dies in the acting plan's discard set,
so that no eviction copies its dead bytes out. Where a newborn takes that range a few
events later, the discard was waste: the newborn's pages are populated again before its
kernel (a call it waits for), after the discard's own work. :class:`DeadRangeReuse`
learns such keys from what it sees and from then on *holds* their dead range: kept as
it is for :data:`REUSE_EVENTS` events, for the newborn that takes it with neither call;
what no newborn takes by then is discarded after all.
"""
from __future__ import annotations

from collections.abc import Iterable

from umrt.backends.base import PAGE

#: A dead range a newborn lands on within this many events (allocations, frees, module
#: boundaries) of its discard was populated again at once: discarding it was waste. Chosen in
#: the simulator (``bench.alternatives``' GPT-2 fp32 45% / BERT-large fp32 33% cells, before the
#: finer decisions of SWAP_MIN_SEGMENT_S): 6 events 2.16x / 2.23x, 16 2.16x / 2.21x, 48 2.21x / 2.21x.
REUSE_EVENTS = 16

Range = tuple[int, int]


def without(ranges: Iterable[Range], lo: int, hi: int) -> list[Range]:
    """``ranges`` less the whole pages ``[lo, hi)`` touches: what of them lies outside."""
    lo, hi = lo // PAGE * PAGE, -(-hi // PAGE) * PAGE
    out: list[Range] = []
    for p, n in ranges:
        if p + n <= lo or p >= hi:
            out.append((p, n))
            continue
        if p < lo:
            out.append((p, lo - p))
        if p + n > hi:
            out.append((hi, p + n - hi))
    return out


class DeadRangeReuse:
    """Which keys' dead ranges the runtime holds for a newborn, and which it holds now.

    Events are counted on the runtime's clock of non-launch events (``Runtime.n_events``),
    the same whether or not it sees launches.
    """

    def __init__(self, window: int = REUSE_EVENTS) -> None:
        self.window = window
        self.keys: set[int] = set()  # learned: their dead range is held
        self._pending: dict[int, int] = {}  # a pending discard's start -> the key that died there
        self._dropped: list[tuple[int, int, int, int]] = []  # discarded lately: (start, end, key, event)
        self._held: list[tuple[int, int, int, int]] = []  # held now: (start, end, key, event)

    def __bool__(self) -> bool:
        """Whether a newborn has anything to be checked against."""
        return bool(self._dropped or self._held)

    def died(self, start: int, end: int, key: int, event: int) -> bool:
        """``key``'s whole pages ``[start, end)`` died, to be discarded: whether they are held
        instead (else the pending discard starting at ``start`` is noted as ``key``'s)."""
        if key in self.keys:
            self._held.append((start, end, key, event))
            return True
        self._pending[start] = key
        return False

    def discarded(self, ranges: Iterable[Range], event: int) -> None:
        """The pending discards were issued: the keyed ones are watched for a newborn."""
        keys, self._pending = self._pending, {}
        if keys:
            self._dropped.extend((p, p + n, keys[p], event) for p, n in ranges if p in keys)

    def born(self, ptr: int, nbytes: int, event: int) -> list[Range]:
        """A newborn at ``[ptr, ptr + nbytes)``: learns the keys whose discarded range it takes;
        returns what of the held ranges is to be discarded now (the rest of one it takes
        part of, and those no newborn came for in time)."""
        end = ptr + nbytes
        since = event - self.window
        dropped = []
        for drop in self._dropped:
            if drop[3] < since:
                continue
            if drop[0] < end and ptr < drop[1]:
                self.keys.add(drop[2])
            else:
                dropped.append(drop)
        self._dropped = dropped
        out: list[Range] = []
        held = []
        for lo, hi, key, at in self._held:
            if (lo < end and ptr < hi) or at < since:
                out.extend(without([(lo, hi - lo)], ptr, end))
            else:
                held.append((lo, hi, key, at))
        self._held = held
        return out

    def release(self) -> list[Range]:
        """Every range held now, to be discarded (an iteration ends)."""
        out = [(lo, hi - lo) for lo, hi, _, _ in self._held]
        self._held = []
        self._dropped = []  # (their events were counted in the iteration that ended)
        return out

    def released(self, ptr: int, end: int) -> None:
        """The pool handed ``[ptr, end)`` back: nothing of it is held or watched."""
        self._held = [r for r in self._held if not ptr <= r[0] < end]
        self._dropped = [r for r in self._dropped if not ptr <= r[0] < end]
        self._pending = {p: k for p, k in self._pending.items() if not ptr <= p < end}
