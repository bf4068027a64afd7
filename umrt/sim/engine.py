"""The simulator's hot loops: per-page Unified Memory state, in numba.

Everything here works on flat numpy arrays indexed by 64 KB page number
(page ``p`` covers bytes ``[p << 16, (p + 1) << 16)`` of the simulated VA
space) and 2 MB VA-block number (block ``b`` holds pages ``32b .. 32b+31``).
:class:`umrt.sim.engine_state.EngineState` owns the arrays and calls these
functions; nothing here allocates but a launch's few bytes of per-block scratch.

Granularity (NVIDIA open-gpu-kernel-modules, kernel-open/nvidia-uvm):

* 2 MB VA blocks (uvm_va_block_types.h) are the unit of eviction (a GPU
  root chunk, uvm_pmm_gpu.c) and the span of the density prefetcher.
* 64 KB big pages are the unit of migration: the driver widens a faulted
  4 KB page to its 64 KB page (uvm_perf_prefetch.c), so one fault entry
  here is one 64 KB page.

Costs are those of ``umrt/sim/MODEL.md``, fitted to a real H100: every
migration moves its bytes at the rate of its path (prefetch each way, the
fault path), a prefetched range pays a set-up once, population (first
touch, by prefetch, of host memory) and the refault path of discarded pages
have their own rates, and prefetches in both directions share one path.

Capacity is accounted in 64 KB pages (resident pages <= capacity) while
eviction frees whole 2 MB blocks, victims taken in the driver's order
(uvm_pmm_gpu.c): discarded blocks first, then least recently *migrated*
(not accessed) — the used list is ordered by allocation/migration time.
Thrashing throttling (uvm_perf_thrashing.c) is not modelled: it skips
eviction-driven migrations, so single-GPU oversubscription is not throttled.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from umrt.backends.base import BLOCK, PAGE  # the driver's units, defined once

PAGE_SHIFT = PAGE.bit_length() - 1  # 64 KB big page (uvm_va_block_types.h): 16
BLOCK_SHIFT = BLOCK.bit_length() - 1  # 2 MB VA block / root chunk: 21
PAGES_PER_BLOCK = BLOCK // PAGE
GIB = float(1 << 30)

# Per-page flag columns of ``pf`` (uint8, shape (pages, NFLAGS)).
F_GPU = 0  # the GPU holds a copy (resident, possibly still in flight)
F_VALID = 1  # content is populated; a migration copies it (0: never touched or discarded)
F_HOSTCOPY = 2  # read-mostly duplicate: the host copy is still up to date
F_RM = 3  # ReadMostly advice
F_PREF = 4  # PreferredLocation advice: PREF_*
F_ACCBY = 5  # AccessedBy(GPU) advice: host-resident data is read over the link
F_REMOTE = 6  # the GPU holds a remote mapping to host memory (PreferredLocation=host fault)
F_MAPPED = 7  # the page belongs to a live managed allocation
F_DISC = 8  # discarded: a kernel touching it takes the refault path until a prefetch to the GPU
F_HOSTPOP = 9  # host memory backs the page: a migration to the host need not populate it first
NFLAGS = 10
PREF_NONE, PREF_HOST, PREF_GPU = 0, 1, 2

# Per-block columns of ``bi`` (int64, shape (blocks, NBCOLS)).
B_RES = 0  # resident pages
B_RESVALID = 1  # resident pages with valid content
B_PREV, B_NEXT = 2, 3  # eviction-list links
B_LIST = 4  # LIST_*
B_PIN = 5  # == G_PIN while being serviced: never the victim
NBCOLS = 6
LIST_NONE, LIST_USED, LIST_DISCARDED = -1, 0, 1

# Scalars in ``g`` (int64).
G_CAP = 0  # capacity, pages
G_RES = 1  # resident pages
G_PEND = 2  # pages whose D2H copy (prefetch to host) is still running: not free yet
G_HEAD = 3  # list heads: G_HEAD + list
G_TAIL = 5  # list tails: G_TAIL + list
G_QHEAD, G_QTAIL = 7, 8  # pending-free queue (ring)
G_FAULTS, G_BATCHES, G_EVICTIONS = 9, 10, 11
G_H2D, G_D2H = 12, 13  # bytes
G_PEAK = 14  # peak resident pages
G_EVENTS = 15  # page events: pages visited by launches, migrations, evictions
G_FLOG = 16  # faults logged (ring index)
G_EPOCH = 17  # launch counter, for per-page de-duplication
G_PIN = 18  # current pin id
G_REMOTE_R, G_REMOTE_W = 19, 20  # bytes read / written remotely over the link
G_ERRPAGE = 21  # page of the last error
G_ERRBLOCKS = 22  # ERR_NO_VICTIM: blocks the batch (or prefetch) being serviced holds pinned
G_RHEAD = 23  # copy records over the link (+ T_H2D / T_D2H): the first that may be in flight ...
G_RTAIL = 25  # ... and the next id, per ring (+ T_H2D / T_D2H / R_GPU)
G_REFAULTS = 28  # pages a launch lost to its own fault servicing and faulted again
G_COPY_H2D, G_COPY_D2H = 29, 30  # bytes the copy engines moved (cudaMemcpyAsync, pinned <-> managed)
NG = 31

# Records: each queued piece of work a page waits on (a prefetch's block, an eviction, a discard)
# completes at ``rec_t[ring, id % RING]``; a page in flight holds ``id * 4 + ring`` in ``prec``
# (-1: none). A copy sharing the link moves the records of the copies there (rings ``T_H2D``,
# ``T_D2H``), whose pages arrive later together; work on the GPU alone never moves (``R_GPU``:
# discards, populations, evictions that copy nothing).
R_GPU, NRINGS = 2, 3
RING = 1 << 18

# Scalars in ``tf`` (float64).
T_H2D = 0  # the H2D copy engine is busy until
T_D2H = 1  # the D2H copy engine is busy until
T_OUT = 2  # launch: time its faults are all serviced
T_WAIT = 3  # launch: transfer wait
T_REMOTE = 4  # launch: time its remote accesses are done (from T_OUT; T_OUT if none)
T_MIG = 5  # the driver's prefetch path (both directions, one migration at a time) is busy until
T_CE_H2D = 6  # the copy engine host -> GPU (cudaMemcpyAsync from pinned memory) is busy until
T_CE_D2H = 7  # the copy engine GPU -> host (cudaMemcpyAsync to pinned memory) is busy until
T_DISC = 8  # the stream the swap path's discards run on (after their copies out) is busy until
T_DROP = 9  # the stream dead ranges are discarded on, beside the kernels, is busy until
NT = 10

# Parameters in ``prm`` (float64), from the hardware profile (rates in bytes/s).
P_H2D, P_D2H = 0, 1  # the link per direction: remote access
P_BATCH = 2  # fault_batch_size
P_LAT = 3  # fault_batch_latency_s
P_THRESH = 4  # prefetch_threshold, percent
P_PF_H2D = 5  # prefetch_h2d_rate
P_PF_D2H = 6  # prefetch_d2h_rate: also every copy back (prefetch to host, eviction)
P_SETUP_H2D = 7  # prefetch_h2d_setup_s: per range a prefetch moves anything in
P_SETUP_D2H = 8  # prefetch_d2h_setup_s
P_FAULT = 9  # fault_migration_rate
P_TOUCH = 10  # first_touch_rate: a fault populates a never-populated page
P_POPULATE = 11  # prefetch_populate_rate: a prefetch populates one
P_HOSTPOP = 12  # host_populate_rate: the first copy of a page to the host
P_REFAULT = 13  # discard_refault_rate: a fault on a discarded page
P_REVALIDATE = 14  # discard_prefetch_rate: a prefetch of a discarded page already on the GPU
P_COPY_H2D = 15  # copy_h2d_rate: cudaMemcpyAsync pinned host -> GPU-resident managed memory
P_COPY_D2H = 16  # copy_d2h_rate: cudaMemcpyAsync GPU-resident managed memory -> pinned host
P_DISCARD = 17  # discard_rate: a discard's own work, bytes/s of the range
NP = 18

# Fault entry kinds (two bits of a sort key).
E_MIGRATE, E_MAPREMOTE, E_COLLAPSE, E_REFAULT = 0, 1, 2, 3
# Per-page classes within one launch: on the GPU when it began, served over the link,
# or migrated in by its fault servicing (used then, so it may leave again).
C_LOCAL, C_REMOTE, C_LANDED = 0, 1, 2

ERR_UNMAPPED = 1  # a launch touched a page outside every allocation
ERR_NO_VICTIM = 2  # capacity too small for the blocks one fault batch pins


def new_scalars(capacity_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """The scalars ``g`` and times ``tf`` of an empty GPU with ``capacity_pages``."""
    g = np.zeros(NG, np.int64)
    g[G_CAP] = capacity_pages
    g[G_HEAD : G_TAIL + 2] = -1  # both lists' heads and tails
    tf = np.zeros(NT, np.float64)
    return g, tf


# ---------------------------------------------------------------- helpers


@njit(cache=True)
def _ready(prec, rec_t, g, p):
    """When page ``p``'s last migration completes (0: none pending); ``prec``: any record codes."""
    r = prec[p]
    if r < 0:
        return 0.0
    d = r & 3
    i = r >> 2
    if g[G_RTAIL + d] - i > RING:  # overwritten: RING records ago, long done
        return 0.0
    return rec_t[d, i % RING]


