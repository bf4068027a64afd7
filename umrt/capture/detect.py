"""Find training iterations in a trace that has no step marks.

A training loop launches the same kernels in the same order every iteration,
so its execution ids form consecutive repeats of one block (the observation
SmartPool and AutoSwap build on). We look for the period ``p`` whose repeats
cover the longest stretch of the trace, then cut it into iterations.

Candidate periods come from ids that occur rarely: an id launched once per
iteration recurs exactly ``p`` launches later. Each candidate is checked with
one vectorised comparison, so detection is linear in the trace length times a
small number of candidates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from umrt.trace.events import Alloc, Free, IterationBoundary, Launch, LayerEnter, LayerExit, Trace

_MAX_CANDIDATES = 64


@dataclass(frozen=True)
class Repeats:
    """``count`` consecutive repeats of a ``period``-launch block from launch ``start``.

    The repeating stretch covers launches ``[start, stop)`` (it may end inside a block).
    """

    start: int
    period: int
    count: int
    stop: int


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in ``mask``."""
    if not mask.any():
        return 0, 0
    m = np.concatenate(([0], mask.astype(np.int8), [0]))
    d = np.diff(m)
    starts = np.flatnonzero(d == 1)
    stops = np.flatnonzero(d == -1)
    lengths = stops - starts
    i = int(np.argmax(lengths))
    return int(starts[i]), int(lengths[i])


def find_repeats(ids: Sequence[int], *, min_period: int = 2, min_count: int = 2) -> Repeats | None:
    """The longest run of consecutive repeats in a sequence of execution ids.

    Returns None when no block repeats at least ``min_count`` times back to back.
    """
    s = np.asarray(ids, dtype=np.int64)
    n = len(s)
    if n < min_period * min_count:
        return None
    counts = Counter(s.tolist())
    # gaps between successive occurrences of the rarest ids
    gaps: Counter[int] = Counter()
    positions: dict[int, list[int]] = {}
    rare = {v for v, c in counts.items() if 2 <= c <= max(min_count, 8) * 4}
    for i, v in enumerate(s.tolist()):
        if v in rare:
            positions.setdefault(v, []).append(i)
    for pos in positions.values():
        for a, b in zip(pos, pos[1:], strict=False):
            if b - a >= min_period:
                gaps[b - a] += 1
    best: Repeats | None = None
    best_cover = 0
    for p, _ in gaps.most_common(_MAX_CANDIDATES):
        if p * min_count > n:
            continue
        start, length = _longest_run(s[:-p] == s[p:])
        count = (length + p) // p
        if count < min_count:
            continue
        cover = count * p
        if cover > best_cover or (cover == best_cover and best is not None and p < best.period):
            best, best_cover = Repeats(start, p, count, start + length + p), cover
    return best


def _end_of_last(events: list, start: int, last_launch: int) -> int:
    """Where the last repeat ends: after its last launch and the frees of what it allocated.

    Frees of older objects after that point are the program tearing down.
    """
    born = {e.obj for e in events[start:last_launch] if isinstance(e, Alloc)}
    idx = last_launch + 1
    while idx < len(events) and isinstance(events[idx], Free) and events[idx].obj in born:
        idx += 1
    return idx


def insert_boundaries(trace: Trace) -> Trace:
    """A copy of ``trace`` with IterationBoundary events at the detected iterations.

    Existing boundaries are dropped. Iterations are aligned to start at a
    top-level forward (a depth-0 LayerEnter) when the trace has layer events,
    else at the start of the repeating stretch. Returns the trace unchanged
    (apart from dropped boundaries) when nothing repeats.
    """
    events = [e for e in trace.events if not isinstance(e, IterationBoundary)]
    launch_pos = [i for i, e in enumerate(events) if isinstance(e, Launch)]
    ids = [events[i].exec_id for i in launch_pos]
    found = find_repeats(ids)
    if found is None:
        return Trace(trace.header, events)
    start, p = found.start, found.period
    # phase: the first launch after a root-level forward enter, inside the stretch
    phase = 0
    depth = 0
    k = 0  # launches seen so far
    for e in events:
        if isinstance(e, Launch):
            k += 1
        elif isinstance(e, LayerEnter) and e.phase == "forward":
            if depth == 0 and start <= k < start + p:
                phase = k - start
                break
            depth += 1
        elif isinstance(e, LayerExit) and e.phase == "forward":
            depth = max(0, depth - 1)
    first = start + phase
    n_iter = (found.stop - first) // p
    cut_launches = [first + j * p for j in range(n_iter + 1) if first + j * p <= len(ids)]
    cut_events = set()
    for j, c in enumerate(cut_launches):
        if c >= len(launch_pos):  # the trace ends with this repeat: close it after its own frees
            cut_events.add(_end_of_last(events, launch_pos[cut_launches[j - 1]] if j else 0, launch_pos[-1]))
            continue
        idx = launch_pos[c]
        # step back over the events that belong to this launch (its allocs, its module entry)
        while idx > 0 and isinstance(events[idx - 1], (Alloc, LayerEnter)):
            idx -= 1
        cut_events.add(idx)
    out = []
    index = 0
    for i, e in enumerate(events):
        if i in cut_events:
            out.append(IterationBoundary(index))
            index += 1
        out.append(e)
    if len(events) in cut_events:
        out.append(IterationBoundary(index))
    return Trace(trace.header, out)
