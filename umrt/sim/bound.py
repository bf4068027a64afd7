"""A policy-independent lower bound on the simulated steady iteration time.

:func:`link_bound` computes, from the trace, the hardware profile and the
budget alone, a time that no policy can beat in :mod:`umrt.sim` — the
*link bound*. It is what a perfect policy would still pay because at most
the budget's bytes can sit on the GPU while the rest must come over the link.

Derivation
----------
Take the iteration :func:`umrt.sim.replay.simulate` reports (the last one)
and its launches ``0 .. n-1``, ``c_i`` each one's roofline compute time
(``HardwareProfile.compute_time``, as the ideal policy computes it). A *cut*
``k`` (``0 <= k <= n``) is the instant right after launch ``k-1`` has run,
before any later event. Follow every *value* (a byte range of an object,
from the event that gave it data to its next overwrite, free or the end of
the iteration; read/write ranges are exact, a launch reads before it writes,
and an in-place update, :attr:`~umrt.trace.events.Launch.updates_in_place`,
reads what it writes). Take two cuts ``k1 < k2``, a *window*:

* ``A``: bytes of values that exist at cut ``k1`` (written by a launch before
  it, made on the host before it, or carried in from before the iteration)
  and that a launch in ``k1 .. k2-1`` reads. The simulator never holds more
  than the budget ``B`` in resident 64 KB pages (capacity is counted in
  pages, so at most ``B`` of these bytes are on the GPU): at least ``A - B``
  are on the host (or on their way to it) at cut ``k1``.
* ``Hb``: bytes of objects made on the host (``Alloc.launch == -1``, e.g.
  an input batch) after cut ``k1`` and read in the window.

Each of these ``H = max(0, A - B) + Hb`` bytes must cross the link
host-to-device after cut ``k1`` and before the launch that reads it ends,
i.e. within the window (a page holding defined data is populated, so a
migration copies it). The simulator can carry it four ways:

1. an explicit prefetch: a copy on the prefetch path taking at least
   ``bytes / rate`` seconds, ``rate`` the fastest any path has
   (``HardwareProfile.fastest_rate``: the larger of the prefetch,
   fault-driven and copy-engine rates; every set-up cost only adds); copies
   issued after the cut start no earlier than it (the CPU is synchronised
   with the GPU);
2. a copy-engine copy of swapped-out data back into its pages (``swap.back``),
   at most the same rate, sharing the link with the migrations;
3. a fault migration: at most the same rate, stalling the compute stream;
4. a remote read (AccessedBy / PreferredLocation=host) by a launch of the
   window: ``bytes / h2d_bandwidth`` seconds of the link, within that launch.

All four share the host-to-device link, and the simulator conserves its
work (fault copies and remote accesses share it with the copy queue,
delaying it by the link time they take), so the window lasts at least the
link time of its ``H`` bytes, ``min(H, R) / h2d_bandwidth + max(H - R, 0) /
rate`` with ``R`` the bytes its launches read (the *shared-link* term), and
at least its compute ``C``. It also lasts at least what it would if remote
reads rode free beside the copy queue (the bound before remote access was
charged to the link, still valid, and larger when the reads crowd into short
launches: a launch's remote reads happen while it runs): the compute stream
carries up to ``c_i * h2d_bandwidth`` remote bytes of launch ``i`` under its
compute, then more at the link rate (stretching launches), then fault
migrations at ``rate``, the queue ``rate`` per second; ``D`` is the smallest
``D >= C`` at which they carry ``H``. A window costs the larger of the two.
Windows between consecutive cuts ``0 = k_0 < k_1 < ... < k_m = n`` do not
overlap in time, so the iteration lasts at least the sum of their costs; the
bound is the largest such sum over every choice of cuts (a dynamic programme
over pairs of cuts, one numpy row per first cut), and at least the ideal
time. Nothing in it depends on what a policy does, so it holds for every
policy; fault latency, call costs, migration set-ups, host population and
the sharing of one migration path by both directions only add time.

Data must also *leave*. A value a launch writes exists only on the GPU; if
it is still needed when launch ``i`` starts and the GPU cannot hold it, it
has left over the device-to-host link before then, and it could start to
leave only once written (at the earliest when the writing launch starts: a
remote write crosses the link during its launch). The simulator never holds
more than the budget in resident pages plus pages still being copied out
(their memory is free only once the copy is done), and every way out (a
copy-engine copy, a prefetch to the host, a fault-path eviction, a remote
write) shares that link at no more than :meth:`~umrt.hardware.HardwareProfile.fastest_rate`.
So with ``W_i`` the bytes written in this iteration before launch ``i`` and
read by it or later, ``D_i = max(0, W_i - B)`` bytes must have crossed by
launch ``i``'s start: no earlier than ``F_i``, the time one queue at that
rate, fed each value from the start of the launch that wrote it (at the
earliest ``before[w]``, its ideal compute before it), finishes ``D_i`` bytes
taking the earliest first. Cut ``i + 1`` comes at least ``c_i`` after launch
``i`` starts, so every chain of windows passes cut ``k`` no earlier than
``F_{k-1} + c_{k-1}``, and the windows after it add to that (they bound
durations). While launch ``i`` runs, what it writes and a later launch reads
needs room as well as what it reads (the simulator frees none of a kernel's
pages under it; one it evicts to fault another in crosses the link): with ``V_i`` those bytes and ``W_i``'s, ``max(0, V_i - B)`` have crossed
(left before, evicted or written over the link) by the time it ends, ``E_i``
by the same queue, so chains pass cut ``i + 1`` no earlier than ``E_i``
either. Host-to-device bytes move at the fastest rate any path has too
(a copy-engine copy back, a prefetch, the fault path): what comes back must
have left first only adds.

Values the iteration *before* wrote (the optimizer's state and parameters,
updated at the end of a step) must leave too: ``time_s`` does not count them,
since a policy may have taken them off the GPU before this iteration began,
at that iteration's cost. :attr:`LinkBound.steady_s` counts them for an
iteration of length ``T`` that follows one of length ``T' <= T`` (a steady
state): a value written by launch ``w`` of the one before started to leave no
earlier than ``R_w - T'`` >= ``R_w - T`` (``R_w``: that iteration's own
bound on reaching launch ``w``, from its start), and the bytes due by launch
``i``'s start are now those values still read at or after ``i`` plus this
iteration's. One queue at the fastest rate, taking the values carried in
first, gives ``F'_i = G_i - T`` (and ``E'_i`` alike); the chains of
windows above, started from ``max(F'_i + c_i, E'_i)`` instead, give
``T >= Q - T`` for their longest ``Q`` (max-plus: a chain's length is linear
in where it starts). So
``steady_s = max(time_s, Q / 2, R_n)``.

:attr:`LinkBound.conserving_s` is an older estimate kept for comparison: the
shared-link windows plus, per window, the bytes written in it and needed after
it beyond the budget over the link rate (not a bound: a value may still be
on its way out at the window's end).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from umrt import hardware
from umrt.errors import ConfigError, TraceFormatError
from umrt.hardware import HardwareProfile
from umrt.sim.budget import resolve_budget
from umrt.sim.replay import iteration_stream
from umrt.trace.events import Alloc, Free, IterationBoundary, Launch, Trace

__all__ = ["LinkBound", "link_bound"]

_PRE, _HOST, _GPU = 0, 1, 2  # where a value came from: before the iteration, the host, a launch


@dataclass(frozen=True)
class LinkBound:
    """The link bound of one (trace, profile, budget); times in seconds, sizes in bytes."""

    time_s: float  # no policy's steady iteration is shorter (in this simulator)
    ideal_s: float  # the iteration's compute time with unlimited memory
    at_launch: int  # the window that costs most over its compute starts before this launch ...
    window_end: int  # ... and ends before this one (n: the iteration's end)
    cuts: tuple[int, ...]  # the windows that gave time_s: cuts before these launches, 0 .. n
    launches: int  # launches in the iteration
    budget_bytes: int
    h2d_min_bytes: int  # bytes that must cross host-to-device, summed over the windows
    d2h_min_bytes: int  # the most bytes that must have left the GPU by a launch's start (D_i above)
    compute_before_s: float  # ideal compute before the window
    compute_after_s: float  # ideal compute in the window
    remote_free_bytes: int  # what remote reads could carry under the window's compute
    h2d_rate: float  # bytes/s: the migration rate's supremum
    d2h_rate: float
    conserving_s: float  # the older estimate with a per-window copy-back term (not a bound)
    leave_launch: int = 0  # the launch whose start the bytes that must leave bound most ...
    leave_s: float = 0.0  # ... at this time: when they can all have left (F_i)
    steady_s: float = 0.0  # no iteration at least as long as the one before it is shorter (see module docstring)
    carried_bytes: int = 0  # bytes the iteration before wrote and this one reads

    @property
    def slowdown(self) -> float:
        """The bound over the ideal time (1.0: memory costs nothing)."""
        return self.time_s / self.ideal_s if self.ideal_s > 0 else float("nan")

    def to_json(self) -> dict:
        """A JSON-serialisable dict (every field, plus ``slowdown``)."""
        return asdict(self) | {"slowdown": self.slowdown}


def link_bound(trace: Trace, profile: HardwareProfile | str, budget: int | str, iterations: int = 3,
               budget_base: str = "footprint") -> LinkBound:
    """The link bound of ``trace``'s steady iteration on ``profile`` with ``budget``.

    ``budget`` and ``budget_base`` are read as :func:`~umrt.sim.replay.simulate`
    reads them (``"20%"`` of the footprint the run needs, ``"8GiB"``, or
    bytes: :mod:`umrt.sim.budget`); ``iterations`` picks the iteration as
    ``simulate`` with the same value reports it (the last simulated one).
    See the module docstring for why no policy can beat ``time_s``.
    """
    if not isinstance(profile, HardwareProfile):
        profile = hardware.load_profile(profile)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations must be a positive integer, got {iterations!r}")
    spans = trace.iteration_spans()
    if not spans:
        raise TraceFormatError("the trace holds no complete iteration (it needs two IterationBoundary events)")
    budget_bytes = resolve_budget(budget, trace, budget_base).bytes
    a, b = spans[min(iterations, len(spans)) - 1]
    flow = _value_flow(trace.events[a + 1 : b], profile)
    return _bound(flow, _carried(trace, spans, iterations, profile, budget_bytes), profile, budget_bytes)[0]


def _carried(trace: Trace, spans, iterations: int, profile: HardwareProfile, budget: int) -> _Carried | None:
    """The values the iteration before the reported one writes and the reported one reads
    (None when the reported iteration is the first), from the events the simulator replays."""
    if iterations < 2:
        return None
    stream = list(iteration_stream(trace, spans, iterations))
    marks = [i for i, ev in enumerate(stream) if isinstance(ev, IterationBoundary)]
    events = stream[marks[-3] + 1 : marks[-1]]
    n_prev = sum(isinstance(ev, Launch) for ev in stream[marks[-3] + 1 : marks[-2]])
    both = _value_flow(events, profile)
    rows = both.wrote[(both.wrote[:, 0] < n_prev) & (both.wrote[:, 1] >= n_prev)]
    # when the iteration before can reach each launch at the earliest, from its start
    prev = _value_flow(events[: next(i for i, ev in enumerate(events) if isinstance(ev, IterationBoundary))], profile)
    reach = _bound(prev, None, profile, budget)[1]
    return _Carried(rows - np.array([0, n_prev, 0]), reach)


# ---------------------------------------------------------------- values


@dataclass
class _Carried:
    """Values the iteration before wrote and this one reads: rows ``(w, r, bytes)``, launch ``w``
    of the iteration before wrote a value last read by launch ``r`` of this one; ``reach``:
    per cut of the iteration before, the earliest any policy passes it, from that iteration's
    start (its own bound; the last, its length at least)."""

    wrote: np.ndarray
    reach: np.ndarray


@dataclass
class _Flow:
    """The iteration's values as event arrays (cut k = before launch k, 0..n).

    * ``need``  (lo, r, bytes): a value that exists at cuts ``lo < k <= r`` is next read by launch ``r``;
    * ``host``  (beta, r, bytes): a value made on the host after cut ``beta`` (at cuts ``k <= beta`` it
      does not exist yet), first read by launch ``r``;
    * ``wrote`` (w, r, bytes): launch ``w`` wrote a value last read by launch ``r``;
    * ``reads`` (i, s, bytes): launch ``i`` reads a value present (or still to come from the host) at
      cuts ``s .. i``.
    """

    compute: np.ndarray
    need: np.ndarray
    host: np.ndarray
    wrote: np.ndarray
    reads: np.ndarray


def _value_flow(events, profile: HardwareProfile) -> _Flow:
    """Walk the iteration once, following every value from its origin through its reads."""
    compute: list[float] = []
    # obj -> sorted segments [start, end, origin, since, reads]; since: the first cut the value exists at
    segs: dict[int, list[list]] = {}
    need: list[tuple[int, int, int]] = []
    host: list[tuple[int, int, int]] = []
    wrote: list[tuple[int, int, int]] = []
    reads: list[tuple[int, int, int]] = []

    def emit(origin: int, since: int, read_by: list[int], nbytes: int) -> None:
        if not read_by:
            return
        if origin == _HOST:  # born after cut since-1: on the host (not yet existing) at cuts <= since-1
            host.append((since - 1, read_by[0], nbytes))
        elif origin == _GPU:
            wrote.append((since - 1, read_by[-1], nbytes))
        prev = since - 1
        for r in read_by:
            if r > prev:
                need.append((prev, r, nbytes))
            prev = max(prev, r)

    def close(obj: int, lo: int, hi: int) -> None:
        """Values of ``obj`` in [lo, hi) end (overwritten or freed)."""
        keep = []
        for s in segs.get(obj, ()):
            if s[1] <= lo or s[0] >= hi:
                keep.append(s)
                continue
            if s[0] < lo:
                keep.append([s[0], lo, s[2], s[3], list(s[4])])
            if s[1] > hi:
                keep.append([hi, s[1], s[2], s[3], list(s[4])])
            emit(s[2], s[3], s[4], min(s[1], hi) - max(s[0], lo))
        keep.sort(key=lambda x: x[0])
        segs[obj] = keep

    def read(obj: int, lo: int, hi: int, i: int) -> None:
        out, pos = [], lo
        for s in segs.get(obj, ()):
            if s[1] > lo and s[0] < hi:
                if s[0] > pos:  # bytes with no value seen yet: carried in from before the iteration
                    out.append([pos, s[0], _PRE, 0, []])
                pos = max(pos, s[1])
            out.append(s)
        if pos < hi:
            out.append([pos, hi, _PRE, 0, []])
        out.sort(key=lambda x: x[0])
        final = []
        for s in out:
            if s[1] <= lo or s[0] >= hi:
                final.append(s)
                continue
            for a, b in _pieces(s[0], s[1], lo, hi):
                piece = [a, b, s[2], s[3], list(s[4])]
                if lo <= a and b <= hi:
                    if not piece[4] or piece[4][-1] != i:
                        piece[4].append(i)
                        reads.append((i, piece[3] if piece[2] == _GPU else 0, b - a))
                final.append(piece)
        segs[obj] = final

    i = 0
    for ev in events:
        if isinstance(ev, Launch):
            in_place = ev.updates_in_place  # its writes are reads first
            for acc in ev.accesses:  # reads first: a launch reads its in-place operands before writing
                if (in_place or not acc.write) and acc.length > 0:
                    read(acc.obj, acc.offset, acc.offset + acc.length, i)
            for acc in ev.accesses:
                if acc.write and acc.length > 0:
                    close(acc.obj, acc.offset, acc.offset + acc.length)
                    segs[acc.obj].append([acc.offset, acc.offset + acc.length, _GPU, i + 1, []])
                    segs[acc.obj].sort(key=lambda x: x[0])
            compute.append(profile.compute_time(ev.flops, ev.bytes, ev.precision))
            i += 1
        elif isinstance(ev, Alloc):
            close(ev.obj, 0, 1 << 62)  # a reused id starts afresh
            # made on the host after cut i (before launch i): exists from cut i + 1
            segs[ev.obj] = [[0, ev.nbytes, _HOST, i + 1, []]] if ev.launch == -1 else []
        elif isinstance(ev, Free):
            close(ev.obj, 0, 1 << 62)
            segs.pop(ev.obj, None)
    for obj in list(segs):
        close(obj, 0, 1 << 62)

    def arr(rows):
        return np.asarray(rows, np.int64).reshape(-1, 3)

    return _Flow(np.asarray(compute, np.float64), arr(need), arr(host), arr(wrote), arr(reads))


def _pieces(s0: int, s1: int, lo: int, hi: int) -> list[tuple[int, int]]:
    edges = [s0, *(x for x in (lo, hi) if s0 < x < s1), s1]
    return list(zip(edges[:-1], edges[1:], strict=False))


# ---------------------------------------------------------------- the bound


def _bound(flow: _Flow, carried: _Carried | None, profile: HardwareProfile, budget: int
           ) -> tuple[LinkBound, np.ndarray]:
    """The longest chain of windows (a dynamic programme over pairs of cuts), row by row; and
    per cut, the earliest time from the iteration's start any policy can pass it."""
    c = flow.compute
    n = c.shape[0]
    before = np.concatenate([[0.0], np.cumsum(c)])  # compute before cut k
    ideal = float(before[-1])
    rate_h = profile.fastest_rate("h2d")  # no migration or copy of data is faster
    rate_d = profile.fastest_rate("d2h")
    leave, leave_at, leave_bytes = _leave_times(flow.wrote, before, budget, rate_d)
    ready = np.zeros(n + 1)  # no chain passes cut k earlier: launch k-1 starts after F_{k-1}
    ready[1:] = np.maximum(leave + c, _leave_times(flow.wrote, before, budget, rate_d, during=True)[0])
    # the same for the values the iteration before wrote, from its start (add -T for this one's)
    ready_carried = np.full(n + 1, -np.inf)
    if carried is not None and carried.wrote.size:
        ready_carried[1:] = np.maximum(_carried_leave(carried, flow.wrote, n, budget, rate_d) + c,
                                       _carried_leave(carried, flow.wrote, n, budget, rate_d, during=True))
    link_h, link_d = profile.h2d_bandwidth, profile.d2h_bandwidth  # remote access runs at the link rate
    cap = link_h * c  # remote bytes launch i carries for free under its compute

    need, host, wrote, reads = flow.need, flow.host, flow.wrote, flow.reads
    best = np.full(n + 1, -np.inf)  # the bound on the time up to cut k
    best[0] = 0.0
    best_carried = best.copy()  # the same from ready_carried (max-plus: the bound is linear in it)
    came = np.zeros(n + 1, np.int64)
    shared = np.full(n + 1, -np.inf)  # the same with a shared link
    shared[0] = 0.0
    # the window that ends at cut k in the best chain (from came[k]): its h2d bytes, excess over compute, free bytes
    win_h2d, win_excess, win_free = np.zeros(n + 1), np.zeros(n + 1), np.zeros(n + 1)
    for k1 in range(n):
        m = n + 1
        # bytes needed in window (k1, k2]: values existing at cut k1 first read by a launch < k2
        act = (need[:, 0] < k1) & (k1 <= need[:, 1])
        exist = np.cumsum(np.bincount(need[act, 1] + 1, need[act, 2], minlength=m + 1)[:m])
        act = k1 <= host[:, 0]
        later = np.cumsum(np.bincount(host[act, 1] + 1, host[act, 2], minlength=m + 1)[:m])
        h2d = (np.maximum(exist - budget, 0.0) + later)[k1 + 1 :]
        # remote-read capacity of launches k1 .. k2-1
        act = (reads[:, 1] <= k1) & (k1 <= reads[:, 0])
        u = np.bincount(reads[act, 0], reads[act, 2], minlength=n)[k1:]
        free = np.cumsum(np.minimum(u, cap[k1:]))
        extra = np.cumsum(np.maximum(u - cap[k1:], 0.0))
        readable = np.cumsum(u)
        comp = before[k1 + 1 :] - before[k1]
        # the link carries remote reads and copies one after the other; reads as if free beside copies
        h2d_s = np.minimum(h2d, readable) / link_h + np.maximum(h2d - readable, 0.0) / rate_h
        span = np.maximum(_window(h2d, comp, free, extra, rate_h, link_h), h2d_s)
        # with the copy-back term: values written in the window and needed after it
        act = k1 <= wrote[:, 0]
        out = np.cumsum(np.bincount(wrote[act, 0] + 1, wrote[act, 2], minlength=m + 1)[:m]
                        - np.bincount(wrote[act, 1] + 1, wrote[act, 2], minlength=m + 1)[:m])[k1 + 1 :]
        span_s = np.maximum(span, np.maximum(out - budget, 0.0) / link_d)
        cand = max(best[k1], ready[k1]) + span
        better = cand > best[k1 + 1 :]
        best[k1 + 1 :] = np.where(better, cand, best[k1 + 1 :])
        came[k1 + 1 :] = np.where(better, k1, came[k1 + 1 :])
        win_h2d[k1 + 1 :] = np.where(better, h2d, win_h2d[k1 + 1 :])
        win_excess[k1 + 1 :] = np.where(better, span - comp, win_excess[k1 + 1 :])
        win_free[k1 + 1 :] = np.where(better, free, win_free[k1 + 1 :])
        shared[k1 + 1 :] = np.maximum(shared[k1 + 1 :], max(shared[k1], ready[k1]) + span_s)
        best_carried[k1 + 1 :] = np.maximum(best_carried[k1 + 1 :], max(best_carried[k1], ready_carried[k1]) + span)

    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(came[cuts[-1]]))
    cuts.reverse()
    windows = list(zip(cuts[:-1], cuts[1:], strict=False))
    excess = [float(win_excess[b]) for _, b in windows]
    a, b = windows[int(np.argmax(excess))] if windows else (0, 0)
    time_s = max(float(best[n]), float(ready[n]), ideal)
    # An iteration of length T after one of length T' <= T: the values carried in may leave from
    # reach[w] - T' >= reach[w] - T, so T >= max(time_s, Q - T), Q the bound with ready_carried;
    # and T >= T' >= reach[n], which the queue's order above assumes (those values leave first).
    q = max(float(best_carried[n]), float(ready_carried[n]))
    steady = max(time_s, q / 2, float(carried.reach[-1])) if carried is not None else time_s
    reach = np.maximum(np.maximum(best, ready), before)
    return LinkBound(
        time_s=time_s,
        ideal_s=ideal,
        at_launch=a,
        window_end=b,
        cuts=tuple(cuts),
        launches=n,
        budget_bytes=int(budget),
        h2d_min_bytes=int(sum(float(win_h2d[y]) for _, y in windows)),
        d2h_min_bytes=int(leave_bytes),
        compute_before_s=float(before[a]),
        compute_after_s=float(before[b] - before[a]),
        remote_free_bytes=int(win_free[b]) if windows else 0,
        h2d_rate=float(rate_h),
        d2h_rate=float(rate_d),
        conserving_s=max(float(shared[n]), float(ready[n]), ideal),
        leave_launch=leave_at,
        leave_s=float(leave[leave_at]) if n else 0.0,
        steady_s=steady,
        carried_bytes=int(carried.wrote[:, 2].sum()) if carried is not None else 0,
    ), reach