@njit(cache=True)
def _new_record(rec_t, g, d, t_done):
    """A record in ring ``d`` (``T_H2D``, ``T_D2H``, ``R_GPU``) completing at ``t_done``; returns its ``prec`` code."""
    i = g[G_RTAIL + d]
    g[G_RTAIL + d] = i + 1
    rec_t[d, i % RING] = t_done
    return i * 4 + d


@njit(cache=True)
def _share_link(tf, rec_t, g, d, t, secs):
    """A copy of ``secs`` (at full link rate) outside the queue of direction ``d``, from ``t``; returns its end.

    The driver's fault-servicing copies run on their own channels, so they do
    not queue behind pending prefetches: they share the link with them
    (time-sliced copy engines), at half rate while both run. Work is
    conserved: the queue ends ``secs`` later, and every queued copy still
    running at ``t`` completes later by the link time the shared copy took
    from it (processor sharing: a copy with ``w`` seconds left at ``t``
    completes at ``t + 2w`` if ``w <= secs``, else ``secs`` later).
    """
    if secs <= 0.0:
        return t
    busy = tf[d] - t
    if busy < 0.0:
        busy = 0.0
    end = t + secs + min(busy, secs)
    if t < tf[T_MIG] <= tf[d]:  # the prefetch path's last migration is on this link: it ends later too
        tf[T_MIG] += min(tf[T_MIG] - t, secs)
    tf[d] = max(tf[d], t) + secs
    tail = g[G_RTAIL + d]
    h = max(g[G_RHEAD + d], tail - RING)
    while h < tail and rec_t[d, h % RING] <= t:  # done before t: no longer in flight
        h += 1
    g[G_RHEAD + d] = h
    for i in range(h, tail):
        r = rec_t[d, i % RING]
        if r > t:
            rec_t[d, i % RING] = r + min(r - t, secs)
    return end


@njit(cache=True)
def _queue(tf, d, start, secs, link=True):
    """A prefetch-path migration of ``secs`` in direction ``d``, ready at ``start``; returns its end.

    Explicit migrations in both directions go through one path, one at a
    time in issue order (h100-measured.md: 2 GiB each way at once took as
    long as both one after the other), behind the copies on its own link.
    A migration that copies nothing over the link (``link`` False: it only
    populates or revalidates pages on the GPU) waits for the path, not for
    the link's queued copies.
    """
    begin = max(start, tf[T_MIG], tf[d]) if link else max(start, tf[T_MIG])
    end = begin + secs
    if secs > 0.0:
        tf[T_MIG] = end
        if link:
            tf[d] = end
    return end


