"""Summary figures of a trace's steady-state iteration.

The steady state is the last complete iteration: the first one also creates
lazily-built state (AdamW's moments), and later ones repeat it.
"""

from __future__ import annotations

from typing import Any

from umrt.errors import TraceFormatError
from umrt.trace.events import Alloc, Free, Kind, Launch, Trace


def kind_name(kind: Kind) -> str:
    return kind.name.lower()


def summarize(trace: Trace) -> dict[str, Any]:
    """Figures of the steady-state iteration (all bytes as ints).

    Keys: ``model``, ``device``, ``iterations`` (complete iterations in the
    trace), ``ops_per_iteration`` (launches), ``objects`` (objects live at any
    point of the iteration), ``peak_live_bytes`` / ``end_live_bytes`` (bytes
    of live objects at the iteration's peak and at its end),
    ``flops_per_iteration``, ``bytes_moved_per_iteration`` (sum of the
    launches' bytes), ``bytes_by_kind`` (per kind, the peak live bytes of that
    kind during the iteration) and ``objects_by_kind``.
    """
    spans = trace.iteration_spans()
    if not spans:
        raise TraceFormatError("trace holds no complete iteration")
    start, stop = spans[-1]
    live: dict[int, tuple[int, Kind]] = {}
    events = trace.events
    for e in events[:start]:
        if isinstance(e, Alloc):
            live[e.obj] = (e.nbytes, e.kind)
        elif isinstance(e, Free):
            live.pop(e.obj, None)
    by_kind = {k: 0 for k in Kind}
    for nbytes, kind in live.values():
        by_kind[kind] += nbytes
    peak_by_kind = dict(by_kind)
    total = sum(by_kind.values())
    peak = total
    seen = set(live)
    ops = flops = moved = 0
    by_precision: dict[str, int] = {}
    for e in events[start:stop]:
        if isinstance(e, Launch):
            ops += 1
            flops += e.flops
            moved += e.bytes
            if e.flops:
                p = e.precision or "unknown"
                by_precision[p] = by_precision.get(p, 0) + e.flops
        elif isinstance(e, Alloc):
            if e.obj in live:  # re-announced: replace
                total -= live[e.obj][0]
                by_kind[live[e.obj][1]] -= live[e.obj][0]
            live[e.obj] = (e.nbytes, e.kind)
            seen.add(e.obj)
            total += e.nbytes
            by_kind[e.kind] += e.nbytes
            if by_kind[e.kind] > peak_by_kind[e.kind]:
                peak_by_kind[e.kind] = by_kind[e.kind]
            if total > peak:
                peak = total
        elif isinstance(e, Free):
            gone = live.pop(e.obj, None)
            if gone is not None:
                total -= gone[0]
                by_kind[gone[1]] -= gone[0]
    kinds_of = {}
    for e in events[:stop]:
        if isinstance(e, Alloc) and e.obj in seen:
            kinds_of[e.obj] = e.kind
    objects_by_kind = {kind_name(k): 0 for k in Kind}
    for k in kinds_of.values():
        objects_by_kind[kind_name(k)] += 1
    return {
        "model": trace.header.model,
        "device": trace.header.device,
        "iterations": len(spans),
        "ops_per_iteration": ops,
        "objects": len(seen),
        "peak_live_bytes": int(peak),
        "end_live_bytes": int(total),
        "flops_per_iteration": int(flops),
        # what the simulator computes each share at (HardwareProfile.peak_for); "unknown": format 1
        "flops_by_precision": dict(sorted(by_precision.items(), key=lambda kv: -kv[1])),
        "bytes_moved_per_iteration": int(moved),
        "bytes_by_kind": {kind_name(k): int(v) for k, v in peak_by_kind.items()},
        "objects_by_kind": objects_by_kind,
    }
