"""A policy-independent lower bound on the simulated steady iteration time.

:func:`link_bound` computes, from the trace, the hardware profile and the
budget alone, a time that no policy can beat in :mod:`umrt.sim` — the
*link bound*. It is what a perfect policy would still pay because at most
the budget's bytes can sit on the GPU while the rest must come over the link.

Derivation
----------
Take the iteration :func:`umrt.sim.replay.simulate` reports (the last one)
and its launches ``0 .. n-1``, ``c_i`` each one's roofline compute time
(``HardwareProfile.compute_time``, as the ideal policy computes it). Cut the
iteration at ``k`` (``0 <= k <= n``): right after launch ``k-1`` has run,
before any later event. Follow every *value* (a byte range of an object,
from the event that gave it data to its next overwrite, free or the end of
the iteration; read/write ranges are exact, reads before writes within a
launch). A value is *needed at cut k* if a launch ``>= k`` reads it.

* ``A_k``: bytes of values needed at cut ``k`` that exist there (written by
  a launch before ``k``, made on the host before the cut, or carried in from
  before the iteration). The simulator never holds more than the budget
  ``B`` in resident 64 KB pages (capacity is counted in pages, so bytes of
  ``A_k`` on the GPU ``<= B``): at least ``A_k - B`` of them are on the host
  (or in flight to it) at the cut.
* ``Hb_k``: bytes of objects made on the host (``Alloc.launch == -1``, e.g.
  an input batch) after the cut and read later: they start in host memory.

Every such byte must cross the link host-to-device *after* the cut, before
the launch that reads it runs: a page holding defined data is populated, so
a migration copies it. The simulator can carry it three ways, and the bound
gives a policy the best of all three at once:

1. an explicit prefetch: the H2D copy engine is a queue whose end advances by
   every copy's duration (``bytes / rate``, rate at most the transfer curve's
   supremum ``min(h2d_bandwidth, transfer_curve_a GiB/s)``); copies issued
   after the cut start no earlier than it, so the last one lands at least
   ``prefetched / rate`` after the cut;
2. a fault migration: it stalls the compute stream at least ``bytes / rate``
   (sharing the link with a busy queue only makes the stall longer);
3. a remote read (AccessedBy / PreferredLocation=host): it stretches launch
   ``i`` to ``max(c_i, remote_i / h2d_bandwidth)`` and is *not* charged to
   the copy engine, so up to ``c_i * h2d_bandwidth`` bytes ride along for
   free — but only bytes launch ``i`` reads.

So with ``D`` the time from the cut to the iteration's end, the queue carries
at most ``rate * D`` and the compute stream, which must also fit
``C_after = sum(c_i, i >= k)``, carries the free remote bytes, then further
remote bytes at the link rate (stretching launches), then fault migrations
at ``rate``. ``D_k`` is the smallest ``D >= C_after`` at which these carry
``H_k = max(0, A_k - B) + Hb_k`` bytes, and the iteration takes at least
``C_before + D_k`` (``C_before = sum(c_i, i < k)``: compute cannot be
skipped). The bound is the maximum over cuts, and at least the ideal time.
Nothing in it depends on what a policy does, so it holds for every policy;
fault latency, call overhead and the transfer curve below its supremum only
add time.

What the bound deliberately does not count, because the simulator lets a
policy avoid it (see :attr:`LinkBound.d2h_min_bytes`): copying written data
*back* to the host before the cut. A written value that must leave the GPU
(``W_k - B`` bytes, ``W_k`` the needed bytes written during this iteration
before the cut) can reach host memory with no copy at all in the simulator —
written over a remote mapping (charged to the launch, not to the D2H engine),
or written into a resident block that the same launch's own fault servicing
evicts (a discarded block is the first victim, and the write then lands on the
host). :attr:`LinkBound.conserving_s` is the bound with that D2H term and a
link that remote access would share: it holds only for a simulator that
charged every crossing to the link.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from umrt import hardware
from umrt.errors import ConfigError, TraceFormatError
from umrt.hardware import GIB, HardwareProfile
from umrt.trace.events import Alloc, Free, Launch, Trace

__all__ = ["LinkBound", "link_bound"]

_PRE, _HOST, _GPU = 0, 1, 2  # where a value came from: before the iteration, the host, a launch


@dataclass(frozen=True)
class LinkBound:
    """The link bound of one (trace, profile, budget); times in seconds, sizes in bytes."""

    time_s: float  # no policy's steady iteration is shorter (in this simulator)
    ideal_s: float  # the iteration's compute time with unlimited memory
    at_launch: int  # the cut that gave time_s: before this launch of the iteration (n = the end)
    launches: int  # launches in the iteration
    budget_bytes: int
    h2d_min_bytes: int  # at that cut: bytes that must cross host-to-device after it
    d2h_min_bytes: int  # at that cut: written bytes that do not fit (not charged, see the module doc)
    compute_before_s: float  # ideal compute before the cut
    compute_after_s: float  # and from it on
    remote_free_bytes: int  # bytes after the cut that remote reads could carry under compute
    h2d_rate: float  # bytes/s: the migration rate's supremum
    d2h_rate: float
    conserving_s: float  # the bound if every crossing (remote, written-back) were charged to the link

    @property
    def slowdown(self) -> float:
        """The bound over the ideal time (1.0: memory costs nothing)."""
        return self.time_s / self.ideal_s if self.ideal_s > 0 else float("nan")

    def to_json(self) -> dict:
        """A JSON-serialisable dict (every field, plus ``slowdown``)."""
        return asdict(self) | {"slowdown": self.slowdown}


def link_bound(trace: Trace, profile: HardwareProfile | str, budget: int | str, iterations: int = 3) -> LinkBound:
    """The link bound of ``trace``'s steady iteration on ``profile`` with ``budget``.

    ``budget`` is read like :func:`umrt.sim.replay.parse_budget` (``"20%"``
    of the trace's peak live bytes, ``"8GiB"``, or bytes); ``iterations``
    picks the iteration as :func:`~umrt.sim.replay.simulate` with the same
    value reports it (the last simulated one). See the module docstring for
    why no policy can beat ``time_s``.
    """
    from umrt.sim.replay import parse_budget, peak_live_bytes

    if not isinstance(profile, HardwareProfile):
        profile = hardware.load_profile(profile)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations must be a positive integer, got {iterations!r}")
    spans = trace.iteration_spans()
    if not spans:
        raise TraceFormatError("the trace holds no complete iteration (it needs two IterationBoundary events)")
    budget_bytes = parse_budget(budget, peak_live_bytes(trace))
    a, b = spans[min(iterations, len(spans)) - 1]
    flow = _value_flow(trace.events[a + 1 : b], profile)
    return _bound(flow, profile, budget_bytes)


# ---------------------------------------------------------------- values


@dataclass
class _Flow:
    """Per-cut byte counts of one iteration (index k = the cut before launch k, 0..n)."""

    compute: np.ndarray  # c_i, per launch
    needed: np.ndarray  # A_k
    host_later: np.ndarray  # Hb_k
    written: np.ndarray  # W_k
    reads: np.ndarray  # (launch i, first cut s, bytes): launch i reads a value existing from cut s on


def _value_flow(events, profile: HardwareProfile) -> _Flow:
    """Walk the iteration once, following every value from its origin to its last read."""
    compute: list[float] = []
    segs: dict[int, list[list[int]]] = {}  # obj -> sorted [start, end, origin, since, last_read]
    closed: list[tuple[int, int, int, int]] = []  # (origin, since, last_read, bytes)
    reads: list[tuple[int, int, int]] = []

    def close(obj: int, lo: int, hi: int) -> None:
        """Values of ``obj`` in [lo, hi) end (overwritten or freed)."""
        keep = []
        for s in segs.get(obj, ()):
            if s[1] <= lo or s[0] >= hi:
                keep.append(s)
                continue
            if s[0] < lo:
                keep.append([s[0], lo, *s[2:]])
            if s[1] > hi:
                keep.append([hi, s[1], *s[2:]])
            end = min(s[1], hi)
            start = max(s[0], lo)
            if s[4] >= 0:
                closed.append((s[2], s[3], s[4], end - start))
        keep.sort()
        segs[obj] = keep

    def read(obj: int, lo: int, hi: int, i: int) -> None:
        out, pos = [], lo
        for s in segs.get(obj, ()):
            if s[1] <= lo or s[0] >= hi:
                out.append(s)
                continue
            if s[0] > pos:  # bytes with no value seen yet: carried in from before the iteration
                out.append([pos, s[0], _PRE, 0, -1])
            pos = max(pos, s[1])
            out.append(s)
        if pos < hi:
            out.append([pos, hi, _PRE, 0, -1])
        out.sort()
        # split at lo/hi, then mark the pieces inside as read by launch i
        final = []
        for s in out:
            for piece in _split(s, lo, hi):
                if piece[0] >= lo and piece[1] <= hi:
                    piece[4] = i
                    first = 0 if piece[2] != _GPU else piece[3]
                    reads.append((i, first, piece[1] - piece[0]))
                final.append(piece)
        segs[obj] = final

    i = 0
    for ev in events:
        if isinstance(ev, Launch):
            for acc in ev.accesses:
                if not acc.write and acc.length > 0:
                    read(acc.obj, acc.offset, acc.offset + acc.length, i)
            for acc in ev.accesses:
                if acc.write and acc.length > 0:
                    close(acc.obj, acc.offset, acc.offset + acc.length)
                    segs[acc.obj].append([acc.offset, acc.offset + acc.length, _GPU, i + 1, -1])
                    segs[acc.obj].sort()
            compute.append(profile.compute_time(ev.flops, ev.bytes))
            i += 1
        elif isinstance(ev, Alloc):
            close(ev.obj, 0, 1 << 62)  # a reused id starts afresh
            # made on the host: exists from the cut after the next launch; read before? it is Hb
            segs[ev.obj] = [[0, ev.nbytes, _HOST, i, -1]] if ev.launch == -1 else []
        elif isinstance(ev, Free):
            close(ev.obj, 0, 1 << 62)
            segs.pop(ev.obj, None)
    for obj in list(segs):
        close(obj, 0, 1 << 62)

    n = i
    needed = np.zeros(n + 2, np.float64)
    host_later = np.zeros(n + 2, np.float64)
    written = np.zeros(n + 2, np.float64)
    for origin, since, last, nbytes in closed:
        if origin == _PRE:
            needed[0] += nbytes
            needed[last + 1] -= nbytes
        elif origin == _HOST:  # born between launch since-1 and since: on the host at cuts <= since
            host_later[0] += nbytes
            host_later[since + 1] -= nbytes
            if last >= since + 1:
                needed[since + 1] += nbytes
                needed[last + 1] -= nbytes
        else:  # written by launch since-1: exists from cut since
            if last >= since:
                needed[since] += nbytes
                needed[last + 1] -= nbytes
                written[since] += nbytes
                written[last + 1] -= nbytes
    return _Flow(
        compute=np.asarray(compute, np.float64),
        needed=np.cumsum(needed)[: n + 1],
        host_later=np.cumsum(host_later)[: n + 1],
        written=np.cumsum(written)[: n + 1],
        reads=np.asarray(reads, np.int64).reshape(-1, 3),
    )


def _split(s: list[int], lo: int, hi: int) -> list[list[int]]:
    cuts = [x for x in (lo, hi) if s[0] < x < s[1]]
    edges = [s[0], *cuts, s[1]]
    return [[edges[j], edges[j + 1], *s[2:]] for j in range(len(edges) - 1)]


# ---------------------------------------------------------------- the bound


def _bound(flow: _Flow, profile: HardwareProfile, budget: int) -> LinkBound:
    c = flow.compute
    n = c.shape[0]
    before = np.concatenate([[0.0], np.cumsum(c)])  # C_before(k), k = 0..n
    ideal = float(before[-1])
    after = ideal - before
    curve = profile.transfer_curve_a * GIB  # the curve's supremum (atan < pi/2)
    rate_h = min(profile.h2d_bandwidth, curve)
    rate_d = min(profile.d2h_bandwidth, curve)
    link_h = profile.h2d_bandwidth  # remote reads run at the link rate itself

    # U[k, i]: bytes launch i >= k reads of values that exist at cut k (or come from the host later)
    u = np.zeros((n + 1, n), np.float64)
    r = flow.reads
    if r.shape[0]:
        first = np.minimum(r[:, 1], r[:, 0])
        np.add.at(u, (first, r[:, 0]), r[:, 2])
        np.add.at(u, (r[:, 0] + 1, r[:, 0]), -r[:, 2])
        u = np.cumsum(u, axis=0)
    cap = link_h * c  # remote bytes launch i carries for free under its compute
    free = np.minimum(u, cap).sum(axis=1)
    extra = np.maximum(u - cap, 0.0).sum(axis=1)

    h2d = np.maximum(flow.needed - budget, 0.0) + flow.host_later
    # smallest D >= after with rate_h*D + free + min(extra, link_h*(D-after)) + rate_h*max(0, D-after-extra/link_h) >= h2d
    short = h2d - rate_h * after - free
    d1 = after + np.maximum(short, 0.0) / (rate_h + link_h)
    over = (d1 - after) * link_h > extra
    d2 = after + extra / link_h + np.maximum(short - extra * (1 + rate_h / link_h), 0.0) / (2 * rate_h)
    span = np.where(over, d2, d1)
    total = before + span
    k = int(np.argmax(total))
    d2h = np.maximum(flow.written - budget, 0.0)
    # A link every crossing shares: remote reads (at the link rate) carry at most what later
    # launches read, the rest migrates; written values leave at most at the link rate.
    readable = u.sum(axis=1)
    h2d_s = np.minimum(h2d, readable) / link_h + np.maximum(h2d - readable, 0.0) / rate_h
    conserving = np.maximum(before, d2h / profile.d2h_bandwidth) + np.maximum(after, h2d_s)
    return LinkBound(
        time_s=max(float(total[k]), ideal),
        ideal_s=ideal,
        at_launch=k,
        launches=n,
        budget_bytes=int(budget),
        h2d_min_bytes=int(h2d[k]),
        d2h_min_bytes=int(d2h[k]),
        compute_before_s=float(before[k]),
        compute_after_s=float(after[k]),
        remote_free_bytes=int(free[k]),
        h2d_rate=float(rate_h),
        d2h_rate=float(rate_d),
        conserving_s=max(float(conserving.max()), ideal),
    )