@njit(cache=True)
def _copy_engine(tf, rec_t, g, d, start, secs):
    """A ``cudaMemcpyAsync`` of ``secs`` (at its copy rate) on the copy engine of direction ``d``,
    ready at ``start``; returns its end.

    Each direction has a copy engine of its own, so copies run beside the
    other direction's and beside compute (uvm-model.md: H2D and D2H copy
    engines run concurrently; not measured for managed memory, MODEL.md).
    Copies on one engine run one at a time in issue order; each shares its
    direction of the link with the migrations queued there exactly as a
    fault-path copy does (:func:`_share_link`: processor sharing, work
    conserved), so a migration and a copy in one direction never both get
    the whole link.
    """
    ce = T_CE_H2D if d == T_H2D else T_CE_D2H
    begin = max(start, tf[ce])
    end = _share_link(tf, rec_t, g, d, begin, secs)
    tf[ce] = end
    return end


@njit(cache=True, inline="always")
def _migrate_runs(pf, prec, lo, hi, d2h, mask, prm, g, rec, rate, fill_rate):
    """Migrate the pages of ``[lo, hi)``; return ``(copy seconds, other seconds)``.

    Every migration in the model moves pages by this rule. To the GPU: mapped,
    non-resident pages, and with a ``mask`` only those it marks
    (``mask[q - lo]``); those with valid content are copied at ``rate``, the
    others populate without a copy at ``fill_rate`` (a discarded page at the
    refault rate instead when ``fill_rate`` is the first-touch one: the
    caller passes ``-1`` for that); the caller lands them once it knows when
    the copy ends. To the host (``d2h``): every resident page leaves the GPU
    here, and those with valid content are copied back at ``rate``, except
    clean read-mostly duplicates whose host copy is current; a copied page
    whose host memory was never populated pays ``P_HOSTPOP`` first (the
    *other* seconds); the copied pages take the copy record ``rec`` (-1: the
    caller waits for the copy itself). The bytes copied are added to
    ``g``'s counter for the direction. Inlined, so each caller's fixed
    direction and mask fold away.
    """
    copied = 0
    other = 0.0
    for q in range(lo, hi):
        if mask is not None:  # the caller kept only mapped, non-resident pages in it
            if mask[q - lo] == 0:
                continue
        elif not d2h:
            if pf[q, F_MAPPED] == 0 or pf[q, F_GPU] == 1:
                continue
        elif pf[q, F_GPU] == 0:
            continue
        if d2h:
            copy = pf[q, F_VALID] == 1 and pf[q, F_HOSTCOPY] == 0
            pf[q, F_GPU] = 0
            pf[q, F_HOSTCOPY] = 0
            prec[q] = rec if copy else -1
            if copy:
                copied += 1
                if pf[q, F_HOSTPOP] == 0:
                    pf[q, F_HOSTPOP] = 1
                    other += PAGE / prm[P_HOSTPOP]
        elif pf[q, F_VALID] == 1:
            copied += 1
        elif fill_rate < 0.0:  # the fault path: zero-fill, or the refault path of a discarded page
            other += PAGE / (prm[P_REFAULT] if pf[q, F_DISC] else prm[P_TOUCH])
        else:
            other += PAGE / fill_rate
    g[G_D2H if d2h else G_H2D] += copied * PAGE
    return copied * PAGE / rate, other


@njit(cache=True)
def _list_remove(bi, g, b):
    lst = bi[b, B_LIST]
    if lst < 0:
        return
    prev = bi[b, B_PREV]
    nxt = bi[b, B_NEXT]
    if prev >= 0:
        bi[prev, B_NEXT] = nxt
    else:
        g[G_HEAD + lst] = nxt
    if nxt >= 0:
        bi[nxt, B_PREV] = prev
    else:
        g[G_TAIL + lst] = prev
    bi[b, B_LIST] = LIST_NONE
    bi[b, B_PREV] = -1
    bi[b, B_NEXT] = -1


@njit(cache=True)
def _list_append(bi, g, b, lst):
    tail = g[G_TAIL + lst]
    bi[b, B_PREV] = tail
    bi[b, B_NEXT] = -1
    if tail >= 0:
        bi[tail, B_NEXT] = b
    else:
        g[G_HEAD + lst] = b
    g[G_TAIL + lst] = b
    bi[b, B_LIST] = lst


@njit(cache=True)
def _touch_block(bi, g, b):
    """Pages just migrated into ``b``: it moves to the tail of the used list."""
    _list_remove(bi, g, b)
    _list_append(bi, g, b, LIST_USED if bi[b, B_RESVALID] > 0 else LIST_DISCARDED)


@njit(cache=True)
def _refresh_block(bi, g, b):
    """Keep ``b`` on the right list after its residency or validity changed."""
    if bi[b, B_RES] == 0:
        _list_remove(bi, g, b)
    elif bi[b, B_RESVALID] == 0:
        if bi[b, B_LIST] != LIST_DISCARDED:
            _list_remove(bi, g, b)
            _list_append(bi, g, b, LIST_DISCARDED)
    elif bi[b, B_LIST] != LIST_USED:
        _list_remove(bi, g, b)
        _list_append(bi, g, b, LIST_USED)


@njit(cache=True)
def _pending_done(g, q_r, rec_t):
    """When the oldest pending D2H copy completes."""
    return _ready(q_r, rec_t, g, g[G_QHEAD] % q_r.shape[0])


@njit(cache=True)
def _retire(g, q_r, q_n, rec_t, t):
    """Pending D2H copies finished by ``t`` free their pages."""
    size = q_r.shape[0]
    while g[G_QHEAD] < g[G_QTAIL] and _pending_done(g, q_r, rec_t) <= t:
        g[G_PEND] -= q_n[g[G_QHEAD] % size]
        g[G_QHEAD] += 1


@njit(cache=True)
def _take_pending(g, q_n, n):
    """A caller that waited for the oldest pending copy takes ``n`` of its pages, no more.

    Its other pages stay pending: the caller's time moved to the copy's end,
    but a launch running before then must not find them free.
    """
    size = q_n.shape[0]
    head = g[G_QHEAD] % size
    take = min(n, q_n[head])
    q_n[head] -= take
    g[G_PEND] -= take
    if q_n[head] == 0:
        g[G_QHEAD] += 1


