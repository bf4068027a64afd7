"""SmartPool's offline planner: one iteration's objects packed by lifetime.

Zhang et al. (SmartPool, 2019) treat the allocations of one training
iteration as an offline dynamic-storage-allocation problem, i.e. weighted
interval colouring: a vertex per object, an edge between objects whose
lifetimes overlap, the weight is the size. The heuristic places objects
largest first, each at the lowest offset that is free of every already
placed, lifetime-overlapping neighbour. This module is that planner as a
pure function; :class:`umrt.memory.pool.LifetimePool` applies it per arena.

Lifetimes are half-open ``[start, end)`` intervals on any integer clock
(event positions); two objects conflict when their intervals intersect.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Lifetime", "Placement", "plan", "max_live_bytes", "quietest_point"]


@dataclass(frozen=True, slots=True)
class Lifetime:
    """One object to place: live during ``[start, end)``, ``nbytes`` large."""

    start: int
    end: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """The planner's answer, in the order of the input.

    ``offsets[i]`` is object ``i``'s byte offset, or ``None`` where it did not
    fit under the ``limit``. ``footprint`` is the end of the highest placed
    object (0 when nothing was placed).
    """

    offsets: tuple[int | None, ...]
    footprint: int


def _align_up(x, alignment: int):
    return -(-x // alignment) * alignment


def plan(
    items: Sequence[Lifetime | tuple[int, int, int]],
    *,
    alignment: int = 1,
    limit: int | None = None,
    alignments: Sequence[int] | None = None,
) -> Placement:
    """Place ``items`` largest first at the lowest offset free of lifetime-overlapping neighbours.

    ``alignment`` aligns every offset (sizes are used as given; an item's
    footprint is ``nbytes``); ``alignments`` overrides it per item. With ``limit``, an item that would end beyond
    ``limit`` is left out (offset ``None``) instead of growing the pool.
    Ties are broken by ``(start, end, input index)``, so the result is a pure
    function of the input. An empty lifetime (``end <= start``) is treated as
    ``[start, start + 1)``.

    Cost: O(n) vectorised work per item (O(n^2) overall), fine for the tens of
    thousands of objects of one training iteration.
    """
    n = len(items)
    aligns = [alignment] * n if alignments is None else list(alignments)
    if len(aligns) != n:
        raise ValueError(f"{len(aligns)} alignments for {n} items")
    if any(a < 1 for a in aligns):
        raise ValueError(f"alignments must be >= 1, got {min(aligns)}")
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    sizes = np.empty(n, dtype=np.int64)
    for i, it in enumerate(items):
        s, e, z = (it.start, it.end, it.nbytes) if isinstance(it, Lifetime) else it
        if z < 0:
            raise ValueError(f"item {i}: negative size {z}")
        starts[i], ends[i], sizes[i] = s, max(e, s + 1), z
    order = sorted(range(n), key=lambda i: (-int(sizes[i]), int(starts[i]), int(ends[i]), i))

    # Placed objects so far, in placement order.
    p_start = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    p_lo = np.empty(n, dtype=np.int64)
    p_hi = np.empty(n, dtype=np.int64)
    k = 0
    offsets: list[int | None] = [None] * n
    footprint = 0
    for i in order:
        s, e, z, a = starts[i], ends[i], int(sizes[i]), aligns[i]
        x = 0
        if k:
            overlap = (p_start[:k] < e) & (p_end[:k] > s)
            if overlap.any():
                lo = p_lo[:k][overlap]
                hi = p_hi[:k][overlap]
                idx = np.argsort(lo, kind="stable")
                lo, hi = lo[idx], hi[idx]
                # Candidate j: just after every neighbour that starts before neighbour j.
                cand = np.empty(len(lo) + 1, dtype=np.int64)
                cand[0] = 0
                cand[1:] = _align_up(np.maximum.accumulate(hi), a)
                fits = lo - cand[:-1] >= z
                x = int(cand[int(np.argmax(fits))] if fits.any() else cand[-1])
        if limit is not None and x + z > limit:
            continue
        offsets[i] = x
        p_start[k], p_end[k], p_lo[k], p_hi[k] = s, e, x, x + z
        k += 1
        footprint = max(footprint, x + z)
    return Placement(tuple(offsets), footprint)


def max_live_bytes(items: Sequence[Lifetime | tuple[int, int, int]]) -> int:
    """The most bytes live at once: a lower bound on any plan's footprint."""
    deltas: dict[int, int] = {}
    for it in items:
        s, e, z = (it.start, it.end, it.nbytes) if isinstance(it, Lifetime) else it
        e = max(e, s + 1)
        deltas[s] = deltas.get(s, 0) + z
        deltas[e] = deltas.get(e, 0) - z
    live = peak = 0
    for t in sorted(deltas):
        live += deltas[t]
        peak = max(peak, live)
    return peak


def quietest_point(spans: Sequence[tuple[int, int | None, int]], length: int) -> int:
    """The point of a periodic iteration ``length`` long where the fewest bytes are alive.

    ``spans``: ``(start, end, nbytes)`` per object on the iteration's clock, ``end``
    past ``length`` for one that dies in the next iteration, None for one alive all
    along (the same at every point). A plan cuts the cycle there, so that few objects
    cross the cut: one that crosses it must be planned as alive all along.
    """
    deltas: dict[int, int] = {0: 0}
    for start, end, nbytes in spans:
        if end is None:
            continue
        a, b = start % length, start % length + (end - start)
        pieces = [(a, min(b, length))] + ([(0, min(b - length, length))] if b > length else [])
        for lo, hi in pieces:
            deltas[lo] = deltas.get(lo, 0) + nbytes
            deltas[hi] = deltas.get(hi, 0) - nbytes
    best_t, best, live = 0, None, 0
    for t in sorted(deltas):
        live += deltas[t]
        if t < length and (best is None or live < best):
            best_t, best = t, live
    return best_t