def _leave_times(wrote: np.ndarray, before: np.ndarray, budget: int, rate_d: float, during: bool = False
                 ) -> tuple[np.ndarray, int, int]:
    """``F_i`` for each launch ``i`` (module docstring): the earliest time by which the bytes
    written before launch ``i``, read by it or later and over the budget can all have left
    the GPU; then the launch where the most bytes must have left, and how many.
    ``during``: ``E_i`` instead, the same with what launch ``i`` writes and a later launch reads.

    ``wrote`` rows are ``(w, r, bytes)``: launch ``w`` wrote a value last read by launch ``r``.
    """
    n = before.shape[0] - 1
    leave = np.zeros(n)
    most, most_at = 0.0, 0
    w, r, nb = wrote[:, 0], wrote[:, 1], wrote[:, 2].astype(np.float64)
    for i in range(n):
        live = ((w <= i) if during else (w < i)) & (i <= r)
        if not live.any():
            continue
        released = np.bincount(w[live], nb[live], minlength=n)[: i + 1]  # bytes that may leave from before[w]
        due = released.sum() - budget
        if due <= 0:
            continue
        if due > most:
            most, most_at = due, i
        earlier = np.cumsum(released) - released  # released before launch w's
        use = (released > 0) & (earlier < due)
        leave[i] = float(np.max(before[: i + 1][use] + (due - earlier[use]) / rate_d))
    return leave, most_at, int(most)