@njit(cache=True)
def _push_pending(g, q_r, q_n, rec, n):
    """``n`` pages leave the GPU by the D2H copy record ``rec``: their memory is free once it completes."""
    size = q_r.shape[0]
    if g[G_QTAIL] - g[G_QHEAD] >= size:  # ring full: the oldest copy is long done
        g[G_PEND] -= q_n[g[G_QHEAD] % size]
        g[G_QHEAD] += 1
    q_r[g[G_QTAIL] % size] = rec
    q_n[g[G_QTAIL] % size] = n
    g[G_QTAIL] += 1
    g[G_PEND] += n


@njit(cache=True)
def _evict_block(pf, prec, rec_t, bi, g, prm, b, rec):
    """Evict every resident page of block ``b``; return the D2H copy-back seconds
    and when its pages' copies to the GPU complete (the copy-back cannot start before).

    Copy-back is skipped for invalid (never written, discarded) pages and for
    clean read-mostly duplicates whose host copy is still current.
    """
    p0 = b * PAGES_PER_BLOCK
    arrived = 0.0
    for q in range(p0, p0 + PAGES_PER_BLOCK):
        if pf[q, F_GPU]:
            arrived = max(arrived, _ready(prec, rec_t, g, q))
    copy, hostpop = _migrate_runs(pf, prec, p0, p0 + PAGES_PER_BLOCK, True, None, prm, g, rec, prm[P_PF_D2H], 0.0)
    secs = copy + hostpop
    g[G_RES] -= bi[b, B_RES]
    g[G_EVENTS] += bi[b, B_RES]
    bi[b, B_RES] = 0
    bi[b, B_RESVALID] = 0
    _list_remove(bi, g, b)
    g[G_EVICTIONS] += 1
    return secs, arrived


@njit(cache=True)
def _victim(bi, g):
    """Discarded blocks first, then the least recently migrated; never a pinned one."""
    for lst in (LIST_DISCARDED, LIST_USED):
        b = g[G_HEAD + lst]
        while b >= 0 and bi[b, B_PIN] == g[G_PIN]:
            b = bi[b, B_NEXT]
        if b >= 0:
            return b
    return -1


@njit(cache=True)
def _make_room(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, n, t, prefetch):
    """Free capacity for ``n`` more pages at time ``t``.

    Evicts only when an allocation fails (driver behaviour), LRU by migration. Returns
    ``(t, evict_seconds, arrived)``; ``t < 0``: no victim exists (every resident block is pinned).

    * Fault path: ``evict_seconds`` is the copy-back time of the evictions,
      which the caller charges synchronously from ``arrived`` (the victims'
      own copies in must be done first).
    * ``prefetch``: room comes first from the caller's pending D2H copies,
      ``t`` moving to when they finish (taking only the pages it needs);
      each eviction is a copy on the D2H engine whose pages stay pending
      (their memory is not free) until it completes, so ``t`` moves past it
      too. ``evict_seconds`` is 0.
    """
    _retire(g, q_r, q_n, rec_t, t)
    secs = 0.0
    arrived = 0.0
    while g[G_RES] + g[G_PEND] + n > g[G_CAP]:
        pending = g[G_PEND] > 0
        if prefetch and pending:
            t = max(t, _pending_done(g, q_r, rec_t))
            _take_pending(g, q_n, g[G_RES] + g[G_PEND] + n - g[G_CAP])
            continue
        b = _victim(bi, g)
        if b < 0:
            if pending:
                t = max(t, _pending_done(g, q_r, rec_t))
                _retire(g, q_r, q_n, rec_t, t)
                continue
            return -1.0, secs, arrived
        if prefetch:
            rec = g[G_RTAIL + T_D2H] * 4 + T_D2H  # the copy record this eviction's pages take
            nres = bi[b, B_RES]
            s, a = _evict_block(pf, prec, rec_t, bi, g, prm, b, rec)
            if s > 0.0:
                _new_record(rec_t, g, T_D2H, _queue(tf, T_D2H, max(t, a), s))
            else:  # nothing copied (no page took ``rec``): free once its own copies are done
                rec = _new_record(rec_t, g, R_GPU, max(t, a))
            _push_pending(g, q_r, q_n, rec, nres)
        else:
            s, a = _evict_block(pf, prec, rec_t, bi, g, prm, b, -1)
            secs += s
            arrived = max(arrived, a)
    return t, secs, arrived


@njit(cache=True)
def _prefetch_mask(pf, b, faulted, thresh, prefix, out):
    """The density prefetcher of uvm_perf_prefetch.c over one 2 MB block.

    Leaves are the block's pages that are resident on the GPU or faulted in
    this batch; for each faulted page, walk its subtrees upward and keep the
    largest whose occupied share exceeds ``thresh`` percent. The tree never
    crosses the block and is clipped to the block's mapped pages. First touch
    of a never-populated block whose PreferredLocation is the GPU takes the
    whole block (the driver's first-touch fast path). ``prefix`` is scratch
    (``PAGES_PER_BLOCK + 1`` entries, the first 0).
    """
    p0 = b * PAGES_PER_BLOCK
    n = 0
    populated = False
    for i in range(PAGES_PER_BLOCK):
        if pf[p0 + i, F_MAPPED]:
            n = i + 1
        if pf[p0 + i, F_VALID] or pf[p0 + i, F_GPU]:
            populated = True
    for i in range(PAGES_PER_BLOCK):
        occ = 1 if (faulted[i] or pf[p0 + i, F_GPU]) and i < n else 0
        prefix[i + 1] = prefix[i] + occ
        out[i] = 0
    for i in range(n):
        if not faulted[i]:
            continue
        if not populated and pf[p0 + i, F_PREF] == PREF_GPU:
            for j in range(n):
                out[j] = 1
            return
        lo, hi = i, i + 1
        size = 2
        while size <= PAGES_PER_BLOCK:
            start = (i // size) * size
            end = min(start + size, n)
            count = prefix[end] - prefix[start]
            if count * 100 > (end - start) * thresh:
                lo, hi = start, end
            size *= 2
        for j in range(lo, hi):
            out[j] = 1


@njit(cache=True)
def _land(pf, prec, bi, g, p, rec, written):
    """Page ``p`` becomes resident (its copy is the record ``rec``; -1: already complete)."""
    dup = pf[p, F_RM] == 1 and pf[p, F_VALID] == 1 and not written
    pf[p, F_GPU] = 1
    pf[p, F_HOSTCOPY] = 1 if dup else 0
    pf[p, F_VALID] = 1  # populated on the GPU: the driver copies it back from now on
    pf[p, F_DISC] = 0
    prec[p] = rec
    b = p // PAGES_PER_BLOCK
    bi[b, B_RES] += 1
    bi[b, B_RESVALID] += 1


@njit(cache=True)
def _arrived(bi, g, b, n):
    """``n`` pages of block ``b`` just landed: count them; ``b`` becomes most recently migrated."""
    g[G_RES] += n
    g[G_EVENTS] += n
    if g[G_RES] > g[G_PEAK]:
        g[G_PEAK] = g[G_RES]
    _touch_block(bi, g, b)


# ---------------------------------------------------------------- entry points


@njit(cache=True)
def launch(pf, prec, rec_t, pmark, pwmark, pclass, bi, g, tf, prm, q_r, q_n, flog,
           a_start, a_end, a_write, t0, ubuf, ebuf, etype):
    """Run one kernel's memory side starting at GPU time ``t0``.

    Pages still in flight from a prefetch make the kernel wait (transfer
    wait, no fault); non-resident pages fault, in batches of ``P_BATCH``
    entries each costing ``P_LAT`` plus its evictions and migrations. The
    driver does not know which pages the kernel will touch, so servicing may
    evict the launch's own resident pages (LRU by migration): those fault
    again in another round (thrashing, at its cost), so every page the launch
    touches is on the GPU (or mapped over the link) when it is used.
    Remote accesses (pages mapped over the link) start once the faults are
    done and are link traffic like copies: reads in the H2D direction,
    writes in the D2H one, each at the link rate and sharing it with the
    copies queued in that direction (:func:`_share_link`).
    Results: ``tf[T_OUT]`` (time the faults are done), ``tf[T_WAIT]``,
    ``tf[T_REMOTE]``; remote bytes accumulate in ``g``. Returns 0 or an
    ``ERR_*`` code.
    """
    g[G_EPOCH] += 1
    epoch = g[G_EPOCH]
    # Pass 1: the unique pages, in access order, and whether the kernel writes them.
    nu = 0
    for k in range(a_start.shape[0]):
        if a_end[k] <= a_start[k]:
            continue
        for p in range(a_start[k] >> PAGE_SHIFT, ((a_end[k] - 1) >> PAGE_SHIFT) + 1):
            if pmark[p] != epoch:
                if not pf[p, F_MAPPED]:
                    g[G_ERRPAGE] = p
                    return ERR_UNMAPPED
                pmark[p] = epoch
                pwmark[p] = 0
                ubuf[nu] = p
                nu += 1
            if a_write[k]:
                pwmark[p] = 1
    g[G_EVENTS] += nu
    # Pass 2: classify; fault entries go to ebuf.
    wait_until = t0
    ne = 0
    nremote = 0
    for i in range(nu):
        p = ubuf[i]
        pclass[p] = C_LOCAL
        if pf[p, F_GPU] and pf[p, F_DISC]:
            ebuf[ne] = p
            etype[ne] = E_REFAULT  # discarded: unmapped, it faults and takes the refault path
            ne += 1
        elif pf[p, F_GPU]:
            ready = _ready(prec, rec_t, g, p)
            if ready > wait_until:
                wait_until = ready
            if pwmark[p] and pf[p, F_HOSTCOPY]:
                ebuf[ne] = p
                etype[ne] = E_COLLAPSE  # a write to a read-duplicated page revokes the copies
                ne += 1
        elif pf[p, F_REMOTE] or (pf[p, F_ACCBY] and pf[p, F_VALID]):
            pclass[p] = C_REMOTE  # mapped over the link: no fault, no migration
            nremote += 1
        elif pf[p, F_PREF] == PREF_HOST:
            pclass[p] = C_REMOTE
            nremote += 1
            ebuf[ne] = p
            etype[ne] = E_MAPREMOTE  # faults once, then maps host memory instead of migrating
            ne += 1
        else:
            ebuf[ne] = p
            etype[ne] = E_MIGRATE
            ne += 1
    tf[T_WAIT] = wait_until - t0
    t = wait_until
    # Pass 3: service the faults in batches; within a batch, per 2 MB block.
    batch = int(prm[P_BATCH])
    faulted = np.zeros(PAGES_PER_BLOCK, np.uint8)
    mask = np.zeros(PAGES_PER_BLOCK, np.uint8)
    prefix = np.zeros(PAGES_PER_BLOCK + 1, np.int64)
    fsize = flog.shape[0]
    keys = np.empty(batch, np.int64)
    while ne > 0:
        evictions = g[G_EVICTIONS]
        for s in range(0, ne, batch):
            e = min(s + batch, ne)
            # sort the batch by page (the driver sorts and coalesces faults per VA block);
            # insertion sort: entries arrive nearly in address order
            m = e - s
            for i in range(m):
                key = ebuf[s + i] * 4 + etype[s + i]
                j = i - 1
                while j >= 0 and keys[j] > key:
                    keys[j + 1] = keys[j]
                    j -= 1
                keys[j + 1] = key
            g[G_BATCHES] += 1
            g[G_FAULTS] += m
            t += prm[P_LAT]
            g[G_PIN] += 1
            pinned = 0
            k = 0
            while k < m:
                b = (keys[k] >> 2) // PAGES_PER_BLOCK
                p0 = b * PAGES_PER_BLOCK
                bi[b, B_PIN] = g[G_PIN]
                pinned += 1
                any_migrate = False
                refaults = 0
                faulted[:] = 0
                while k < m and (keys[k] >> 2) // PAGES_PER_BLOCK == b:
                    p = keys[k] >> 2
                    kind = keys[k] & 3
                    if kind == E_MIGRATE:
                        faulted[p - p0] = 1
                        any_migrate = True
                    elif kind == E_MAPREMOTE:
                        pf[p, F_REMOTE] = 1
                        pf[p, F_VALID] = 1  # first touch populates host memory
                        pf[p, F_HOSTPOP] = 1
                    elif kind == E_REFAULT:
                        pf[p, F_DISC] = 0
                        prec[p] = -1
                        refaults += 1
                    else:
                        pf[p, F_HOSTCOPY] = 0
                    k += 1
                flog[g[G_FLOG] % fsize] = b
                g[G_FLOG] += 1
                t += refaults * PAGE / prm[P_REFAULT]
                if not any_migrate:
                    continue
                _prefetch_mask(pf, b, faulted, prm[P_THRESH], prefix, mask)
                n = 0
                for i in range(PAGES_PER_BLOCK):
                    p = p0 + i
                    if mask[i] and (pf[p, F_GPU] or not pf[p, F_MAPPED] or (
                            not faulted[i] and (pf[p, F_PREF] == PREF_HOST or pf[p, F_ACCBY] or pf[p, F_REMOTE]))):
                        mask[i] = 0  # already here, or served over the link
                    n += mask[i]
                t, evict_secs, arrived = _make_room(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, n, t, False)
                if t < 0:
                    g[G_ERRPAGE] = p0
                    g[G_ERRBLOCKS] = pinned
                    return ERR_NO_VICTIM
                if evict_secs > 0.0:  # eviction is synchronous in the fault path
                    t = _share_link(tf, rec_t, g, T_D2H, max(t, arrived), evict_secs)
                elif arrived > t:  # a victim still in flight (a copy out, a discard) is freed once done
                    t = arrived
                for i in range(PAGES_PER_BLOCK):  # a page moves once its previous move (to the host) is done
                    if mask[i] and pf[p0 + i, F_VALID]:
                        t = max(t, _ready(prec, rec_t, g, p0 + i))
                copy, fill = _migrate_runs(pf, prec, p0, p0 + PAGES_PER_BLOCK, False, mask, prm, g, -1,
                                           prm[P_FAULT], -1.0)
                t = _share_link(tf, rec_t, g, T_H2D, t, copy) + fill
                for i in range(PAGES_PER_BLOCK):
                    if mask[i]:
                        p = p0 + i
                        _land(pf, prec, bi, g, p, -1, pwmark[p] == 1 and pmark[p] == epoch)
                        if pmark[p] == epoch:
                            pclass[p] = C_LANDED
                _arrived(bi, g, b, n)
        # Pages the launch had on the GPU and lost to its own servicing fault again
        # (each at most once: a page migrated in by this launch has been used);
        # only an eviction takes a page off the GPU here.
        ne = 0
        for i in range(nu if g[G_EVICTIONS] != evictions else 0):
            p = ubuf[i]
            if pclass[p] == C_LOCAL and not pf[p, F_GPU]:
                ebuf[ne] = p
                etype[ne] = E_MIGRATE
                ne += 1
        g[G_REFAULTS] += ne
    tf[T_OUT] = t
    # Pass 4: writes make content valid again (undoing a discard).
    for k in range(a_start.shape[0]):
        if not a_write[k] or a_end[k] <= a_start[k]:
            continue
        for p in range(a_start[k] >> PAGE_SHIFT, ((a_end[k] - 1) >> PAGE_SHIFT) + 1):
            if not pf[p, F_VALID]:
                pf[p, F_VALID] = 1
                if pf[p, F_GPU]:
                    b = p // PAGES_PER_BLOCK
                    bi[b, B_RESVALID] += 1
                    _refresh_block(bi, g, b)
    # Pass 5: bytes that cross the link remotely.
    remote_r, remote_w = 0, 0
    for k in range(a_start.shape[0] if nremote else 0):
        if a_end[k] <= a_start[k]:
            continue
        for p in range(a_start[k] >> PAGE_SHIFT, ((a_end[k] - 1) >> PAGE_SHIFT) + 1):
            if pclass[p] == C_REMOTE:
                lo = max(a_start[k], p << PAGE_SHIFT)
                hi = min(a_end[k], (p + 1) << PAGE_SHIFT)
                if a_write[k]:
                    remote_w += hi - lo
                else:
                    remote_r += hi - lo
    g[G_REMOTE_R] += remote_r
    g[G_REMOTE_W] += remote_w
    end_r = _share_link(tf, rec_t, g, T_H2D, t, remote_r / prm[P_H2D])
    end_w = _share_link(tf, rec_t, g, T_D2H, t, remote_w / prm[P_D2H])
    tf[T_REMOTE] = max(end_r, end_w)
    return 0


@njit(cache=True)
def prefetch_gpu(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, p_lo, p_hi, t_issue):
    """cudaMemPrefetchAsync(range, GPU) for page spans ``[p_lo, p_hi)``, range ``r`` issued at ``t_issue[r]``.

    Pipelined across VA blocks on the prefetch path (uvm_migrate.c): a range
    that moves anything pays ``P_SETUP_H2D`` once, then each block its bytes
    over ``P_PF_H2D`` (never-populated pages populate at ``P_POPULATE``, no
    copy; discarded pages still on the GPU come back at ``P_REVALIDATE``). It
    may evict other managed memory, waiting first for its own pending
    prefetches to host. Each page is usable once its block's copy completes
    (its copy record).
    """
    for r in range(p_lo.shape[0]):
        p = p_lo[r]
        setup = prm[P_SETUP_H2D]
        while p < p_hi[r]:
            b = p // PAGES_PER_BLOCK
            p0 = b * PAGES_PER_BLOCK
            stop = min(p_hi[r], p0 + PAGES_PER_BLOCK)
            n = 0
            nrev = 0
            for q in range(p, stop):
                if pf[q, F_MAPPED] and not pf[q, F_GPU]:
                    n += 1
                elif pf[q, F_GPU] and pf[q, F_DISC]:
                    nrev += 1
            if n or nrev:
                t = t_issue[r]
                if n:
                    g[G_PIN] += 1
                    bi[b, B_PIN] = g[G_PIN]
                    t, _, _ = _make_room(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, n, t, True)
                    if t < 0:
                        g[G_ERRPAGE] = p0
                        g[G_ERRBLOCKS] = 1
                        return ERR_NO_VICTIM
                start = t
                for q in range(p, stop):  # a page moves once its previous move (to the host) is done
                    if pf[q, F_MAPPED] and not pf[q, F_GPU] and pf[q, F_VALID]:
                        start = max(start, _ready(prec, rec_t, g, q))
                    elif pf[q, F_GPU] and pf[q, F_DISC]:  # and is repopulated once its discard is done
                        start = max(start, _ready(prec, rec_t, g, q))
                copy, fill = _migrate_runs(pf, prec, p, stop, False, None, prm, g, -1, prm[P_PF_H2D],
                                           prm[P_POPULATE])
                done = _queue(tf, T_H2D, start, setup + copy + fill + nrev * PAGE / prm[P_REVALIDATE], copy > 0.0)
                setup = 0.0
                rec = _new_record(rec_t, g, T_H2D if copy > 0.0 else R_GPU, done)
                for q in range(p, stop):
                    if pf[q, F_MAPPED] and not pf[q, F_GPU]:
                        _land(pf, prec, bi, g, q, rec, False)
                    elif pf[q, F_GPU] and pf[q, F_DISC]:
                        pf[q, F_DISC] = 0  # mapped and populated again: usable once that is done
                        prec[q] = rec
                        if not pf[q, F_VALID]:
                            pf[q, F_VALID] = 1
                            bi[b, B_RESVALID] += 1
                if nrev:
                    _refresh_block(bi, g, b)
                if n:
                    _arrived(bi, g, b, n)
            p = stop
    return 0


@njit(cache=True)
def prefetch_host(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, p_lo, p_hi, t_issue, extra):
    """cudaMemPrefetchAsync(range, cudaCpuDeviceId) for page spans, range ``r`` issued at ``t_issue[r]``.

    A range that moves anything pays ``P_SETUP_D2H`` plus ``extra`` (a range
    of a batched call) once, then each block its copied bytes over
    ``P_PF_D2H``, plus ``P_HOSTPOP`` for pages whose host memory was never
    populated. The pages' GPU memory is free once the copy completes
    (pending queue). Clean read-mostly duplicates and invalid pages copy nothing.
    """
    for r in range(p_lo.shape[0]):
        p = p_lo[r]
        setup = prm[P_SETUP_D2H] + extra
        while p < p_hi[r]:
            b = p // PAGES_PER_BLOCK
            stop = min(p_hi[r], (b + 1) * PAGES_PER_BLOCK)
            n = 0
            nvalid = 0
            start = t_issue[r]
            for q in range(p, stop):
                if pf[q, F_GPU]:
                    n += 1
                    nvalid += pf[q, F_VALID]
                    ready = _ready(prec, rec_t, g, q)
                    if ready > start:
                        start = ready  # cannot copy back what has not arrived
            if n:
                rec = _new_record(rec_t, g, T_D2H, start)
                copy, hostpop = _migrate_runs(pf, prec, p, stop, True, None, prm, g, rec, prm[P_PF_D2H], 0.0)
                done = _queue(tf, T_D2H, start, setup + copy + hostpop)
                setup = 0.0
                rec_t[T_D2H, (rec >> 2) % RING] = done
                bi[b, B_RES] -= n
                bi[b, B_RESVALID] -= nvalid
                g[G_RES] -= n
                g[G_EVENTS] += n
                _push_pending(g, q_r, q_n, rec, n)
                _refresh_block(bi, g, b)
            p = stop
    return 0


@njit(cache=True)
def _discard_after(pf, prec, rec_t, bi, g, tf, prm, lo, hi, start, stream):
    """Discard pages ``[lo, hi)`` on the discard stream ``stream`` (``T_DISC``: the swap path's,
    ``T_DROP``: dead ranges') once ``start`` has passed and the discards queued there before
    are done: ``bytes / P_DISCARD`` of work. The pages hold nothing from now on (a launch
    touching one refaults); the GPU memory of those resident is free once the work is done
    (their copy record). Returns that time."""
    dbegin = max(start, tf[stream])
    dend = dbegin + (hi - lo) * PAGE / prm[P_DISCARD]
    tf[stream] = dend
    rec = _new_record(rec_t, g, R_GPU, dend)
    for q in range(lo, hi):
        g[G_EVENTS] += 1
        pf[q, F_DISC] = 1
        if pf[q, F_GPU]:
            prec[q] = rec
        if pf[q, F_VALID]:
            pf[q, F_VALID] = 0
            pf[q, F_HOSTCOPY] = 0
            if pf[q, F_GPU]:
                b = q // PAGES_PER_BLOCK
                bi[b, B_RESVALID] -= 1
                _refresh_block(bi, g, b)
    return dend


@njit(cache=True)
def discard_beside(pf, prec, rec_t, bi, g, tf, prm, p_lo, p_hi, t):
    """Dead pages ``[p_lo[r], p_hi[r])`` discarded on the stream of dead ranges (``T_DROP``) from
    ``t`` (after the kernels queued so far), beside the kernels (:func:`_discard_after`);
    returns when done."""
    last = t
    for r in range(p_lo.shape[0]):
        if p_hi[r] > p_lo[r]:
            last = max(last, _discard_after(pf, prec, rec_t, bi, g, tf, prm, p_lo[r], p_hi[r], t, T_DROP))
    return last


@njit(cache=True)
def copy_out(pf, prec, rec_t, bi, g, tf, prm, p_lo, p_hi, nbytes, d_lo, d_hi, t_issue):
    """Swap out: ``cudaMemcpyAsync`` of ``nbytes[r]`` from managed pages ``[p_lo[r], p_hi[r])``
    to a pinned host slot, then a discard of the whole pages ``[d_lo[r], d_hi[r])``.

    The copy starts once issued (``t_issue[r]``: after the range's last
    writer, the CPU being synchronised with the GPU), once the pages' own
    migrations are done and once the D2H copy engine is free; it takes
    ``nbytes / P_COPY_D2H`` and shares the D2H link (:func:`_copy_engine`).
    The discard follows it on a stream of its own (``T_DISC``, discards one
    after the other, beside the copies and the migration path): its work,
    ``bytes / P_DISCARD``, as measured for the call. Discarded pages hold
    nothing (a later eviction copies nothing: they are the first victims)
    and are free only once the discard is done (their copy record). A
    kernel touching one before :func:`copy_in` takes the refault path.
    Returns when the last range's discard is done.
    """
    last = 0.0
    for r in range(p_lo.shape[0]):
        start = t_issue[r]
        for q in range(p_lo[r], p_hi[r]):
            if pf[q, F_GPU]:
                ready = _ready(prec, rec_t, g, q)
                if ready > start:
                    start = ready  # cannot copy what has not arrived
        end = _copy_engine(tf, rec_t, g, T_D2H, start, nbytes[r] / prm[P_COPY_D2H])
        g[G_COPY_D2H] += nbytes[r]
        if d_hi[r] <= d_lo[r]:
            last = max(last, end)
            continue
        last = max(last, _discard_after(pf, prec, rec_t, bi, g, tf, prm, d_lo[r], d_hi[r], end, T_DISC))
    return last


@njit(cache=True)
def copy_in(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, p_lo, p_hi, nbytes, t_issue):
    """Swap in: populate pages ``[p_lo[r], p_hi[r])`` on the GPU, then ``cudaMemcpyAsync``
    ``nbytes[r]`` into them from a pinned host slot.

    Population is a prefetch to the GPU (:func:`prefetch_gpu`: discarded
    pages still on the GPU come back at ``P_REVALIDATE``, pages the driver
    took away populate at ``P_POPULATE``, making room as a prefetch does);
    the copy follows it on the H2D copy engine at ``P_COPY_H2D``, sharing
    the H2D link (:func:`_copy_engine`). Every page of the range is valid
    and usable once the copy is done (its copy record): a kernel reaching it
    earlier waits (transfer wait). Returns 0 or an ``ERR_*`` code.
    """
    issue = np.empty(1, np.float64)
    for r in range(p_lo.shape[0]):
        start = t_issue[r]
        for q in range(p_lo[r], p_hi[r]):  # after the range's own copy out and discard
            ready = _ready(prec, rec_t, g, q)
            if ready > start:
                start = ready
        issue[0] = start
        err = prefetch_gpu(pf, prec, rec_t, bi, g, tf, prm, q_r, q_n, p_lo[r : r + 1], p_hi[r : r + 1], issue)
        if err:
            return err
        for q in range(p_lo[r], p_hi[r]):
            ready = _ready(prec, rec_t, g, q)
            if ready > start:
                start = ready  # populated first
        end = _copy_engine(tf, rec_t, g, T_H2D, start, nbytes[r] / prm[P_COPY_H2D])
        g[G_COPY_H2D] += nbytes[r]
        rec = _new_record(rec_t, g, T_H2D, end)
        for q in range(p_lo[r], p_hi[r]):
            pf[q, F_DISC] = 0
            prec[q] = rec
            if not pf[q, F_VALID]:
                pf[q, F_VALID] = 1
                b = q // PAGES_PER_BLOCK
                bi[b, B_RESVALID] += 1
                _refresh_block(bi, g, b)
    return 0


@njit(cache=True)
def ready_time(prec, rec_t, g, p_lo, p_hi):
    """When the last migration or copy of any page in the spans ``[p_lo[r], p_hi[r])`` completes."""
    t = 0.0
    for r in range(p_lo.shape[0]):
        for q in range(p_lo[r], p_hi[r]):
            t = max(t, _ready(prec, rec_t, g, q))
    return t


@njit(cache=True)
def discard(pf, bi, g, p_lo, p_hi):
    """Pages ``[p_lo, p_hi)`` lose their content: a later migration or eviction copies nothing.

    They are *discarded* (``F_DISC``): a kernel touching one faults and takes
    the refault path unless a prefetch to the GPU brings it back first. A
    resident block left with no valid page moves to the discarded list,
    which the driver evicts before any used block.
    """
    for r in range(p_lo.shape[0]):
        for p in range(p_lo[r], p_hi[r]):
            g[G_EVENTS] += 1
            pf[p, F_DISC] = 1
            if pf[p, F_VALID]:
                pf[p, F_VALID] = 0
                pf[p, F_HOSTCOPY] = 0
                if pf[p, F_GPU]:
                    b = p // PAGES_PER_BLOCK
                    bi[b, B_RESVALID] -= 1
                    _refresh_block(bi, g, b)


@njit(cache=True)
def release(pf, prec, bi, g, b_lo, b_hi):
    """Blocks ``[b_lo, b_hi)`` are unmapped (cudaFree): dropped, nothing copied."""
    for b in range(b_lo, b_hi):
        g[G_RES] -= bi[b, B_RES]
        _list_remove(bi, g, b)
        bi[b, B_RES] = 0
        bi[b, B_RESVALID] = 0
        bi[b, B_PIN] = -1
        for p in range(b * PAGES_PER_BLOCK, (b + 1) * PAGES_PER_BLOCK):
            for c in range(NFLAGS):
                pf[p, c] = 0
            prec[p] = -1


@njit(cache=True)
def back_on_gpu(pf, prec, bi, g, p_lo, p_hi):
    """Pages ``[p_lo, p_hi)`` of a new allocation, populated and resident at once (device memory)."""
    for p in range(p_lo, p_hi):
        if pf[p, F_MAPPED] and not pf[p, F_GPU]:
            _land(pf, prec, bi, g, p, -1, True)
            _arrived(bi, g, p // PAGES_PER_BLOCK, 1)


@njit(cache=True)
def host_write(pf, prec, bi, g, p_lo, p_hi):
    """The host wrote pages ``[p_lo, p_hi)``: the only current copy is in host memory."""
    for r in range(p_lo.shape[0]):
        for p in range(p_lo[r], p_hi[r]):
            if pf[p, F_GPU]:
                b = p // PAGES_PER_BLOCK
                bi[b, B_RES] -= 1
                if pf[p, F_VALID]:
                    bi[b, B_RESVALID] -= 1
                g[G_RES] -= 1
                pf[p, F_GPU] = 0
                prec[p] = -1
                _refresh_block(bi, g, b)
            pf[p, F_VALID] = 1
            pf[p, F_HOSTCOPY] = 0
            pf[p, F_DISC] = 0
            pf[p, F_HOSTPOP] = 1