def _carried_leave(carried: _Carried, wrote: np.ndarray, n: int, budget: int, rate_d: float,
                   during: bool = False) -> np.ndarray:
    """Per launch ``i``, the earliest time, from the start of the iteration before, by which the
    bytes due to have left by its start (``during``: its end) can have (``-inf`` where none need
    to), taking first the values that iteration wrote (``carried.wrote``), each from when that
    iteration can reach the launch that wrote it (``carried.reach``), then this iteration's
    (``wrote``), which only add once those are out."""
    out = np.full(n, -np.inf)
    cw, cr, cb = carried.wrote[:, 0], carried.wrote[:, 1], carried.wrote[:, 2].astype(np.float64)
    w, r, nb = wrote[:, 0], wrote[:, 1], wrote[:, 2].astype(np.float64)
    n_prev = carried.reach.shape[0] - 1
    for i in range(n):
        live = i <= cr
        if not live.any():
            continue
        released = np.bincount(cw[live], cb[live], minlength=n_prev)
        due = released.sum() + nb[((w <= i) if during else (w < i)) & (i <= r)].sum() - budget
        if due <= 0:
            continue
        earlier = np.cumsum(released) - released
        use = (released > 0) & (earlier < due)
        out[i] = float(np.max(carried.reach[:-1][use] + (due - earlier[use]) / rate_d))
    return out


def _window(h2d, comp, free, extra, rate_h: float, link_h: float) -> np.ndarray:
    """Shortest time in which a window with ``comp`` of compute moves ``h2d`` bytes in.

    The copy queue carries ``rate_h`` per second; the compute stream carries
    ``free`` remote bytes under its compute, then ``extra`` more remote bytes
    at ``link_h`` (stretching launches), then fault migrations at ``rate_h``.
    """
    short = h2d - rate_h * comp - free
    d1 = comp + np.maximum(short, 0.0) / (rate_h + link_h)
    over = (d1 - comp) * link_h > extra
    d2 = comp + extra / link_h + np.maximum(short - extra * (1 + rate_h / link_h), 0.0) / (2 * rate_h)
    return np.where(over, d2, d1)
